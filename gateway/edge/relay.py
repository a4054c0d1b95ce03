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
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, cast

import httptools

from gateway.edge.failures import UpstreamBroken, UpstreamError, UpstreamFailure, UpstreamTimeout

if TYPE_CHECKING:
    from gateway.edge.server import Request

# Interim (1xx) responses accepted before the final one. RFC 9110 sets no limit, but every
# real server sends at most a few (100 Continue, 103 Early Hints); each one costs a parse,
# so a backend that streams them without end would stall the loop.
MAX_INTERIM_RESPONSES: Final = 16
# Header fields per response, as for requests (gateway/edge/server.py).
MAX_HEADERS: Final = 128
# The whole head may be this many times the field limit, as for requests.
HEAD_FACTOR: Final = 8


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
        self._spent = False  # the parser stopped mid-message (a HEAD answer): make a new one
        self._head_ended = False  # this exchange ended at its head (a HEAD answer)
        self._in_trailer = False  # the last chunk's trailer fields are being read
        self.transport: asyncio.Transport | None = None
        self.on_unsolicited: Callable[[], None] | None = None
        self.unsolicited = False  # bytes or EOF arrived unasked: never reuse
        self.closed = False
        # The exchange under way.
        self.expecting = False  # from the request's write until its response ended
        self.final_head = False
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
        self._done = False
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

    def begin(self, *, head_only: bool, read_timeout: float | None) -> None:
        if self._spent:
            self._parser = httptools.HttpResponseParser(self)
            self._spent = False
        self._resume_reading()
        self.expecting = True
        self.final_head = False
        self.interim = 0
        self.head_only = head_only
        self.status = 0
        self.headers = []
        self.relayed = 0
        self._head_bytes = 0
        self._head_ended = False
        self._in_trailer = False
        self._out = []
        self._chunks = []
        self._buffered = 0
        self._done = False
        self._failure = None
        self._sink = None
        self.read_timeout = read_timeout
        self._last_read = self._sent_at = self._loop.time()
        self._arm_timer()

    async def head(self) -> None:
        """Wait for the final response head; raises the exchange's UpstreamFailure."""
        while not self.final_head and self._failure is None:
            await self._wait()
        if not self.final_head:
            assert self._failure is not None
            raise self._failure
        # A failure after a whole head (a body cut off) is the body's: read or relay raise it.

    async def read(self) -> bytes:
        """The next piece of the body as it arrives; b"" at its end."""
        while not self._chunks and not self._done and self._failure is None:
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
        if chunks or self._done:
            # What came with the head (a whole small reply, often) leaves with it, in one write.
            self._chunks = []
            self._buffered = 0
            for chunk in chunks:
                self.relayed += len(chunk)
            sink.send(chunks, last=self._done)
        else:
            sink.flush_head()  # nothing yet: the client gets the head before the first event
        if not sink.writing_paused:
            self._resume_reading()
        elif not self._done:
            self._pause_for(sink)
        while not self._done and self._failure is None:
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
        """End the exchange with `exc` (the first failure wins) and stop reading."""
        if self._failure is None and not self._done:
            self._failure = exc
        self.expecting = False
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
        if self.expecting:
            if self._until_eof and self.final_head:
                self._message_done()  # a body without framing ends with the connection
            elif self.final_head:
                self.fail(UpstreamBroken("ClientPayloadError"))
            else:
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
        had_head = self.final_head
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
                    if self._head_ended and not _ends_at_head(data):
                        # Bytes after a HEAD answer's head, unasked for.
                        self._refuse()
                return
            if self._done:
                # Bytes after a response that ended (llhttp refuses anything after one that
                # closes the connection): the response goes out whole, the bytes are stray.
                self._flush()
                self._refuse()
                return
            if not had_head:
                # The head came in the same read as the fault: it is never handed over,
                # and the exchange fails as a whole (a 502), not mid-body.
                self.final_head = False
            kind = UpstreamBroken if self.final_head else UpstreamError
            self.fail(kind(type(exc).__name__))
            self.abort()
            return
        self._flush()
        if self.expecting and (not self.final_head or (in_trailer and self._in_trailer)):
            # The parser holds an unfinished field without bound: the head as a whole, and
            # a chunked body's trailer section, are bounded (to the cap plus one read; the
            # read a head ends in is not counted).
            self._head_bytes += len(data)
            if self._head_bytes > HEAD_FACTOR * self._max_field:
                kind = UpstreamBroken if self.final_head else UpstreamError
                self.fail(kind("LineTooLong"))
                self.abort()

    def _flush(self) -> None:
        """Send the body pieces of this read to the client, with the body's end if it came."""
        sink = self._sink
        if sink is None or not (self._out or self._done):
            return
        out = self._out
        self._out = []
        try:
            sink.send(out, last=self._done)
        except ConnectionError as exc:
            self.fail(exc)
            return
        if sink.writing_paused and not self._done:
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
        if self.final_head:
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
        if len(name) > limit or len(value) > limit or len(self._fields) >= MAX_HEADERS:
            self.fail(UpstreamError("LineTooLong"))
            self.abort()
            raise _Abandon
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        code = parser.get_status_code()
        if 100 <= code <= 199 and code != 101:
            self.interim += 1
            if self.interim > MAX_INTERIM_RESPONSES:
                self.fail(UpstreamError("too many interim responses"))
                self.abort()
                raise _Abandon
            return
        self.final_head = True
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
        framed = code in (204, 304) or code == 101
        codings: list[str] | None = None
        for name, value in headers:
            lowered = name.lower()
            if lowered == "content-length":
                framed = True
            elif lowered == "transfer-encoding":
                codings = (codings or []) + value.lower().split(",")
        if codings is not None:
            # The gateway re-frames every body it relays: it can drop a chunked framing,
            # not a coding under it (gzip, chunked) that the client would then never learn
            # of; and a list that does not end in chunked (chunked, gzip) has no framing a
            # relay can trust. Either is a 502 before any of it reaches the client.
            if [c for c in map(str.strip, codings) if c] != ["chunked"]:
                self.final_head = False
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
            self._head_ended = True
            self.should_close = self.should_close or code == 101
            self._message_done()
            self._wake()
            raise _Abandon
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
        if not self.final_head:
            return  # an interim response ended; the final one follows
        self._message_done()

    def _message_done(self) -> None:
        self._done = True
        self.expecting = False
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
        return (self._last_read if self.final_head else self._sent_at) + timeout

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


__all__ = ["MAX_INTERIM_RESPONSES", "BackendConnection", "UpstreamFailure"]
