"""An abort of one rid reaches its owner alone, also when bodies are forwarded unparsed.

With policy.skip_parse_without_mask_key (the RL filter's setting) a body without the mask
key is never parsed; its rid is read by a walk of its structure (gateway/contract/rids.py)
so that /abort_request {"rid"} still goes to the one engine serving it. Three real stubs,
a generation held open on one of them, then the abort: only that stub receives it.
"""

from __future__ import annotations

import io

import aiohttp
import orjson
import pytest

from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url, wait_for

SLOW = {"X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "100", "Content-Type": "application/json"}
IDS_100K = list(range(1000, 101_000))


def _abort_bodies(stub: StubBackend) -> list[bytes]:
    return [
        r.body
        for r in stub.received
        if r.path == "/abort_request" and "X-Forwarded-For" in r.headers
    ]


@pytest.mark.parametrize(
    "size",
    [
        "small",  # parsed for its rid: cheaper than a walk
        "100k ids",  # walked (the RL body)
        "2 MiB",  # walked a slice at a time
    ],
)
async def test_an_abort_reaches_only_the_owner_without_a_parse(
    stubs: list[StubBackend], make_gateway: GatewayFactory, size: str
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), policy={"skip_parse_without_mask_key": True})
    request: dict[str, object] = {"stream": True, "sampling_params": {"max_new_tokens": 100}}
    if size == "small":
        request["text"] = "x"
    else:
        request["input_ids"] = IDS_100K if size == "100k ids" else IDS_100K * 4
    request["rid"] = "rollout-7"  # after the ids, as a dict built in that order sends it
    body = orjson.dumps(request)
    assert b"return_sampling_mask" not in body  # the kind of body that is not parsed
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/generate"), data=io.BytesIO(body), headers=SLOW) as r,
    ):
        assert r.status == 200
        await r.content.readline()  # under way on one engine
        (owner,) = [b for b in stubs if b.generation_requests()]
        assert gw.proxy is not None and gw.proxy.owners.owner("rollout-7") == owner.url
        abort = b'{"rid": "rollout-7"}'
        async with s.post(gw_url(gw, "/abort_request"), data=abort) as a:
            assert a.status == 200
            assert [x["url"] for x in (await a.json())["results"]] == [owner.url]
        for stub in stubs:
            assert _abort_bodies(stub) == ([abort] if stub is owner else [])
    await wait_for(lambda: not gw.proxy.owners if gw.proxy else False)
