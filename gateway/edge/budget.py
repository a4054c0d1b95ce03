"""A bound on the memory that inspecting request bodies may take at once.

Each inspection is charged what its parse can cost at most before it starts, and waits
(in arrival order) while the budget is spent: requests queue, the process never runs out
of memory. The charge of one parse, in bytes (docs/hardening.md, "Memory per request"):

    parsed < 1 MiB:   16 x parsed
    otherwise:        2 x parsed + 24 x (commas + colons in parsed)

where `parsed` is the body the parser reads (after gateway/contract/skim.py took out the
long integer arrays). simdjson keeps a padded copy and a string buffer (up to 2 bytes per byte) plus
about 24 bytes per value (a 4-byte structural index per token and a 16-byte tape entry),
and every value but the first follows a comma or a colon. A body small enough to cost
little is charged its worst case flat, which costs no count.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Final

from gateway.contract import scan

_FLAT_BELOW: Final = 1 << 20
_FLAT_FACTOR: Final = 16
_PER_BYTE: Final = 2
_PER_VALUE: Final = 24


def parse_cost(parsed: bytes) -> int:
    if len(parsed) < _FLAT_BELOW:
        return _FLAT_FACTOR * len(parsed)
    # Two counting passes, no copy: a translate would be faster but allocates a body-sized
    # buffer before the budget is even charged.
    values = parsed.count(b",") + parsed.count(b":")
    return _PER_BYTE * len(parsed) + _PER_VALUE * values


async def parse_cost_sliced(parsed: bytes) -> int:
    """parse_cost, counting a slice at a time (gateway/contract/scan.py): over a 64 MiB
    body that the skim cannot shrink the two passes held the loop for 80 ms."""
    if len(parsed) < _FLAT_BELOW:
        return _FLAT_FACTOR * len(parsed)
    values = await scan.count(parsed, b",") + await scan.count(parsed, b":")
    return _PER_BYTE * len(parsed) + _PER_VALUE * values


class TooCostly(Exception):
    """One inspection alone would exceed the whole budget."""


class InspectionBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waited = 0  # inspections that had to wait
        self.refused = 0  # inspections that timed out waiting
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def try_acquire(self, cost: int) -> bool:
        """Take `cost` now if it fits and nobody waits ahead; never blocks."""
        if cost > self.limit:
            raise TooCostly
        if not self._waiters and self.used + cost <= self.limit:
            self.used += cost
            self.peak = max(self.peak, self.used)
            return True
        return False

    def try_hold(self, size: int) -> bool:
        """Take `size` for a body held while its engines are paused (gateway/fleet/pool.py),
        if it fits now: what accumulates during a long pause shares the bound inspections
        have. Never waits, never raises: a body larger than the whole budget is not held."""
        return size <= self.limit and self.try_acquire(size)

    async def acquire(self, cost: int, wait_s: float) -> bool:
        """Take `cost`, waiting up to `wait_s` for it; False when the wait ran out."""
        if self.try_acquire(cost):
            return True
        self.waited += 1
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (cost, waiter)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(wait_s):
                await waiter
        except TimeoutError:
            self.refused += 1
            self._abandon(entry)
            return False
        except BaseException:  # the client left while waiting
            self._abandon(entry)
            raise
        return True

    def _abandon(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        cost, waiter = entry
        if waiter.done() and not waiter.cancelled():
            self.release(cost)  # granted just as the wait ended: hand it on
            return
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(entry)
        self._wake()  # the one given up may have blocked those behind it

    def release(self, cost: int) -> None:
        self.used -= cost
        self._wake()

    def _wake(self) -> None:
        """Grant waiters in order while each fits (the first one that does not, blocks the
        rest: no large body starves behind a stream of small ones)."""
        while self._waiters:
            cost, waiter = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self.used + cost > self.limit:
                return
            self._waiters.popleft()
            self.used += cost
            self.peak = max(self.peak, self.used)
            waiter.set_result(None)
