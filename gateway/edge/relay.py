"""The request path's upstream connection: llhttp reads the backend's response, and its body
goes straight to the client's connection as it arrives.

No stream reader stands between the two sockets: each piece of body the parser yields is
written to the client's transport from the backend's own `data_received`, so a streamed
response wakes no task per event, and a whole reply that came in one read leaves in one
write. Flow control runs both ways: when the client's socket buffer passes its high-water
mark, reading from the backend pauses, and resumes when the client has drained it; a body
read by the caller instead (control calls, tests) pauses the backend past its high-water
mark of buffered bytes.

Each connection is held to one rule: the backend speaks only when asked. HTTP/1.1 has no
request ids, so a response is matched to a request only by its place on the connection.
Bytes that arrive while no response is expected (on an idle pooled connection, or after a
response ended) would be read as the answer to the next request sent on it; such bytes are
never parsed: they mark the connection unusable and close it, and so does an EOF while
idle, and a second response in the same read as the first one's end.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final, cast

import httptools

from gateway.edge import http1
from gateway.edge.failures import UpstreamBroken, UpstreamError, UpstreamFailure, UpstreamTimeout

if TYPE_CHECKING:
    from gateway.edge.server import Request


class Phase(enum.Enum):
    """Where a connection's exchange stands. Every change goes through
    BackendConnection._to, which holds it to TRANSITIONS."""

    # Enum's own __hash__ is Python code (the hash of the name), run on every lookup of a
    # member in a dict or set on the request path; members are singletons compared by
    # identity, so the identity hash agrees with == and costs nothing.
    __hash__ = object.__hash__

    IDLE = "idle"  # no exchange yet: just connected
    HEAD = "head"  # the request went out; the final response head is awaited
    BODY = "body"  # the final head came; its body is being read
    DONE = "done"  # the response ended: the connection may carry the next exchange
    FAILED = "failed"  # the exchange failed: the connection is never reused


TRANSITIONS: Final[Mapping[Phase, frozenset[Phase]]] = {
    Phase.IDLE: frozenset({Phase.HEAD}),
    # A head that ends the exchange (a HEAD answer, a 101) goes straight to DONE.
    Phase.HEAD: frozenset({Phase.BODY, Phase.DONE, Phase.FAILED}),
    Phase.BODY: frozenset({Phase.DONE, Phase.FAILED}),
    Phase.DONE: frozenset({Phase.HEAD}),
    Phase.FAILED: frozenset(),
}
_EXPECTING: Final = frozenset({Phase.HEAD, Phase.BODY})


class _Abandon(Exception):
    """Raised from a parser callback: stop parsing this connection's bytes."""


class BackendConnection(asyncio.Protocol):
    """One keep-alive connection to a backend, one exchange at a time."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, max_field_size: int, read_high_water: int
    ) -> None:
        self._loop = loop
        self._max_field = max_field_size
        self._high_water = read_high_water
        self._head_bytes = 0
        self._parser = httptools.HttpResponseParser(self)
        # The parser stopped at a head that ended the exchange (a HEAD answer): the next
        # exchange gets a new one, and bytes after that head in its read are unasked for.
        self._spent = False
        self._in_trailer = False  # the last chunk's trailer fields are being read
        self.transport: asyncio.Transport | None = None
        self.on_unsolicited: Callable[[], None] | None = None
        self.unsolicited = False  # bytes or EOF arrived unasked: never reuse
        self.closed = False
        # The exchange under way.
        self.phase = Phase.IDLE
        # The head was never handed over: the exchange fails as a whole (a 502), not
        # mid-body.
        self._withheld = False
        self.interim = 0
        self.head_only = False  # a HEAD request: the response has no body, whatever it says
        self.should_close = False
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[str, str]] = []
        self.relayed = 0  # body bytes written to the client
        self._reason = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._until_eof = False  # no length, no chunks: the body ends with the connection
        self._chunks: list[bytes] = []  # body read before a relay (or a reader) took it
        self._out: list[bytes] = []  # body of the current read, for the relay's one write
        self._buffered = 0
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Request | None = None
        self._read_paused = False
        # The read timeout: the wait for the head (ttfb, counted from the request's write:
        # a head sent a byte at a time gains nothing), then the silence between pieces.
        self.read_timeout: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self._sent_at = 0.0

    # -- the exchange ------------------------------------------------------------------------

    @property
    def expecting(self) -> bool:
        """From the request's write until its response ended (or failed)."""
        return self.phase in _EXPECTING

    def _to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"exchange phase {self.phase.value} -> {phase.value}")
        self.phase = phase

    def begin(self, *, head_only: bool, read_timeout: float | None) -> None:
        """A request is about to be written: the exchange's state starts afresh."""
        self._to(Phase.HEAD)
        if self._spent:
            self._parser = httptools.HttpResponseParser(self)
            self._spent = False
        self._resume_reading()
        self._withheld = False
        self.interim = 0
        self.head_only = head_only
        self.status = 0
        self.headers = []
        self.relayed = 0
        self._head_bytes = 0
        self._in_trailer = False
        self._out = []
        self._chunks = []
        self._buffered = 0
        self._failure = None
        self._sink = None
        self.read_timeout = read_timeout
        self._last_read = self._sent_at = self._loop.time()
        self._arm_timer()

    async def head(self) -> None:
        """Wait for the final response head; raises the exchange's UpstreamFailure."""
        while self.phase is Phase.HEAD:
            await self._wait()
        if self._withheld:
            assert self._failure is not None
            raise self._failure
        # A failure after a whole head (a body cut off) is the body's: read or relay raise it.

    async def read(self) -> bytes:
        """The next piece of the body as it arrives; b"" at its end."""
        while not self._chunks and self.phase is Phase.BODY:
            await self._wait()
        if self._chunks:
            chunks = self._chunks
            self._chunks = []
            self._buffered = 0
            self._resume_reading()
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self._failure is not None:
            raise self._failure
        return b""

    async def relay(self, sink: Request) -> None:
        """Write the body to the client's connection as it arrives, until its end.

        Raises UpstreamFailure when the backend broke off or fell silent, ConnectionError
        when the client is gone.
        """
        self._sink = sink
        chunks = self._chunks
        done = self.phase is Phase.DONE
        if chunks or done:
            # What came with the head (a whole small reply, often) leaves with it, in one write.
            self._chunks = []
            self._buffered = 0
            for chunk in chunks:
                self.relayed += len(chunk)
            sink.send(chunks, last=done)
        else:
            sink.flush_head()  # nothing yet: the client gets the head before the first event
        if not sink.writing_paused:
            self._resume_reading()
        elif not done:
            self._pause_for(sink)
        while self.phase is Phase.BODY:
            await self._wait()
        if self._failure is not None:
            raise self._failure

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """End the exchange with `exc` (the first failure wins; an exchange that ended
        stays ended) and stop reading."""
        if self.phase in _EXPECTING:
            if self.phase is Phase.HEAD:
                self._withheld = True
            self._failure = exc
            self._to(Phase.FAILED)
        self._cancel_timer()
        self._wake()

    def expire(self) -> None:
        """The exchange's total deadline passed: the same error a read timeout raises."""
        self.fail(UpstreamTimeout("ServerTimeoutError"))
        self.abort()

    @property
    def reusable(self) -> bool:
        transport = self.transport
        return (
            not self.unsolicited
            and not self.closed
            and not self._chunks
            and not self._read_paused
            and transport is not None
            and not transport.is_closing()
        )

    # -- connection events ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self.phase is Phase.BODY:
            if self._until_eof:
                self._message_done()  # a body without framing ends with the connection
            else:
                self.fail(UpstreamBroken("ClientPayloadError"))
        elif self.phase is Phase.HEAD:
            self.fail(UpstreamError("ServerDisconnectedError"))
        self.transport = None

    def eof_received(self) -> None:
        if not self.expecting:
            self.unsolicited = True  # a FIN on an idle connection: the backend closed it

    def data_received(self, data: bytes) -> None:
        if data and not self.expecting:
            self._refuse()
            return
        self._last_read = self._loop.time()
        had_head = self.phase is Phase.BODY
        in_trailer = self._in_trailer
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # 101: the head was delivered (the caller refuses it); nothing after it is HTTP.
            self.should_close = True
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _Abandon):
                # Parsing stopped on purpose; a whole response before it still goes out.
                if self._failure is None:
                    self._flush()
                    if self._spent and not _ends_at_head(data):
                        # Bytes after a HEAD answer's head, unasked for.
                        self._refuse()
                return
            if self.phase is Phase.DONE:
                # Bytes after a response that ended (llhttp refuses anything after one that
                # closes the connection): the response goes out whole, the bytes are stray.
                self._flush()
                self._refuse()
                return
            if not had_head:
                # The head came in the same read as the fault: it is never handed over,
                # and the exchange fails as a whole (a 502), not mid-body.
                self._withheld = True
            kind = UpstreamError if self._withheld else UpstreamBroken
            self.fail(kind(type(exc).__name__))
            self.abort()
            return
        self._flush()
        phase = self.phase
        if phase is Phase.HEAD or (phase is Phase.BODY and in_trailer and self._in_trailer):
            # The parser holds an unfinished field without bound: the head as a whole, and
            # a chunked body's trailer section, are bounded (to the cap plus one read; the
            # read a head ends in is not counted).
            self._head_bytes += len(data)
            if self._head_bytes > http1.HEAD_FACTOR * self._max_field:
                kind = UpstreamBroken if phase is Phase.BODY else UpstreamError
                self.fail(kind("LineTooLong"))
                self.abort()

    def _flush(self) -> None:
        """Send the body pieces of this read to the client, with the body's end if it came."""
        sink = self._sink
        done = self.phase is Phase.DONE
        if sink is None or not (self._out or done):
            return
        out = self._out
        self._out = []
        try:
            sink.send(out, last=done)
        except ConnectionError as exc:
            self.fail(exc)
            return
        if sink.writing_paused and not done:
            # Only while the body is under way: a finished exchange is never left paused,
            # or the next request on this connection would wait for a resume that never comes.
            self._pause_for(sink)

    def _refuse(self) -> None:
        if not self.unsolicited:
            self.unsolicited = True
            if self.on_unsolicited is not None:
                self.on_unsolicited()
        self.abort()

    def abort(self) -> None:
        transport = self.transport
        if transport is not None:
            transport.abort()

    def close(self) -> None:
        transport = self.transport
        if transport is not None:
            transport.close()

    # -- parser callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.phase is not Phase.HEAD:
            # A second response to one request (found in the same read as the first one's
            # end): it answers nothing, and whatever comes next is suspect.
            self._refuse()
            raise _Abandon
        self._reason = b""
        self._fields = []

    def on_status(self, reason: bytes) -> None:
        self._reason += reason
        if len(self._reason) > self._max_field:
            self.fail(UpstreamError("LineTooLong"))
            self.abort()
            raise _Abandon

    def on_header(self, name: bytes, value: bytes) -> None:
        limit = self._max_field
        if len(name) > limit or len(value) > limit or len(self._fields) >= http1.MAX_HEADERS:
            self.fail(UpstreamError("LineTooLong"))
            self.abort()
            raise _Abandon
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        code = parser.get_status_code()
        if 100 <= code <= 199 and code != 101:
            self.interim += 1
            if self.interim > http1.MAX_INTERIM_RESPONSES:
                self.fail(UpstreamError("too many interim responses"))
                self.abort()
                raise _Abandon
            return
        self.status = code
        # Decoded so that the head's encoding (utf-8, surrogateescape) gives back the bytes
        # as sent, whatever they are (latin-1 here would turn \xe9 into \xc3\xa9).
        self.reason = self._reason.decode("utf-8", "surrogateescape")
        headers = self.headers = [
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
            for name, value in self._fields
        ]
        self._fields = []
        self.should_close = not parser.should_keep_alive()
        framed = code in http1.NO_BODY_STATUS or code == 101
        codings: list[str] | None = None
        for name, value in headers:
            lowered = name.lower()
            if lowered == "content-length":
                framed = True
            elif lowered == "transfer-encoding":
                codings = [*(codings or ()), value]
        if codings is not None:
            # The gateway re-frames every body it relays: it can drop a chunked framing,
            # not a coding under it (gzip, chunked) that the client would then never learn
            # of; and a list that does not end in chunked (chunked, gzip) has no framing a
            # relay can trust. Either is a 502 before any of it reaches the client.
            if not http1.only_chunked(codings):
                self.fail(UpstreamError("unsupported transfer coding"))
                self.abort()
                raise _Abandon
            framed = True
        self._until_eof = not framed
        if self.head_only or code == 101:
            # llhttp cannot be told a response answers HEAD, so it would read the next
            # bytes as this one's body: the exchange ends at the head, and the next one
            # gets a fresh parser. (101: nothing after it is HTTP; the caller closes.)
            self._spent = True
            self.should_close = self.should_close or code == 101
            self._message_done()
            raise _Abandon
        self._to(Phase.BODY)
        self._wake()

    def on_chunk_header(self) -> None:
        # Fields until the chunk ends are trailers if it turns out to be the last (no body).
        self._in_trailer = True

    def on_chunk_complete(self) -> None:
        self._in_trailer = False

    def on_body(self, body: bytes) -> None:
        self._in_trailer = False
        sink = self._sink
        if sink is None:
            self._chunks.append(body)
            self._buffered += len(body)
            if self._buffered > self._high_water:
                self._pause_reading()
            return
        # Sent once the read is parsed: every piece of one read in one write.
        self.relayed += len(body)
        self._out.append(body)

    def on_message_complete(self) -> None:
        if self.phase is Phase.BODY:
            self._message_done()
        # else an interim response ended; the final one follows

    def _message_done(self) -> None:
        self._to(Phase.DONE)
        self._wake()  # the timer stays for the next exchange; its check sees none under way

    # -- flow control -------------------------------------------------------------------

    def _pause_for(self, sink: Request) -> None:
        self._pause_reading()
        sink.on_resume(self._resume_reading)

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused:
            self._read_paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    # -- the read timeout ----------------------------------------------------------------

    def _arm_timer(self) -> None:
        """Have the check run by the current deadline. A timer already due no later is
        kept (its check reschedules itself), so a kept-alive connection does not make a
        timer per exchange."""
        timeout = self.read_timeout
        if timeout is None:
            self._cancel_timer()
            return
        due = self._due(timeout)
        timer = self._timer
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()
        self._timer = self._loop.call_at(due, self._check)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def set_read_timeout(self, seconds: float | None) -> None:
        self.read_timeout = seconds
        if self.expecting:
            self._arm_timer()

    def _due(self, timeout: float) -> float:
        """When the exchange times out: the head within `timeout` of the request's write,
        then each piece of the body within `timeout` of the last."""
        return (self._sent_at if self.phase is Phase.HEAD else self._last_read) + timeout

    def _check(self) -> None:
        """Rescheduled from the last read rather than on every read: one timer per
        silence, not one per piece."""
        self._timer = None
        timeout = self.read_timeout
        if timeout is None or not self.expecting:
            return
        if self._read_paused:
            # Paused for the client: the silence is the gateway's own, not the backend's.
            self._last_read = self._loop.time()
        due = self._due(timeout)
        if self._loop.time() >= due:
            self.fail(UpstreamTimeout("ServerTimeoutError"))
            self.abort()
        else:
            self._timer = self._loop.call_at(due, self._check)


def _ends_at_head(data: bytes) -> bool:
    """Whether a read that ended a bodyless head holds nothing after it. (llhttp does not
    say where it stopped; a head ends at the only blank line of the read, and a stray
    response after it would bring a blank line of its own, or no ending one.)"""
    return data.endswith(b"\r\n\r\n") and data.count(b"\r\n\r\n") == 1


__all__ = ["TRANSITIONS", "BackendConnection", "Phase", "UpstreamFailure"]
