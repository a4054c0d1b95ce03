"""The client connection driven byte by byte: a fake transport and a fake clock, no sockets.

The socket-level tests (tests/hardening) show the same behaviour end to end; these point at
the callback where it goes wrong.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.edge.server import Listener, Reply, Request, _Connection
from tests.edge.protocol_fakes import FakeClock, FakeTransport, settle
from tests.hardening.rawnet import parse_responses

GET = b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n"


class _App:
    """Answers each request with its path; `hold` keeps answers back until released."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, request: Request) -> Reply:
        self.seen.append(request.raw_path)
        body = await request.read_body(1 << 20)
        if self.hold is not None:
            await self.hold.wait()
        return Reply(200, request.raw_path.encode() + body)


async def _connection(
    app: _App, **limits: float
) -> tuple[_Connection, FakeTransport, FakeClock, Listener]:
    listener = Listener(
        app,
        max_connections=10,
        keepalive_s=limits.get("keepalive_s", 75.0),
        max_header_bytes=1024,
        max_body=1 << 20,
        send_timeout_s=limits.get("send_timeout_s", 60.0),
    )
    clock = FakeClock()
    listener.loop = clock  # type: ignore[assignment]
    conn = _Connection(listener)
    transport = FakeTransport()
    conn.connection_made(transport)
    return conn, transport, clock, listener


def _statuses(transport: FakeTransport) -> list[int]:
    return [r.status for r in parse_responses(transport.output())]


async def test_a_request_is_answered_and_the_connection_kept() -> None:
    app = _App()
    conn, transport, _, _ = await _connection(app)
    conn.data_received(GET)
    await settle()
    (reply,) = parse_responses(transport.output())
    assert (reply.status, reply.body) == (200, b"/x")
    assert "connection" not in reply.headers and not transport.closed


async def test_a_pipelined_request_waits_for_the_replies_before_it_to_drain() -> None:
    app = _App()
    conn, transport, _, _ = await _connection(app)
    conn.pause_writing()  # the client has not read what it was sent
    conn.data_received(GET + GET.replace(b"/x", b"/y"))
    await settle()
    assert app.seen == [] and not transport.reading  # nothing started, reading stopped
    conn.resume_writing()
    await settle()
    assert app.seen == ["/x", "/y"]
    assert _statuses(transport) == [200, 200]


async def test_a_reply_left_unread_resets_only_without_progress() -> None:
    app = _App()
    conn, transport, clock, listener = await _connection(app, send_timeout_s=1.0)
    conn.data_received(GET)
    await settle()
    transport.buffered = 500_000
    conn.pause_writing()
    for _ in range(5):  # the client takes some every period: never reset
        transport.buffered -= 50_000
        clock.advance(1.0)
    assert not transport.aborted and listener.send_timeouts == 0
    clock.advance(1.0)  # a whole period with nothing taken
    assert transport.aborted and listener.send_timeouts == 1


async def test_the_send_deadline_ends_when_the_buffer_drains() -> None:
    conn, transport, clock, _ = await _connection(_App(), send_timeout_s=1.0)
    transport.buffered = 100_000
    conn.pause_writing()
    conn.resume_writing()
    clock.advance(10)
    assert not transport.aborted and clock.pending <= 1  # only the keep-alive deadline


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /x HTTP/1.1\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET  /x HTTP/1.1\r\nHost: h\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nHost: h\r\n" + b"X: y\r\n" * 200 + b"\r\n", 431),
    ],
    ids=["no-host", "two-hosts", "two-spaces", "te-gzip-chunked", "te-http10", "fields"],
)
@pytest.mark.parametrize("split", [None, 1, 7, 18])
async def test_refusals_whatever_the_reads(raw: bytes, status: int, split: int | None) -> None:
    app = _App()
    conn, transport, _, listener = await _connection(app)
    pieces = [raw] if split is None else [raw[:split], raw[split:]]
    for piece in pieces:
        conn.data_received(piece)
    await settle()
    assert _statuses(transport) == [status]
    assert app.seen == [] and listener.refused == {status: 1}
    assert transport.eof_written  # a lingering close, so the refusal is read


async def test_a_refusal_waits_for_the_replies_before_it() -> None:
    app = _App()
    app.hold = asyncio.Event()
    conn, transport, _, _ = await _connection(app)
    conn.data_received(GET + b"GET  /bad HTTP/1.1\r\nHost: h\r\n\r\n")
    await settle()
    assert transport.output() == b""
    app.hold.set()
    await settle()
    assert _statuses(transport) == [200, 400]


async def test_the_head_cap_counts_from_the_read_after_the_head_began() -> None:
    """A read full of whole requests that ends inside the next head adds nothing to that
    head's count; the reads that follow do."""
    app = _App()
    conn, transport, _, _ = await _connection(app)
    burst = GET * 400 + b"GET /x HTTP/1.1\r\n"  # 11 KB, past the 8 KiB cap of this listener
    conn.data_received(burst)
    await settle()
    conn.data_received(b"Host: h\r\n\r\n")
    for _ in range(500):
        await settle()
        if len(app.seen) == 401:
            break
    assert len(app.seen) == 401
    assert set(_statuses(transport)) == {200}
    conn.data_received(b"GET /x HTTP/1.1\r\n")
    for _ in range(10):
        conn.data_received(b"X-Filler: " + b"a" * 900 + b"\r\n")
    await settle()
    assert _statuses(transport) == [431]


async def test_an_idle_connection_closes_at_the_keepalive_deadline() -> None:
    conn, transport, clock, _ = await _connection(_App(), keepalive_s=5.0)
    conn.data_received(GET)
    await settle()
    clock.advance(4.9)
    assert not transport.closed
    clock.advance(0.2)
    assert transport.closed
