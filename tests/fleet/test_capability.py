"""A mixed fleet: each backend's own mask admission, and routing to the ones that serve.

Three stub engines, each playing its release's admission (gateway/testing/stub/rules.py,
coded apart from the gateway's profiles): 0.5.19; 0.5.23 with --sampling-mask-max-tokens
64; 0.5.23 with speculative decoding. The gateway learns each from its /server_info.
Every mask request must be served by a backend that admits it (the stubs refuse what their
release refuses, so a wrong route shows as a 400 from a stub), or refused at the edge with
the message of the backend closest to admitting it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.app import Gateway
from gateway.contract.lax import TOP_K_ALL
from gateway.contract.profiles import (
    CAP_MESSAGE,
    FINITE_TOP_K_MESSAGE,
    SPECULATIVE_MESSAGE,
)
from gateway.fleet.pool import Health
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url, proxied, wait_for

JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def fleet() -> AsyncIterator[list[StubBackend]]:
    engines = [
        StubBackend(version="0.5.19"),
        StubBackend(version="0.5.23", sampling_mask_max_tokens=64),
        StubBackend(version="0.5.23", speculative_algorithm="EAGLE"),
    ]
    for e in engines:
        await e.start()
    yield engines
    for e in engines:
        await e.stop()


async def _learnt(make_gateway: GatewayFactory, *urls: str, **overrides: Any) -> Gateway:
    gw = await make_gateway(*urls, **overrides)
    await wait_for(lambda: all(b.server_info is not None for b in gw.pool.backends))
    return gw


def _mask(top_k: int | None = None, **params: Any) -> bytes:
    sp = params | ({} if top_k is None else {"top_k": top_k})
    return orjson.dumps({"text": "x", "return_sampling_mask": True, "sampling_params": sp})


async def _send(gw: Gateway, body: bytes, n: int = 1, **headers: str) -> list[tuple[int, Any]]:
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(gw_url(gw, "/generate"), data=body, headers=JSON | headers) as r:
                out.append((r.status, await r.json()))
    return out


def _served(engines: list[StubBackend]) -> list[int]:
    return [len([r for r in proxied(e) if r.path == "/generate"]) for e in engines]


async def test_each_mask_request_goes_only_where_it_is_admitted(
    fleet: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await _learnt(make_gateway, *(e.url for e in fleet))
    assert [b.profile.name for b in gw.pool.backends] == [
        "finite_top_k",
        "capped:64",
        "capped:4096+speculative",
    ]

    # top_k 50: 0.5.19 and the capped one serve it; speculative decoding never does.
    got = await _send(gw, _mask(50), 20)
    assert {s for s, _ in got} == {200}
    assert all(len(out["meta_info"]["output_token_sampling_mask"][0]) == 50 for _, out in got)
    served = _served(fleet)
    assert served[2] == 0 and served[0] > 0 and served[1] > 0 and sum(served) == 20

    # top_k 100 is above the cap of 64: only 0.5.19 serves it. Greedy is top_k 1 anywhere
    # but under speculative decoding.
    before = _served(fleet)
    assert {s for s, _ in await _send(gw, _mask(100), 10)} == {200}
    assert {s for s, _ in await _send(gw, _mask(5, temperature=0), 10)} == {200}
    after = _served(fleet)
    assert after[2] == before[2] == 0
    assert after[0] - before[0] >= 10

    # No top_k: none admits it; the answer is the closest backend's (0.5.19: finite top_k).
    before = _served(fleet)
    ((status, out),) = await _send(gw, _mask())
    assert status == 400 and out == {"error": {"message": FINITE_TOP_K_MESSAGE}}
    assert _served(fleet) == before

    # A request without a mask goes anywhere, speculative decoding included.
    plain = orjson.dumps({"text": "x", "sampling_params": {"max_new_tokens": 2}})
    before = _served(fleet)
    assert {s for s, _ in await _send(gw, plain, 9)} == {200}
    assert _served(fleet)[2] > before[2]

    # Every mask request reached only a backend whose release serves it.
    for e in fleet:
        for r in proxied(e):
            if r.path == "/generate" and b"return_sampling_mask" in r.body:
                assert e.release.refusal(_top_k_of(r.body), None) is None, (e.version, r.body)


def _top_k_of(body: bytes) -> int:
    sp = orjson.loads(body)["sampling_params"]
    if sp.get("temperature") == 0:
        return 1
    return int(sp.get("top_k", TOP_K_ALL))


async def test_the_edge_answers_with_the_closest_backends_message(
    fleet: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    _, capped, spec = fleet
    gw = await _learnt(make_gateway, capped.url, spec.url)
    # The capped backend is closer than speculative decoding: lowering top_k helps there.
    ((status, out),) = await _send(gw, _mask(100))
    assert status == 400
    assert out["error"]["message"] == CAP_MESSAGE.format(cap=64, top_k=100)
    ((status, out),) = await _send(gw, _mask())
    assert out["error"]["message"] == CAP_MESSAGE.format(cap=64, top_k=TOP_K_ALL)
    alone = await _learnt(make_gateway, spec.url)
    ((status, out),) = await _send(alone, _mask(5))
    assert status == 400 and out["error"]["message"] == SPECULATIVE_MESSAGE
    assert _served([capped, spec]) == [0, 0]
    async with aiohttp.ClientSession() as s, s.get(admin_url(gw, "/metrics")) as r:
        text = await r.text()
    assert (
        'sglang_gateway_rejections_total{policy="sampling_mask",profile="capped:64",'
        'reason="top_k_above_cap"} 1.0' in text
    )
    assert (
        f'sglang_gateway_backend_info{{backend="{spec.url}",profile="capped:4096+speculative",'
        'version="0.5.23"} 1.0' in text
    )
    async with aiohttp.ClientSession() as s, s.get(gw_url(gw, "/workers")) as r:
        workers = (await r.json())["workers"]
    assert [(w["version"], w["profile"]) for w in workers] == [
        ("0.5.23", "capped:64"),
        ("0.5.23", "capped:4096+speculative"),
    ]


async def test_sessions_stick_among_the_admitting_backends(
    fleet: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await _learnt(
        make_gateway, *(e.url for e in fleet), backends={"balancer": "consistent_hash"}
    )
    for session in (f"episode-{i}" for i in range(8)):
        before = _served(fleet)
        got = await _send(gw, _mask(50), 4, **{"X-Session-Id": session})
        assert {s for s, _ in got} == {200}
        delta = [a - b for a, b in zip(_served(fleet), before, strict=True)]
        assert sorted(delta) == [0, 0, 4] and delta[2] == 0, (session, delta)


async def test_an_unknown_release_gets_every_rule_at_once(
    fleet: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    _, capped, _ = fleet
    unknown = StubBackend(version="0.9.0")
    await unknown.start()
    try:
        gw = await _learnt(make_gateway, unknown.url, capped.url)
        assert [b.profile.name for b in gw.pool.backends] == ["strict:64", "capped:64"]
        # Strict: a finite top_k at most the smallest cap in the fleet, 0.5.19's words.
        got = await _send(gw, _mask(64), 6)
        assert {s for s, _ in got} == {200}
        assert _served([unknown])[0] > 0
        ((status, out),) = await _send(gw, _mask(65))
        assert status == 400
        assert out["error"]["message"] == CAP_MESSAGE.format(cap=64, top_k=65)  # closest
    finally:
        await unknown.stop()


async def test_log_only_forwards_what_no_backend_admits_and_counts_it(
    fleet: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    v19, capped, _ = fleet
    gw = await _learnt(
        make_gateway, v19.url, capped.url, policy={"sampling_mask": {"mode": "log_only"}}
    )
    ((status, _),) = await _send(gw, _mask())
    # Forwarded: the backend's own admission refused it (a real 0.5.x would too).
    assert status == 400 and sum(_served([v19, capped])) == 1
    async with aiohttp.ClientSession() as s, s.get(admin_url(gw, "/metrics")) as r:
        text = await r.text()
    assert (
        'sglang_gateway_log_only_rejections_total{policy="sampling_mask",profile="finite_top_k",'
        'reason="unbounded_top_k"} 1.0' in text
    )


async def test_a_pinned_profile_applies_to_every_backend(
    fleet: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    v19 = fleet[0]
    gw = await _learnt(
        make_gateway,
        v19.url,
        policy={"sampling_mask": {"profile": "0.5.21", "max_tokens": 8}},
    )
    assert gw.pool.backends[0].profile.name == "capped:8"
    ((status, out),) = await _send(gw, _mask(9))
    assert status == 400 and out["error"]["message"] == CAP_MESSAGE.format(cap=8, top_k=9)


async def test_the_weights_asked_for_and_the_mask_both_decide(
    fleet: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    v19, capped, spec = fleet
    v19.weight_version, capped.weight_version, spec.weight_version = "v2", "v2", "v1"
    gw = await _learnt(make_gateway, *(e.url for e in fleet))
    await wait_for(lambda: all(b.weight_version for b in gw.pool.backends))
    # v2 runs on 0.5.19 and on the capped one: top_k 100 only on 0.5.19.
    got = await _send(gw, _mask(100), 10, **{"X-Weight-Version": "v2"})
    assert {(s, out["meta_info"]["weight_version"]) for s, out in got} == {(200, "v2")}
    assert _served(fleet) == [10, 0, 0]
    # v1 runs only under speculative decoding: refused at the edge, in its words.
    ((status, out),) = await _send(gw, _mask(5), **{"X-Weight-Version": "v1"})
    assert status == 400 and out["error"]["message"] == SPECULATIVE_MESSAGE


async def test_a_restarted_backend_is_asked_again_what_it_runs(
    make_gateway: GatewayFactory,
) -> None:
    engine = StubBackend(version="0.5.18")
    await engine.start()
    try:
        gw = await _learnt(make_gateway, engine.url, backends={"health": {"interval_s": 0.05}})
        (backend,) = gw.pool.backends
        assert backend.profile.name == "top_p_or_top_k"
        engine.health_status = 503  # down, then back as another release
        await wait_for(lambda: backend.health is Health.UNHEALTHY, timeout=10)
        engine.version, engine.sampling_mask_max_tokens = "0.5.23", 32
        engine.server_info_status = 500  # and it does not say so at first
        engine.health_status = 200
        await wait_for(lambda: backend.health is Health.HEALTHY, timeout=10)
        assert backend.profile.name == "strict:4096"  # not the release it ran before
        ((status, _),) = await _send(gw, _mask(None, top_p=0.5))  # 0.5.18 served this
        assert status == 400
    finally:
        await engine.stop()
