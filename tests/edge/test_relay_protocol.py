"""BackendConnection driven byte by byte: a fake transport and a fake clock, no sockets.

The socket-level tests (tests/hardening) show the same faults end to end; these point at
the callback and the phase where one goes wrong.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from gateway.edge.failures import UpstreamBroken, UpstreamError, UpstreamTimeout
from gateway.edge.relay import TRANSITIONS, BackendConnection, Phase
from tests.edge.protocol_fakes import FakeClock, FakeTransport, settle

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def _conn(clock: FakeClock) -> tuple[BackendConnection, FakeTransport]:
    conn = BackendConnection(
        cast(asyncio.AbstractEventLoop, clock), max_field_size=8192, read_high_water=1 << 16
    )
    transport = FakeTransport()
    conn.connection_made(transport)
    return conn, transport


async def _body(conn: BackendConnection) -> bytes:
    out = b""
    while piece := await conn.read():
        out += piece
    return out


def test_the_transition_table() -> None:
    """Every phase is reached from IDLE; FAILED is the only end; a connection carries the
    next exchange only from DONE."""
    seen = {Phase.IDLE}
    frontier = [Phase.IDLE]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(Phase)
    assert TRANSITIONS[Phase.FAILED] == frozenset()
    assert [p for p in Phase if Phase.HEAD in TRANSITIONS[p]] == [Phase.IDLE, Phase.DONE]


async def test_an_illegal_transition_raises() -> None:
    conn, _ = _conn(FakeClock())
    conn.begin(head_only=False, read_timeout=None)
    with pytest.raises(RuntimeError, match="head -> head"):
        conn.begin(head_only=False, read_timeout=None)  # a second request mid-exchange


async def test_a_whole_response_in_one_read() -> None:
    conn, transport = _conn(FakeClock())
    conn.begin(head_only=False, read_timeout=None)
    assert conn.phase is Phase.HEAD and conn.expecting
    conn.data_received(OK)
    await conn.head()
    assert conn.phase is Phase.DONE and not conn.expecting
    assert (conn.status, conn.reason) == (200, "OK")
    assert await _body(conn) == b"{}"
    assert conn.reusable and not transport.closed
    conn.begin(head_only=False, read_timeout=None)  # DONE -> HEAD: the next exchange
    assert conn.phase is Phase.HEAD


async def test_bytes_while_idle_are_never_parsed() -> None:
    conn, transport = _conn(FakeClock())
    unasked: list[bool] = []
    conn.on_unsolicited = lambda: unasked.append(True)
    conn.data_received(OK)
    assert conn.unsolicited and unasked == [True]
    assert transport.aborted and not conn.reusable
    assert conn.phase is Phase.IDLE and conn.status == 0


async def test_a_second_response_in_the_read_that_ends_the_first() -> None:
    conn, transport = _conn(FakeClock())
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(OK + OK)
    await conn.head()
    assert await _body(conn) == b"{}"  # the first goes out whole
    assert conn.unsolicited and transport.aborted


async def test_a_head_answer_ends_at_its_head_and_the_parser_is_replaced() -> None:
    conn, _ = _conn(FakeClock())
    conn.begin(head_only=True, read_timeout=None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    await conn.head()
    assert conn.phase is Phase.DONE and conn.reusable
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(OK)
    await conn.head()
    assert await _body(conn) == b"{}"


@pytest.mark.parametrize("codings", [b"gzip, chunked", b"chunked, gzip", b"br"])
async def test_a_coding_under_chunked_fails_the_head(codings: bytes) -> None:
    conn, transport = _conn(FakeClock())
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + codings + b"\r\n\r\n")
    with pytest.raises(UpstreamError):
        await conn.head()
    assert conn.phase is Phase.FAILED and transport.aborted


async def test_a_fault_in_the_read_that_brought_the_head_withholds_it() -> None:
    """A 502 as a whole, not a head and then a broken body."""
    conn, _ = _conn(FakeClock())
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    with pytest.raises(UpstreamError):
        await conn.head()


async def test_a_fault_after_the_head_is_the_bodys() -> None:
    conn, _ = _conn(FakeClock())
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await conn.head()
    conn.data_received(b"zz\r\n")
    with pytest.raises(UpstreamBroken):
        await conn.read()


async def test_the_connection_lost_mid_body_or_at_an_unframed_end() -> None:
    clock = FakeClock()
    conn, _ = _conn(clock)
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
    await conn.head()
    conn.connection_lost(None)
    assert await conn.read() == b"12345"
    with pytest.raises(UpstreamBroken):
        await conn.read()

    conn, _ = _conn(clock)
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
    await conn.head()
    conn.connection_lost(None)  # no framing: the close is the body's end
    assert conn.phase is Phase.DONE
    assert await _body(conn) == b"until the end"


async def test_the_head_is_due_ttfb_after_the_write_however_it_trickles() -> None:
    clock = FakeClock()
    conn, transport = _conn(clock)
    conn.begin(head_only=False, read_timeout=2.0)
    for byte in OK[:30]:
        clock.advance(0.3)
        if conn.phase is not Phase.HEAD:
            break
        conn.data_received(bytes([byte]))
    with pytest.raises(UpstreamTimeout):
        await asyncio.wait_for(conn.head(), 2)  # real seconds: a head never due hangs
    assert transport.aborted


async def test_past_the_head_each_piece_has_its_own_idle_time() -> None:
    clock = FakeClock()
    conn, _ = _conn(clock)
    conn.begin(head_only=False, read_timeout=1.0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await conn.head()
    conn.set_read_timeout(1.0)
    for _ in range(5):  # 4 s in all, longer than the head's deadline, never 1 s silent
        clock.advance(0.8)
        conn.data_received(b"1\r\nx\r\n")
    conn.data_received(b"0\r\n\r\n")
    assert await _body(conn) == b"xxxxx"
    clock.advance(5)  # the timer left for the next exchange finds none under way
    assert conn.phase is Phase.DONE


async def test_the_reason_phrase_bytes_come_back_as_sent() -> None:
    conn, _ = _conn(FakeClock())
    conn.begin(head_only=False, read_timeout=None)
    conn.data_received(b"HTTP/1.1 200 Caf\xe9 \x80\r\nContent-Length: 0\r\n\r\n")
    await conn.head()
    assert conn.reason.encode("utf-8", "surrogateescape") == b"Caf\xe9 \x80"
    await settle()
