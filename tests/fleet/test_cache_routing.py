"""cache_aware over real sockets: stub engines with a prefix cache behind the gateway.

Multi-turn sessions stay where their conversation is cached (cached_tokens grow turn by
turn), a shared system prompt spreads over the engines instead of piling on one, and an
overloaded owner is balanced away; session affinity spills the same way."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.app import Gateway
from gateway.testing.stub import StubBackend
from gateway.testing.stub.cache import PrefixCache
from tests.conftest import GatewayFactory, admin_url, gw_url, wait_for

JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def engines() -> AsyncIterator[list[StubBackend]]:
    backends = [StubBackend(prefix_cache=PrefixCache(200_000, 16)) for _ in range(4)]
    for b in backends:
        await b.start()
    yield backends
    for b in backends:
        await b.stop()


def text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))


async def generate(
    session: aiohttp.ClientSession, gw: Gateway, prompt: str, **headers: str
) -> dict[str, Any]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    async with session.post(
        gw_url(gw, "/generate"), data=orjson.dumps(body), headers={**JSON, **headers}
    ) as r:
        assert r.status == 200
        out: dict[str, Any] = orjson.loads(await r.read())
        return out["meta_info"]  # type: ignore[no-any-return]


def served(engines: list[StubBackend]) -> list[int]:
    return [len(e.generation_requests()) for e in engines]


def which(before: list[int], after: list[int]) -> int:
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b != a]
    assert len(moved) == 1
    return moved[0]


async def test_multi_turn_sessions_stick_to_their_engine(
    engines: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(*(e.url for e in engines), backends={"balancer": "cache_aware"})
    convos = {sid: text(200, sid) for sid in range(8)}
    homes: dict[int, set[int]] = {sid: set() for sid in convos}
    cached: dict[int, list[int]] = {sid: [] for sid in convos}
    for turn in range(5):
        for sid, convo in convos.items():
            before = served(engines)
            meta = await generate(session, gw, convo)
            homes[sid].add(which(before, served(engines)))
            cached[sid].append(meta["cached_tokens"])
            convos[sid] += " " + text(60, 1000 * turn + sid)
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) > 1  # sessions spread
    for hits in cached.values():
        assert hits[0] == 0
        assert all(later > earlier for earlier, later in itertools.pairwise(hits))
    # GET /workers says why each engine got its share: 8 first turns unmatched, 32 matched.
    async with session.get(gw_url(gw, "/workers")) as r:
        routed = [w["cache_aware"] for w in (await r.json())["workers"]]
    assert sum(w["decisions"]["unmatched"] for w in routed) == 8
    assert sum(w["decisions"]["matched"] for w in routed) == 32
    assert all(w["decisions"]["balanced"] == w["decisions"]["no_prompt"] == 0 for w in routed)
    assert sum(w["matched_bytes"] for w in routed) > 0


async def test_least_inflight_loses_the_sessions_caches(
    engines: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    # The same sessions without cache_aware: the control that shows the test can fail.
    gw = await make_gateway(*(e.url for e in engines))
    # 7 sessions over 4 engines: the rotation of ties does not bring a session back home.
    convos = {sid: text(200, sid) for sid in range(7)}
    homes: dict[int, set[int]] = {sid: set() for sid in convos}
    for turn in range(3):
        for sid, convo in convos.items():
            before = served(engines)
            await generate(session, gw, convo)
            homes[sid].add(which(before, served(engines)))
            convos[sid] += " " + text(60, 1000 * turn + sid)
    assert any(len(h) > 1 for h in homes.values())


async def test_a_shared_system_prompt_spreads_over_the_engines(
    engines: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    for e in engines:
        e.delay_s = 0.2  # they overlap, so load builds up
    gw = await make_gateway(
        *(e.url for e in engines),
        backends={"balancer": "cache_aware", "balance_abs_threshold": 2},
    )
    system = text(1500, 99)
    metas = await asyncio.gather(
        *(generate(session, gw, system + " " + text(30, 500 + i)) for i in range(32))
    )
    counts = served(engines)
    assert sum(counts) == 32
    assert min(counts) >= 2, counts  # every engine took a share, none took all
    # ...and most requests still found the system prompt cached where they went.
    assert sum(1 for m in metas if m["cached_tokens"] >= 1400) >= 32 - 2 * len(engines)


@pytest.mark.heavy
async def test_an_overloaded_owner_is_balanced_away(
    engines: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(
        *(e.url for e in engines),
        backends={"balancer": "cache_aware", "balance_abs_threshold": 2},
    )
    convo = text(400, 7)
    before = served(engines)
    await generate(session, gw, convo)
    owner = which(before, served(engines))
    # Three slow turns of the same conversation pile onto its owner (within the rule)...
    slow = [
        asyncio.ensure_future(
            generate(session, gw, convo + f" slow{i}", **{"X-Stub-Delay-Ms": "1500"})
        )
        for i in range(3)
    ]
    await wait_for(lambda: gw.pool.backends[owner].inflight == 3)
    # Counted in flight before sent: the engine's own count shows they arrived.
    await wait_for(lambda: served(engines)[owner] == 4)
    # ...then the owner is 3 over the idle ones: the next turn goes elsewhere.
    before = served(engines)
    await generate(session, gw, convo + " next")
    assert which(before, served(engines)) != owner
    await asyncio.gather(*slow)
    async with session.get(admin_url(gw, "/metrics")) as r:
        metrics = await r.text()
    assert "sglang_gateway_cache_aware_decisions_total{" in metrics
    balanced = [
        line
        for line in metrics.splitlines()
        if line.startswith("sglang_gateway_cache_aware_decisions_total")
        and 'decision="balanced"' in line
        and not line.endswith(" 0.0")
    ]
    assert len(balanced) == 1


@pytest.mark.heavy
async def test_session_affinity_spills_when_its_worker_is_overloaded(
    engines: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(
        *(e.url for e in engines),
        backends={"balancer": "consistent_hash", "balance_abs_threshold": 2},
    )
    key = {"X-Session-Id": "rollout-1"}
    before = served(engines)
    await generate(session, gw, "turn one", **key)
    owner = which(before, served(engines))
    slow = [
        asyncio.ensure_future(generate(session, gw, "slow", **key, **{"X-Stub-Delay-Ms": "1500"}))
        for _ in range(3)
    ]
    await wait_for(lambda: gw.pool.backends[owner].inflight == 3)
    # Counted in flight before sent: the engine's own count shows they arrived, so only
    # "turn two" can move a count below.
    await wait_for(lambda: served(engines)[owner] == 4)
    before = served(engines)
    await generate(session, gw, "turn two", **key)
    assert which(before, served(engines)) != owner
    await asyncio.gather(*slow)
    before = served(engines)
    await generate(session, gw, "turn three", **key)
    assert which(before, served(engines)) == owner  # back home once the load is gone


@pytest.mark.parametrize("bounded", [True, False])
async def test_the_gateway_forgets_what_the_engine_evicted(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession, bounded: bool
) -> None:
    """Each engine says in /server_info what its cache holds (max_total_num_tokens); by
    default the gateway bounds what it remembers of it to that, so where it believes a
    prompt cached, the engine has it cached, and where the engine evicted it, the gateway
    no longer sends the prompt there for its cache. With the bound off it keeps believing."""
    small = [StubBackend(prefix_cache=PrefixCache(2048, 16)) for _ in range(2)]
    for e in small:
        await e.start()
    try:
        cache = {} if bounded else {"cache_aware": {"engine_cache_tokens": "off"}}
        gw = await make_gateway(
            *(e.url for e in small), backends={"balancer": "cache_aware", **cache}
        )
        await wait_for(lambda: all(b.server_info is not None for b in gw.pool.backends))
        assert [b.server_info and b.server_info.cache_tokens for b in gw.pool.backends] == [
            2048,
            2048,
        ]
        prefix = gw.pool.prefix
        assert prefix is not None
        # 24 prompts of 300 tokens: 3,600 for each engine, whose caches hold 2,048.
        prompts = [text(300, 7000 + i) for i in range(24)]
        for p in prompts:
            await generate(session, gw, p)
        limits = [prefix.cache_limit(b.url) for b in gw.pool.backends]
        if bounded:
            # `w123456 ` words, one stub token each: 8 bytes a token.
            assert 7.5 < prefix.bytes_per_token < 8.5
            assert limits == [int(2048 * prefix.bytes_per_token)] * 2
        else:
            assert limits == [None, None]
        # The first prompt is evicted wherever it went; the last is held whole.
        before = {u: s.decisions.copy() for u, s in prefix.stats.items()}
        first = await generate(session, gw, prompts[0] + " " + text(20, 1))
        last = await generate(session, gw, prompts[-1] + " " + text(20, 2))
        assert first["cached_tokens"] == 0 and last["cached_tokens"] >= 288
        decided = {
            d: sum(s.decisions[d] - before.get(u, {}).get(d, 0) for u, s in prefix.stats.items())
            for d in ("matched", "unmatched")
        }
        # Bounded: the evicted one is placed by load (unmatched), the held one matched.
        # Unbounded: the gateway still thinks the first cached (matched twice).
        assert decided == (
            {"matched": 1, "unmatched": 1} if bounded else {"matched": 2, "unmatched": 0}
        )
    finally:
        for e in small:
            await e.stop()
