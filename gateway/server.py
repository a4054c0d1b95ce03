"""One gateway instance: its listeners, its upstream session, its background tasks.

Start-up, serving and shutdown are separate steps so tests can run a real gateway on
ephemeral ports in-process, and the CLI can drain on SIGTERM: readiness fails at once,
the listeners stop accepting, in-flight requests and streams get a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from http import HTTPStatus
from typing import Final

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway import errors
from gateway.admin import make_admin_app
from gateway.backends import BALANCERS, BackendPool
from gateway.config import GatewayConfig
from gateway.health import HealthChecker
from gateway.metrics import Metrics
from gateway.observe import AccessLog, Observer
from gateway.proxy import Proxy
from gateway.routes import Family

log = logging.getLogger("gateway.server")

_UPSTREAM_READ_BUFSIZE: Final = 1 << 18  # fewer, larger reads for multi-MB responses


def _bound_port(runner: web.BaseRunner) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return int(addr[1])
    raise RuntimeError("listener has no TCP address")


class _RequestHandler(RequestHandler):
    """aiohttp's connection protocol, with error replies that name no internals.

    aiohttp answers a request it cannot parse with the parser's message, which echoes the
    offending bytes, and a crash in debug mode with a traceback. aiohttp still logs that
    detail; the client gets a fixed JSON body.
    """

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, None)  # logs; raises if a reply is under way
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        body = errors.render(Family.PLAIN, status, phrase)
        resp = web.Response(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


def make_session(cfg: GatewayConfig) -> aiohttp.ClientSession:
    """The one pooled upstream client of a gateway instance."""
    t = cfg.timeouts
    connector = aiohttp.TCPConnector(
        limit=0,  # the per-backend cap is the meaningful one
        limit_per_host=cfg.limits.max_connections_per_backend,
        # Shorter than uvicorn's 5 s idle timeout, so the gateway never sends a request on a
        # pooled connection the backend is closing (the keep-alive race).
        keepalive_timeout=t.upstream_keepalive_s,
        ttl_dns_cache=10,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None,  # generations run for minutes; only silence is bounded
            connect=t.connect_s,
            sock_connect=t.connect_s,
            sock_read=t.read_s,
        ),
        # Forward exactly what the client sent: no added Accept, Accept-Encoding,
        # User-Agent or Content-Type, and no inflating of compressed responses.
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        read_bufsize=_UPSTREAM_READ_BUFSIZE,
        max_line_size=cfg.limits.max_header_bytes,
        max_field_size=cfg.limits.max_header_bytes,
    )


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.draining = False
        self.port = 0
        self.admin_port = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.ServerRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._health: HealthChecker | None = None
        self.pool = BackendPool(
            cfg.backends.static,
            BALANCERS[cfg.backends.balancer](),
            healthy_threshold=cfg.backends.health.healthy_threshold,
            unhealthy_threshold=cfg.backends.health.unhealthy_threshold,
        )
        self.proxy: Proxy | None = None
        self.metrics: Metrics | None = None

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.pool.ready:
            return False, "no healthy backend"
        return True, "ok"

    async def start(self, *, reuse_port: bool = False) -> None:
        cfg = self.cfg
        self._session = make_session(cfg)
        proxy_ref: list[Proxy] = []
        self.metrics = Metrics(self.pool, lambda: proxy_ref[0].inflight if proxy_ref else 0)
        observers: list[Observer] = [self.metrics]
        if cfg.logging.access_log:
            observers.append(AccessLog(cfg.logging.format))
        self.proxy = Proxy(cfg, self._session, self.pool, observers)
        proxy_ref.append(self.proxy)

        server = _Server(
            self.proxy.handle,
            # A client that goes away cancels its handler, which closes the upstream request.
            handler_cancellation=True,
            keepalive_timeout=cfg.timeouts.client_keepalive_s,
            max_line_size=cfg.limits.max_header_bytes,
            max_field_size=cfg.limits.max_header_bytes,
            # Never inflate a compressed request body: the gateway refuses encoded bodies
            # so that it and SGLang read the same bytes.
            auto_decompress=False,
            access_log=None,
        )
        self._runner = web.ServerRunner(
            server, handle_signals=False, shutdown_timeout=cfg.timeouts.shutdown_grace_s
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            cfg.listen.host,
            cfg.listen.port,
            reuse_port=reuse_port or None,
            backlog=1024,
        )
        await site.start()
        self.port = _bound_port(self._runner)

        metrics = self.metrics
        admin = make_admin_app(ready=self.readiness, metrics=metrics.render)
        self._admin_runner = web.AppRunner(admin, handle_signals=False, access_log=None)
        await self._admin_runner.setup()
        await web.TCPSite(
            self._admin_runner, cfg.admin.host, cfg.admin.port, reuse_port=reuse_port or None
        ).start()
        self.admin_port = _bound_port(self._admin_runner)

        self._health = HealthChecker(self.pool, self._session, cfg.backends.health)
        self._health.start()
        log.info(
            "gateway listening on %s:%d (admin %s:%d), backends: %s",
            cfg.listen.host,
            self.port,
            cfg.admin.host,
            self.admin_port,
            ", ".join(b.url for b in self.pool.backends),
        )

    async def stop(self) -> None:
        """Drain: readiness off, stop accepting, let in-flight requests finish, close."""
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()  # waits up to shutdown_grace_s for handlers
            self._runner = None
        if self._health is not None:
            await self._health.stop()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None


async def serve(cfg: GatewayConfig) -> None:
    """Run until SIGTERM or SIGINT, then drain and return."""
    gateway = Gateway(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    try:
        await stop.wait()
        log.info("shutting down: draining for up to %.0fs", cfg.timeouts.shutdown_grace_s)
        gateway.draining = True
    finally:
        await gateway.stop()
    log.info("stopped")
