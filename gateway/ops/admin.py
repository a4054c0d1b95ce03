"""The gateway's own endpoints, on their own listener so they never shadow SGLang's routes.

/livez: the process and its event loop answer. /readyz: config loaded, not draining, and
at least one backend seen healthy. /metrics: Prometheus text, or OpenMetrics when the
scraper's Accept header asks for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from gateway import build

T = TypeVar("T")
# Plain callables in a gateway; coroutines in the --workers supervisor, which asks workers.
Source = Callable[[], T | Awaitable[T]]


async def _call(source: Source[T]) -> T:
    result = source()
    if inspect.isawaitable(result):
        return await result
    return result


def make_admin_app(
    *,
    ready: Source[tuple[bool, str]],
    metrics: Callable[[str | None], tuple[bytes, str] | Awaitable[tuple[bytes, str]]],
) -> web.Application:
    async def livez(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ok, why = await _call(ready)
        return web.json_response(
            {"status": "ready" if ok else "not_ready", "reason": why}, status=200 if ok else 503
        )

    async def metrics_handler(request: web.Request) -> web.Response:
        # The scraper's Accept decides the format: OpenMetrics if it asks for it.
        body, content_type = await _call(lambda: metrics(request.headers.get("Accept")))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    async def announce(_: web.Request, response: web.StreamResponse) -> None:
        # The main listener's name, not aiohttp's name and version.
        response.headers["Server"] = build.NAME

    app = web.Application()
    app.on_response_prepare.append(announce)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    return app
