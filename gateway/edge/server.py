"""The client side of the request path: one asyncio protocol per connection, over llhttp.

A general web framework builds, for every request, objects the gateway has no use for
(a request mapping, a response object with its own header multidict, a payload stream, a
writer) and runs its machinery around them: most of the gateway's CPU on a small request.
Here the parser's callbacks fill one plain `Request`, the proxy answers it with a `Reply`
or writes a relayed response straight to the transport, and the connection enforces what
the edge guarantees:

- llhttp in its strict mode refuses every framing ambiguity (CL+TE, duplicate or
  malformed Content-Length, obs-fold, bad chunk sizes, bare CR or LF); on top of it, a
  Transfer-Encoding on HTTP/1.0 is a 400 (RFC 9112 s.6.1), any coding but a lone `chunked`
  (over all its lines) a 501, an HTTP/1.1 request without exactly one Host (or any with
  two) a 400 (s.3.2), a request line with more than single spaces a 400 (s.3), and so is
  an upgrade request with a body, whose bytes llhttp would stop parsing at the head;
- the head is bounded: the request line and each header field by limits.max_header_bytes,
  at most http1.MAX_HEADERS fields, and the whole head by http1.HEAD_FACTOR times the
  limit, so a connection's memory is bounded before any field ends;
- a head must arrive whole within the keep-alive timeout, which runs from the connection's
  start and from the end of each response (a client dripping bytes gains nothing);
- requests are answered one at a time, in order; pipelined ones wait parsed, and reading
  pauses once a few are waiting; the next one starts only once the replies before it went
  below the socket's high-water mark, so a client that sends and never reads holds one
  reply's worth of memory, and one that leaves a reply unread for timeouts.client_send_s is
  reset;
- a refused request is answered with a fixed JSON body naming no byte of it, after the
  replies to the requests before it, and the connection closes;
- a client that goes away (an EOF counts: the half-closed client is indistinguishable from
  one that left, and SGLang's abort depends on the close) cancels its request's handler,
  which closes the upstream request, so SGLang aborts the generation;
- a reply that ends a connection before the client stopped sending is a lingering close.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import sys
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final, NamedTuple, cast

import httptools
from multidict import CIMultiDict

from gateway.contract import replies, scan
from gateway.contract.routes import ErrorShape
from gateway.edge import http1
from gateway.edge.headers import SERVER
from gateway.ops.redact import describe
from gateway.runtime import ListeningServer

log = logging.getLogger("gateway.listener")

# Parsed requests that may wait behind the one being answered before reading pauses: one,
# so a pipelined body waits in the kernel, not in memory (and a read already taken in is
# parsed to its end, so a pipeline's memory is one read's worth of requests at most).
_PIPELINE_DEPTH: Final = 1
# Small pieces are joined into one bytes object (one write, one send); larger ones go out
# with writelines, which sends them without a copy.
_JOIN_MAX: Final = 16 << 10

# A request line is its target (at most limits.max_header_bytes) and this much more: the
# method, two spaces, the version and CRLF.
_LINE_SLACK: Final = 64
# How long a closing connection keeps reading (and dropping) what the client still sends.
_LINGER_S: Final = 2.0
# Bytes read from one connection before it lets the loop turn. libuv reads up to 32 times
# 256 KiB in a row from a client that keeps sending, and each read costs three copies of
# the bytes (into the read buffer, the chunk, the body piece): two 64 MiB uploads held the
# loop for 20 ms a turn. Reading pauses for the rest of the turn at the limit: one pause and
# resume per MiB.
_READ_PER_TURN: Final = 1 << 20
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_SERVER_LINE: Final = f"{SERVER[0]}: {SERVER[1]}\r\n"


class HttpVersion(NamedTuple):
    major: int
    minor: int


HTTP_11: Final = HttpVersion(1, 1)
HTTP_10: Final = HttpVersion(1, 0)
_VERSIONS: Final = {"1.1": HTTP_11, "1.0": HTTP_10}


class BodyTooLarge(Exception):
    """The request body grew past the limit it was read under."""


class _Refuse(Exception):
    """Raised from a parser callback: refuse the request with this status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Reply:
    """A reply the gateway makes itself: a status, a whole body, a few headers."""

    __slots__ = ("body", "close", "content_type", "headers", "status")

    def __init__(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str = "application/json",
        headers: list[tuple[str, str]] | None = None,
        close: bool = False,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers if headers is not None else []
        self.close = close  # close the connection after it (the body was not read)


Handler = Callable[["Request"], Awaitable[Reply | None]]


class Request:
    """One request as the parser read it, and the means to answer it on its connection.

    The proxy answers with a Reply (written by the connection), or relays a response
    itself with `start`, `send` (its pieces as they come, with `writing_paused` and `on_resume`
    for flow control) and `end`, and returns None.
    """

    __slots__ = (
        "_chunks",
        "_complete",
        "_conn",
        "_ended",
        "_framing",
        "_head",
        "_limit",
        "_overflow",
        "_size",
        "_waiter",
        "body_exists",
        "content_length",
        "headers",
        "keep_alive",
        "method",
        "raw_path",
        "remote",
        "started",
        "version",
    )

    scheme: Final = "http"

    def __init__(
        self,
        conn: _Connection,
        method: str,
        raw_path: str,
        version: HttpVersion,
        headers: CIMultiDict[str],
        *,
        content_length: int | None,
        chunked: bool,
        keep_alive: bool,
        limit: int,
    ) -> None:
        self._conn = conn
        self.method = method
        self.raw_path = raw_path
        self.version = version
        self.headers = headers
        self.remote = conn.remote
        self.content_length = content_length
        self.body_exists = chunked or bool(content_length)
        self.keep_alive = keep_alive
        self.started = False  # the response head is written (or queued behind the first bytes)
        self._ended = False
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = not self.body_exists
        self._overflow = False
        self._limit = limit
        self._waiter: asyncio.Future[None] | None = None
        self._head: bytes | None = None  # a sized response's head, sent with its first bytes
        self._framing = 0  # 0: sized or none, 1: chunked, 2: until the connection closes

    # -- the body ----------------------------------------------------------------------------

    @property
    def body_complete(self) -> bool:
        return self._complete

    @property
    def body_joins_at_once(self) -> bool:
        """The body read so far is one piece, or few enough bytes to join on the loop."""
        return len(self._chunks) <= 1 or self._size < scan.JOIN_IN_THREAD

    def take_body(self) -> bytes:
        """The body read so far (all of it once body_complete); BodyTooLarge if it grew
        past the listener's limit. It is joined on the loop: read_body joins a large one
        off it."""
        if self._overflow:
            raise BodyTooLarge
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = [body] if body else []
        return body

    async def read_body(self, limit: int) -> bytes:
        """Wait for the whole body; BodyTooLarge once it passes `limit` bytes."""
        if limit < self._limit:
            self._limit = limit
            if self._size > limit:
                self._overflowed()
        while not self._complete and not self._overflow:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            self._conn.resume_body()
            try:
                await waiter
            finally:
                self._waiter = None
        if self._overflow:
            raise BodyTooLarge
        if self.body_joins_at_once:
            return self.take_body()
        # Nothing is added to a complete body: the thread joins exactly these pieces.
        body = await scan.join(self._chunks)
        self._chunks = [body]
        return body

    def _add(self, data: bytes) -> None:
        if self._overflow:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._overflowed()
            return
        self._chunks.append(data)

    def _overflowed(self) -> None:
        # The rest is never read: the reply is a 413 and the connection closes after it.
        self._overflow = True
        self._chunks = []
        self._conn.stop_reading()
        self._wake()

    def _finish_body(self) -> None:
        self._complete = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the response ------------------------------------------------------------------------

    def send_continue(self) -> None:
        self._conn.write_raw(_CONTINUE)

    def start(
        self, status: int, reason: str, headers: list[tuple[str, str]], *, sized: bool
    ) -> None:
        """Begin a relayed response: `headers` are the backend's end-to-end ones (with its
        Content-Length when `sized`); framing and Connection are added here. The head waits
        for the body's first bytes, so a whole reply leaves in one write; the relay flushes
        it alone when no bytes are there yet (a stream's head goes out before its first
        event)."""
        conn = self._conn
        closing = conn.must_close(self)
        lines = [f"HTTP/1.1 {status} {reason or http1.phrase(status)}\r\n"]
        if status == 204 or status < 200:
            # RFC 9110 s.8.6: never a Content-Length on these, whatever the backend said.
            headers = [h for h in headers if h[0].lower() != "content-length"]
        for name, value in headers:
            lines += (name, ": ", value, "\r\n")
        bodyless = self.method == "HEAD" or status in http1.NO_BODY_STATUS or status < 200
        if not sized and not bodyless:
            if self.version >= HTTP_11:
                lines.append("Transfer-Encoding: chunked\r\n")
                self._framing = 1
            else:
                closing = True  # HTTP/1.0 has no chunks: the body ends with the connection
                self._framing = 2
        if not any(name.lower() == "date" for name, _ in headers):
            lines += ("Date: ", http1.date.now(), "\r\n")
        head = _finish_head(lines, self, closing)
        if bodyless:
            self._ended = True
            conn.write_raw(head)
        else:
            self._head = head

    def flush_head(self) -> None:
        """Send a head still waiting for body bytes."""
        head = self._head
        if head is not None:
            self._head = None
            self._conn.write_raw(head)

    def send(self, pieces: list[bytes], *, last: bool) -> None:
        """Relay pieces of the body (and its end, when `last`) in one write, with a head
        still waiting; ConnectionError once the client is gone."""
        if self._ended:
            return
        out: list[bytes] = []
        head = self._head
        if head is not None:
            self._head = None
            out.append(head)
        if self._framing == 1:
            for piece in pieces:
                if piece:
                    out += (b"%x\r\n" % len(piece), piece, http1.CRLF)
            if last:
                out.append(b"0\r\n\r\n")
        else:
            out += pieces
        if last:
            self._ended = True
        if out:
            self._conn.write_pieces(*out)

    @property
    def writing_paused(self) -> bool:
        """The client's socket buffer is over its high-water mark."""
        return self._conn.write_paused

    def on_resume(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the client's socket buffer has drained (a paused backend
        resumes reading then)."""
        self._conn.resume_callback = callback

    def end(self) -> None:
        """The body's end (a no-op once it was sent with the last pieces)."""
        self.send([], last=True)

    def abort(self) -> None:
        """Reset the connection: a relayed body that broke off must end visibly broken."""
        self._ended = True
        self._conn.abort()


# Linux's count of bytes in a socket's send queue not yet acknowledged by the peer.
_OUTQ: Final = getattr(termios, "TIOCOUTQ", None)


def _unsent(transport: asyncio.Transport) -> int:
    """Reply bytes the client has not taken: the transport's buffer and, where the system
    says, the kernel's send queue (which can hold megabytes the client drains slowly)."""
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if _OUTQ is not None and sock is not None:
        try:
            queued = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
        except OSError:
            return size
        size += int.from_bytes(queued, sys.byteorder)
    return size


def _finish_head(lines: list[str], request: Request, closing: bool) -> bytes:
    """End a response head with the Connection the exchange decided, as bytes; the request
    counts as answered from here (a failure later can only drop the connection)."""
    if closing:
        request.keep_alive = False
        lines.append("Connection: close\r\n\r\n")
    elif request.version < HTTP_11:
        lines.append("Connection: keep-alive\r\n\r\n")
    else:
        lines.append("\r\n")
    request.started = True
    return "".join(lines).encode("utf-8", "surrogateescape")


class _Connection(asyncio.Protocol):
    """One client connection: parses, queues and answers its requests in order."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._loop = listener.loop
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        # The message being parsed.
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._parsing: Request | None = None
        # A head under way (begun, not complete), and the bytes of the reads since the one
        # it began in: the parser holds an unfinished field without bound.
        self._in_head = False
        self._head_size = 0
        self._began = False  # a head (or a chunk's trailer section) began in this read
        # Where messages lie in the read being parsed, so each request line can be read as
        # sent (llhttp skips repeated spaces in it): the read, where the next message starts
        # in it (-1: unknown), where the current body started in it, and the body bytes of
        # this read so far. Past a chunked body the places are lost until a read starts at a
        # message boundary, which every unpipelined request does.
        self._data = b""
        self._between = True  # no message under way: the next byte starts one
        self._cursor = 0
        self._body_from = -1
        self._body_here = 0
        self._line: bytes | None = None  # a request line still incomplete, to be checked
        self._chunked = False  # the body being read is chunked
        # Requests parsed and waiting their turn; the one being answered.
        self._queue: deque[Request] = deque()
        self._active: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: int | None = None  # answer once the requests before it are answered
        self._stopped = False  # nothing more is parsed on this connection
        self._read_paused = False
        self._read_in_turn = 0  # bytes read since reading last paused for a turn
        self._turn_paused = False
        self.write_paused = False
        self.resume_callback: Callable[[], None] | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # the send buffer's size when the no-progress period began
        self.closing = False  # close once the active request is answered (a drain)
        self._gone = False

    # -- connection events ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        listener = self._listener
        if listener.full():
            # Refused before anything is read, while the process still has descriptors to
            # spare for its backends, its probes and the admin listener.
            listener.connections_refused += 1
            self._gone = True
            transport.write(listener.full_reply)
            transport.close()
            return
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) else None
        listener.connections.add(self)
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._gone and self.transport is None:
            return  # refused at the cap, never registered
        self._gone = True
        self._listener.connections.discard(self)
        self._cancel_deadline()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # the client left: the handler closes its upstream request
        self._queue.clear()
        self.resume_callback = None
        parsing = self._parsing
        if parsing is not None:
            parsing._wake()
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True
        timeout = self._listener.send_timeout_s
        if timeout is not None and self._send_timer is None and self.transport is not None:
            self._unsent = _unsent(self.transport)
            self._send_timer = self._loop.call_later(timeout, self._unread)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        callback, self.resume_callback = self.resume_callback, None
        if callback is not None:
            callback()
        if self._active is None and self._queue and self.transport is not None:
            if self.closing:
                self._close(linger=True)
            else:
                self._begin(self._queue.popleft())
                self.resume_body()

    def _unread(self) -> None:
        """A reply has waited over the socket's high-water mark for timeouts.client_send_s.
        If the client took none of it in that time it is not reading, so the connection
        (and with it any generation it holds upstream) is reset; a slow reader that takes
        some gets another period (like nginx's send_timeout: a bound on no progress, not
        on a slow transfer)."""
        self._send_timer = None
        transport = self.transport
        timeout = self._listener.send_timeout_s
        if transport is None or not self.write_paused or timeout is None:
            return
        unsent = _unsent(transport)
        if unsent < self._unsent:
            self._unsent = unsent
            self._send_timer = self._loop.call_later(timeout, self._unread)
            return
        self._listener.send_timeouts += 1
        log.debug("reset a client that left its replies unread")
        self.abort()

    # -- reading ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._read_in_turn += len(data)
        if self._read_in_turn >= _READ_PER_TURN:
            self._pause_for_turn()
        if self._stopped:
            return
        self._began = False
        self._data = data
        self._cursor = 0 if self._between else -1
        # A sized body begun in an earlier read goes on from this read's first byte.
        self._body_from = 0 if self._parsing is not None and not self._chunked else -1
        self._body_here = 0
        try:
            if self._line is not None:
                self._check_line(self._line + data[: self._listener.max_field + _LINE_SLACK])
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # llhttp stops at an upgrade request's head; the gateway switches no protocol,
            # so that request is answered as HTTP and the connection closes after it.
            self._stopped = True
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if self._stopped:
                return  # bytes after a request that closes the connection: never read
            self._refuse(cause.status if isinstance(cause, _Refuse) else 400)
            return
        except _Refuse as exc:
            self._refuse(exc.status)
            return
        finally:
            self._data = b""
        if self._in_head:
            # Counted from the read after the one the head began in, which may hold the
            # replies' worth of requests before it: so the bound is the cap plus one read.
            self._head_size = 0 if self._began else self._head_size + len(data)
            if self._head_size > self._listener.head_max:
                self._refuse(431)

    def _check_line(self, line: bytes) -> None:
        """A request line is method SP target SP version, single spaces (RFC 9112 s.3);
        `line` is its start, as far as the reads so far go."""
        end = line.find(b"\r\n")
        if end < 0:
            # Held until its end arrives; on_url bounds the target, so this stays small.
            self._line = line[: self._listener.max_field + _LINE_SLACK]
            return
        self._line = None
        if line[:end].count(b" ") != 2 or b"  " in line[:end]:
            raise _Refuse(400)

    def on_message_begin(self) -> None:
        self._in_head = True
        self._began = True
        self._head_size = 0
        self._url = b""
        self._fields = []
        self._between = False
        self._line = None
        cursor = self._cursor
        if cursor >= 0:
            data = self._data
            # RFC 9112 s.2.2: empty lines before a request line are skipped, as llhttp does.
            while data[cursor : cursor + 2] == b"\r\n":
                cursor += 2
            self._cursor = cursor
            self._check_line(data[cursor : cursor + self._listener.max_field + _LINE_SLACK])

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._listener.max_field:
            raise _Refuse(400)

    def on_header(self, name: bytes, value: bytes) -> None:
        limit = self._listener.max_field
        fields = self._fields
        if len(name) > limit or len(value) > limit or len(fields) >= http1.MAX_HEADERS:
            raise _Refuse(431)
        fields.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_size = 0
        self._cancel_deadline()
        if self._line is not None:
            raise _Refuse(400)  # the head ended without the request line's own end
        cursor = self._cursor
        if cursor >= 0:
            end = self._data.find(b"\r\n\r\n", cursor)
            self._body_from = end + 4 if end >= 0 else -1
        else:
            self._body_from = -1
        self._body_here = 0
        parser = self._parser
        version = _VERSIONS.get(parser.get_http_version())
        if version is None:
            raise _Refuse(505)
        headers: CIMultiDict[str] = CIMultiDict(
            [
                (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
                for name, value in self._fields
            ]
        )
        self._fields = []
        chunked = "Transfer-Encoding" in headers
        if chunked:
            if version < HTTP_11:
                raise _Refuse(400)  # RFC 9112 s.6.1: the framing of such a message is faulty
            if not http1.only_chunked(headers.getall("Transfer-Encoding")):
                # llhttp takes any list that ends in chunked; a coding the gateway would
                # have to undo (or a second chunked) is one it does not implement (s.6.1).
                raise _Refuse(501)
            self._body_from = -1  # where a chunked body ends is not followed
        self._chunked = chunked
        hosts = len(headers.getall("Host", ()))
        if hosts > 1 or (hosts == 0 and version >= HTTP_11):
            raise _Refuse(400)  # RFC 9112 s.3.2
        length_text = headers.get("Content-Length")
        length = int(length_text) if length_text is not None else None
        keep_alive = parser.should_keep_alive()
        if parser.should_upgrade():
            if chunked or length:
                raise _Refuse(400)
            keep_alive = False
        request = Request(
            self,
            parser.get_method().decode("ascii"),
            self._url.decode("utf-8", "surrogateescape"),
            version,
            headers,
            content_length=length,
            chunked=chunked,
            keep_alive=keep_alive,
            limit=self._listener.max_body,
        )
        self._parsing = request
        if self._active is None and not self.write_paused:
            self._begin(request)
        else:
            # Behind the one being answered, or behind replies the client has not read yet.
            self._queue.append(request)
            if len(self._queue) >= _PIPELINE_DEPTH:
                self._pause_reading()

    def on_chunk_header(self) -> None:
        # Until the chunk's data comes, what follows may be the last chunk's trailer fields,
        # which the parser holds unfinished without bound: counted like a head.
        self._in_head = True
        self._began = True
        self._head_size = 0

    def on_chunk_complete(self) -> None:
        self._in_head = False

    def on_body(self, body: bytes) -> None:
        self._in_head = False
        self._body_here += len(body)
        request = self._parsing
        if request is not None:
            request._add(body)

    def on_message_complete(self) -> None:
        request = self._parsing
        self._parsing = None
        self._between = True
        start = self._body_from
        self._cursor = start + self._body_here if start >= 0 else -1
        if request is not None:
            request._finish_body()
            if not request.keep_alive:
                self._stopped = True  # whatever follows a closing request is never read

    def stop_reading(self) -> None:
        """Parse nothing more: the request under way is refused, then the connection closes.
        What still arrives is read and dropped, so the close after the refusal is no reset
        that could destroy the refusal in the client's buffer."""
        self._stopped = True

    def resume_body(self) -> None:
        if self._read_paused and not self._stopped and len(self._queue) < _PIPELINE_DEPTH:
            self._read_paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def _pause_for_turn(self) -> None:
        transport = self.transport
        if self._turn_paused or transport is None or transport.is_closing():
            return
        self._turn_paused = True
        transport.pause_reading()
        self._loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_paused = False
        self._read_in_turn = 0
        transport = self.transport
        if transport is not None and not self._read_paused and not transport.is_closing():
            transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    # -- the head deadline ------------------------------------------------------------------

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        self._deadline = self._loop.call_later(self._listener.keepalive_s, self._expired)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        # Idle, or a head still incomplete: close without a word (nothing was asked).
        self._deadline = None
        if self._active is None:
            self._shut()

    # -- answering ---------------------------------------------------------------------------

    def _begin(self, request: Request) -> None:
        self._active = request
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        try:
            reply = await self._listener.handler(request)
        except asyncio.CancelledError:
            return  # the client left (or the drain's grace ran out): nothing to answer
        except ConnectionError:
            self.abort()
            return
        except Exception as exc:
            log.error("connection handler failed: %s", describe(exc))
            if request.started:
                self.abort()
                return
            body = replies.render(
                ErrorShape.PLAIN, 500, "The gateway failed to handle the request."
            )
            reply = Reply(500, body, close=True)
        if self._gone:
            return
        try:
            if reply is not None:
                self._send(request, reply)
            elif not request._ended:
                self.abort()  # a relay that neither ended nor aborted: never a clean truncation
                return
            self._next(request)
        except ConnectionError:
            self.abort()  # closing under the reply (a shutdown's abort): nothing more to say

    def must_close(self, request: Request) -> bool:
        """Whether the connection closes after this request's reply."""
        return (
            not request.keep_alive
            or not request._complete
            or request._overflow
            or self.closing
            # Refused bytes follow: the replies to what came before them, then the refusal.
            or (self._refusal is not None and not self._queue)
        )

    def _send(self, request: Request, reply: Reply) -> None:
        status = reply.status
        body = reply.body
        closing = reply.close or self.must_close(request)
        parts = [
            f"HTTP/1.1 {status} {http1.phrase(status)}\r\n"
            f"Content-Type: {reply.content_type}\r\nContent-Length: {len(body)}\r\n"
        ]
        for name, value in reply.headers:
            parts += (name, ": ", value, "\r\n")
        parts += ("Date: ", http1.date.now(), "\r\n")
        head = _finish_head(parts, request, closing)
        request._ended = True
        if request.method == "HEAD" or not body:
            self.write_raw(head)
        elif len(body) <= _JOIN_MAX:
            self.write_raw(head + body)
        else:
            self.write_pieces(head, body)

    def _next(self, request: Request) -> None:
        """The request is answered: close, or go on to the next one."""
        self._active = None
        self._task = None
        transport = self.transport
        if transport is None:
            return
        if self._queue and request.keep_alive and not self.closing:
            if not self.write_paused:
                self._begin(self._queue.popleft())
                self.resume_body()
            # else resume_writing begins it: a client that sends and never reads would
            # otherwise have every reply pile up in the transport's buffer.
            return
        if request.keep_alive and not self.must_close(request):
            self._arm_deadline()
            return
        if self._refusal is not None:
            self._write_refusal()
        # The client may still be sending (a body the reply did not wait for, pipelined
        # requests, bytes after a refusal): whenever the gateway ends the connection.
        self._close(linger=True)

    def _close(self, *, linger: bool) -> None:
        """Close after the last reply. Where the client may still be sending (a body the
        reply did not wait for, bytes after a refusal), closing at once would reset the
        connection when those bytes land, and a reset discards the reply the client has not
        read yet: so send FIN, drop what arrives, and close on the client's EOF or after
        _LINGER_S (a lingering close)."""
        transport = self.transport
        if transport is None:
            return
        if not linger or not transport.can_write_eof():
            transport.close()
            return
        self._stopped = True
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        transport.write_eof()
        self._cancel_deadline()
        self._deadline = self._loop.call_later(_LINGER_S, self._shut)

    def _shut(self) -> None:
        """Close now; a client that stopped reading would hold a plain close open forever
        (it waits for the buffer to drain), so reset it instead."""
        transport = self.transport
        if transport is None:
            return
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()

    def _refuse(self, status: int) -> None:
        """The parser refused the bytes: answer after the requests before, then close."""
        self._listener.count_refused(status)
        log.debug("refused a request the HTTP parser could not read: %d", status)
        self._stopped = True
        self._cancel_deadline()
        parsing = self._parsing
        if parsing is not None and not parsing._complete:
            # Its body will never be complete: a handler waiting on it is answered 400 now.
            self._parsing = None
            if parsing is self._active:
                task = self._task
                if task is not None:
                    task.cancel()
                self._active = None
                self._task = None
            elif parsing in self._queue:
                self._queue.remove(parsing)
        if self._active is None and not self._queue:
            self._refusal = status
            self._write_refusal()
            self._close(linger=True)
        else:
            self._refusal = status
            self._pause_reading()  # until the replies before it are written

    def _write_refusal(self) -> None:
        status = self._refusal or 400
        body = replies.render(ErrorShape.PLAIN, status, http1.phrase(status))
        head = (
            f"HTTP/1.1 {status} {http1.phrase(status)}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{_SERVER_LINE}Date: {http1.date.now()}\r\n"
            "Connection: close\r\n\r\n"
        )
        self.write_raw(head.encode() + body)

    # -- writing -----------------------------------------------------------------------------

    def write_raw(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)

    def write_pieces(self, *pieces: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if len(pieces) == 1:
            transport.write(pieces[0])
        elif sum(len(p) for p in pieces) <= _JOIN_MAX:
            transport.write(b"".join(pieces))
        else:
            transport.writelines(pieces)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- the drain ---------------------------------------------------------------------------

    def close_if_idle(self) -> None:
        """At a drain: close now if nothing is under way, else after the current reply."""
        self.closing = True
        if self._active is None and not self._queue and self.transport is not None:
            self.transport.close()

    def cancel(self) -> asyncio.Task[None] | None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            return task
        return None


class Listener:
    """The request path's listener: its connections, their limits, its drain."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_connections: int,
        keepalive_s: float,
        max_header_bytes: int,
        max_body: int,
        send_timeout_s: float | None = None,
    ) -> None:
        self.handler = handler
        self.send_timeout_s = send_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.max_field = max_header_bytes
        self.head_max = http1.HEAD_FACTOR * max_header_bytes
        self.max_body = max_body
        self.connections: set[_Connection] = set()
        self.connections_refused = 0
        self.send_timeouts = 0  # connections reset for leaving their replies unread
        self.refused: dict[int, int] = {}  # requests the parser refused, by status
        self.full_reply = _full_reply()
        self.loop = asyncio.get_running_loop()
        self._server: ListeningServer | None = None
        self.port = 0

    @property
    def open_connections(self) -> int:
        return len(self.connections)

    def full(self) -> bool:
        return len(self.connections) >= self.max_connections

    def count_refused(self, status: int) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1

    async def start(self, host: str, port: int, *, reuse_port: bool, backlog: int) -> None:
        server: ListeningServer = await self.loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            # Said, not left to the default: a restart binds at once, beside the last
            # run's connections in TIME_WAIT.
            reuse_address=True,
            reuse_port=reuse_port or None,
            backlog=backlog,
        )
        self._server = server
        for sock in server.sockets:
            self.port = int(sock.getsockname()[1])
            break

    def stop_accepting(self) -> None:
        """Stop accepting; close idle connections, the others after their current reply."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()

    async def shutdown(self, cancel_wait: float) -> None:
        """Cancel what outlived the grace, give it `cancel_wait` to close its upstreams,
        then reset every connection left."""
        tasks = [t for conn in list(self.connections) if (t := conn.cancel()) is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=cancel_wait)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


_FULL: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n"
    + SERVER[0].encode()
    + b": "
    + SERVER[1].encode()
    + b"\r\nContent-Length: %d\r\n\r\n%s"
)


def _full_reply() -> bytes:
    body = replies.render(
        ErrorShape.PLAIN, 503, "The gateway is at its client connection limit; retry later."
    )
    return _FULL % (len(body), body)
