"""Prometheus metrics, prefixed `sglang_gateway_`, with bounded labels only.

Labels come from fixed vocabularies (route paths from the route table or "unmatched",
known HTTP methods or "other", status classes, policy/reason names, outcome names, the
backends of the current pool), never from request data, so a hostile client cannot grow
the series count. The registry is owned by the gateway instance, not global, so tests and
several gateways in one process do not collide.

Backend state (health, ejection, in-flight count, membership) is read from the pool at
scrape time by a collector, so a backend that leaves the pool (discovery) leaves the
output too instead of lingering as a stale series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.backends import BackendPool, Health
from gateway.observe import Exchange

PREFIX: Final = "sglang_gateway_"

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

# Methods a client can send are whatever the HTTP parser accepts; only these become labels.
_METHODS: Final = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"}
)
# Outcomes that are a failure of the backend (as opposed to the client or the gateway).
_UPSTREAM_FAILURES: Final = frozenset({"upstream_error", "upstream_timeout", "upstream_broken"})


def _status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


def _method(method: str) -> str:
    return method if method in _METHODS else "other"


class _WithoutCreated(Collector):
    """A view of a registry that leaves out the `<name>_created` samples.

    prometheus_client writes a `_created` timestamp beside every counter and histogram
    series, which doubles the output and that Prometheus' text format does not need. Its
    switch (`disable_created_metrics()`) is process-global state; filtering our own
    registry's output here keeps the choice local to this gateway instance.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            if not any(s.name == created for s in family.samples):
                yield family
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s for s in family.samples if s.name != created]
            yield out


class _BackendCollector(Collector):
    """Per-backend state of the pool, read at scrape time."""

    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        members, healthy, state, ejected, inflight = families
        counts = dict.fromkeys((h.value for h in Health), 0)
        now = time.monotonic()  # the pool's clock (BackendPool's default)
        for b in self._pool.backends:
            counts[b.health.value] += 1
            healthy.add_metric([b.url], 0.0 if b.health is Health.UNHEALTHY else 1.0)
            for h in Health:
                state.add_metric([b.url, h.value], 1.0 if b.health is h else 0.0)
            ejected.add_metric([b.url], 1.0 if b.ejected_until > now else 0.0)
            inflight.add_metric([b.url], float(b.inflight))
        for name, n in counts.items():
            members.add_metric([name], float(n))
        return families

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        p = PREFIX
        return (
            GaugeMetricFamily(
                p + "backends",
                "Backends in the pool (membership), by health state.",
                labels=["state"],
            ),
            GaugeMetricFamily(
                p + "backend_healthy",
                "1 unless active probes marked the backend unhealthy (an unprobed backend "
                "counts as healthy: it is routable), else 0.",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                p + "backend_state",
                "1 for the backend's current health state (unknown, healthy, unhealthy).",
                labels=["backend", "state"],
            ),
            GaugeMetricFamily(
                p + "backend_ejected",
                "1 while the backend is passively ejected after a refused connection.",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                p + "backend_inflight_requests",
                "Requests in flight per backend.",
                labels=["backend"],
            ),
        )


class Metrics:
    """The gateway's metrics; also an observer of finished exchanges."""

    def __init__(self, pool: BackendPool, inflight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
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
        self.log_only_rejections = Counter(
            p + "log_only_rejections",
            "Requests a policy in log_only mode would have refused (they were forwarded).",
            ["policy", "reason"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            p + "upstream_attempts",
            "Requests sent (or tried) to a backend, by backend.",
            ["backend"],
            registry=r,
        )
        self.upstream_retries = Counter(
            p + "upstream_retries",
            "Attempts beyond a request's first, by the backend whose failure caused the retry "
            "and the cause.",
            ["backend", "cause"],
            registry=r,
        )
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Upstream failures by backend and cause (connect_failed, upstream_error, "
            "upstream_timeout, upstream_broken).",
            ["backend", "cause"],
            registry=r,
        )
        self.client_disconnects = Counter(
            p + "client_disconnects",
            "Clients that went away before the reply ended, by phase (waiting: before the "
            "response headers, streaming: during the body).",
            ["phase"],
            registry=r,
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
            p + "request_body_bytes",
            "Request body sizes received from clients.",
            ["route"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.bytes_out = Histogram(
            p + "response_body_bytes",
            "Response body sizes sent to clients.",
            ["route"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        Gauge(p + "inflight_requests", "Requests being handled.", registry=r).set_function(
            lambda: float(inflight())
        )
        r.register(_BackendCollector(pool))
        self._exposed = _WithoutCreated(r)

    def finish(self, ex: Exchange) -> None:
        route = ex.route
        self.requests.labels(route, _method(ex.method), _status_class(ex.status)).inc()
        self.outcomes.labels(ex.outcome).inc()
        if ex.outcome.startswith("rejected:"):
            self.rejections.labels(ex.outcome[9:], ex.reason).inc()
        elif ex.outcome == "client_disconnect":
            phase = "waiting" if ex.first_byte is None else "streaming"
            self.client_disconnects.labels(phase).inc()
        if ex.log_only:
            self.log_only_rejections.labels(ex.log_only, ex.reason).inc()
        for i, url in enumerate(ex.connect_failed):
            self.upstream_attempts.labels(url).inc()
            self.upstream_errors.labels(url, "connect_failed").inc()
            if i + 1 < ex.attempts:  # another attempt followed this failure
                self.upstream_retries.labels(url, "connect_failed").inc()
        if ex.backend and ex.attempts > len(ex.connect_failed):
            self.upstream_attempts.labels(ex.backend).inc()
            if ex.outcome in _UPSTREAM_FAILURES:
                self.upstream_errors.labels(ex.backend, ex.outcome).inc()
        if ex.first_byte is not None:
            self.ttfb.labels(route).observe(ex.first_byte - ex.started)
        if ex.finished is not None:
            self.duration.labels(route).observe(ex.finished - ex.started)
        self.bytes_in.labels(route).observe(ex.bytes_in)
        self.bytes_out.labels(route).observe(ex.bytes_out)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST


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
