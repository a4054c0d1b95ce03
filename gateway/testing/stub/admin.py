"""The stub's admin listener: /livez and /readyz, the gateway's probe contract.

One image runs either the gateway or the stub, and its HEALTHCHECK asks
`127.0.0.1:$GATEWAY_ADMIN_PORT/livez` without knowing which. So the stub answers there
too when told a port (`--admin-port`, else GATEWAY_ADMIN_PORT, which the image sets).
SGLang has no such listener, so without either the stub keeps exactly SGLang's surface.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web


class Serving(Protocol):
    """What readiness is judged from: the stub itself (StubBackend)."""

    @property
    def serving(self) -> bool: ...

    @property
    def health_status(self) -> int: ...


def make_admin_app(stub: Serving) -> web.Application:
    async def livez(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        # Ready exactly when SGLang's own /health would pass, so an orchestrator that asks
        # either gets the same answer.
        if not stub.serving:
            why = "not serving"
        elif stub.health_status != 200:
            why = f"/health answers {stub.health_status}"
        else:
            return web.json_response({"status": "ready", "reason": ""})
        return web.json_response({"status": "not_ready", "reason": why}, status=503)

    app = web.Application()
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    return app


async def start_admin(stub: Serving, host: str, port: int) -> tuple[web.AppRunner, int]:
    """The listener, started; its runner (to clean up) and the port it got."""
    runner = web.AppRunner(make_admin_app(stub), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
