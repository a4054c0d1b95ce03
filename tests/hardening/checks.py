"""Assertions and process readings shared by the hardening tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

# Type names the gateway's OpenAI-shaped bodies legitimately carry (SGLang's vocabulary).
_ALLOWED_NAMES = frozenset(
    {"BadRequestError", "AuthenticationError", "NotFoundError", "RateLimitError"}
    | {"InternalServerError"}
)
_EXCEPTION_NAME = re.compile(r"\b\w*(?:Error|Exception)\b")
_INTERNALS = re.compile(
    r"Traceback|File \"|\.py\b|aiohttp|orjson|uvloop|asyncio|yarl|multidict|Errno|errno|"
    r"b'|b\"|bytearray\(|line \d+ column|\(char \d+\)|0x[0-9a-f]{6,}|<[a-z_.]+ object at"
)


def assert_no_internals(body: bytes, *, addresses: Iterable[str] = ()) -> None:
    """A gateway-made body names no backend, carries no trace and no exception text."""
    text = body.decode("utf-8", "replace")
    match = _INTERNALS.search(text)
    assert match is None, f"internal detail {match.group(0)!r} in {text!r}"
    names = set(_EXCEPTION_NAME.findall(text)) - _ALLOWED_NAMES
    assert not names, f"exception names {names} in {text!r}"
    assert "127.0.0.1" not in text and "localhost" not in text, text
    for address in addresses:
        host_port = address.split("://", 1)[-1]
        port = host_port.rsplit(":", 1)[-1]
        assert host_port not in text, text
        assert not re.search(rf"\b{re.escape(port)}\b", text), f"port {port} in {text!r}"


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def vmrss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@dataclass
class LoopTurns:
    """The longest turn of the running event loop seen by a ticker: on the wall clock, and
    in CPU time of the loop's thread.

    The CPU time is what the code on the loop cost between two ticks. On a machine busy
    with other work the wall-clock gaps also hold the time the thread waited for a core,
    which says nothing about the code under test, while its CPU time stays what it is;
    a bound on the CPU time holds under load and still fails when one step runs long.
    """

    worst_cpu: float = 0.0
    worst_wall: float = 0.0
    ticks: int = 0

    def __str__(self) -> str:
        return (
            f"longest turn {self.worst_cpu * 1000:.1f} ms of CPU "
            f"({self.worst_wall * 1000:.1f} ms on the wall clock, {self.ticks} ticks)"
        )


@contextlib.asynccontextmanager
async def loop_turns(interval: float = 0.0) -> AsyncIterator[LoopTurns]:
    """Measure the loop's turns while the block runs: a tick every `interval` seconds (0:
    every turn of the loop)."""
    turns = LoopTurns()
    done = False

    async def tick() -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        while not done:
            await asyncio.sleep(interval)
            now_cpu, now_wall = time.thread_time(), time.perf_counter()
            turns.worst_cpu = max(turns.worst_cpu, now_cpu - cpu)
            turns.worst_wall = max(turns.worst_wall, now_wall - wall)
            turns.ticks += 1
            cpu, wall = now_cpu, now_wall

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    try:
        yield turns
    finally:
        done = True
        await ticker
