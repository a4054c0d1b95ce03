"""Hardening III: what an outside review of the request path's own protocols found.

Each finding over real sockets: a client that pipelines and never reads, a backend that
sends its head a byte at a time, pipelines whose reads end inside a head, framing RFC 9112
refuses, and backend responses that must reach the client as sent (or not at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.app import Gateway
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gateway_process, gw_url, process_config, proxied
from tests.hardening.rawnet import ScriptedBackend, parse_responses, raw_exchange

OK = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
JSON = {"Content-Type": "application/json"}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _unread_socket(port: int) -> socket.socket:
    """A client socket with a small receive buffer that the test never reads from."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


# -- finding 2: a client that sends and never reads -------------------------------------------


@pytest.mark.heavy
async def test_a_client_that_pipelines_and_never_reads_holds_bounded_memory(
    stub: StubBackend, tmp_path: Path
) -> None:
    """Before: every request was answered into the transport's buffer whatever its state,
    so 18 MiB of 32-byte requests took the gateway from 61 to 555 MiB. Now the next request
    waits until the replies before it are below the socket's high-water mark: the gateway
    stops reading, and the client's sends block."""
    request = b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"  # answered by the gateway itself
    batch = request * 2048
    config = process_config(stub.url, "logging: {access_log: false}\n")
    async with gateway_process(config, tmp_path) as gw:
        before = _rss_mib(gw.proc.pid)
        sock = _unread_socket(gw.port)
        loop = asyncio.get_running_loop()
        sent = 0
        stalled = 0.0
        deadline = loop.time() + 8.0
        try:
            while loop.time() < deadline and sent < 32 << 20:
                try:
                    sent += sock.send(batch)
                    stalled = 0.0
                except BlockingIOError:
                    if not stalled:
                        stalled = loop.time()
                    elif loop.time() - stalled > 1.5:
                        break  # nothing taken for 1.5 s: the gateway stopped reading
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            grown = _rss_mib(gw.proc.pid) - before
        finally:
            sock.close()
    # The kernel's socket buffers take a few MiB; the gateway holds about one reply.
    assert sent < 16 << 20, f"the gateway kept reading: {sent >> 20} MiB of requests taken"
    assert grown < 40, f"RSS grew {grown:.0f} MiB for {sent >> 20} MiB of unread pipelining"


async def test_a_client_that_leaves_a_reply_unread_is_reset_and_the_upstream_closed(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url, timeouts={"client_send_s": 1.0})
    body = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 2}})
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Stub-Events: 200000\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    sock = _unread_socket(gw.port)
    try:
        sock.send(head + body)
        await asyncio.wait_for(stub.disconnect_event.wait(), 30)
    finally:
        sock.close()
    server = gw._http_server
    assert server is not None
    assert server.send_timeouts == 1
    # The stream filled the buffers, then stayed paused for client_send_s: reset, and the
    # backend saw its request's connection close (SGLang aborts the generation on it).
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{gw.admin_port}/metrics") as r,
    ):
        text = await r.text()
    assert "sglang_gateway_client_send_timeouts_total 1.0" in text


@pytest.mark.heavy
async def test_a_slow_reader_that_keeps_reading_is_not_reset(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    """The deadline is on a reply left unread, not on a slow transfer (nginx's
    send_timeout too bounds a time without progress)."""
    gw = await make_gateway(stub.url, timeouts={"client_send_s": 0.1})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.connect(("127.0.0.1", gw.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
    body = OK
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Stub-Response-Bytes: 16000000\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
        % len(body)
        + body
    )
    got = 0
    started = time.monotonic()
    # About 6 MB/s: the gateway's buffer stays over its mark for about 0.2 s at a time,
    # longer than the deadline, while the kernel's queue drains under it.
    while chunk := await reader.read(65536):
        got += len(chunk)
        await asyncio.sleep(0.01)
    writer.close()
    assert got > 16_000_000
    assert time.monotonic() - started > 1.0  # slow, for longer than the deadline
    server = gw._http_server
    assert server is not None and server.send_timeouts == 0


# -- finding 3: the head's deadline -----------------------------------------------------------


class _Trickle(ScriptedBackend):
    """Sends a valid response head one byte every `gap` seconds."""

    def __init__(self, gap: float) -> None:
        super().__init__()
        self.gap = gap

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        for i in range(len(reply)):
            writer.write(reply[i : i + 1])
            await writer.drain()
            await asyncio.sleep(self.gap)
        return False


@pytest.mark.heavy
async def test_ttfb_is_a_deadline_for_the_head_not_a_silence(make_gateway: GatewayFactory) -> None:
    """Before: each byte restarted the wait, so with ttfb_s 2 a head sent a byte every
    0.3 s was relayed as a 200 after about 24 s. Now the head is due ttfb_s after the
    request's write."""
    backend = _Trickle(0.3)
    url = await backend.start()
    try:
        gw = await make_gateway(
            url, backends={"health": {"enabled": False}}, timeouts={"ttfb_s": 2.0}
        )
        started = time.monotonic()
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r,
        ):
            status = r.status
            await r.read()
        took = time.monotonic() - started
    finally:
        await backend.stop()
    assert status == 504
    # Due at 2 s; the old per-byte restart answered after about 24 s. The upper bound sits
    # between the two, far from both, so a loaded machine cannot cross it.
    assert 1.9 <= took < 12, took
    assert backend.requests == 1


@pytest.mark.heavy
async def test_the_body_still_gets_its_idle_timeout_after_the_head(
    make_gateway: GatewayFactory,
) -> None:
    """Past the head, each piece has idle_s of its own: a stream whose events come every
    0.3 s for longer than ttfb_s is relayed whole."""

    class Slow(ScriptedBackend):
        async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
            for _ in range(10):
                writer.write(b"6\r\ndata:\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.3)
            writer.write(b"0\r\n\r\n")
            return False

    backend = Slow()
    url = await backend.start()
    try:
        gw = await make_gateway(
            url, backends={"health": {"enabled": False}}, timeouts={"ttfb_s": 1.0, "idle_s": 1.0}
        )
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r,
        ):
            assert r.status == 200
            assert await r.read() == b"data:\n" * 10
    finally:
        await backend.stop()


# -- finding 4: pipelines whose reads end inside a head ---------------------------------------


@pytest.mark.heavy
async def test_a_long_valid_pipeline_gets_every_answer(stub: StubBackend, gateway: Gateway) -> None:
    """Before: a read that began and ended inside heads counted whole toward the head cap,
    so 20,000 pipelined GET /health got a 431 after about 13,000 answers. Each is answered
    now (the stub answers /health; the client reads as it sends, as h11 would have it)."""
    n = 20_000
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)

    async def send() -> None:
        for start in range(0, n, 1000):
            writer.write(request * min(1000, n - start))
            await writer.drain()

    sender = asyncio.create_task(send())
    statuses: list[int] = []
    buffer = b""
    async with asyncio.timeout(120):
        while len(statuses) < n:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            buffer += chunk
            while True:
                head_end = buffer.find(b"\r\n\r\n")
                if head_end < 0:
                    break
                head = buffer[:head_end]
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if len(buffer) < head_end + 4 + length:
                    break
                statuses.append(int(head.split(b" ", 2)[1]))
                buffer = buffer[head_end + 4 + length :]
    await sender
    writer.close()
    assert len(statuses) == n, f"{len(statuses)} answers of {n}"
    assert set(statuses) == {200}, {s for s in statuses if s != 200}


async def test_a_head_dripped_over_many_reads_is_still_capped(gateway: Gateway) -> None:
    """The cap still holds for a head that never ends, read after read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    answer = b""
    with contextlib.suppress(ConnectionError):
        for _ in range(400):  # 400 KB: past the 128 KiB cap plus one read
            writer.write(line)
            await writer.drain()
            await asyncio.sleep(0.001)
        answer = await asyncio.wait_for(reader.read(4096), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:60]


# -- finding 5: framing RFC 9112 refuses ------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        # s.6.1: only chunked, alone, is a transfer coding the gateway implements.
        (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            501,
        ),
        (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            b"0\r\n\r\n",
            501,
        ),
        # llhttp itself refuses a second chunked, as the backend's uvicorn (httptools) does.
        (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        # s.3.2: exactly one Host on HTTP/1.1, never two.
        (b"GET /health HTTP/1.1\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /health HTTP/1.0\r\nHost: a\r\nhost: b\r\n\r\n", 400),
        # s.3: single spaces in the request line.
        (b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /health  HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ],
    ids=[
        "te-identity-then-chunked",
        "te-gzip-chunked",
        "te-chunked-twice",
        "no-host",
        "two-hosts",
        "two-hosts-http10",
        "two-spaces-before-target",
        "two-spaces-after-target",
    ],
)
async def test_framing_rfc_9112_refuses_is_refused(
    stub: StubBackend, gateway: Gateway, raw: bytes, status: int
) -> None:
    before = len(proxied(stub))
    responses = parse_responses(await raw_exchange(gateway.port, raw, timeout=3))
    assert [r.status for r in responses] == [status]
    assert orjson.loads(responses[0].body)["detail"]
    assert responses[0].headers["connection"] == "close"
    assert len(proxied(stub)) == before  # nothing reached the backend


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /health HTTP/1.0\r\n\r\n",  # HTTP/1.0 needs no Host
        b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n"
        b"Connection: close\r\n\r\n0\r\n\r\n",
        # s.2.2: an empty line first
        b"\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ],
    ids=["http10-no-host", "te-chunked-capitalised", "leading-crlf"],
)
async def test_framing_rfc_9112_allows_is_served(gateway: Gateway, raw: bytes) -> None:
    responses = parse_responses(await raw_exchange(gateway.port, raw, timeout=3))
    assert [r.status for r in responses] == [200]


@pytest.mark.parametrize("split", [1, 3, 4, 5, 13, 20])
async def test_a_bad_request_line_is_refused_whatever_the_reads(
    stub: StubBackend, gateway: Gateway, split: int
) -> None:
    """The request line is checked as sent even when it arrives over several reads, and
    behind pipelined requests with bodies."""
    good = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(OK) + OK
    )
    bad = b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n"
    data = good + bad
    cut = len(good) + split
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(data[:cut])
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.write(data[cut:])
    await writer.drain()
    raw = b""
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(5):
            while chunk := await reader.read(65536):
                raw += chunk
    writer.close()
    assert [r.status for r in parse_responses(raw)] == [200, 400]


async def test_pipelined_requests_after_bodies_still_get_the_request_line_check(
    stub: StubBackend, gateway: Gateway
) -> None:
    one = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(OK) + OK
    )
    data = one * 3 + b"GET /health  HTTP/1.1\r\nHost: x\r\n\r\n"
    responses = parse_responses(await raw_exchange(gateway.port, data, timeout=3))
    assert [r.status for r in responses] == [200, 200, 200, 400]


# -- finding 6: backend responses relayed as sent, or not at all ------------------------------


class _Answer(ScriptedBackend):
    def __init__(self, reply: bytes) -> None:
        super().__init__()
        self.reply = reply

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(self.reply)
        await writer.drain()
        return False


async def _through(make_gateway: GatewayFactory, reply: bytes, request: bytes) -> bytes:
    backend = _Answer(reply)
    url = await backend.start()
    try:
        gw = await make_gateway(url, backends={"health": {"enabled": False}})
        return await raw_exchange(gw.port, request, timeout=3)
    finally:
        await backend.stop()


GENERATE = (
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(OK) + OK
)


@pytest.mark.parametrize(
    "codings",
    [b"gzip, chunked", b"chunked, gzip", b"gzip\r\nTransfer-Encoding: chunked"],
    ids=["gzip-chunked", "chunked-gzip", "gzip-then-chunked-lines"],
)
async def test_a_transfer_coding_under_chunked_is_a_502(
    make_gateway: GatewayFactory, codings: bytes
) -> None:
    """Before: gzip, chunked was relayed as plain chunked, the coding dropped (the client
    got gzip bytes it was never told of); chunked, gzip was read until close and cut as a
    truncation. Neither can be relayed faithfully: 502 before a byte of it."""
    gzipped = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03"
    reply = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: "
        + codings
        + b"\r\n\r\n%x\r\n" % len(gzipped)
        + gzipped
        + b"\r\n0\r\n\r\n"
    )
    responses = parse_responses(await _through(make_gateway, reply, GENERATE))
    assert [r.status for r in responses] == [502]
    assert gzipped not in responses[0].raw + responses[0].body


async def test_a_204_never_carries_a_content_length(make_gateway: GatewayFactory) -> None:
    reply = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-Kept: yes\r\n\r\n"
    raw = await _through(make_gateway, reply, GENERATE)
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 204 ")
    assert b"\r\nx-kept: yes" in head
    assert b"content-length" not in head  # RFC 9110 s.8.6


async def test_the_reason_phrase_passes_as_sent(make_gateway: GatewayFactory) -> None:
    """Before: the phrase was read as latin-1 and written as UTF-8 (\\xe9 became
    \\xc3\\xa9)."""
    for phrase in (b"Caf\xe9", "Café".encode(), b"Weird \x80\xff"):
        reply = b"HTTP/1.1 200 " + phrase + b"\r\nContent-Length: 2\r\n\r\n{}"
        raw = await _through(make_gateway, reply, GENERATE)
        assert raw.startswith(b"HTTP/1.1 200 " + phrase + b"\r\n"), raw[:40]
