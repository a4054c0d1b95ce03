"""The request path's upstream client (gateway/edge/upstream.py), against raw servers on 127.0.0.1.

The proxy tests exercise it end to end; these pin down what a scripted server can show
directly: the bytes of the request head, connection reuse and retirement, interim 1xx
answers, the whole-exchange deadline and connect failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.edge.upstream import (
    ConnectFailed,
    Upstream,
    UpstreamBroken,
    UpstreamError,
    UpstreamFailure,
    UpstreamTimeout,
    build_head,
)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Answers each request on a connection with the script; records heads and connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed = 0
        self.heads: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                await self.script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


async def answer_ok(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(OK)
    await writer.drain()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    client = Upstream(
        keepalive_s=0.3, read_bufsize=1 << 16, max_line_size=8190, max_field_size=8190
    )
    yield client
    client.close()


async def get(client: Upstream, url: str, **kw: object) -> tuple[int, bytes]:
    resp = await client.request(
        url,
        str(kw.get("method", "POST")),
        "/generate",
        [("Content-Type", "application/json")],
        b"{}" if kw.get("body", True) else None,
        connect_s=2,
        ttfb_s=2,
        total_s=kw.get("total_s"),  # type: ignore[arg-type]
    )
    try:
        body = b""
        while chunk := await resp.read():
            body += chunk
    except BaseException:
        resp.close()
        raise
    resp.release()
    return resp.status, body


# -- the request head ---------------------------------------------------------------------------


def test_head_adds_host_and_content_length() -> None:
    head = build_head("POST", "/generate?x=1", [("Accept", "*/*")], "10.0.0.1:30000", b"abc")
    assert head == (
        b"POST /generate?x=1 HTTP/1.1\r\nAccept: */*\r\nHost: 10.0.0.1:30000\r\n"
        b"Content-Length: 3\r\n\r\n"
    )


def test_head_keeps_the_clients_host_and_sends_no_length_without_a_body() -> None:
    head = build_head("GET", "/health", [("host", "gw.example")], "10.0.0.1:30000", None)
    assert head == b"GET /health HTTP/1.1\r\nhost: gw.example\r\n\r\n"
    # A body method without a body still says so, as aiohttp's client did.
    assert b"Content-Length: 0\r\n\r\n" in build_head("POST", "/", [], "h:1", None)


@pytest.mark.parametrize("bad", ["a\r\nX-Injected: 1", "a\nb", "a\rb"])
def test_head_refuses_cr_or_lf_in_a_value(bad: str) -> None:
    with pytest.raises(ValueError, match="CR or LF"):
        build_head("POST", "/generate", [("Authorization", bad)], "h:1", b"")


def test_head_sends_undecodable_header_bytes_back_as_they_came() -> None:
    # aiohttp's parser decodes header bytes with surrogateescape; they go out unchanged.
    value = b"caf\xe9".decode("utf-8", "surrogateescape")
    assert b"X-Name: caf\xe9\r\n" in build_head("GET", "/", [("X-Name", value)], "h:1", None)


# -- connections --------------------------------------------------------------------------------


async def test_connection_is_reused_then_retired_after_keepalive(upstream: Upstream) -> None:
    async with RawServer(answer_ok) as server:
        assert await get(upstream, server.url) == (200, b"ok")
        assert await get(upstream, server.url) == (200, b"ok")
        assert server.connections == 1
        assert upstream.pool_state() == (1, 0)
        # Idle past keepalive_s: the sweep closes it without any new request.
        for _ in range(50):
            await asyncio.sleep(0.05)
            if server.closed == 1:
                break
        assert server.closed == 1 and upstream.pool_state() == (0, 0)
        # Nor is the backend itself remembered: pods come and go under discovery.
        assert upstream.known_backends == 0
        assert await get(upstream, server.url) == (200, b"ok")
        assert server.connections == 2 and upstream.known_backends == 1


async def test_a_backend_that_never_answered_is_forgotten(upstream: Upstream) -> None:
    async with RawServer(answer_ok) as server:
        url = server.url
    with pytest.raises(ConnectFailed):
        await get(upstream, url)
    assert upstream.known_backends == 1
    await asyncio.sleep(0.5)  # past keepalive_s (0.3 s): the sweep runs without any pool
    assert upstream.known_backends == 0


async def test_connection_close_answer_is_not_pooled(upstream: Upstream) -> None:
    async def answer_and_close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with RawServer(answer_and_close) as server:
        assert await get(upstream, server.url) == (200, b"ok")
        assert upstream.pool_state() == (0, 0)
        assert await get(upstream, server.url) == (200, b"ok")
        assert server.connections == 2


async def test_interim_1xx_answers_are_skipped(upstream: Upstream) -> None:
    async def interim_then_ok(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n")
        writer.write(OK)
        await writer.drain()

    async with RawServer(interim_then_ok) as server:
        assert await get(upstream, server.url) == (200, b"ok")
        assert await get(upstream, server.url) == (200, b"ok")  # and the connection is sane
        assert server.connections == 1


async def test_the_request_bytes_on_the_wire(upstream: Upstream) -> None:
    async with RawServer(answer_ok) as server:
        await get(upstream, server.url)
        await get(upstream, server.url, method="GET", body=False)
    assert server.heads == [
        b"POST /generate HTTP/1.1\r\nContent-Type: application/json\r\n"
        + f"Host: 127.0.0.1:{server.port}\r\nContent-Length: 2\r\n\r\n".encode(),
        b"GET /generate HTTP/1.1\r\nContent-Type: application/json\r\n"
        + f"Host: 127.0.0.1:{server.port}\r\n\r\n".encode(),
    ]


async def test_total_deadline_breaks_a_slow_body(upstream: Upstream) -> None:
    async def trickle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _ in range(100):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.02)

    async with RawServer(trickle) as server:
        with pytest.raises(UpstreamTimeout):
            await get(upstream, server.url, total_s=0.3)
        await asyncio.sleep(0.1)
        assert server.closed == 1  # the connection was closed, not pooled
    assert upstream.pool_state() == (0, 0)


async def test_refused_connection_is_a_connect_failure(upstream: Upstream) -> None:
    async with RawServer(answer_ok) as server:
        url = server.url
    with pytest.raises(ConnectFailed) as caught:
        await get(upstream, url)
    assert caught.value.cause == "ClientConnectorError"
    assert upstream.pool_state() == (0, 0)


async def test_a_pooled_connection_the_backend_closed_is_not_reused(upstream: Upstream) -> None:
    async def answer_then_hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(OK)
        await writer.drain()
        writer.close()

    async with RawServer(answer_then_hang_up) as server:
        assert await get(upstream, server.url) == (200, b"ok")
        await asyncio.sleep(0.1)  # the FIN arrives while the connection sits in the pool
        assert await get(upstream, server.url) == (200, b"ok")
        assert server.connections == 2


async def test_close_drops_idle_connections() -> None:
    client = Upstream(keepalive_s=30, read_bufsize=1 << 16, max_line_size=8190, max_field_size=8190)
    async with RawServer(answer_ok) as server:
        await get(client, server.url)
        assert client.pool_state() == (1, 0)
        client.close()
        assert client.pool_state() == (0, 0)
        with contextlib.suppress(Exception):
            for _ in range(20):
                await asyncio.sleep(0.05)
                if server.closed:
                    break
        assert server.closed == 1


async def test_head_and_body_answers_alternate_on_one_connection(upstream: Upstream) -> None:
    """A HEAD answer announces a length it never sends: the parser must know, per request."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head_request = server.heads[-1].startswith(b"HEAD ")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
        if not head_request:
            writer.write(b"ok")
        await writer.drain()

    server = RawServer(answer)
    async with server:
        for method in ("GET", "HEAD", "HEAD", "GET", "POST", "HEAD"):
            status, body = await asyncio.wait_for(
                get(upstream, server.url, method=method, body=False), 2
            )
            assert (status, body) == (200, b"" if method == "HEAD" else b"ok"), method
        assert server.connections == 1


async def test_an_answer_before_the_whole_body_was_taken_retires_the_connection(
    upstream: Upstream,
) -> None:
    """The backend answers from the head alone and never reads the 16 MB body: the rest of
    it is still queued, so the connection must not carry the next request."""
    connections = 0
    done = asyncio.Event()

    async def answer_unread(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK)
        await writer.drain()
        await done.wait()  # keeps the connection open, reading nothing more
        writer.close()

    server = await asyncio.start_server(answer_unread, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        big = b"x" * (16 << 20)
        for _ in range(2):
            resp = await upstream.request(
                url, "POST", "/generate", [], big, connect_s=2, ttfb_s=2, total_s=None
            )
            assert resp.status == 200 and await resp.read() == b"ok"
            resp.release()
            assert upstream.pool_state() == (0, 0)
        assert connections == 2
    finally:
        done.set()
        server.close()
        await server.wait_closed()


async def test_ipv6_backend(upstream: Upstream) -> None:
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        await reader.readexactly(2)
        writer.write(OK)
        await writer.drain()
        writer.close()

    try:
        server = await asyncio.start_server(answer, "::1", 0)
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    port = server.sockets[0].getsockname()[1]
    try:
        assert await get(upstream, f"http://[::1]:{port}") == (200, b"ok")
        assert f"Host: [::1]:{port}\r\n".encode() in heads[0]
    finally:
        server.close()
        await server.wait_closed()


# -- every failure mode, in the gateway's own types ------------------------------------------


async def _close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


def _send(data: bytes, *later: bytes, then_close: bool = True, hold_s: float = 0.0) -> Script:
    """Write `data`, then each of `later` after a pause (so the client has the head by
    then), then hold the connection and close it."""

    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        for part in later:
            await asyncio.sleep(0.05)
            writer.write(part)
            await writer.drain()
        if hold_s:
            await asyncio.sleep(hold_s)
        if then_close:
            writer.close()

    return script


def _reset_after(data: bytes) -> Script:
    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        # SO_LINGER 0: close() sends a RST instead of a FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    return script


_HEAD = b"HTTP/1.1 200 OK\r\n"
FAILURES: list[tuple[str, Script, type[UpstreamFailure]]] = [
    ("closed before the head", _close, UpstreamError),
    (
        # The same for a chunked body's last trailer field, after the head was handed over.
        "an unending trailer",
        _send(
            _HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: ",
            *[b"a" * (1 << 16)] * 32,
            then_close=False,
            hold_s=2,
        ),
        UpstreamBroken,
    ),
    (
        # A header value that never ends, on a connection held open: refused at the head's
        # cap (8 x the field limit), not held until the head's timeout.
        "an unending head",
        _send(_HEAD + b"X: ", *[b"a" * (1 << 16)] * 32, then_close=False, hold_s=2),
        UpstreamError,
    ),
    ("not HTTP", _send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), UpstreamError),
    ("a bad status line", _send(b"HTTP/1.1 2x0 OK\r\n\r\n"), UpstreamError),
    ("half a head, then close", _send(b"HTTP/1.1 200 OK\r\nContent-Le"), UpstreamError),
    (
        "a header line past the limit",
        _send(_HEAD + b"X: " + b"a" * 9000 + b"\r\n\r\n"),
        UpstreamError,
    ),
    (
        "switched protocols",
        _send(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"),
        UpstreamError,
    ),
    (
        "endless interim answers",
        _send(b"HTTP/1.1 100 Continue\r\n\r\n" * 200, hold_s=1),
        UpstreamError,
    ),
    ("a reset before the head", _reset_after(b""), UpstreamError),
    ("no head in time", _send(b"", then_close=False, hold_s=3), UpstreamTimeout),
    ("closed mid-body", _send(_HEAD + b"Content-Length: 10\r\n\r\nabc"), UpstreamBroken),
    (
        "a bad chunk size in the first packet",
        _send(_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n"),
        UpstreamError,  # the parse fails before the head is handed over: a 502
    ),
    (
        "a bad chunk size after the head",
        _send(_HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", b"zz\r\nab\r\n"),
        UpstreamBroken,
    ),
    (
        "chunked, closed before the last chunk",
        _send(_HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nab\r\n"),
        UpstreamBroken,
    ),
    ("a reset mid-body", _reset_after(_HEAD + b"Content-Length: 10\r\n\r\nabc"), UpstreamBroken),
    (
        "silent mid-body past the idle timeout",
        _send(_HEAD + b"Content-Length: 10\r\n\r\nabc", then_close=False, hold_s=3),
        UpstreamTimeout,
    ),
]


@pytest.mark.parametrize(
    ("script", "expected"), [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES]
)
async def test_every_failure_is_one_of_the_gateways_types(
    upstream: Upstream, script: Script, expected: type[UpstreamFailure]
) -> None:
    """The proxy decides status and outcome from these types alone (it imports no aiohttp
    exception): whatever the backend does, nothing else may come out of the client."""
    async with RawServer(script) as server:
        with pytest.raises(Exception) as caught:
            resp = await upstream.request(
                server.url,
                "POST",
                "/generate",
                [],
                b"{}",
                connect_s=1,
                ttfb_s=0.5,
                total_s=None,
            )
            resp.set_idle_timeout(0.3)
            try:
                while await resp.read():
                    pass
            finally:
                resp.close()
        assert type(caught.value) is expected, repr(caught.value)
        assert caught.value.cause
    assert upstream.pool_state() == (0, 0)


async def test_a_refused_connect_and_a_total_deadline_are_the_gateways_types(
    upstream: Upstream,
) -> None:
    async with RawServer(answer_ok) as server:
        url = server.url
    with pytest.raises(ConnectFailed):
        await get(upstream, url)
    async with RawServer(_send(b"", then_close=False, hold_s=3)) as server:
        with pytest.raises(UpstreamTimeout):
            await get(upstream, server.url, total_s=0.3)


async def test_bytes_after_a_closing_response_are_stray_and_the_body_is_whole(
    upstream: Upstream,
) -> None:
    """llhttp refuses any byte after a `Connection: close` response: the response is still
    whole and ends at once, and the bytes count as unsolicited."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nokEXTRA")
        await writer.drain()
        await asyncio.sleep(3)  # held open: the exchange must not wait for the close

    server = RawServer(answer)
    async with server:
        status, body = await asyncio.wait_for(get(upstream, server.url), 30)
    assert (status, body) == (200, b"ok")
    assert upstream.unsolicited == 1
    assert upstream.pool_state() == (0, 0)


async def test_bytes_after_a_head_answer_retire_the_connection(upstream: Upstream) -> None:
    """A HEAD answer ends at its head; whatever follows it in the same read answers
    nothing, so the connection is closed rather than reused."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nHTTP/1.1 200 OK\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    server = RawServer(answer)
    async with server:
        status, body = await asyncio.wait_for(
            get(upstream, server.url, method="HEAD", body=False), 2
        )
        assert (status, body) == (200, b"")
        assert upstream.unsolicited == 1
        assert upstream.pool_state() == (0, 0)
