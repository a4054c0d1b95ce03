"""Hardening II, item 6: the smaller faults an outside review found, each over real sockets.

Drain time against the configured grace; a backend flooding interim responses; a backend
switching protocols; Content-Encoding split over two lines; `100 Continue` for HTTP/1.0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.stub import StubBackend
from tests.conftest import ROOT, GatewayFactory, gw_url, read_match
from tests.hardening.rawnet import raw_exchange

OK = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
STREAM = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 2}})
JSON = {"Content-Type": "application/json"}


async def test_drain_cuts_streams_at_the_grace_not_twice_it(
    stub: StubBackend, tmp_path: Path
) -> None:
    grace = 2.0
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        f"backends: {{static: ['{stub.url}'], health: {{enabled: false}}}}\n"
        f"timeouts: {{shutdown_grace_s: {grace}}}\nlogging: {{access_log: false}}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--config", str(cfg), cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        m = await read_match(proc.stderr, r"listening on 127\.0\.0\.1:(\d+)")
        port = int(m.group(1))
        long = {**JSON, "X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "600"}  # 60 s
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/generate", data=STREAM, headers=long) as r:
                assert r.status == 200
                await r.content.readline()  # the stream is under way
                term = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
                cut = time.monotonic() - term
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            exited = time.monotonic() - term
        # The stream had its grace, and no more than the grace plus the short cancel wait.
        assert grace - 0.1 <= cut <= grace + 1.0, cut
        assert exited <= grace + 1.5, exited
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


class _Scripted:
    """A backend that answers every request with fixed bytes."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.requests = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    await reader.readexactly(int(line.split(b":")[1]))
            self.requests += 1
            writer.write(self.answer)
            await writer.drain()
            await asyncio.sleep(1)
        self._writers.discard(writer)
        writer.close()


FINAL = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        # A handful of interim responses is normal (100, 103): relayed past to the final one.
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 3 + FINAL, 200),
        # An endless flood of them is a broken backend: bounded, 502.
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 200_000 + FINAL, 502),
        # A protocol switch the client never asked for: 502, and nothing after it is read as
        # HTTP.
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n" + FINAL, 502),
    ],
    ids=["three-103", "flood-103", "101"],
)
async def test_interim_and_switching_responses(
    make_gateway: GatewayFactory, answer: bytes, status: int
) -> None:
    backend = _Scripted(answer)
    url = await backend.start()
    try:
        gw = await make_gateway(url, backends={"health": {"enabled": False}})
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r,
        ):
            assert r.status == status
            body = await r.json()
        took = loop.time() - started
        if status == 200:
            assert body == {}
        else:
            assert "error" in body
            assert took < 1.0  # the flood is cut after a few responses, not parsed whole
        assert backend.requests == 1  # never replayed
    finally:
        await backend.stop()


@pytest.mark.parametrize(
    "lines",
    [
        [b"identity", b"gzip"],
        [b"gzip", b"identity"],
        [b"identity", b"identity, br"],
    ],
)
async def test_content_encoding_on_any_line_is_refused(
    make_gateway: GatewayFactory, stub: StubBackend, lines: list[bytes]
) -> None:
    gw = await make_gateway(stub.url)
    head = b"".join(b"Content-Encoding: %s\r\n" % line for line in lines)
    raw = await raw_exchange(
        gw.port,
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(OK), OK),
    )  # fmt: skip
    assert raw.startswith(b"HTTP/1.1 415 "), raw[:80]
    assert stub.generation_requests() == []


async def test_one_identity_line_still_passes(
    make_gateway: GatewayFactory, stub: StubBackend
) -> None:
    gw = await make_gateway(stub.url)
    raw = await raw_exchange(
        gw.port,
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: identity\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(OK), OK),
    )
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:80]


async def _expect_exchange(port: int, version: bytes) -> bytes:
    """Send the head with Expect: 100-continue, wait, and report what came back before the
    body was sent; then send the body and read the rest."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /generate HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(OK)
        )
        await writer.drain()
        try:
            early = await asyncio.wait_for(reader.read(64), 0.5)
        except TimeoutError:
            early = b""
        writer.write(OK)
        await writer.drain()
        async with asyncio.timeout(5):
            rest = await reader.read(65536)
        return early + b"|" + rest
    finally:
        writer.close()


async def test_100_continue_only_for_http_1_1(
    make_gateway: GatewayFactory, stub: StubBackend
) -> None:
    gw = await make_gateway(stub.url)
    got_11 = await _expect_exchange(gw.port, b"1.1")
    assert got_11.startswith(b"HTTP/1.1 100 Continue\r\n\r\n|")
    got_10 = await _expect_exchange(gw.port, b"1.0")
    assert got_10.startswith(b"|HTTP/1.0 200 ") or got_10.startswith(b"|HTTP/1.1 200 "), got_10
    assert b" 100 " not in got_10.split(b"\r\n", 1)[0]
