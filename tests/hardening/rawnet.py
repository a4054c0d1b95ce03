"""Raw sockets for what HTTP libraries refuse to send or to be: malformed requests, bad backends.

`raw_exchange` writes exact bytes to the gateway and reads what comes back. `FaultBackend` is
a tiny asyncio TCP server that misbehaves on purpose (garbage, resets, hangs, truncation) and
counts the requests it received, so tests can check that nothing is ever replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    raw: bytes


async def raw_exchange(port: int, data: bytes, *, timeout: float = 5.0) -> bytes:
    """Send bytes, then read until the gateway closes the connection (or the timeout)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        chunks: list[bytes] = []
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def raw_first_response(port: int, data: bytes, *, timeout: float = 5.0) -> bytes:
    """Send bytes and read exactly one response (head and Content-Length body), no more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            return head + await reader.readexactly(length)
    finally:
        writer.transport.abort()


def parse_responses(raw: bytes) -> list[RawResponse]:
    """Every HTTP/1.1 response in a byte stream (Content-Length or chunked bodies)."""
    out: list[RawResponse] = []
    rest = raw
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, rest = rest[:n], rest[n:]
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0] or b"0", 16)
                parts.append(rest[:size])
                rest = rest[size + 2 :]
                if size == 0:
                    break
            body = b"".join(parts)
        else:
            body, rest = rest, b""
        out.append(RawResponse(status, headers, body, head))
    return out


@dataclass
class FaultBackend:
    """A TCP server that answers each request according to `mode`.

    Modes: ok (a valid JSON reply), hop_headers (a valid reply full of hop-by-hop headers),
    garbage (not HTTP), bad_status (a broken status line),
    reset (reads the request, then an RST), reset_on_accept (an RST before reading), hang
    (reads, never answers), close (reads, closes without a byte), half_headers (part of a
    status line and headers, then silence), short_body (promises 1000 bytes, sends 10, closes),
    idle_close (answers like ok, but a request arriving on a connection idle for longer than
    idle_close_s meets a reset, as if it crossed the backend's close in flight).
    """

    mode: str = "ok"
    idle_close_s: float = 5.0  # mode "idle_close": uvicorn's timeout_keep_alive
    requests: int = 0
    connections: int = 0
    received: list[bytes] = field(default_factory=list)
    lost: int = 0  # mode "idle_close": requests that arrived on a connection closed as idle
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    @staticmethod
    def _rst(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        self.requests += 1
        self.received.append(head + body)
        return head + body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            if self.mode == "reset_on_accept":
                self._rst(writer)
                return
            loop = asyncio.get_running_loop()
            last = loop.time()
            while await self._read_request(reader) is not None:
                if self.mode == "idle_close" and loop.time() - last > self.idle_close_s:
                    # The worst case of the keep-alive race: the server closed this idle
                    # connection just before the request arrived, and the client had not yet
                    # seen the FIN. The request is lost and the connection reset.
                    self.lost += 1
                    self._rst(writer)
                    return
                if not await self._answer(writer):
                    return
                last = loop.time()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            if not writer.transport.is_closing():
                writer.close()

    async def _answer(self, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is finished."""
        mode = self.mode
        if mode in ("ok", "idle_close"):
            body = b'{"text": "ok"}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            return True
        if mode == "hop_headers":
            body = b'{"ok": true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\n"
                b"Proxy-Authenticate: Basic\r\nUpgrade: h2c\r\nTrailer: X-T\r\n"
                b"X-End-To-End: kept\r\nX-Request-Id: backend-chosen\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            return True
        if mode == "garbage":
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff garbage \r\n\r\n")
        elif mode == "bad_status":
            writer.write(b"HTTP/1.1 2x0 Maybe\r\nContent-Length: 0\r\n\r\n")
        elif mode == "half_headers":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: appl")
            await writer.drain()
            await asyncio.sleep(3600)
        elif mode == "short_body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
        elif mode == "reset":
            self._rst(writer)
            return False
        elif mode == "hang":
            await asyncio.sleep(3600)
        # close, and the modes above: end the connection
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        return False


class ScriptedBackend:
    """A TCP server that reads requests one after another on each connection (head, then a
    Content-Length body) and lets `answer` write whatever it likes for each; counts them.
    `stop()` closes every connection it holds."""

    def __init__(self) -> None:
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

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write the answer to one request; False ends the connection."""
        raise NotImplementedError

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":", 1)[1]))
                self.requests += 1
                if not await self.answer(head, writer):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


def header(head: bytes, name: bytes) -> bytes | None:
    """A header's value in a raw request head (the first line that names it)."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None
