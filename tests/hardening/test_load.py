"""Reliability checklist, "Load" (shared/reliability-checklist.md).

Bounded versions run by default (2,000 mixed requests, 5 rounds of 400, 200 streams); the
checklist's full sizes (20,000 requests, 5 rounds of 4,000, 1,000+ streams) run with -m slow.
Everything runs in this process (client, gateway and stub on one loop), so descriptor,
task and memory figures are upper bounds for the gateway alone.
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest

from gateway.app import Gateway
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url, wait_for
from tests.hardening.checks import fd_count, vmrss_kib

pytestmark = pytest.mark.heavy

JSON = {"Content-Type": "application/json"}


def pooled(gw: Gateway) -> tuple[int, int]:
    """(idle pooled, acquired) upstream connections of the gateway's request path."""
    upstream = gw._upstream
    assert upstream is not None
    return upstream.pool_state()


@dataclass(frozen=True)
class Req:
    rid: str
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    expect: int
    forwarded: bool
    stream: bool = False


def mixed_requests(n: int, seed: int, prefix: str) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rid = f"{prefix}-{i}"
        hdrs = {**JSON, "X-Request-Id": rid}
        kind = rng.choices(
            ["plain", "stream", "batch", "chat", "rejected", "passthrough"],
            weights=[40, 20, 10, 10, 15, 5],
        )[0]
        k = rng.choice([1, 4, 40])
        if kind == "plain":
            body = {"text": "x", "sampling_params": {"top_k": k}, "return_sampling_mask": True}
            out.append(Req(rid, "POST", "/generate", orjson.dumps(body), hdrs, 200, True))
        elif kind == "stream":
            body = {"text": "x", "stream": True, "sampling_params": {"top_k": k}}
            hdrs["X-Stub-Events"] = "3"
            out.append(Req(rid, "POST", "/generate", orjson.dumps(body), hdrs, 200, True, True))
        elif kind == "batch":
            body = {
                "text": ["a", "b", "c"],
                "sampling_params": [{"top_k": k}, {}, {"temperature": 0}],
                "return_sampling_mask": [True, False, True],
            }
            out.append(Req(rid, "POST", "/generate", orjson.dumps(body), hdrs, 200, True))
        elif kind == "chat":
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "top_k": k,
                "return_sampling_mask": True,
                "return_meta_info": True,
            }
            out.append(
                Req(rid, "POST", "/v1/chat/completions", orjson.dumps(body), hdrs, 200, True)
            )
        elif kind == "rejected":
            body = {"text": "x", "sampling_params": {"top_p": 0.9}, "return_sampling_mask": "yes"}
            out.append(Req(rid, "POST", "/generate", orjson.dumps(body), hdrs, 400, False))
        else:
            out.append(Req(rid, "GET", "/v1/models", None, hdrs, 200, True))
    return out


@dataclass
class LoadResult:
    sent: int = 0
    answered: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def run_load(gw: Gateway, reqs: list[Req], concurrency: int) -> LoadResult:
    result = LoadResult()
    queue: asyncio.Queue[Req] = asyncio.Queue()
    for req in reqs:
        queue.put_nowait(req)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def worker() -> None:
            while not queue.empty():
                req = queue.get_nowait()
                result.sent += 1
                try:
                    async with s.request(
                        req.method, gw_url(gw, req.path), data=req.body, headers=req.headers
                    ) as r:
                        data = await r.read()
                        result.answered[r.headers.get("X-Request-Id", "?")] += 1
                        result.statuses[r.status] += 1
                        ok = r.status == req.expect and r.headers.get("X-Request-Id") == req.rid
                        if ok and req.stream:
                            ok = data.endswith(b"data: [DONE]\n\n")
                        if not ok:
                            result.wrong.append(f"{req.rid}: {r.status} {data[:200]!r}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    result.errors.append(f"{req.rid}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result


def check_exactly_once(
    result: LoadResult, reqs: list[Req], stub: StubBackend, before: int, prefix: str
) -> dict[str, int]:
    assert result.errors == []
    assert result.wrong == []
    assert result.sent == len(reqs)
    # Every request answered exactly once, under its own id.
    assert set(result.answered) == {r.rid for r in reqs}
    assert set(result.answered.values()) == {1}
    # The stub saw each forwarded request exactly once, and nothing else.
    seen = Counter(
        r.headers.get("X-Request-Id")
        for r in list(stub.received)[before:]
        if (r.headers.get("X-Request-Id") or "").startswith(prefix + "-")
    )
    forwarded = {r.rid for r in reqs if r.forwarded}
    assert set(seen) == forwarded
    assert set(seen.values()) == {1}
    return {
        "sent": result.sent,
        "answered": sum(result.answered.values()),
        "forwarded": len(forwarded),
        "stub_received": sum(seen.values()),
        "rejected": result.statuses[400],
    }


async def exactly_once(stub: StubBackend, gw: Gateway, n: int) -> dict[str, int]:
    reqs = mixed_requests(n, seed=n, prefix=f"once{n}")
    before = len(stub.received)
    result = await run_load(gw, reqs, concurrency=64)
    figures = check_exactly_once(result, reqs, stub, before, f"once{n}")
    await wait_for(lambda: gw.proxy is not None and gw.proxy.inflight == 0)
    print("exactly-once:", figures)
    return figures


async def test_exactly_once_accounting(stub: StubBackend, gateway: Gateway) -> None:
    figures = await exactly_once(stub, gateway, 2_000)
    assert figures["forwarded"] == figures["stub_received"]


@pytest.mark.slow
# 20,000 requests through real sockets: minutes on a loaded 2-core machine.
@pytest.mark.timeout(900)
async def test_exactly_once_accounting_20000(stub: StubBackend, gateway: Gateway) -> None:
    figures = await exactly_once(stub, gateway, 20_000)
    assert figures["forwarded"] == figures["stub_received"]


def snapshot(gw: Gateway) -> dict[str, float]:
    gc.collect()
    idle, acquired = pooled(gw)
    return {
        "fds": fd_count(),
        "tasks": len(asyncio.all_tasks()),
        "pooled_idle": idle,
        "pooled_acquired": acquired,
        "rss_mib": round(vmrss_kib() / 1024, 1),
    }


async def _settled(gw: Gateway, start: dict[str, float], timeout: float = 30.0) -> None:
    """Until descriptors and tasks beyond the idle pooled connections' are back to `start`,
    or `timeout` (the caller's assertions then show what stayed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        snap = snapshot(gw)
        idle = snap["pooled_idle"]
        if snap["fds"] - 2 * idle <= start["fds"] and snap["tasks"] - idle <= start["tasks"]:
            return
        await asyncio.sleep(0.05)


async def no_leaks(stub: StubBackend, gw: Gateway, rounds: int, per_round: int) -> None:
    await asyncio.sleep(0.3)
    start = snapshot(gw)
    print(f"before load: {start}")
    snapshots = []
    for i in range(rounds):
        prefix = f"leak{per_round}r{i}"
        reqs = mixed_requests(per_round, seed=i, prefix=prefix)
        before = len(stub.received)
        result = await run_load(gw, reqs, concurrency=64)
        check_exactly_once(result, reqs, stub, before, prefix)
        stub.received.clear()  # the stub's own record is not the gateway's memory
        await wait_for(lambda: gw.proxy is not None and gw.proxy.inflight == 0)
        # Closed transports finish closing on later loop turns, more of them the busier the
        # machine: wait (boundedly) for the count to settle; a leak never does.
        await _settled(gw, start)
        snap = snapshot(gw)
        snapshots.append(snap)
        print(f"round {i}: {snap}")
    for snap in snapshots:
        # How many connections stay pooled depends on each round's peak concurrency (at most
        # one per concurrent client). Each idle pooled connection holds exactly two
        # descriptors (the gateway's and the stub's end) and one task (the stub's handler);
        # apart from those, every round ends where the load started.
        idle = snap["pooled_idle"]
        assert snap["pooled_acquired"] == 0, snapshots
        assert idle <= 64, snapshots
        assert snap["fds"] - 2 * idle <= start["fds"], snapshots
        assert snap["tasks"] - idle <= start["tasks"], snapshots
    # Resident memory does not climb round after round.
    assert snapshots[-1]["rss_mib"] - snapshots[1]["rss_mib"] < 16, snapshots
    # Once idle pooled connections expire, everything is back to the pre-load baseline.
    await wait_for(lambda: pooled(gw) == (0, 0), timeout=30)
    await _settled(gw, start)
    end = snapshot(gw)
    print(f"idle again: {end}")
    assert end["fds"] <= start["fds"] and end["tasks"] <= start["tasks"], (start, end)


async def test_no_leaks_over_five_rounds(stub: StubBackend, make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(
        stub.url,
        logging={"access_log": False},
        timeouts={"upstream_keepalive_s": 0.5},
        backends={"health": {"enabled": False}},  # no probe in flight during snapshots
    )
    await no_leaks(stub, gw, rounds=5, per_round=400)


@pytest.mark.slow
# Five rounds of 4,000 requests, each waiting for the closes to settle.
@pytest.mark.timeout(900)
async def test_no_leaks_over_five_full_rounds(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(
        stub.url,
        logging={"access_log": False},
        timeouts={"upstream_keepalive_s": 0.5},
        backends={"health": {"enabled": False}},  # no probe in flight during snapshots
    )
    await no_leaks(stub, gw, rounds=5, per_round=20_000)


async def concurrent_streams(
    stub: StubBackend, gw: Gateway, streams: int, events: int, delay_ms: int
) -> dict[str, float]:
    body = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 3}})
    hdrs = {**JSON, "X-Stub-Events": str(events), "X-Stub-Chunk-Delay-Ms": str(delay_ms)}
    gc.collect()
    rss_before = vmrss_kib()
    peak = rss_before
    started = asyncio.Event()
    open_now = 0
    most_open = 0
    done = False

    async def sample() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, vmrss_kib())
            await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as s:

        async def one(i: int) -> int:
            nonlocal open_now, most_open
            async with s.post(
                gw_url(gw, "/generate"), data=body, headers={**hdrs, "X-Request-Id": f"sse-{i}"}
            ) as r:
                assert r.status == 200
                open_now += 1
                most_open = max(most_open, open_now)
                if most_open == streams:
                    started.set()
                n = 0
                async for line in r.content:
                    if line.startswith(b"data: "):
                        n += 1
                open_now -= 1
                return n

        sampler = asyncio.create_task(sample())
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        done = True
        await sampler
    assert counts == [events + 1] * streams  # every event and the final [DONE]
    await wait_for(lambda: gw.proxy is not None and gw.proxy.inflight == 0)
    per_stream_kib = (peak - rss_before) / streams
    figures = {
        "streams": streams,
        "concurrent_at_peak": most_open,
        "rss_before_mib": round(rss_before / 1024, 1),
        "rss_peak_mib": round(peak / 1024, 1),
        "per_stream_kib": round(per_stream_kib, 1),
    }
    print("streams:", figures)
    assert most_open == streams  # they were all open at once
    return figures


async def test_concurrent_long_sse_streams(stub: StubBackend, make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(stub.url, logging={"access_log": False})
    figures = await concurrent_streams(stub, gw, streams=200, events=20, delay_ms=100)
    # Client, gateway and stub together: a bounded amount per stream.
    assert figures["per_stream_kib"] < 200


@pytest.mark.slow
# 1,000 long streams at once from one test process.
@pytest.mark.timeout(600)
async def test_1000_concurrent_long_sse_streams(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    # Above the default per-backend cap of 1,024: this measures memory per stream, not the cap.
    gw = await make_gateway(
        stub.url, logging={"access_log": False}, backends={"max_inflight_per_backend": 2000}
    )
    figures = await concurrent_streams(stub, gw, streams=1200, events=100, delay_ms=100)
    assert figures["per_stream_kib"] < 200
