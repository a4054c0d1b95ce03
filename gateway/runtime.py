"""The process the gateway runs in: its event loop, malloc tuning, waiting for signals, and
its own resource limits (logging: gateway/ops/logs.py).

Everything here is about the process, not about requests: the CLI, the demo, the stub and the
--workers supervisor all start their loop and wait for their signals the same way.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Final, Protocol, TypeVar

log = logging.getLogger("gateway.runtime")
T = TypeVar("T")


# -- the event loop and signals -------------------------------------------------------------


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (every supported platform), else asyncio's."""
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up, imported only when running
    except ImportError:  # pragma: no cover - uvloop is absent only on exotic platforms
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


class ListeningServer(Protocol):
    """What create_server returns, on either loop: asyncio's Server, or uvloop's, which is
    no asyncio.Server and whose `sockets` is a list. Compiled code checks annotations at run
    time (gateway/build.py), so a listener's server is typed by what it is used for."""

    @property
    def sockets(self) -> Sequence[socket.socket]: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


def run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


class Signals:
    """SIGTERM and SIGINT stop, SIGHUP runs `on_hup` (each in a task of its own), while the
    context is open; installed on entering, so a signal during start-up is not lost."""

    def __init__(self, on_hup: Callable[[], Awaitable[object]] | None = None) -> None:
        self._on_hup = on_hup
        self._tasks: set[asyncio.Task[object]] = set()
        self.stopped = asyncio.Event()

    def stop(self) -> None:
        self.stopped.set()

    def _hup(self) -> None:
        assert self._on_hup is not None
        task: asyncio.Task[object] = asyncio.ensure_future(self._on_hup())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def __aenter__(self) -> Signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopped.set)
        if self._on_hup is not None:
            loop.add_signal_handler(signal.SIGHUP, self._hup)
        return self

    async def __aexit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    async def wait(self) -> None:
        await self.stopped.wait()


class Shielded:
    """Runs coroutines that must finish even if their caller is cancelled (a client that
    went away must not leave half a control action behind), and holds a reference to each
    until it is done: the loop keeps only weak ones."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future[Any]] = set()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await asyncio.shield(task)


async def until_stopped() -> None:
    """Return at SIGTERM or SIGINT."""
    async with Signals() as signals:
        await signals.wait()


# -- the process's own limits ----------------------------------------------------------------
# The process's own limits: which failures are the gateway's fault, and how many client
# connections its descriptor limit allows.
#
# A connect that fails with EMFILE is no sign that the backend is down: counting it against
# the backend ejected healthy ones in turn, each ejection doubling. And a gateway that accepts
# connections until it has no descriptor left cannot open one to a backend, nor answer its own
# probes; refusing clients early keeps a reserve for both.


# A local resource is exhausted: another backend would fare no better.
LOCAL_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

# Descriptors kept back from clients: listeners, the admin side, health probes, discovery,
# log files, the event loop's own.
RESERVED_FDS: Final = 64


def is_local(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in LOCAL_ERRNOS


def default_max_client_connections() -> int:
    """Half of the descriptors left after the reserve: each client connection may need one
    more, to its backend."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - RESERVED_FDS) // 2)


# -- malloc --------------------------------------------------------------------------------
# glibc malloc settings for a process that moves multi-MB bodies.
#
# Python asks malloc for each large body (a joined request body, simdjson's padded copy,
# response chunks). glibc serves blocks above its mmap threshold (128 KiB to start) with a
# fresh mmap, so every such block is page-faulted in as it is written and unmapped on free
# (a large share of the CPU on MB-sized bodies: docs/bench.md, "Tuned constants"). Serving
# blocks up to 32 MiB from
# the heap, and keeping up to 64 MiB of freed heap before giving it back, lets those pages be
# reused hot. The cost is RSS that stays up to that much above the live set after a burst.

# mallopt parameter numbers, from glibc's malloc.h.
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD: Final = 32 << 20
TRIM_THRESHOLD: Final = 64 << 20
# Set to 0 to leave malloc as glibc configures it (e.g. when MALLOC_* tunables are set).
DISABLE_ENV: Final = "GATEWAY_MALLOC_TUNING"


def tune_malloc() -> bool:
    """Apply the settings above where the C library is glibc; True if they were applied."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present on glibc only (musl lacks it)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not applied:
        log.warning("mallopt refused the gateway's malloc settings; running with defaults")
    return applied
