"""A real stub and a real gateway on a background event loop, for synchronous tests.

Hypothesis drives property tests synchronously (and shrinks failures), so those tests talk
to a gateway that runs in its own thread over real sockets with plain `http.client`, which
sends exactly the bytes it is given.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from gateway import config as config_mod
from gateway.app import Gateway
from gateway.testing.stub import Received, StubBackend
from tests.conftest import merge

T = TypeVar("T")


class LiveGateway:
    """Stub + gateway on a private loop in a daemon thread; `stop()` tears both down."""

    def __init__(self, **overrides: Any) -> None:
        self._overrides = overrides
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="live-gw", daemon=True)
        self.stub = StubBackend()
        self.gateway: Gateway | None = None
        self.port = 0

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> LiveGateway:
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        await self.stub.start()
        data = merge(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "admin": {"host": "127.0.0.1", "port": 0},
                "backends": {"static": [self.stub.url], "health": {"enabled": False}},
                "timeouts": {"shutdown_grace_s": 1},
                "logging": {"access_log": False},
                # The model the live checks compare against is 0.5.19's, and with probes
                # off the gateway learns no release: pin it.
                "policy": {"sampling_mask": {"profile": "0.5.19"}},
            },
            self._overrides,
        )
        self.gateway = Gateway(config_mod.build(data))
        await self.gateway.start()
        self.port = self.gateway.port

    def stop(self) -> None:
        async def _stop() -> None:
            if self.gateway is not None:
                await self.gateway.stop()
            await self.stub.stop()

        try:
            self.run(_stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def last_received(self) -> Received | None:
        received = self.stub.received
        return received[-1] if received else None


def exchange(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
) -> tuple[int, dict[str, str], bytes]:
    """One request on a kept-alive connection; reconnects once if the gateway closed it."""
    for attempt in (0, 1):
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
            conn.close()
            if attempt:
                raise
    raise AssertionError("unreachable")
