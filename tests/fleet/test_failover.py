"""One of three backends is SIGKILLed during sustained load.

Requests already sent to it cannot be retried (a generation may have started), so they may
fail; every request that starts after the kill must succeed, because connect failures are
retried on the survivors and the dead backend is ejected. The run prints its figures.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest

from gateway.fleet.pool import Health
from tests.conftest import GatewayFactory, start_stub_process

pytestmark = pytest.mark.heavy


@dataclass
class Run:
    kill_at: float = 0.0
    results: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, outcome


@pytest.fixture
async def stub_processes() -> AsyncIterator[list[tuple[asyncio.subprocess.Process, str]]]:
    procs = [await start_stub_process("--delay-ms", "30") for _ in range(3)]
    yield procs
    for proc, _ in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def drive(
    gw_port: int, duration: float, concurrency: int, on_tick: asyncio.Event, run: Run
) -> None:
    body = orjson.dumps({"text": "x", "sampling_params": {"top_k": 5, "max_new_tokens": 4}})
    url = f"http://127.0.0.1:{gw_port}/generate"
    deadline = time.monotonic() + duration

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                async with session.post(
                    url, data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    outcome = str(r.status)
            except aiohttp.ClientError as exc:
                outcome = type(exc).__name__
            run.results.append((started, time.monotonic(), outcome))
            on_tick.set()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))


@pytest.mark.parametrize(
    "duration",
    [pytest.param(4.0, id="bounded"), pytest.param(30.0, id="long", marks=pytest.mark.slow)],
)
async def test_backend_killed_under_load(
    stub_processes: list[tuple[asyncio.subprocess.Process, str]],
    make_gateway: GatewayFactory,
    duration: float,
) -> None:
    gw = await make_gateway(
        *(url for _, url in stub_processes),
        backends={"health": {"interval_s": 0.5, "timeout_s": 0.5}},
    )
    run = Run()
    tick = asyncio.Event()
    load = asyncio.ensure_future(drive(gw.port, duration, 32, tick, run))
    await asyncio.sleep(duration / 3)
    victim, victim_url = stub_processes[1]
    run.kill_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    dead = next(b for b in gw.pool.backends if b.url == victim_url)
    shifted_at = None
    while not load.done():
        await asyncio.sleep(0.005)
        if shifted_at is None and (
            dead.ejected_until > time.monotonic() or dead.health is Health.UNHEALTHY
        ):
            shifted_at = time.monotonic()
    await load

    outcomes = Counter(o for _, _, o in run.results)
    failed = [(s, o) for s, _, o in run.results if o != "200"]
    assert shifted_at is not None
    after_shift = [o for s, o in failed if s > shifted_at]
    shift_ms = round((shifted_at - run.kill_at) * 1000, 1)
    print(
        f"\nfailover: sent={len(run.results)} answered_200={outcomes['200']} "
        f"failed={len(failed)} reasons={dict(Counter(o for _, o in failed))} "
        f"failed_after_kill={sum(s > run.kill_at for s, _ in failed)} "
        f"failed_after_shift={len(after_shift)} traffic_shifted_after_ms={shift_ms}"
    )
    assert outcomes["200"] > 100
    assert shifted_at - run.kill_at < 1.0
    # Only requests sent to the backend before the gateway saw it die may fail: once sent, a
    # generation is never replayed. After the shift, nothing fails.
    assert after_shift == []
    assert len(failed) <= 32
