"""Hardening II, item 1: a response that no request asked for never reaches a client.

A backend may write on an idle kept-alive connection (RFC 9112 lets a server send 408 before
closing one; a buggy one may send a stray response). Read as the answer to the next request
sent on that connection, it would shift every later answer by one: each client would get the
previous client's reply. These backends answer each request with the tag the client sent,
and misbehave around it; every client must get its own tag back, or an error, never another's.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aiohttp
import pytest

from tests.conftest import GatewayFactory, gw_url

STRAY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 16\r\n\r\n"
STRAY += b'{"tag": "stray"}'
TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"
# Half a response head, never finished: parsed, it would garble the next real answer.
PARTIAL = b"HTTP/1.1 200 OK\r\nContent-Le"


def _reply(tag: bytes) -> bytes:
    body = b'{"tag": "%s"}' % tag
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


@dataclass
class StrayBackend:
    """Answers each request with its X-Tag, then misbehaves according to `mode`:
    idle (a stray response 30 ms after each answer, connection kept open), trailing (a stray
    response in the same write as the answer), idle_408 (a 408 30 ms after each answer, kept
    open), idle_partial (half a response head 30 ms after each answer), interim_after (a 100
    Continue after the answer)."""

    mode: str
    requests: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                tag = b"none"
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"x-tag":
                        tag = value.strip()
                    elif name.lower() == b"content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                self.requests += 1
                if self.mode == "trailing":
                    writer.write(_reply(tag) + STRAY)
                elif self.mode == "interim_after":
                    writer.write(_reply(tag) + b"HTTP/1.1 100 Continue\r\n\r\n")
                else:
                    writer.write(_reply(tag))
                    extra = {"idle_408": TIMEOUT_408, "idle_partial": PARTIAL}.get(self.mode, STRAY)
                    task = asyncio.create_task(self._later(writer, extra))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _later(writer: asyncio.StreamWriter, data: bytes) -> None:
        await asyncio.sleep(0.03)
        if not writer.is_closing():
            writer.write(data)


@pytest.mark.parametrize("mode", ["idle", "trailing", "idle_408", "idle_partial", "interim_after"])
async def test_no_client_ever_gets_a_response_it_did_not_ask_for(
    make_gateway: GatewayFactory, mode: str
) -> None:
    backend = StrayBackend(mode)
    url = await backend.start()
    try:
        gw = await make_gateway(url, backends={"health": {"enabled": False}})
        got: list[tuple[str, int, str]] = []
        async with aiohttp.ClientSession() as s:
            for i in range(12):
                tag = f"client-{i}"
                async with s.get(gw_url(gw, "/v1/models"), headers={"X-Tag": tag}) as r:
                    body = await r.json() if r.status == 200 else None
                    got.append((tag, r.status, body["tag"] if body else ""))
                # Long enough for the backend's stray bytes to land on the idle connection.
                await asyncio.sleep(0.08)
        wrong = [(tag, status, seen) for tag, status, seen in got if status == 200 and seen != tag]
        assert wrong == [], f"clients got other answers: {wrong}"
        # Every request was answered with its own reply: a poisoned connection is closed, and
        # the next request goes out on a fresh one rather than failing.
        assert [status for _, status, _ in got] == [200] * 12
        assert backend.requests == 12
        stray = gw.metrics.registry.get_sample_value("sglang_gateway_upstream_unsolicited_total")
        assert stray is not None and stray >= 1
    finally:
        await backend.stop()
