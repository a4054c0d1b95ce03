"""The cap on parallel samples (`n`): one request must not be able to exhaust SGLang's memory."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from gateway.contract.policy import BodyRules, ParallelSampleCap
from gateway.contract.routes import Kind
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url

CAP = BodyRules(samples=ParallelSampleCap(16))


@pytest.mark.parametrize(
    ("kind", "body", "refused"),
    [
        (Kind.GENERATE, {"text": "x", "sampling_params": {"n": 16}}, False),
        (Kind.GENERATE, {"text": "x", "sampling_params": {"n": 17}}, True),
        (Kind.GENERATE, {"text": "x", "sampling_params": {"n": 2**31}}, True),
        (Kind.GENERATE, {"text": "x", "sampling_params": {"n": 1e9}}, True),
        (Kind.GENERATE, {"text": "x", "sampling_params": {"n": 2**31, "temperature": 0}}, True),
        (Kind.GENERATE, {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 99}]}, True),
        (Kind.GENERATE, {"text": "x", "sampling_params": {"n": True}}, False),
        (Kind.GENERATE, {"text": "x", "sampling_params": {"n": "99"}}, False),  # SGLang crashes
        (
            Kind.VERTEX,
            {"instances": [{"text": "a"}], "parameters": {"sampling_params": {"n": 99}}},
            True,
        ),
        (Kind.CHAT, {"messages": [], "n": 99}, True),
        (Kind.CHAT, {"messages": [], "n": "99"}, True),  # pydantic reads it as 99
        (Kind.CHAT, {"messages": [], "n": 4}, False),
        (Kind.COMPLETIONS, {"prompt": "x", "n": 99}, True),
    ],
)
def test_cap_truth_table(kind: Kind, body: dict[str, Any], refused: bool) -> None:
    rejection = CAP.check(kind, body)
    if refused:
        assert rejection is not None
        assert (rejection.status, rejection.rule, rejection.reason) == (
            400,
            "parallel_sampling",
            "n_too_large",
        )
        assert "at most 16" in rejection.message
    else:
        assert rejection is None or rejection.rule != "parallel_sampling"
    if refused:
        assert BodyRules().check(kind, body) is None  # without the cap nothing refuses it


async def test_cap_through_the_gateway(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(stub.url)  # default cap: 1024
    headers = {"Content-Type": "application/json"}
    huge = orjson.dumps({"text": "x", "sampling_params": {"n": 2**31, "top_k": 2}})
    async with session.post(gw_url(gw, "/generate"), data=huge, headers=headers) as r:
        assert r.status == 400
        assert "at most 1024" in (await r.json())["error"]["message"]
    fine = orjson.dumps({"text": "x", "sampling_params": {"n": 8, "top_k": 2}})
    async with session.post(gw_url(gw, "/generate"), data=fine, headers=headers) as r:
        assert r.status == 200
    assert [x.body for x in stub.generation_requests()] == [fine]
    off = await make_gateway(stub.url, policy={"max_parallel_samples": None})
    async with session.post(gw_url(off, "/generate"), data=huge, headers=headers) as r:
        await r.read()
    assert [x.body for x in stub.generation_requests()] == [fine, huge]
