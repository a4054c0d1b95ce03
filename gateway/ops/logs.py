"""Where the process's log lines go, and in what shape.

Two streams: operational messages (start-up, reloads, failures) on stderr, written at once
as they happen; the access log on stdout, one line per request, written in batches. With
`logging.format: json` both are JSON, one object per line with a `level`, so a log pipeline
can take the whole output of the process as it is.

The access log is batched because a write per request was the costliest part of logging
it: a line is appended to a buffer and the buffer goes out when it holds `BATCH_BYTES`, or
`BATCH_DELAY_S` after its first line, or when the process drains or exits cleanly.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import logging
import os
import select
import stat
import sys
import time
from datetime import UTC, datetime
from types import TracebackType
from typing import Final

import orjson

from gateway.ops.redact import describe

BATCH_BYTES: Final = 64 * 1024
BATCH_DELAY_S: Final = 0.1
# How long the drain and the exit wait for a slow reader to take the last lines.
DRAIN_TIMEOUT_S: Final = 5.0
# Lines kept while stdout cannot take them (a reader that stopped reading); past this the
# oldest are dropped and counted rather than growing without bound.
MAX_PENDING_BYTES: Final = 4 * 1024 * 1024
# Writes to a pipe up to PIPE_BUF bytes are atomic: with --workers N sharing one stdout
# pipe, a batch cut at lines within that size never interleaves with a sibling's mid-line
# (a line longer than that, which the fields' limits rule out, could).
_PIPE_BUF: Final = 4096


class AccessWriter:
    """Access-log lines, buffered and written to one file descriptor in batches.

    The event loop never waits on the reader. stdout is usually a blocking pipe or socket
    (a container runtime, systemd, a shell), and a reader that stops reading would stall
    a blocking write, and every request with it. So on a pipe, socket or terminal each
    piece written is at most PIPE_BUF bytes and goes out only when poll() says the
    descriptor can take it (a pipe reports writable only with a page free); otherwise the
    lines wait in the buffer, and past `max_pending` the oldest are dropped and counted.
    """

    def __init__(
        self,
        fd: int,
        *,
        batch_bytes: int = BATCH_BYTES,
        delay_s: float = BATCH_DELAY_S,
        max_pending: int = MAX_PENDING_BYTES,
    ) -> None:
        self._fd = fd
        self._buf = bytearray()
        self._batch = batch_bytes
        self._delay = delay_s
        self._max_pending = max_pending
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._poll = _stream_poller(fd)
        self._chunk = _PIPE_BUF if self._poll is not None else batch_bytes
        # The first line in the buffer went out in part: its rest must be kept whole.
        self._partial = False
        self.written_lines = 0
        self.dropped_lines = 0
        self._pending_lines = 0
        self._broken = False
        self._failing = False

    def write(self, line: bytes) -> None:
        """Queue one line (without its newline)."""
        buf = self._buf
        buf += line
        buf += b"\n"
        self._pending_lines += 1
        if len(buf) >= self._batch:
            self.flush()
        elif self._timer is None or self._timer_loop is None or self._timer_loop.is_closed():
            # Most lines find the batch's timer armed: no loop lookup for them.
            self._arm()

    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (start-up, tests): nothing would flush later
            self.flush()
            return
        # A timer of another loop (one that ran before this one) would never fire here.
        if self._timer is None or self._timer_loop is not loop:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(self._delay, self._due)
            self._timer_loop = loop

    def _due(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        """Write what the descriptor takes now; the rest stays for the next try."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        buf = self._buf
        if not buf:
            return
        if self._broken:
            self._drop(len(buf))
            return
        view = memoryview(buf)
        done = 0
        poll = self._poll
        lost = False
        try:
            while done < len(buf):
                end = len(buf)
                if end - done > self._chunk:
                    # Cut at the last whole line that fits; an overlong line goes in pieces.
                    cut = buf.rfind(b"\n", done, done + self._chunk)
                    end = cut + 1 if cut >= done else done + self._chunk
                if poll is not None and not poll.poll(0):
                    break  # the reader is behind: never block the loop on it
                done += os.write(self._fd, view[done:end])
        except BlockingIOError:
            pass  # a non-blocking stdout is full: the rest goes out with the next batch
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.EBADF):
                self._broken = True  # stdout is gone for good: keep serving, count the loss
            else:
                # ENOSPC, EIO: this batch is lost, later ones may get through (logged once
                # until a write succeeds again).
                lost = True
                if not self._failing:
                    self._failing = True
                    logging.getLogger("gateway.access").warning(
                        "access log write failed: %s", exc.strerror
                    )
        finally:
            view.release()
        if done:
            self._failing = False
        if done:
            written = buf.count(b"\n", 0, done)
            self.written_lines += written
            self._pending_lines -= written
            self._partial = buf[done - 1] != 0x0A
            del buf[:done]
        if self._broken or lost:
            self._drop(len(buf))
        elif len(buf) > self._max_pending:
            self._drop(len(buf) - self._max_pending)
        if buf:
            self._arm_retry()

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Write everything buffered, waiting up to `timeout_s` for a slow reader: at the
        drain and at exit, when no request waits on the loop any more. What a reader that
        stopped reading leaves behind after that is dropped and counted."""
        deadline = time.monotonic() + timeout_s
        while self._buf and not self._broken:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._poll is not None:
                self._poll.poll(max(1, int(left * 1000)))
            self.flush()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._buf:
            self._drop(len(self._buf))

    async def settle(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """drain() from a running loop: the reader gets its time in short sleeps, so the
        loop (the admin listener, other gateways in the process) is never held."""
        deadline = time.monotonic() + timeout_s
        self.flush()
        while self._buf and not self._broken and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            self.flush()
        self.drain(timeout_s=0)  # what is left now is dropped and counted

    def _arm_retry(self) -> None:
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            if self._timer is None:
                self._timer = loop.call_later(self._delay, self._due)
                self._timer_loop = loop

    def _drop(self, nbytes: int) -> None:
        """Drop the oldest whole lines covering at least `nbytes`, but never the rest of a
        line already written in part (the reader has its head: it must get its end)."""
        buf = self._buf
        start = buf.find(b"\n") + 1 if self._partial else 0
        if start <= 0 and self._partial:
            return  # the partial line is all there is
        cut = buf.find(b"\n", start + nbytes - 1) + 1 or len(buf)
        lines = buf.count(b"\n", start, cut)
        del buf[start:cut]
        self.dropped_lines += lines
        self._pending_lines -= lines


def _stream_poller(fd: int) -> select.poll | None:
    """A poller for a pipe, socket or terminal (writes to them can block on the reader);
    None for a regular file or /dev/null, which always take a write."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or (stat.S_ISCHR(mode) and not os.isatty(fd)):
        return None
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return poller


_writer: AccessWriter | None = None


def access_writer() -> AccessWriter | None:
    """The process's batched access-log writer, once `setup` made one."""
    return _writer


async def flush() -> None:
    """Write the lines still buffered (the drain calls this after the last request)."""
    if _writer is not None:
        await _writer.settle()


# -- operational lines ---------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, and an exception described
    by type and frames (redact.describe), never by its message."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        # Read untyped: logging keeps a falsy exc_info as given (asyncio passes False), not
        # the tuple or None typeshed says, and compiled code would check that type.
        exc_info = vars(record).get("exc_info")
        if exc_info and exc_info[1] is not None:
            out["error"] = describe(exc_info[1])
        return orjson.dumps(out).decode()


_TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup(level: str, fmt: str = "text") -> AccessWriter:
    """Operational logs to stderr at `level`, in `fmt`; the access log to stdout, batched.

    Idempotent: a second call replaces the handlers the first installed.
    """
    global _writer
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_gateway", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    handler._gateway = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # Python's own warnings and uncaught exceptions become records too, so with the JSON
    # format no plain-text traceback lands between the JSON lines.
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    # The access logger keeps its own switch (logging.access_log): level "warning" quiets
    # the gateway's messages, not the one line per request.
    access = logging.getLogger("gateway.access")
    access.setLevel(logging.INFO)
    if _writer is None:
        _writer = AccessWriter(sys.stdout.fileno())
        atexit.register(_writer.drain)
    return _writer


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("gateway").critical("uncaught exception", exc_info=(kind, exc, tb))


# -- timestamps ------------------------------------------------------------------------------

_second: int = -1
_second_text: str = ""
# The millisecond part and the zone, one string per millisecond: formatting `:03d` for
# each line showed in a profile of the access log.
_MILLIS: Final = tuple(f".{milli:03d}Z" for milli in range(1000))


def timestamp(epoch: float | None = None) -> str:
    """RFC 3339 in UTC with milliseconds, e.g. 2026-11-30T08:15:02.127Z.

    The seconds part is formatted once per second: building a datetime for each line cost
    more than the rest of the line.
    """
    global _second, _second_text
    if epoch is None:
        epoch = time.time()
    whole = int(epoch)
    if whole != _second:
        _second_text = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second = whole
    # epoch - whole is exact and below 1, so the index is 0..999.
    return _second_text + _MILLIS[int((epoch - whole) * 1000)]
