"""The proxy's upstream HTTP/1.1 client: pooled keep-alive connections, one write per request.

A general client does much per request that a proxy forwarding bytes has no use for (URL
objects, cookie jar, auto headers, payload registry, tracing, request and response
objects). Here the request head is built as one string and written with the body in one
call, idle connections are pooled per backend, and each connection is a
gateway/edge/relay.py BackendConnection: llhttp reads the response, and its body goes to
the client as it arrives. Health probes and discovery use aiohttp; they are not on the
request path.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
from collections import deque
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

from mypy_extensions import mypyc_attr

from gateway.edge.failures import (
    ConnectFailed,
    UpstreamBroken,
    UpstreamError,
    UpstreamFailure,
    UpstreamTimeout,
)
from gateway.edge.relay import BackendConnection
from gateway.runtime import is_local

if TYPE_CHECKING:
    from gateway.edge.server import Request

__all__ = [
    "ConnectFailed",
    "Upstream",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamFailure",
    "UpstreamResponse",
    "UpstreamTimeout",
    "build_head",
]

_CRLF: Final = "\r\n"
# Bodies up to this size are joined to their head: one plain send costs less than a
# gathered one.
_JOIN_MAX: Final = 16 << 10
_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def build_head(
    method: str, target: str, headers: list[tuple[str, str]], host: str, body: bytes | None
) -> bytes:
    """The request line and header block: Host added where the client sent none, and a
    Content-Length for the bytes that follow (or 0 where a method implies a body).

    Header names and values come from the request parser or from the gateway itself; a CR or
    LF in any of them (a config value, say) would split the head, so the line count is
    checked once on the whole string rather than per value.
    """
    parts = [method, " ", target, " HTTP/1.1\r\n"]
    has_host = False
    for name, value in headers:
        parts += (name, ": ", value, _CRLF)
        if not has_host and name.lower() == "host":
            has_host = True
    lines = len(headers) + 2
    if not has_host:
        parts += ("Host: ", host, _CRLF)
        lines += 1
    if body is not None:
        parts += ("Content-Length: ", str(len(body)), _CRLF, _CRLF)
    elif method in _NO_BODY_METHODS:
        parts.append(_CRLF)
    else:
        parts.append("Content-Length: 0\r\n\r\n")
    if body is not None or method not in _NO_BODY_METHODS:
        lines += 1
    text = "".join(parts)
    if text.count("\n") != lines or text.count("\r") != lines:
        raise ValueError("a header name or value contains CR or LF")
    # surrogateescape: bytes the request parser decoded that way go out as they came in.
    return text.encode("utf-8", "surrogateescape")


class _Endpoint:
    __slots__ = ("host", "host_header", "idle", "port", "tls", "url")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None  # normalised by config
        self.url = url
        self.host = parts.hostname
        self.port = parts.port
        self.host_header = parts.netloc
        self.tls = parts.scheme == "https"
        # (protocol, loop time after which it is too old to reuse); newest on the right.
        self.idle: deque[tuple[BackendConnection, float]] = deque()


class UpstreamResponse:
    """A response whose head has arrived; `relay` or `read` takes its body."""

    __slots__ = (
        "_conn",
        "_deadline",
        "_endpoint",
        "_owner",
        "_proto",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self,
        owner: Upstream,
        endpoint: _Endpoint,
        proto: BackendConnection,
        *,
        deadline: asyncio.TimerHandle | None,
    ) -> None:
        self._owner = owner
        self._endpoint = endpoint
        self._proto: BackendConnection | None = proto
        self._deadline = deadline
        self.status = proto.status
        self.reason = proto.reason
        self.headers = proto.headers  # (name, value) as the backend sent them, in order
        self._conn = proto

    def header(self, name: str, default: str | None = None) -> str | None:
        """The first value of a header, by case-insensitive name."""
        lowered = name.lower()
        for key, value in self.headers:
            if key.lower() == lowered:
                return value
        return default

    async def read(self) -> bytes:
        """The next piece of the body as it arrives; b"" at its end.

        Raises UpstreamTimeout when no byte came within the idle timeout (or the total
        deadline passed), UpstreamBroken when the body broke off.
        """
        return await self._conn.read()

    async def relay(self, sink: Request) -> None:
        """Write the body to the client's connection as it arrives, to its end.

        Raises UpstreamTimeout or UpstreamBroken as `read` does, and ConnectionError when
        the client is gone.
        """
        await self._conn.relay(sink)

    @property
    def relayed(self) -> int:
        """Body bytes written to the client so far."""
        return self._conn.relayed

    @property
    def content_length(self) -> int | None:
        value = self.header("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    def set_idle_timeout(self, seconds: float | None) -> None:
        """From now on bound the silence between chunks, not the wait for the head."""
        if self._proto is not None:
            self._proto.set_read_timeout(seconds)

    def release(self) -> None:
        """The body was read to its end: keep the connection for the next request."""
        proto = self._take()
        if proto is not None:
            self._owner.put_idle(self._endpoint, proto)

    def close(self) -> None:
        """Close the connection, which is what tells SGLang to abort the generation."""
        proto = self._take()
        if proto is not None:
            _shut(proto)

    def _take(self) -> BackendConnection | None:
        proto, self._proto = self._proto, None
        if proto is not None:
            self._owner.active -= 1
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        return proto


# Compiled, a class takes no Python subclass unless it says so: tracing.TracedUpstream is one.
@mypyc_attr(allow_interpreted_subclasses=True)
class Upstream:
    """Keep-alive connections to the backends, reused newest first."""

    def __init__(
        self,
        *,
        keepalive_s: float,
        read_bufsize: int,
        max_line_size: int,
        max_field_size: int,
    ) -> None:
        self._keepalive_s = keepalive_s
        self._read_bufsize = read_bufsize  # body bytes buffered for a reader before a pause
        self._max_field_size = max(max_line_size, max_field_size)
        # Only backends with pooled connections stay here (the sweep drops the rest), so
        # pods that come and go under discovery do not pile up over the gateway's life.
        self._endpoints: dict[str, _Endpoint] = {}
        self._tls: ssl.SSLContext | None = None  # one context for every https backend
        self._closed = False
        self._sweeper: asyncio.TimerHandle | None = None
        self.active = 0  # connections carrying a request or its response
        # Connections closed because the backend sent bytes no request asked for.
        self.unsolicited = 0
        # Connects that failed for want of a local resource (EMFILE, ENFILE, ENOBUFS).
        self.local_errors = 0

    @property
    def known_backends(self) -> int:
        """Backends with pooled connections or a request under way since the last sweep."""
        return len(self._endpoints)

    def pool_state(self) -> tuple[int, int]:
        """(idle pooled connections, active ones): for leak checks."""
        return sum(len(e.idle) for e in self._endpoints.values()), self.active

    async def request(
        self,
        url: str,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        *,
        connect_s: float,
        ttfb_s: float | None,
        total_s: float | None,
    ) -> UpstreamResponse:
        """Send one request and wait for its response head.

        Raises ConnectFailed when no connection could be made (nothing was sent),
        UpstreamTimeout when the head did not come within ttfb_s (or total_s), and
        UpstreamError when the backend broke the exchange after it was sent; ValueError for
        a header that would split the request head (before anything is sent).
        """
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            endpoint = self._endpoints[url] = _Endpoint(url)
            self._schedule_sweep()  # drops it again if no connection ever gets pooled
        # Built first: a head that cannot be sent must not cost a connection.
        head = build_head(method, target, headers, endpoint.host_header, body)
        loop = asyncio.get_running_loop()
        proto = self._take_idle(endpoint, loop.time())
        if proto is None:
            proto = await self._connect(endpoint, loop, connect_s)
        self.active += 1
        deadline = None
        try:
            proto.begin(head_only=method == "HEAD", read_timeout=ttfb_s)
            transport = proto.transport
            assert transport is not None
            if body and len(body) > _JOIN_MAX:
                # Sent without a copy of the body under uvloop, a writev per turn of what
                # the socket takes (asyncio's own loop joins them on Python 3.11).
                transport.writelines((head, body))
            else:
                transport.write(head + body if body else head)
            if total_s is not None:
                # The same error a read timeout raises, for the head or for the body.
                deadline = loop.call_later(total_s, proto.expire)
            # Interim (1xx) answers are skipped by the connection, which caps them.
            await proto.head()
            if proto.status == 101:
                # The gateway relays HTTP/1.1 only; going on after a protocol switch would
                # read the new protocol's bytes as HTTP.
                raise UpstreamError("switched protocols (101)")
        except BaseException:
            if deadline is not None:
                deadline.cancel()
            self.active -= 1
            _shut(proto)
            raise
        return UpstreamResponse(self, endpoint, proto, deadline=deadline)

    async def _connect(
        self, endpoint: _Endpoint, loop: asyncio.AbstractEventLoop, connect_s: float
    ) -> BackendConnection:
        try:
            async with asyncio.timeout(connect_s):
                _, proto = await loop.create_connection(
                    lambda: BackendConnection(
                        loop,
                        max_field_size=self._max_field_size,
                        read_high_water=self._read_bufsize,
                    ),
                    endpoint.host,
                    endpoint.port,
                    ssl=self._tls_context() if endpoint.tls else None,
                    server_hostname=endpoint.host if endpoint.tls else None,
                )
        except TimeoutError:
            raise ConnectFailed("ConnectionTimeoutError") from None
        except OSError as exc:  # refused, unreachable, DNS, TLS; or out of descriptors
            if is_local(exc):
                self.local_errors += 1
                raise ConnectFailed(
                    errno.errorcode.get(exc.errno or 0, "OSError"), local=True
                ) from exc
            raise ConnectFailed("ClientConnectorError") from exc
        proto.on_unsolicited = self._count_unsolicited
        return proto

    def _count_unsolicited(self) -> None:
        self.unsolicited += 1

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _take_idle(self, endpoint: _Endpoint, now: float) -> BackendConnection | None:
        idle = endpoint.idle
        while idle:
            proto, expires = idle.pop()
            if expires > now and proto.reusable:
                return proto
            _shut(proto)
        return None

    def put_idle(self, endpoint: _Endpoint, proto: BackendConnection) -> None:
        transport = proto.transport
        if (
            self._closed
            or proto.should_close
            or not proto.reusable
            or proto.expecting  # the body was not read to its end
            or transport is None
            or transport.is_closing()
            # The backend answered before taking the whole request body: what is still
            # queued would be read as the start of the next request on this connection.
            or transport.get_write_buffer_size()
        ):
            _shut(proto)
            return
        # The sweep may have dropped this endpoint while the request ran: file it again.
        endpoint = self._endpoints.setdefault(endpoint.url, endpoint)
        now = asyncio.get_running_loop().time()
        _retire(endpoint.idle, now)
        endpoint.idle.append((proto, now + self._keepalive_s))
        self._schedule_sweep()

    def _schedule_sweep(self) -> None:
        if self._sweeper is None and not self._closed:
            self._sweeper = asyncio.get_running_loop().call_later(self._keepalive_s, self._sweep)

    def _sweep(self) -> None:
        """Close connections left idle past the keep-alive time, so a quiet gateway holds
        no sockets for long, and forget backends with none left; runs while any is known."""
        self._sweeper = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for url, endpoint in list(self._endpoints.items()):
            _retire(endpoint.idle, now)
            if not endpoint.idle:
                del self._endpoints[url]
        if self._endpoints and not self._closed:
            self._sweeper = loop.call_later(self._keepalive_s / 2, self._sweep)

    def close(self) -> None:
        """Close every idle connection; in-flight ones are closed by their handlers."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for endpoint in self._endpoints.values():
            while endpoint.idle:
                endpoint.idle.pop()[0].close()


def _retire(idle: deque[tuple[BackendConnection, float]], now: float) -> None:
    """Close pooled connections that are too old or closed, oldest first: the gateway retires
    them before the backend's own idle timeout can close one under a new request."""
    while idle and (idle[0][1] <= now or not idle[0][0].reusable):
        _shut(idle.popleft()[0])


def _shut(proto: BackendConnection) -> None:
    """Close a connection now. A plain close waits until queued bytes are sent, which a
    backend that stopped reading the request body would never allow: reset it instead."""
    transport = proto.transport
    if transport is not None and transport.get_write_buffer_size():
        proto.abort()
    else:
        proto.close()
