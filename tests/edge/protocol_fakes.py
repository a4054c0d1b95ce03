"""A transport and a clock to drive the request path's protocol objects without sockets.

Bytes go in through `data_received`, what the protocol writes is collected, and time moves
only when the test says, so a failing test points at one callback and one moment.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any


class FakeTransport(asyncio.Transport):
    """Records what a protocol does to its connection; `buffered` stands for the bytes a
    real transport would still hold unsent."""

    def __init__(self, peer: tuple[str, int] = ("127.0.0.1", 40000)) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.reading = True
        self.closed = False
        self.aborted = False
        self.eof_written = False
        self.buffered = 0
        self._peer = peer

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "write after close"
        self.written.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def output(self) -> bytes:
        """Everything written so far, then forgotten."""
        out = b"".join(self.written)
        self.written.clear()
        return out

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._peer if name == "peername" else default


class FakeClock:
    """The loop methods the protocols use for time (`time`, `call_later`, `call_at`), on a
    clock that moves only in `advance`; futures and tasks go to the real running loop."""

    def __init__(self) -> None:
        self._now = 1000.0
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._seq = itertools.count()
        self._loop = asyncio.get_running_loop()

    def time(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Any:
        handle = asyncio.TimerHandle(when, callback, args, self._loop)
        heapq.heappush(self._timers, (when, next(self._seq), handle))
        return handle

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Any:
        return self.call_at(self._now + delay, callback, *args)

    def create_future(self) -> asyncio.Future[Any]:
        return self._loop.create_future()

    def create_task(self, coro: Any) -> asyncio.Task[Any]:
        return self._loop.create_task(coro)

    def advance(self, seconds: float) -> None:
        """Move the clock, running every timer that falls due on the way, in order."""
        end = self._now + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, handle = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not handle.cancelled():
                handle._run()
        self._now = end

    @property
    def pending(self) -> int:
        return sum(1 for _, _, h in self._timers if not h.cancelled())


async def settle() -> None:
    """Let the tasks the protocol started run until they wait again."""
    for _ in range(5):
        await asyncio.sleep(0)
