"""Tests of the bundled SGLang stub backend, over real sockets."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from typing import Any

import aiohttp
import orjson
import pytest
from yarl import URL

from gateway.testing.stub import MASK_TOP_K_MESSAGE, StubBackend


async def post(
    session: aiohttp.ClientSession, url: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw else None, resp


async def sse(resp: aiohttp.ClientResponse) -> list[bytes]:
    """The data payloads of an SSE stream, [DONE] included."""
    return [line[6:].rstrip(b"\n") async for line in resp.content if line.startswith(b"data: ")]


# --- /generate ---------------------------------------------------------------------------------


async def test_generate_single(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {"text": "hello there world", "sampling_params": {"max_new_tokens": 4}}
    status, out, resp = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    assert resp.headers["Content-Type"].startswith("application/json")
    assert len(out["output_ids"]) == 4
    assert out["text"] == " w0 w1 w2 w3"
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert "output_token_sampling_mask" not in meta
    assert isinstance(meta["id"], str) and isinstance(meta["e2e_latency"], float)


async def test_generate_put_and_default_length(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    async with session.put(f"{stub.url}/generate", json={"input_ids": [1, 2, 3]}) as resp:
        out = await resp.json()
    assert resp.status == 200
    assert out["meta_info"]["completion_tokens"] == 16
    assert out["meta_info"]["prompt_tokens"] == 3


async def test_generate_batch(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {
        "text": ["a", "b c", "d"],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 3}],
    }
    status, out, _ = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    assert [o["meta_info"]["completion_tokens"] for o in out] == [1, 2, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [1, 2, 1]
    status, out, _ = await post(session, f"{stub.url}/generate", {"input_ids": [[1], [2, 3]]})
    assert status == 200 and len(out) == 2


async def test_generate_stream(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4}}
    arrivals: list[float] = []
    events: list[bytes] = []
    headers = {"X-Stub-Chunk-Delay-Ms": "100"}
    async with session.post(f"{stub.url}/generate", json=body, headers=headers) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            if line.startswith(b"data: "):
                arrivals.append(time.monotonic())
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [c["text"] for c in chunks] == [" w0", " w0 w1", " w0 w1 w2", " w0 w1 w2 w3"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None, None, None]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    # Written one by one: the events are spread over the chunk delays, not sent in one burst.
    assert arrivals[3] - arrivals[0] >= 0.25


async def test_events_header(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {"text": ["a", "b"], "stream": True}
    headers = {"X-Stub-Events": "3"}
    async with session.post(f"{stub.url}/generate", json=body, headers=headers) as resp:
        events = await sse(resp)
    assert len(events) == 2 * 3 + 1
    assert sorted(orjson.loads(e)["index"] for e in events[:-1]) == [0, 0, 0, 1, 1, 1]


async def test_mask_metadata(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {
        "text": "x",
        "return_sampling_mask": True,
        "sampling_params": {"top_k": 5, "max_new_tokens": 3},
    }
    status, out, _ = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    meta = out["meta_info"]
    assert meta["output_token_sampling_mask"] == [[0, 1, 2, 3, 4]] * 3
    assert [len(row) for row in meta["output_token_sampling_logprobs"]] == [5, 5, 5]
    assert meta["output_token_sampling_mask_length"] == [5, 5, 5]


async def test_mask_per_item_and_greedy(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {
        "text": ["a", "b"],
        "return_sampling_mask": [True, False],
        "sampling_params": [{"temperature": 0, "max_new_tokens": 2}, {"max_new_tokens": 2}],
    }
    status, out, _ = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    assert out[0]["meta_info"]["output_token_sampling_mask_length"] == [1, 1]
    assert "output_token_sampling_mask" not in out[1]["meta_info"]


@pytest.mark.parametrize(
    "body",
    [
        {"text": "x", "return_sampling_mask": True},
        {"text": "x", "return_sampling_mask": "yes", "sampling_params": {"top_k": -1}},
        {"text": "x", "return_sampling_mask": [False], "sampling_params": {"top_k": None}},
        {"text": ["a", "b"], "return_sampling_mask": True, "sampling_params": [{"top_k": 3}, {}]},
    ],
)
async def test_unbounded_mask_rejected(
    stub: StubBackend, session: aiohttp.ClientSession, body: dict[str, Any]
) -> None:
    status, out, _ = await post(session, f"{stub.url}/generate", body)
    assert status == 400
    assert out == {"error": {"message": MASK_TOP_K_MESSAGE}}


async def test_unbounded_mask_rejected_in_band_when_streaming(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {"text": "x", "stream": True, "return_sampling_mask": True}
    async with session.post(f"{stub.url}/generate", json=body) as resp:
        events = await sse(resp)
    assert resp.status == 200
    assert events[-1] == b"[DONE]"
    reason = orjson.loads(events[0])["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"] == MASK_TOP_K_MESSAGE


async def test_malformed_json(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    async with session.post(f"{stub.url}/generate", data=b'{"text": ') as resp:
        out = await resp.json()
    assert resp.status == 400
    assert out["type"] == "Bad Request" and out["code"] == 400 and out["object"] == "error"


# --- OpenAI-style routes -----------------------------------------------------------------------


async def test_chat(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, out, _ = await post(session, f"{stub.url}/v1/chat/completions", body)
    assert status == 200
    assert out["object"] == "chat.completion" and out["model"] == "m"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == " w0 w1 w2"
    assert choice["finish_reason"] == "length" and "meta_info" not in choice
    assert out["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}


async def test_chat_mask_meta_info(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "top_k": 4,
        "return_sampling_mask": True,
        "return_meta_info": True,
    }
    status, out, _ = await post(session, f"{stub.url}/invocations", body)
    assert status == 200
    meta = out["choices"][0]["meta_info"]
    assert meta["output_token_sampling_mask_length"] == [4, 4]
    assert len(meta["output_token_sampling_mask"]) == 2


async def test_chat_unbounded_mask_rejected(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {"messages": [], "return_sampling_mask": True, "return_meta_info": True, "top_p": 0.9}
    status, out, _ = await post(session, f"{stub.url}/v1/chat/completions", body)
    assert status == 400
    assert out == {
        "object": "error",
        "message": MASK_TOP_K_MESSAGE,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


async def test_chat_stream(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
    async with session.post(f"{stub.url}/v1/chat/completions", json=body) as resp:
        events = await sse(resp)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == " w0 w1 w2"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completions_and_other_routes(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    status, out, _ = await post(session, f"{stub.url}/v1/completions", {"prompt": "a b"})
    assert status == 200 and out["object"] == "text_completion"
    assert out["choices"][0]["finish_reason"] == "length"
    body = {"prompt": "a", "stream": True, "max_tokens": 2}
    async with session.post(f"{stub.url}/v1/completions", json=body) as resp:
        events = await sse(resp)
    assert len(events) == 3 and events[-1] == b"[DONE]"
    status, out, _ = await post(session, f"{stub.url}/v1/responses", {"input": "hi"})
    assert status == 200 and out["object"] == "response" and out["status"] == "completed"
    body = {"instances": [{"text": "a"}, {"text": "b"}], "parameters": {"sampling_params": {}}}
    status, out, _ = await post(session, f"{stub.url}/vertex_generate", body)
    assert status == 200 and len(out["predictions"]) == 2


async def test_info_routes(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{stub.url}/model_info") as resp:
        info = await resp.json()
    assert info["model_path"] == "stub-model" and info["preferred_sampling_params"] is None
    async with session.get(f"{stub.url}/get_server_info") as resp:
        server = await resp.json()
    assert server["version"] == "0.5.19" and server["speculative_algorithm"] is None
    assert server["sampling_backend"] == "flashinfer"
    async with session.get(f"{stub.url}/v1/models") as resp:
        models = await resp.json()
    assert models["data"][0]["id"] == "stub-model" and models["object"] == "list"
    async with session.get(f"{stub.url}/metrics") as resp:
        assert "sglang:num_running_reqs" in await resp.text()
    async with session.post(f"{stub.url}/flush_cache") as resp:
        assert (await resp.text()).startswith("Cache flushed")
    async with session.post(f"{stub.url}/abort_request", json={"rid": "x"}) as resp:
        assert resp.status == 200 and await resp.read() == b""


# --- scripting headers -------------------------------------------------------------------------


async def test_delay_header(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    started = time.monotonic()
    headers = {"X-Stub-Delay-Ms": "200"}
    status, _, _ = await post(session, f"{stub.url}/generate", {"text": "x"}, headers)
    assert status == 200 and time.monotonic() - started >= 0.2


async def test_status_header_and_attribute(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    headers = {"X-Stub-Status": "503"}
    status, out, _ = await post(session, f"{stub.url}/generate", {"text": "x"}, headers)
    assert status == 503 and "message" in out["error"]
    stub.fail_status = 429
    status, out, _ = await post(session, f"{stub.url}/v1/chat/completions", {"messages": []})
    assert status == 429 and out["object"] == "error" and out["code"] == 429
    async with session.get(f"{stub.url}/health") as resp:
        assert resp.status == 200  # the attribute scripts generation routes only


async def test_redirect_header(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    headers = {"X-Stub-Redirect": "/elsewhere"}
    async with session.post(
        f"{stub.url}/generate", json={}, headers=headers, allow_redirects=False
    ) as resp:
        assert resp.status == 307 and resp.headers["Location"] == "/elsewhere"


async def test_drop_before_headers(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    with pytest.raises(aiohttp.ClientError):
        await post(
            session, f"{stub.url}/generate", {"text": "x"}, {"X-Stub-Drop": "before-headers"}
        )
    assert stub.dropped == 1 and stub.cancelled == 0 and not stub.disconnect_event.is_set()


async def test_drop_mid_body(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    headers = {"X-Stub-Drop": "mid-body"}
    async with session.post(f"{stub.url}/generate", json={"text": "x"}, headers=headers) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    body = {"text": "x", "stream": True}
    seen = b""
    async with session.post(f"{stub.url}/generate", json=body, headers=headers) as resp:
        with pytest.raises(aiohttp.ClientPayloadError):
            async for line in resp.content:
                seen += line
    assert 0 < seen.count(b"data: ") < 16 and b"[DONE]" not in seen
    assert stub.dropped == 2 and stub.cancelled == 0


@pytest.mark.parametrize("target", [10, 5000, 5 * 1024 * 1024])
async def test_response_bytes(
    stub: StubBackend, session: aiohttp.ClientSession, target: int
) -> None:
    headers = {"X-Stub-Response-Bytes": str(target)}
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    bodies = []
    for _ in range(2):
        async with session.post(f"{stub.url}/generate", json=body, headers=headers) as resp:
            assert resp.status == 200
            bodies.append(await resp.read())
    outs = [orjson.loads(raw) for raw in bodies]
    assert outs[0]["meta_info"]["completion_tokens"] == 2
    if target > 1000:
        assert len(bodies[0]) == len(bodies[1]) == target
    # Only the volatile fields differ between identical requests, never the padding.
    for out in outs:
        del out["meta_info"]["id"], out["meta_info"]["e2e_latency"]
    assert outs[0] == outs[1]
    if target > 1_000_000:
        assert len(outs[0]["meta_info"]["output_token_sampling_mask"]) > 1000


async def test_sha256_count_and_request_id_echo(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    raw = b'{"text": "dup", "text": "last"}'
    headers = {"X-Request-Id": "req-1", "Content-Type": "application/json"}
    url = URL(f"{stub.url}/generate?x=%41", encoded=True)
    async with session.post(url, data=raw, headers=headers) as resp:
        await resp.read()
    assert resp.headers["X-Stub-Body-Sha256"] == hashlib.sha256(raw).hexdigest()
    assert resp.headers["X-Request-Id"] == "req-1"
    assert resp.headers["X-Stub-Request-Count"] == "1"
    async with session.get(f"{stub.url}/nope") as resp:
        assert resp.headers["X-Stub-Request-Count"] == "2"
        assert resp.headers["X-Stub-Body-Sha256"] == hashlib.sha256(b"").hexdigest()
    first = stub.received[0]
    assert (first.method, first.path, first.raw_path) == ("POST", "/generate", "/generate?x=%41")
    assert first.body == raw and first.headers["X-Request-Id"] == "req-1"
    assert [r.path for r in stub.generation_requests()] == ["/generate"]
    assert stub.completed == 2


async def test_route_errors(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{stub.url}/does-not-exist") as resp:
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
    async with session.get(f"{stub.url}/generate") as resp:
        assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}
    async with session.post(f"{stub.url}/generate/", json={}, allow_redirects=False) as resp:
        assert resp.status == 307 and resp.headers["Location"].endswith("/generate")
    status, out, _ = await post(session, f"{stub.url}/%67enerate", {"text": "x"})
    assert status == 200 and "meta_info" in out
    assert stub.received[-1].path == "/generate"


async def test_health_status_flip(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{stub.url}/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    stub.health_status = 503
    async with session.get(f"{stub.url}/health_generate") as resp:
        assert resp.status == 503
    assert [r.path for r in stub.received] == ["/health", "/health_generate"]


async def test_disconnect_tracking(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 50}}
    headers = {"X-Stub-Chunk-Delay-Ms": "5000"}
    timeout = aiohttp.ClientTimeout(sock_read=0.2)
    with pytest.raises(asyncio.TimeoutError):
        async with session.post(
            f"{stub.url}/generate", json=body, headers=headers, timeout=timeout
        ) as resp:
            async for _ in resp.content:
                pass
    await asyncio.wait_for(stub.disconnect_event.wait(), timeout=30)
    assert stub.cancelled == 1 and stub.completed == 0


async def test_idle_close() -> None:
    backend = StubBackend(idle_close_s=0.1)
    port = await backend.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: stub\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        # The stub closes the idle keep-alive connection on its own, like uvicorn does.
        assert await asyncio.wait_for(reader.read(), timeout=30) == b""
    finally:
        writer.close()
        await writer.wait_closed()
        await backend.stop()


async def test_cli_prints_bound_port() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.testing.stub", "--port", "0", "--model", "cli-model",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=20)).decode().strip()
        assert line.startswith("stub listening on http://127.0.0.1:")
        async with (
            aiohttp.ClientSession() as client,
            client.get(f"{line.rsplit(' ', 1)[1]}/v1/models") as resp,
        ):
            assert (await resp.json())["data"][0]["id"] == "cli-model"
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0


async def test_a_long_lived_stub_remembers_a_bounded_number_of_requests() -> None:
    stub = StubBackend(keep=5, keep_body_bytes=10)
    await stub.start()
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(20):
                body = orjson.dumps({"text": "x" * (100 + i), "sampling_params": {"top_k": 2}})
                async with s.post(stub.url + "/generate", data=body) as r:
                    assert r.status == 200
                    count = r.headers["X-Stub-Request-Count"]
        assert count == "20" and stub.requests_seen == 20 and stub.generations_seen == 20
        assert len(stub.received) == 5
        assert all(len(r.body) == 10 for r in stub.received)
        # The digest is still of the whole body, so forwarding stays checkable.
        assert stub.received[-1].sha256 == hashlib.sha256(body).hexdigest()
    finally:
        await stub.stop()


def test_the_stub_cli_keeps_little_by_default() -> None:
    from gateway.testing.stub.cli import _parse_args

    args = _parse_args([])
    assert (args.keep, args.keep_body_bytes) == (1000, 4096)


async def test_the_stub_plays_an_rl_engine() -> None:
    """Pause holds new generations until continue; a weight update sets the version every
    answer reports; memory is not released while a request runs; loads count the held."""
    stub = StubBackend()
    await stub.start()
    gen = orjson.dumps({"text": "x", "sampling_params": {"max_new_tokens": 2}})
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(stub.url + "/pause_generation", json={"mode": "abort"}) as r:
                assert r.status == 200
            held = asyncio.ensure_future(s.post(stub.url + "/generate", data=gen))
            await asyncio.sleep(0.1)
            assert not held.done()
            async with s.get(stub.url + "/v1/loads") as r:
                (load,) = (await r.json())["loads"]
            assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
            update = {"model_path": "/ckpt", "weight_version": "v7"}
            async with s.post(stub.url + "/update_weights_from_disk", json=update) as r:
                assert r.status == 200
            async with s.post(stub.url + "/continue_generation", json={}) as r:
                assert r.status == 200
            async with await held as r:
                assert (await r.json())["meta_info"]["weight_version"] == "v7"
            async with s.get(stub.url + "/model_info") as r:
                assert (await r.json())["weight_version"] == "v7"
            slow = asyncio.ensure_future(
                s.post(stub.url + "/generate", data=gen, headers={"X-Stub-Delay-Ms": "300"})
            )
            await asyncio.sleep(0.1)
            async with s.post(stub.url + "/release_memory_occupation", json={}) as r:
                assert r.status == 400 and (await r.json())["success"] is False
            async with await slow as r:
                assert r.status == 200
            async with s.post(stub.url + "/release_memory_occupation", json={}) as r:
                assert r.status == 200
    finally:
        await stub.stop()


async def _until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_abort_request_ends_in_flight_generations(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    slow = {"X-Stub-Delay-Ms": "5000"}
    mine = asyncio.ensure_future(
        post(session, f"{stub.url}/generate", {"text": "x", "rid": "r-1"}, slow)
    )
    other = asyncio.ensure_future(
        post(session, f"{stub.url}/generate", {"text": ["a", "b"], "rid": ["r-2", "r-3"]}, slow)
    )
    await _until(lambda: stub.generations_seen == 2)
    async with session.post(f"{stub.url}/abort_request", json={"rid": "r-1"}) as r:
        assert r.status == 200 and await r.read() == b""
    status, out, _ = await mine
    assert status == 200 and out["meta_info"]["id"] == "r-1"
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort request"}
    assert not other.done() and stub.aborted == 1
    body = {"abort_all": True, "abort_message": "weights changing"}
    async with session.post(f"{stub.url}/abort_request", json=body) as r:
        assert r.status == 200
    status, outs, _ = await other
    assert [o["meta_info"]["id"] for o in outs] == ["r-2", "r-3"]
    assert {o["meta_info"]["finish_reason"]["message"] for o in outs} == {"weights changing"}
    assert stub.aborted == 2


async def test_abort_ends_a_stream_with_an_abort_event(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    headers = {"X-Stub-Chunk-Delay-Ms": "50", "X-Stub-Events": "200"}
    body = {"text": "x", "stream": True, "rid": "s-1"}
    async with session.post(f"{stub.url}/generate", json=body, headers=headers) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert orjson.loads(first[6:])["meta_info"]["finish_reason"] is None
        async with session.post(f"{stub.url}/abort_request", json={"abort_all": True}) as r:
            assert r.status == 200
        events = await sse(resp)
    assert events[-1] == b"[DONE]"
    assert orjson.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events) < 100


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_that_keeps_running_requests_holds_them(
    stub: StubBackend, session: aiohttp.ClientSession, mode: str
) -> None:
    headers = {"X-Stub-Chunk-Delay-Ms": "20", "X-Stub-Events": "10"}
    body = {"text": "x", "stream": True}
    async with session.post(f"{stub.url}/generate", json=body, headers=headers) as resp:
        await resp.content.readuntil(b"\n\n")
        async with session.post(f"{stub.url}/pause_generation", json={"mode": mode}) as r:
            assert r.status == 200
        await asyncio.sleep(0.2)
        async with session.get(f"{stub.url}/v1/loads") as r:
            (load,) = (await r.json())["loads"]
        expected = (0, 1) if mode == "retract" else (1, 0)
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == expected
        async with session.post(f"{stub.url}/flush_cache") as r:
            assert r.status == 400  # a request is still held
        async with session.post(f"{stub.url}/continue_generation", json={}) as r:
            assert r.status == 200
        events = await sse(resp)
    final = orjson.loads(events[-2])["meta_info"]["finish_reason"]
    assert final["type"] == "length" and stub.aborted == 0


async def test_pause_in_abort_mode_aborts_running_requests(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    running = asyncio.ensure_future(
        post(session, f"{stub.url}/generate", {"text": "x"}, {"X-Stub-Delay-Ms": "5000"})
    )
    await _until(lambda: stub.generations_seen == 1)
    async with session.post(f"{stub.url}/pause_generation", json={}) as r:
        assert r.status == 200
    status, out, _ = await running
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    async with session.post(f"{stub.url}/pause_generation", json={"mode": "later"}) as r:
        assert r.status == 400
    async with session.post(f"{stub.url}/flush_cache") as r:
        assert r.status == 200  # idle, and paused with abort rather than in place
    async with session.post(f"{stub.url}/pause_generation", json={"mode": "in_place"}) as r:
        assert r.status == 200
    async with session.post(f"{stub.url}/flush_cache") as r:
        assert r.status == 400


async def test_a_generation_running_when_paused_in_place_stays_running(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    running = asyncio.ensure_future(
        post(session, f"{stub.url}/generate", {"text": "x"}, {"X-Stub-Delay-Ms": "200"})
    )
    await _until(lambda: stub.generations_seen == 1)
    async with session.post(f"{stub.url}/pause_generation", json={"mode": "in_place"}) as r:
        assert r.status == 200
    await asyncio.sleep(0.4)  # its work is done; it is held in place until continue
    assert not running.done()
    async with session.get(f"{stub.url}/v1/loads") as r:
        (load,) = (await r.json())["loads"]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 0)
    async with session.post(f"{stub.url}/release_memory_occupation", json={}) as r:
        assert r.status == 400  # a request is running
    async with session.post(f"{stub.url}/continue_generation", json={}) as r:
        assert r.status == 200
    status, out, _ = await running
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"


async def test_an_aborted_batch_answers_every_item_with_its_own_message(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    slow = {"X-Stub-Delay-Ms": "5000"}
    batch = asyncio.ensure_future(
        post(session, f"{stub.url}/generate", {"text": ["a", "b", "c"]}, slow)
    )
    await _until(lambda: stub.generations_seen == 1)
    body = {"abort_all": True, "abort_message": "first"}
    async with session.post(f"{stub.url}/abort_request", json=body) as r:
        assert r.status == 200
    later = {"abort_all": True, "abort_message": "second"}
    async with session.post(f"{stub.url}/abort_request", json=later) as r:
        assert r.status == 200
    status, outs, _ = await batch
    assert status == 200 and len(outs) == 3
    assert {o["meta_info"]["finish_reason"]["message"] for o in outs} == {"first"}
