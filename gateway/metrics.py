"""Prometheus metrics, prefixed `sglang_gateway_`, with bounded labels only.

Labels come from fixed vocabularies (route paths from the route table or "unmatched",
status classes, policy/reason names, configured backend URLs), never from request data,
so a hostile client cannot grow the series count. The registry is owned by the gateway
instance, not global, so tests and several gateways in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gateway.backends import BackendPool, Health
from gateway.observe import Exchange

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1800,
)
_BYTES_BUCKETS = tuple(float(1 << s) for s in range(8, 31, 2))  # 256 B .. 1 GiB


def _status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


class Metrics:
    """The gateway's metrics; also an observer of finished exchanges."""

    def __init__(self, pool: BackendPool, inflight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "sglang_gateway_"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by route, method and status class.",
            ["route", "method", "status_class"],
            registry=r,
        )
        self.outcomes = Counter(
            p + "request_outcomes",
            "Requests by outcome (ok, rejected:<policy>, no_backend, upstream_error, ...).",
            ["outcome"],
            registry=r,
        )
        self.rejections = Counter(
            p + "rejections",
            "Requests refused by the gateway, by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            p + "upstream_attempts",
            "Connection attempts to backends, by backend.",
            ["backend"],
            registry=r,
        )
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Upstream failures by backend and cause.",
            ["backend", "cause"],
            registry=r,
        )
        self.client_disconnects = Counter(
            p + "client_disconnects", "Clients that went away before the reply ended.", registry=r
        )
        self.ttfb = Histogram(
            p + "upstream_ttfb_seconds",
            "Time from request start to upstream response headers.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            p + "request_duration_seconds",
            "Time from request start to the end of the reply.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.bytes_in = Histogram(
            p + "request_body_bytes", "Request body sizes.", buckets=_BYTES_BUCKETS, registry=r
        )
        self.bytes_out = Histogram(
            p + "response_body_bytes", "Response body sizes.", buckets=_BYTES_BUCKETS, registry=r
        )
        Gauge(p + "inflight_requests", "Requests being handled.", registry=r).set_function(
            lambda: float(inflight())
        )
        self._health = Gauge(
            p + "backend_healthy",
            "1 if the backend is routable (healthy or not yet probed), else 0.",
            ["backend"],
            registry=r,
        )
        self._backend_inflight = Gauge(
            p + "backend_inflight_requests",
            "Requests in flight per backend.",
            ["backend"],
            registry=r,
        )
        self._pool = pool

    def finish(self, ex: Exchange) -> None:
        self.requests.labels(ex.route, ex.method, _status_class(ex.status)).inc()
        self.outcomes.labels(ex.outcome).inc()
        if ex.outcome.startswith("rejected:"):
            self.rejections.labels(ex.outcome[9:], ex.reason).inc()
        elif ex.outcome == "client_disconnect":
            self.client_disconnects.inc()
        for url in ex.connect_failed:
            self.upstream_attempts.labels(url).inc()
            self.upstream_errors.labels(url, "connect_failed").inc()
        if ex.backend and ex.attempts > len(ex.connect_failed):
            self.upstream_attempts.labels(ex.backend).inc()
            if ex.outcome in ("upstream_error", "upstream_timeout", "upstream_broken"):
                self.upstream_errors.labels(ex.backend, ex.outcome).inc()
        if ex.first_byte is not None:
            self.ttfb.labels(ex.route).observe(ex.first_byte - ex.started)
        if ex.finished is not None:
            self.duration.labels(ex.route).observe(ex.finished - ex.started)
        self.bytes_in.observe(ex.bytes_in)
        self.bytes_out.observe(ex.bytes_out)

    def render(self) -> tuple[bytes, str]:
        # Rebuilt from the current membership, so removed backends leave no stale series.
        self._health.clear()
        self._backend_inflight.clear()
        for b in self._pool.backends:
            self._health.labels(b.url).set(0.0 if b.health is Health.UNHEALTHY else 1.0)
            self._backend_inflight.labels(b.url).set(float(b.inflight))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _DiscoveryStats(Protocol):
    name: str
    updates: int
    errors: int


class _FleetView(Protocol):
    @property
    def discovery(self) -> _DiscoveryStats | None: ...


class _GatewayView(Protocol):
    reloads: int
    reload_failures: int
    draining: bool

    @property
    def fleet(self) -> _FleetView: ...


class FleetCollector(Collector):
    """Counters owned by other objects (discovery, reload), read at scrape time."""

    def __init__(self, gateway: _GatewayView) -> None:
        self._gw = gateway

    def collect(self) -> Iterator[Metric]:
        p = "sglang_gateway_"
        d = self._gw.fleet.discovery
        updates = CounterMetricFamily(
            p + "discovery_updates", "Membership snapshots published.", labels=["discovery"]
        )
        errors = CounterMetricFamily(
            p + "discovery_errors",
            "Failed or empty discovery answers (the last good set was kept).",
            labels=["discovery"],
        )
        if d is not None:
            updates.add_metric([d.name], d.updates)
            errors.add_metric([d.name], d.errors)
        yield updates
        yield errors
        reloads = CounterMetricFamily(
            p + "config_reloads", "Config reloads by result.", labels=["result"]
        )
        reloads.add_metric(["ok"], self._gw.reloads)
        reloads.add_metric(["refused"], self._gw.reload_failures)
        yield reloads
        yield GaugeMetricFamily(
            p + "draining", "1 while shutting down.", value=1.0 if self._gw.draining else 0.0
        )
