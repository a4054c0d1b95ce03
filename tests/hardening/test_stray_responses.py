"""Hardening II, item 1: a response that no request asked for never reaches a client.

A backend may write on an idle kept-alive connection (RFC 9112 lets a server send 408 before
closing one; a buggy one may send a stray response). Read as the answer to the next request
sent on that connection, it would shift every later answer by one: each client would get the
previous client's reply. These backends answer each request with the tag the client sent,
and misbehave around it; every client must get its own tag back, or an error, never another's.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import GatewayFactory, gw_url
from tests.hardening.rawnet import ScriptedBackend, header

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


class StrayBackend(ScriptedBackend):
    """Answers each request with its X-Tag, then misbehaves according to `mode`:
    idle (a stray response 30 ms after each answer, connection kept open), trailing (a stray
    response in the same write as the answer), idle_408 (a 408 30 ms after each answer, kept
    open), idle_partial (half a response head 30 ms after each answer), interim_after (a 100
    Continue after the answer)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self._later: set[asyncio.Task[None]] = set()

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        reply = _reply(header(head, b"X-Tag") or b"none")
        if self.mode == "trailing":
            writer.write(reply + STRAY)
        elif self.mode == "interim_after":
            writer.write(reply + b"HTTP/1.1 100 Continue\r\n\r\n")
        else:
            writer.write(reply)
            extra = {"idle_408": TIMEOUT_408, "idle_partial": PARTIAL}.get(self.mode, STRAY)
            task = asyncio.create_task(self._write_later(writer, extra))
            self._later.add(task)
            task.add_done_callback(self._later.discard)
        return True

    @staticmethod
    async def _write_later(writer: asyncio.StreamWriter, data: bytes) -> None:
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
