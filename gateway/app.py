"""One gateway instance: its listeners, its upstream session, its fleet, its lifecycle.

Start-up, serving, reload and shutdown are separate steps so tests can run a real gateway
on ephemeral ports in-process, and the CLI can reload on SIGHUP and drain on SIGTERM:
readiness fails at once, the listeners stop accepting, in-flight requests and streams get
a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Final

import aiohttp
from aiohttp import web

from gateway import config as config_mod
from gateway import runtime
from gateway.config import GatewayConfig, header_safe
from gateway.contract.policy import BodyRules, Mode, ParallelSampleCap, SamplingMaskRule
from gateway.contract.routes import RouteTable
from gateway.edge import tracing
from gateway.edge.auth import ApiKeys, read_keys_file
from gateway.edge.clients import AiohttpClients, make_session
from gateway.edge.control import ControlAccess
from gateway.edge.engine_metrics import Limits as EngineMetricsLimits
from gateway.edge.etcd import client_for
from gateway.edge.headers import ForwardedHeaders
from gateway.edge.proxy import Proxy, ProxySettings
from gateway.edge.server import Listener
from gateway.edge.upstream import Upstream
from gateway.fleet.discovery import Resolver, describe_failure
from gateway.fleet.etcd_state import EtcdState
from gateway.fleet.membership import Fleet
from gateway.fleet.pool import BackendPool
from gateway.fleet.rid_owners import RidPublisher
from gateway.fleet.shared import SharedState
from gateway.ops import logs
from gateway.ops.admin import make_admin_app
from gateway.ops.lifecycle import hold_lifeline, read_reload, watch_mtime
from gateway.ops.metrics import FleetCollector, Metrics
from gateway.ops.observe import AccessLog, Observer
from gateway.ops.redact import install as install_log_redaction
from gateway.ops.supervisor import report_ready
from gateway.runtime import default_max_client_connections

log = logging.getLogger("gateway.app")

# How long handlers still running at the end of the drain get to close their upstreams
# once cancelled.
_CANCEL_WAIT_S: Final = 0.2
# Body bytes a caller reading a response (not relaying it: control calls) may have buffered
# before the backend is paused (docs/bench.md, "Tuned constants").
_UPSTREAM_READ_BUFSIZE: Final = 1 << 17


def _bound_port(runner: web.BaseRunner) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return int(addr[1])
    raise RuntimeError("listener has no TCP address")


def proxy_settings(cfg: GatewayConfig) -> ProxySettings:
    """Build the settings; reads the key files, so an unreadable one raises OSError and
    an unusable upstream Authorization file ValueError."""
    a = cfg.auth
    keys = None
    if a.enabled:
        listed = [k.get_secret_value() for k in a.keys]
        keys = ApiKeys(listed + (read_keys_file(a.keys_file) if a.keys_file else []))
    upstream_auth = (
        a.upstream_authorization.get_secret_value() if a.upstream_authorization else None
    )
    if a.upstream_authorization_file:
        upstream_auth = Path(a.upstream_authorization_file).read_text(encoding="utf-8").strip()
        if not header_safe(upstream_auth):
            raise ValueError(
                f"{a.upstream_authorization_file}: the upstream Authorization value must be "
                "one line without control characters"
            )
    mask = cfg.policy.sampling_mask
    t = cfg.timeouts
    b = cfg.backends
    control = cfg.control
    control_keys = [k.get_secret_value() for k in control.keys]
    if control.keys_file:
        control_keys += read_keys_file(control.keys_file)
    return ProxySettings(
        routes=RouteTable(
            vertex_path=cfg.routes.vertex_path, extra_passthrough=cfg.routes.passthrough
        ),
        body_rules=BodyRules(
            mask=SamplingMaskRule(Mode(mask.mode), default_top_k=mask.default_top_k),
            samples=ParallelSampleCap(cfg.policy.max_parallel_samples),
        ),
        forwarding=ForwardedHeaders(
            cfg.forwarding.trusted_proxies,
            upstream_authorization=upstream_auth,
            strip_client_authorization=a.enabled,
        ),
        max_body=cfg.limits.max_body_bytes,
        max_inspecting=cfg.limits.max_inspecting_bytes,
        body_timeout=t.body_read_s,
        attempts=b.connect_attempts,
        queue_timeout=b.queue_timeout_s,
        hash_header=b.hash_header if b.balancer == "consistent_hash" else None,
        latest_weights=cfg.routing.weight_version == "latest",
        connect_s=t.connect_s,
        ttfb_s=t.ttfb_s,
        total_s=t.total_s,
        idle_s=t.idle_s,
        skip_parse=cfg.policy.skip_parse_without_mask_key,
        auth=keys,
        auth_exempt=frozenset(a.exempt_paths),
        control_access=ControlAccess.build(
            control_keys,
            control.trusted_cidrs,
            control.membership.trusted_cidrs,
            client_abort=control.client_abort,
        ),
        control_forwarding=ForwardedHeaders(
            cfg.forwarding.trusted_proxies,
            upstream_authorization=upstream_auth,
            strip_client_authorization=True,
        ),
        control_timeout=control.timeout_s,
        engine_metrics=EngineMetricsLimits(
            timeout_s=cfg.engine_metrics.timeout_s,
            max_bytes_per_engine=cfg.engine_metrics.max_bytes_per_engine,
            max_total_bytes=cfg.engine_metrics.max_total_bytes,
        ),
        pause_hold=control.timeout_s if b.pause_hold_s is None else b.pause_hold_s,
    )


def _max_connections(cfg: GatewayConfig) -> int:
    configured = cfg.limits.max_client_connections
    return configured if configured is not None else default_max_client_connections()


def make_upstream(cfg: GatewayConfig, cls: type[Upstream] = Upstream) -> Upstream:
    """The request path's pooled upstream client."""
    return cls(
        # Shorter than uvicorn's 5 s idle timeout, so the gateway never sends a request on a
        # pooled connection the backend is closing (the keep-alive race).
        keepalive_s=cfg.timeouts.upstream_keepalive_s,
        read_bufsize=_UPSTREAM_READ_BUFSIZE,
        max_line_size=cfg.limits.max_header_bytes,
        max_field_size=cfg.limits.max_header_bytes,
    )


def etcd_state(cfg: GatewayConfig) -> EtcdState | None:
    """The fleet state shared through etcd, where state.backend says so."""
    etcd = cfg.state.etcd
    if cfg.state.backend != "etcd" or etcd is None:
        return None
    return EtcdState(
        client_for(etcd),
        etcd.prefix,
        seed=list(cfg.backends.static),
        lease_ttl_s=etcd.lease_ttl_s,
        lock_wait_s=etcd.lock_wait_s,
    )


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        *,
        config_path: str | None = None,
        overrides: dict[str, object] | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self._overrides = dict(overrides or {})
        self.draining = False
        self.port = 0
        self.admin_port = 0
        self.reloads = 0
        self.reload_failures = 0
        self._session: aiohttp.ClientSession | None = None
        self._upstream: Upstream | None = None
        self._http_server: Listener | None = None
        self._admin_runner: web.AppRunner | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self.fleet = Fleet(
            cfg.backends, resolver=resolver, pinned=cfg.policy.sampling_mask.pinned_profile
        )
        self.proxy: Proxy | None = None
        self.metrics: Metrics | None = None
        self.tracer: tracing.Tracer = tracing.NO_TRACING
        self._reload_lock = asyncio.Lock()

    @property
    def pool(self) -> BackendPool:
        return self.fleet.pool

    @property
    def upstream_stats(self) -> Upstream | None:
        return self._upstream

    @property
    def client_connections(self) -> tuple[int, int, int, int]:
        """(open, limit, refused so far, reset for leaving replies unread) for the main
        listener."""
        server = self._http_server
        if server is None:
            return 0, 0, 0, 0
        return (
            server.open_connections,
            server.max_connections,
            server.connections_refused,
            server.send_timeouts,
        )

    @property
    def control_counts(self) -> dict[tuple[str, str], int]:
        """Fleet control calls by (route, result: ok, failed, forbidden)."""
        return self.proxy.control.fanout.counts if self.proxy is not None else {}

    @property
    def engine_metrics_counts(self) -> dict[str, int]:
        """Engine /metrics reads for /engine_metrics and /metrics, by result."""
        return self.proxy.surfaces.metrics.counts if self.proxy is not None else {}

    @property
    def shared_state(self) -> SharedState | EtcdState | None:
        """The state shared with the other --workers (or replicas), if there are any."""
        return self.fleet.shared

    @property
    def refused_requests(self) -> dict[int, int]:
        """Requests the HTTP parser refused (before the proxy saw them), by status."""
        return self._http_server.refused if self._http_server is not None else {}

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        # A failing discovery does not by itself make the gateway unready (the last good
        # set serves), but the reason says why the fleet may be stale or empty.
        failing = describe_failure(self.fleet.discovery)
        notes = [f"{failing}, last good set served"] if failing else []
        # Generation is served on the last known state while etcd is away: still ready.
        if (store := self.fleet.store_problem()) is not None:
            notes.append(store)
        if not self.fleet.pool.ready:
            return False, "; ".join(["no healthy backend", *([failing] if failing else [])])
        return True, "; ".join(["ok", *notes])

    async def start(
        self, *, reuse_port: bool = False, shared: SharedState | EtcdState | None = None
    ) -> None:
        cfg = self.cfg
        if shared is None:
            shared = etcd_state(cfg)
        # First: without the otel extra this refuses to start before anything is open.
        self.tracer = tracing.build(cfg.tracing)
        install_log_redaction()
        self._session = make_session(cfg)
        self.metrics = Metrics(
            self.fleet.pool, lambda: self.proxy.inflight if self.proxy is not None else 0
        )
        self.metrics.registry.register(FleetCollector(self))
        observers: list[Observer] = [self.metrics]
        if cfg.logging.access_log:
            observers.append(AccessLog(cfg.logging.format, logs.access_writer()))
        if self.tracer.observer is not None:
            # First, so the access log line carries the trace id the spans went out with.
            observers.insert(0, self.tracer.observer)
        self._upstream = make_upstream(cfg, self.tracer.upstream_type)
        self.proxy = Proxy(
            proxy_settings(cfg), self._upstream, self.fleet, observers, tracer=self.tracer
        )
        self.proxy.surfaces.draining = lambda: self.draining

        # The fleet first: a worker restarted under --workers serves only once it knows the
        # registry and engine states its siblings share.
        self.fleet.start(AiohttpClients(self._session))
        if shared is not None:
            await self.fleet.join(shared)
            if isinstance(shared, EtcdState) and cfg.state.etcd is not None:
                shared.rid_publisher = self._share_rid_owners(shared, cfg.state.etcd.prefix)
        server = Listener(
            self.tracer.serve(self.proxy.handle),
            max_connections=_max_connections(cfg),
            keepalive_s=cfg.timeouts.client_keepalive_s,
            max_header_bytes=cfg.limits.max_header_bytes,
            max_body=cfg.limits.max_body_bytes,
            send_timeout_s=cfg.timeouts.client_send_s,
        )
        self._http_server = server
        await server.start(cfg.listen.host, cfg.listen.port, reuse_port=reuse_port, backlog=1024)
        self.port = server.port

        admin = make_admin_app(ready=self.readiness, metrics=self.metrics.render)
        self._admin_runner = web.AppRunner(admin, handle_signals=False, access_log=None)
        await self._admin_runner.setup()
        await web.TCPSite(
            self._admin_runner, cfg.admin.host, cfg.admin.port, reuse_port=reuse_port or None
        ).start()
        self.admin_port = _bound_port(self._admin_runner)

        if cfg.reload.watch_interval_s is not None and self.config_path is not None:
            self._watch_task = asyncio.create_task(
                watch_mtime(self.config_path, cfg.reload.watch_interval_s, self.reload),
                name="config-watch",
            )
        log.info(
            "gateway listening on %s:%d (admin %s:%d), discovery %s",
            cfg.listen.host,
            self.port,
            cfg.admin.host,
            self.admin_port,
            cfg.backends.discovery,
        )

    async def reload(self, cfg: GatewayConfig | None = None) -> bool:
        """Re-read the config file (or take `cfg`) and apply it without dropping requests.

        An invalid config is refused and the running one stays.
        """
        async with self._reload_lock:
            if cfg is None:
                if self.config_path is None:
                    log.warning("reload requested, but the gateway was started without --config")
                    return False
                loaded = await read_reload(self.config_path, self._overrides, self.cfg)
                if loaded is None:
                    self.reload_failures += 1
                    return False
                cfg = loaded
            else:
                cfg = config_mod.as_reloaded(cfg, self.cfg)
            assert self.proxy is not None
            try:
                settings = await asyncio.to_thread(proxy_settings, cfg)
            except (OSError, ValueError) as exc:
                self.reload_failures += 1
                log.error("reload refused, keeping the running config: %s", exc)
                return False
            self.proxy.settings = settings
            self.proxy.budget.limit = settings.max_inspecting
            if self._http_server is not None:
                self._http_server.max_connections = _max_connections(cfg)
                self._http_server.max_body = settings.max_body
                self._http_server.send_timeout_s = cfg.timeouts.client_send_s
            await self.fleet.reconfigure(cfg.backends, cfg.policy.sampling_mask.pinned_profile)
            self.cfg = cfg
            self.reloads += 1
            log.info("config reloaded")
            return True

    async def _drain(self, grace: float) -> None:
        """Stop accepting, close idle connections, and wait up to `grace` for the requests
        in flight (a connection closes after its current reply)."""
        if self._http_server is not None:
            self._http_server.stop_accepting()
        if self.proxy is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self.proxy.wait_idle()

    def _share_rid_owners(self, shared: EtcdState, prefix: str) -> RidPublisher:
        """Which engine serves each rid, written to etcd so an abort through another
        replica reaches that engine alone."""
        assert self.proxy is not None
        control = self.proxy.control
        publisher = RidPublisher(
            control.owners,
            shared.store,
            prefix,
            lambda: shared.lease,
            store_up=lambda: shared.store_up,
        )
        control.publisher = publisher
        publisher.start()
        return publisher

    async def stop(self) -> None:
        """Drain: readiness off, stop accepting, let in-flight requests finish, close."""
        self.draining = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        if self._http_server is not None:
            await self._drain(self.cfg.timeouts.shutdown_grace_s)
            await self._http_server.shutdown(_CANCEL_WAIT_S)  # cancels what outlived the grace
        await self.fleet.stop()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.tracer.shutdown()  # the drained requests' spans
        self.tracer = tracing.NO_TRACING
        await logs.flush()  # the drained requests' lines, before the process exits


async def serve(
    cfg: GatewayConfig,
    *,
    config_path: str | None = None,
    overrides: dict[str, object] | None = None,
    worker_index: int | None = None,
) -> None:
    """Run until SIGTERM or SIGINT (reloading on SIGHUP), then drain and return.

    As one of several --workers: share the port and report the private admin port.
    """
    gateway = Gateway(cfg, config_path=config_path, overrides=overrides)
    worker = worker_index is not None
    async with runtime.Signals(on_hup=gateway.reload) as signals:
        # Through etcd every process shares with every other, the --workers of one host too.
        local = SharedState.from_env(worker_index) if cfg.state.backend == "local" else None
        try:
            await gateway.start(reuse_port=worker, shared=local)
        except BaseException:
            # What start opened before it failed (HTTP sessions, probes, the store's client)
            # is closed, not left to a warning at exit.
            await gateway.stop()
            raise
        if worker:

            def orphaned() -> None:
                log.warning("the supervisor is gone: draining and exiting")
                signals.stop()

            hold_lifeline(orphaned)
            report_ready(gateway.admin_port)
        try:
            await signals.wait()
            grace = gateway.cfg.timeouts.shutdown_grace_s
            log.info("shutting down: draining for up to %.0fs", grace)
            gateway.draining = True
        finally:
            await gateway.stop()
    log.info("stopped")
