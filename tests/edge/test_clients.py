"""Real client libraries against the gateway: the openai SDK, httpx, and SGLang's own tests.

Clients must notice no difference between the gateway and SGLang, except that an unbounded
mask request is refused at the edge with SGLang's message.
"""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from gateway.app import Gateway
from gateway.contract.policy import MASK_MESSAGE
from gateway.testing.stub import StubBackend
from tests.conftest import gw_url

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def oai(gateway: Gateway) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=gw_url(gateway, "/v1"), api_key="sk-test", max_retries=0)
    yield client  # type: ignore[misc]
    await client.close()


async def test_openai_chat_with_finite_top_k_gets_the_mask(
    stub: StubBackend, oai: openai.AsyncOpenAI
) -> None:
    resp = await oai.chat.completions.create(
        model="stub-model",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body={"top_k": 10, "return_sampling_mask": True, "return_meta_info": True},
    )
    assert resp.choices[0].message.content
    sent = orjson.loads(stub.generation_requests()[-1].body)
    assert sent["top_k"] == 10
    assert sent["return_sampling_mask"] is True


async def test_openai_chat_without_top_k_raises_bad_request(
    stub: StubBackend, oai: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model="stub-model",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            top_p=0.99,
            extra_body={"return_sampling_mask": True, "return_meta_info": True},
        )
    assert info.value.status_code == 400
    assert MASK_MESSAGE in str(info.value)
    assert info.value.body is not None
    assert info.value.body["message"] == MASK_MESSAGE  # type: ignore[index]
    assert stub.generation_requests() == []


async def test_openai_streaming_chat_and_completions(
    stub: StubBackend, oai: openai.AsyncOpenAI
) -> None:
    stream = await oai.chat.completions.create(
        model="stub-model",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=5,
        stream=True,
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert len([p for p in pieces if p]) == 5
    completion = await oai.completions.create(model="stub-model", prompt="Hello", max_tokens=3)
    assert completion.choices[0].text
    models = await oai.models.list()
    assert [m.id for m in models.data] == ["stub-model"]


async def test_openai_streamed_chat_with_mask_is_refused(
    stub: StubBackend, oai: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model="stub-model",
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            extra_body={"top_k": 10, "return_sampling_mask": True, "return_meta_info": True},
        )
    assert "not supported with streaming" in str(info.value)
    assert stub.generation_requests() == []


# SGLang's own regression tests (test/registered/sampling/test_sampling_mask.py), replayed
# through the gateway with httpx.


@pytest.mark.parametrize("top_p", [0.99, 1.0])
async def test_generate_rejects_unbounded_sampling_mask(
    stub: StubBackend, gateway: Gateway, top_p: float
) -> None:
    body = {
        "text": "The capital of France is",
        "sampling_params": {
            "temperature": 1.0,
            "top_p": top_p,
            "max_new_tokens": 4,
            "ignore_eos": True,
        },
        "return_sampling_mask": True,
    }
    async with httpx.AsyncClient(base_url=gw_url(gateway)) as client:
        resp = await client.post("/generate", json=body)
    assert resp.status_code == 400
    assert "top_p-only sampling is valid but can return huge masks in the tail" in resp.text
    assert stub.generation_requests() == []


async def test_chat_completions_returns_sampling_mask(stub: StubBackend, gateway: Gateway) -> None:
    body = {
        "model": "stub-model",
        "messages": MESSAGES,
        "max_tokens": 4,
        "top_k": 10,
        "top_p": 0.99,
        "return_sampling_mask": True,
        "return_meta_info": True,
        "return_token_ids": True,
    }
    raw = orjson.dumps(body)
    async with httpx.AsyncClient(base_url=gw_url(gateway)) as client:
        resp = await client.post(
            "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
        )
    assert resp.status_code == 200
    assert stub.generation_requests()[-1].body == raw
    meta = resp.json()["choices"][0]["meta_info"]
    masks = meta["output_token_sampling_mask"]
    assert len(masks) == 4
    assert all(len(m) == 10 for m in masks)


async def test_httpx_streaming_generate(stub: StubBackend, gateway: Gateway) -> None:
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3, "top_k": 2}}
    lines = []
    async with (
        httpx.AsyncClient(base_url=gw_url(gateway)) as client,
        client.stream("POST", "/generate", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = [line async for line in resp.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 4
