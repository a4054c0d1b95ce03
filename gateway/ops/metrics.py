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

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from http import HTTPStatus
from typing import Any, Final, Protocol

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway import build
from gateway.contract.policy import SAMPLING_MASK
from gateway.contract.replies import Outcome
from gateway.contract.routes import CONTROL_ROUTES
from gateway.fleet.cache_aware import DECISIONS, RouteStats
from gateway.fleet.pd import ROLES, RoleStats
from gateway.fleet.pool import HOLD_EVENTS, BackendPool, Health
from gateway.ops import logs
from gateway.ops.observe import Exchange

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
_UPSTREAM_FAILURES: Final = frozenset(
    {Outcome.UPSTREAM_ERROR, Outcome.UPSTREAM_TIMEOUT, Outcome.UPSTREAM_BROKEN}
)
_UPSTREAM_CAUSES: Final = ("connect_failed", *sorted(o.value for o in _UPSTREAM_FAILURES))


def _status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


# The registered codes (and the gateway's 499): a backend that invents codes shows as
# "other" rather than growing the series count by route x method each time.
_STATUS_CODES: Final = {s.value: str(s.value) for s in HTTPStatus} | {499: "499"}


def _status_code(status: int) -> str:
    return _STATUS_CODES.get(status, "other")


# Every refusal the gateway makes that holds for any backend, as (Exchange.rejected_by,
# its reason): each rejections_total series (profile "") and each rule's outcome series
# exist from the start at 0, so `increase()` over a fresh process and absence alerts read
# a number. The mask refusals that depend on a backend's admission are exported per
# profile as profiles become known (MaskProfile.reasons()). A test holds this table to the
# Rejection(...) calls in the code.
REJECTION_REASONS: Final = (
    ("auth", "missing_key"),
    ("auth", "malformed_key"),
    ("auth", "invalid_key"),
    ("control", "forbidden"),
    ("control", "client_abort_off"),
    ("control", "not_addressable"),
    ("lora", "adapter_not_loaded"),
    ("parallel_sampling", "n_too_large"),
    ("registry", "invalid"),
    ("registry", "not_found"),
    ("request_body", "invalid_json"),
    ("request_body", "not_an_object"),
    ("request_body", "invalid_field"),
    ("request_body", "media_type"),
    ("request_body", "charset"),
    ("request_body", "content_encoding"),
    ("request_body", "too_large"),
    ("request_body", "body_timeout"),
    ("request_body", "too_costly"),
    ("request_body", "inspection_busy"),
    ("routing", "disaggregated_only"),
    ("routing", "pd_unsupported"),
    (SAMPLING_MASK, "invalid_top_k"),
    (SAMPLING_MASK, "parallel_mask_list"),
    (SAMPLING_MASK, "missing_meta_info"),
    (SAMPLING_MASK, "stream_meta_info"),
)
REJECTION_RULES: Final = tuple(sorted({rule for rule, _ in REJECTION_REASONS}))


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry in the format the scraper asked for: OpenMetrics when its Accept
    header names it, else the Prometheus text format."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def _method(method: str) -> str:
    return method if method in _METHODS else "other"


class _Counter:
    """Counter series keyed by their label values.

    Plain floats, no locks: every update happens on the event loop thread, and
    prometheus_client's per-series locks and label validation cost more than the rest of
    the bookkeeping of a request together.
    """

    __slots__ = ("doc", "labels", "name", "values")

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name = PREFIX + name
        self.doc = doc
        self.labels = list(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[key] = values.get(key, 0.0) + amount

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric(list(key), value)
        return family


class _Histogram:
    """Histogram series keyed by label values: per-bucket counts and a sum, made cumulative
    only when scraped."""

    __slots__ = ("bounds", "doc", "labels", "les", "name", "values")

    def __init__(self, name: str, doc: str, labels: Sequence[str], bounds: Sequence[float]) -> None:
        self.name = PREFIX + name
        self.doc = doc
        self.labels = list(labels)
        self.bounds = tuple(sorted(bounds))
        self.les = tuple(_bound(b) for b in self.bounds)
        # counts for each bound, then +Inf, then the sum
        self.values: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        row = self.values.get(key)
        if row is None:
            row = self.values[key] = [0.0] * (len(self.bounds) + 2)
        row[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        row[-1] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, row in self.values.items():
            buckets = []
            total = 0.0
            for le, count in zip(self.les, row, strict=False):
                total += count
                buckets.append((le, total))
            buckets.append(("+Inf", total + row[len(self.bounds)]))
            family.add_metric(list(key), buckets, row[-1])
        return family


def _bound(value: float) -> str:
    # The spelling prometheus_client's own histograms use for `le` (e.g. 1.048576e+06);
    # the library ships the helper without annotations.
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


class _BackendCollector(Collector):
    """Per-backend state of the pool, read at scrape time."""

    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        members, healthy, state, ejected, ejections, flaps, inflight, weights, info = families
        counts = dict.fromkeys((h.value for h in Health), 0)
        pool = self._pool
        for b in pool.backends:
            counts[b.health.value] += 1
            healthy.add_metric([b.url], 0.0 if b.health is Health.UNHEALTHY else 1.0)
            for h in Health:
                state.add_metric([b.url, h.value], 1.0 if b.health is h else 0.0)
            state.add_metric([b.url, "paused"], 1.0 if b.paused else 0.0)
            state.add_metric([b.url, "asleep"], 1.0 if b.asleep else 0.0)
            ejected.add_metric([b.url], 1.0 if pool.ejected(b) else 0.0)
            ejections.add_metric([b.url], float(b.ejections_total))
            flaps.add_metric([b.url], float(b.flaps))
            inflight.add_metric([b.url], float(b.inflight))
            if b.weight_version is not None:
                weights.add_metric([b.url, b.weight_version], 1.0)
            release = b.server_info.version if b.server_info is not None else None
            info.add_metric([b.url, release or "unknown", b.profile.name], 1.0)
        for name, n in counts.items():
            members.add_metric([name], float(n))
        return families

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
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
                "1 for the backend's current health state (unknown, healthy, unhealthy), and "
                "for paused / asleep while a pause or a memory release through the gateway "
                "holds it.",
                labels=["backend", "state"],
            ),
            GaugeMetricFamily(
                p + "backend_ejected",
                "1 while the backend is passively ejected after a refused connection.",
                labels=["backend"],
            ),
            CounterMetricFamily(
                p + "backend_ejections",
                "Passive ejections of the backend (each time it was taken out, not each "
                "extension): reliable where the backend_ejected gauge changes between scrapes.",
                labels=["backend"],
            ),
            CounterMetricFamily(
                p + "backend_flaps",
                "Passive ejections of the backend after it had passed a probe or answered a "
                "request since its previous ejection (or since it joined): it keeps coming "
                "back and failing again. A dead backend, ejected again and again while its "
                "probes fail, counts once.",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                p + "backend_inflight_requests",
                "Requests in flight per backend.",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                p + "backend_weight_version",
                "1, labelled with the weight version the backend serves (read from its "
                "/model_info, or set by a weight update through the gateway); absent while "
                "unknown.",
                labels=["backend", "version"],
            ),
            GaugeMetricFamily(
                p + "backend_info",
                "1, labelled with the SGLang release the backend reports (/server_info; "
                "unknown until it answers) and the mask admission profile the gateway "
                "applies to it.",
                labels=["backend", "version", "profile"],
            ),
        )


class _CacheAwareCollector(Collector):
    """What cache_aware decided per backend (gateway/fleet/cache_aware.py), read at scrape
    time; no series with another balancer."""

    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        pool = self._pool
        first = pool.prompt_balancer()
        if first is None:
            return ()
        families = self._families()
        decisions, matched, prompt, blocks, limits, per_token = families
        per_token.add_metric([], first.bytes_per_token)
        for b in pool.backends:
            # On a PD fleet each worker is routed by its role's balancer.
            prefix = pool.prefix_of(b)
            if prefix is None:
                continue
            url = b.url
            stats = prefix.stats.get(url) or RouteStats()
            for decision in DECISIONS:
                decisions.add_metric([url, decision], float(stats.decisions[decision]))
            matched.add_metric([url], float(stats.matched_bytes))
            prompt.add_metric([url], float(stats.prompt_bytes))
            blocks.add_metric([url], float(prefix.held_blocks(url)))
            limit = prefix.cache_limit(url)
            if limit is not None:
                limits.add_metric([url], float(limit))
        return families

    @staticmethod
    def _families() -> tuple[
        CounterMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        p = PREFIX + "cache_aware_"
        return (
            CounterMetricFamily(
                p + "decisions",
                "Requests cache_aware sent to the backend, by why: matched (it held the "
                "longest prompt prefix), balanced (it was the least loaded, the longest "
                "match's backend being over the balance rule), unmatched (no backend held "
                "cache_threshold of the prompt), no_prompt (none located in the body).",
                labels=["backend", "decision"],
            ),
            CounterMetricFamily(
                p + "matched_bytes",
                "Prompt bytes of the requests sent to the backend that it had served before "
                "(its prefix match); over prompt_bytes, the gateway's estimate of its "
                "prefix-cache hit rate.",
                labels=["backend"],
            ),
            CounterMetricFamily(
                p + "prompt_bytes",
                "Prompt bytes of the requests sent to the backend (up to max_prompt_bytes each).",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                p + "index_blocks",
                "Prompt-prefix blocks the gateway remembers the backend served.",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                p + "cache_limit_bytes",
                "Prompt bytes the gateway takes the backend's prefix cache to hold (the "
                "tokens it reports or configured, times bytes_per_token); absent while "
                "unbounded.",
                labels=["backend"],
            ),
            GaugeMetricFamily(
                p + "bytes_per_token",
                "Request bytes a prompt token is taken to take: configured, or learnt from "
                "the prompts.",
            ),
        )


class _PdCollector(Collector):
    """What became of prefill/decode pairs (gateway/fleet/pd.py), read at scrape time; no
    series on a plain fleet."""

    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        pd = self._pool.pd
        if pd is None:
            return ()
        families = self._families()
        pairs, failures, by_worker = families
        pairs.add_metric([], float(pd.pairs))
        for (side, cause), n in pd.failures.items():
            failures.add_metric([side, cause], float(n))
        for b in self._pool.backends:
            if b.worker_type not in ROLES:
                continue
            stats = pd.stats.get(b.url) or RoleStats()
            by_worker.add_metric([b.url, b.worker_type, "paired"], float(stats.paired))
            by_worker.add_metric([b.url, b.worker_type, "failed"], float(stats.failed))
        return families

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        p = PREFIX + "pd_"
        return (
            CounterMetricFamily(
                p + "pairs", "Requests sent to a prefill and a decode worker together."
            ),
            CounterMetricFamily(
                p + "failures",
                "Paired requests that failed, by the side that failed and why: no_worker (none "
                "of the role routable), connect, timeout, error_status (it answered non-2xx), "
                "broken (it dropped the exchange).",
                labels=["side", "cause"],
            ),
            CounterMetricFamily(
                p + "worker_requests",
                "Paired requests per worker and role: paired (it served its side), failed "
                "(its side failed).",
                labels=["backend", "role", "result"],
            ),
        )


class Metrics(Collector):
    """The gateway's request metrics (an observer of finished exchanges) and its registry."""

    def __init__(self, pool: BackendPool, inflight: Callable[[], int]) -> None:
        self._inflight = inflight
        self.requests = _Counter(
            "requests",
            "Requests answered, by route, method, status class and status code.",
            ["route", "method", "status_class", "status_code"],
        )
        self.outcomes = _Counter(
            "request_outcomes",
            "Requests by outcome (ok, rejected:<policy>, no_backend, upstream_error, ...).",
            ["outcome"],
        )
        self.rejections = _Counter(
            "rejections",
            "Requests refused by the gateway, by policy, reason and (for mask refusals) the "
            "backend profile whose admission refused.",
            ["policy", "reason", "profile"],
        )
        self.log_only_rejections = _Counter(
            "log_only_rejections",
            "Requests a policy in log_only mode would have refused (they were forwarded).",
            ["policy", "reason", "profile"],
        )
        self.upstream_attempts = _Counter(
            "upstream_attempts", "Requests sent (or tried) to a backend, by backend.", ["backend"]
        )
        self.upstream_retries = _Counter(
            "upstream_retries",
            "Attempts beyond a request's first, by the backend whose failure caused the retry "
            "and the cause.",
            ["backend", "cause"],
        )
        self.upstream_errors = _Counter(
            "upstream_errors",
            "Upstream failures by backend and cause (connect_failed, upstream_error, "
            "upstream_timeout, upstream_broken).",
            ["backend", "cause"],
        )
        self.client_disconnects = _Counter(
            "client_disconnects",
            "Clients that went away before the reply ended, by phase (waiting: before the "
            "response headers, streaming: during the body).",
            ["phase"],
        )
        self.upstream_responses = _Counter(
            "upstream_responses",
            "Response heads relayed from a backend, by backend and status class: a backend's "
            "own 5xx shows here, apart from the gateway's 502/503/504.",
            ["backend", "status_class"],
        )
        self.ttfb = _Histogram(
            "upstream_ttfb_seconds",
            "Time from request start to upstream response headers.",
            ["route"],
            _LATENCY_BUCKETS,
        )
        self.duration = _Histogram(
            "request_duration_seconds",
            "Time from request start to the end of the reply.",
            ["route"],
            _LATENCY_BUCKETS,
        )
        self.bytes_in = _Histogram(
            "request_body_bytes",
            "Request body sizes received from clients.",
            ["route"],
            _BYTES_BUCKETS,
        )
        self.bytes_out = _Histogram(
            "response_body_bytes", "Response body sizes sent to clients.", ["route"], _BYTES_BUCKETS
        )
        self._series: tuple[_Counter | _Histogram, ...] = (
            self.requests,
            self.outcomes,
            self.rejections,
            self.log_only_rejections,
            self.upstream_attempts,
            self.upstream_retries,
            self.upstream_errors,
            self.client_disconnects,
            self.upstream_responses,
            self.ttfb,
            self.duration,
            self.bytes_in,
            self.bytes_out,
        )
        for outcome in Outcome:
            if outcome is Outcome.REJECTED:
                for rule in REJECTION_RULES:
                    self.outcomes.inc((f"rejected:{rule}",), 0.0)
            else:
                self.outcomes.inc((outcome.value,), 0.0)
        for phase in ("waiting", "streaming"):
            self.client_disconnects.inc((phase,), 0.0)
        for rule, reason in REJECTION_REASONS:
            self.rejections.inc((rule, reason, ""), 0.0)
            if rule == SAMPLING_MASK:  # the one policy that runs log_only
                self.log_only_rejections.inc((rule, reason, ""), 0.0)
        self._profiles: set[str] = set()  # whose mask reasons are exported
        self._pool = pool
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.registry.register(_BackendCollector(pool))
        self.registry.register(_CacheAwareCollector(pool))
        self.registry.register(_PdCollector(pool))
        # The standard process_* and python_* families, on this registry (not the global).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def collect(self) -> Iterable[Metric]:
        # Every member's upstream series exist from the moment it joins, at 0; a backend
        # that left (discovery churn) takes its never-used ones along.
        members = {b.url for b in self._pool.backends}
        for counter in (self.upstream_attempts, self.upstream_errors, self.upstream_responses):
            stale = [k for k, v in counter.values.items() if not v and k[0] not in members]
            for key in stale:
                del counter.values[key]
        for b in self._pool.backends:
            if b.profile.name not in self._profiles:
                # Kept after its backends leave: a counter series does not vanish, and the
                # profiles a fleet runs are few.
                self._profiles.add(b.profile.name)
                for reason in b.profile.reasons():
                    key3 = (SAMPLING_MASK, reason, b.profile.name)
                    self.rejections.inc(key3, 0.0)
                    self.log_only_rejections.inc(key3, 0.0)
            key = (b.url,)
            self.upstream_attempts.inc(key, 0.0)
            for cause in _UPSTREAM_CAUSES:
                self.upstream_errors.inc((b.url, cause), 0.0)
            for status_class in ("2xx", "4xx", "5xx"):
                self.upstream_responses.inc((b.url, status_class), 0.0)
        for series in self._series:
            yield series.family()
        yield GaugeMetricFamily(
            PREFIX + "inflight_requests", "Requests being handled.", value=float(self._inflight())
        )
        yield from _hold_families(self._pool)

    def finish(self, ex: Exchange) -> None:
        route = (ex.route,)
        outcome = ex.outcome
        status = ex.status
        self.requests.inc(
            (ex.route, _method(ex.method), _status_class(status), _status_code(status))
        )
        self.outcomes.inc((ex.outcome_label,))
        if outcome is Outcome.REJECTED:
            self.rejections.inc((ex.rejected_by, ex.reason, ex.profile))
        elif outcome is Outcome.CLIENT_DISCONNECT:
            self.client_disconnects.inc(("waiting" if ex.first_byte is None else "streaming",))
        if ex.log_only:
            self.log_only_rejections.inc((ex.log_only, ex.reason, ex.profile))
        for i, url in enumerate(ex.connect_failed):
            self.upstream_attempts.inc((url,))
            self.upstream_errors.inc((url, "connect_failed"))
            if i + 1 < ex.attempts:  # another attempt followed this failure
                self.upstream_retries.inc((url, "connect_failed"))
        if ex.backend and ex.attempts > len(ex.connect_failed):
            self.upstream_attempts.inc((ex.backend,))
            if outcome in _UPSTREAM_FAILURES:
                self.upstream_errors.inc((ex.backend, outcome._value_))
        if ex.first_byte is not None:
            self.ttfb.observe(route, ex.first_byte - ex.started)
            if ex.backend:
                self.upstream_responses.inc((ex.backend, _status_class(ex.status)))
        if ex.finished is not None:
            self.duration.observe(route, ex.finished - ex.started)
        self.bytes_in.observe(route, ex.bytes_in)
        self.bytes_out.observe(route, ex.bytes_out)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        return render(self.registry, accept)


_CONTROL_RESULTS: Final = ("ok", "failed", "forbidden")
# The state --workers share: what can go wrong with it, each series there from the start.
_SHARED_ERRORS: Final = (
    ("read", "damaged"),
    ("read", "unreadable"),
    ("write", "damaged"),
    ("write", "unwritable"),
    ("ack", "unwritable"),
)


def _hold_families(pool: BackendPool) -> Iterator[Metric]:
    """The requests held for paused or asleep engines (backends.pause_hold_s)."""
    yield GaugeMetricFamily(
        PREFIX + "held_requests",
        "Requests held because only paused or asleep engines could serve them, waiting for "
        "a continue or resume.",
        value=float(pool.holding),
    )
    holds = CounterMetricFamily(
        PREFIX + "request_holds",
        "Holds of requests for paused or asleep engines, by event: held (a hold began), "
        "released (it ended with an engine, or with the fleet no longer paused for it), "
        "expired (backends.pause_hold_s ran out: 503), abandoned (its client left while "
        "held; nothing was sent upstream), refused (not held: a hold of 0 s, every slot the "
        "paused engines will have already promised, or no memory for its body: 503).",
        labels=["event"],
    )
    for event in HOLD_EVENTS:
        holds.add_metric([event], float(pool.hold_counts[event]))
    yield holds


class _DiscoveryStats(Protocol):
    # Read-only here, so any discovery's own attribute types fit.
    @property
    def name(self) -> str: ...
    @property
    def causes(self) -> tuple[str, ...]: ...
    @property
    def updates(self) -> int: ...
    @property
    def errors(self) -> Mapping[str, int]: ...
    @property
    def failing(self) -> object | None: ...


class _FleetView(Protocol):
    @property
    def discovery(self) -> _DiscoveryStats | None: ...


class _SharedStats(Protocol):
    errors: dict[tuple[str, str], int]
    repairs: int


class _UpstreamStats(Protocol):
    unsolicited: int
    local_errors: int


class _GatewayView(Protocol):
    reloads: int
    reload_failures: int
    draining: bool

    @property
    def fleet(self) -> _FleetView: ...

    @property
    def upstream_stats(self) -> _UpstreamStats | None: ...

    @property
    def refused_requests(self) -> dict[int, int]: ...

    @property
    def client_connections(self) -> tuple[int, int, int, int]: ...

    @property
    def control_counts(self) -> dict[tuple[str, str], int]: ...

    @property
    def engine_metrics_counts(self) -> dict[str, int]: ...

    @property
    def shared_state(self) -> _SharedStats | None: ...


class FleetCollector(Collector):
    """Counters owned by other objects (discovery, reload), read at scrape time."""

    def __init__(self, gateway: _GatewayView) -> None:
        self._gw = gateway

    def collect(self) -> Iterator[Metric]:
        p = "sglang_gateway_"
        d = self._gw.fleet.discovery
        updates = CounterMetricFamily(
            p + "discovery_updates", "Membership snapshots published.", labels=["source"]
        )
        errors = CounterMetricFamily(
            p + "discovery_errors",
            "Failed or empty discovery answers (the last good set was kept), by source and "
            "cause: unauthorized (401), forbidden (403), gone (410: an expired watch, relisted "
            "at once), unreachable (no answer, or 5xx/408/429), bad_response, empty; for "
            "Kubernetes pods by role, once per pod: ambiguous_role (it matches both role "
            "selectors), bad_annotation (its bootstrap-port annotation is no port).",
            labels=["source", "cause"],
        )
        failing = GaugeMetricFamily(
            p + "discovery_failing",
            "1 while the discovery's answers are not taken (its last call failed or found no "
            "backend; the last good set is served), else 0.",
            labels=["source"],
        )
        if d is not None:
            updates.add_metric([d.name], d.updates)
            # Every cause the source can report, at 0 until it does, so increase() and
            # alerts see its first error.
            by_cause = {**dict.fromkeys(d.causes, 0), **d.errors}
            for cause, count in sorted(by_cause.items()):
                errors.add_metric([d.name, cause], float(count))
            failing.add_metric([d.name], 0.0 if d.failing is None else 1.0)
        yield updates
        yield errors
        yield failing
        reloads = CounterMetricFamily(
            p + "config_reloads", "Config reloads by result.", labels=["result"]
        )
        reloads.add_metric(["ok"], self._gw.reloads)
        reloads.add_metric(["refused"], self._gw.reload_failures)
        yield reloads
        yield GaugeMetricFamily(
            p + "draining", "1 while shutting down.", value=1.0 if self._gw.draining else 0.0
        )
        info = GaugeMetricFamily(
            p + "build_info",
            "1, labelled with the gateway's version, source revision, Python, aiohttp and "
            "build (compiled: the hot path compiled with mypyc; pure: all Python).",
            labels=["version", "revision", "python", "aiohttp", "build"],
        )
        info.add_metric(
            [build.VERSION, build.REVISION, build.PYTHON, build.AIOHTTP, build.BUILD], 1.0
        )
        yield info
        refused = CounterMetricFamily(
            p + "malformed_requests",
            "Requests the HTTP parser refused before routing (bad request line or headers, "
            "bad chunk sizes, oversized heads), by the status answered.",
            labels=["status"],
        )
        for status, count in sorted(self._gw.refused_requests.items()):
            refused.add_metric([str(status)], float(count))
        yield refused
        control = CounterMetricFamily(
            p + "control_requests",
            "Fleet control calls (sent to every backend) by route and result: ok (every "
            "backend answered 2xx), failed (some did not: 502), forbidden (no right to the "
            "call: 403, why in rejections_total with policy control), refused (an addressed "
            "call to a path outside the per-engine list: 404, not forwarded), unshared "
            "(applied, but the change could not be shared with the other --workers: 503).",
            labels=["route", "result"],
        )
        counts = dict.fromkeys(
            ((route, result) for route in CONTROL_ROUTES for result in _CONTROL_RESULTS), 0
        )
        counts.update(self._gw.control_counts)
        for (route, result), count in sorted(counts.items()):
            control.add_metric([route, result], float(count))
        yield control
        scrapes = CounterMetricFamily(
            p + "engine_metrics_scrapes",
            "Engine /metrics reads for GET /engine_metrics and /metrics on the main port, by "
            "result: ok, unreachable (no connection, or a broken answer), timeout "
            "(engine_metrics.timeout_s), bad_status (not 2xx), too_large (over "
            "engine_metrics.max_bytes_per_engine or .max_total_bytes); forbidden counts "
            "requests refused for want of an operator credential (403, nothing read).",
            labels=["result"],
        )
        for result, count in sorted(self._gw.engine_metrics_counts.items()):
            scrapes.add_metric([result], float(count))
        yield scrapes
        open_conns, limit, conns_refused, send_timeouts = self._gw.client_connections
        yield GaugeMetricFamily(
            p + "client_connections", "Client connections open.", value=float(open_conns)
        )
        yield GaugeMetricFamily(
            p + "client_connections_limit",
            "limits.max_client_connections in force.",
            value=float(limit),
        )
        yield CounterMetricFamily(
            p + "client_connections_refused",
            "Client connections answered 503 and closed at once: the limit was reached.",
            value=float(conns_refused),
        )
        yield CounterMetricFamily(
            p + "client_send_timeouts",
            "Client connections reset because a reply stayed unread for "
            "timeouts.client_send_s (a client that sends and does not read).",
            value=float(send_timeouts),
        )
        writer = logs.access_writer()
        yield CounterMetricFamily(
            p + "access_log_dropped_lines",
            "Access-log lines dropped because stdout could not take them (a stalled or "
            "closed reader); the requests themselves were served.",
            value=float(writer.dropped_lines if writer is not None else 0),
        )
        yield from _shared_families(self._gw.shared_state)
        up = self._gw.upstream_stats
        yield CounterMetricFamily(
            p + "upstream_unsolicited",
            "Upstream connections closed because the backend sent bytes (or closed) while no "
            "response was expected; such bytes never reach a client.",
            value=float(up.unsolicited if up is not None else 0),
        )
        yield CounterMetricFamily(
            p + "upstream_local_errors",
            "Upstream connects that failed for want of a local resource (EMFILE, ENFILE, "
            "ENOBUFS): the gateway's fault, never counted against a backend.",
            value=float(up.local_errors if up is not None else 0),
        )


def _rid_owner_families(publisher: Any) -> Iterator[Metric]:
    """rid owners shared through etcd (gateway/fleet/rid_owners.py)."""
    if publisher is None:
        return
    flushes = CounterMetricFamily(
        PREFIX + "rid_owner_flushes",
        "Batches of rid owners written to etcd, by result (failed: a try with etcd away, "
        "the batch kept to retry; refused: etcd refused the batch itself, dropped).",
        labels=["result"],
    )
    for result, count in sorted(publisher.flushes.items()):
        flushes.add_metric([result], float(count))
    yield flushes
    yield CounterMetricFamily(
        PREFIX + "rid_owner_writes",
        "rid owner keys put or deleted in etcd.",
        value=float(publisher.writes),
    )
    lookups = CounterMetricFamily(
        PREFIX + "abort_owner_lookups",
        "Aborts by rid looking for the engine serving it: local (routed here), found (in "
        "etcd: another replica routed it), unknown (to every engine), failed (etcd did not "
        "answer in time: to every engine).",
        labels=["result"],
    )
    for result, count in sorted(publisher.lookups.items()):
        lookups.add_metric([result], float(count))
    yield lookups


def _shared_families(shared: _SharedStats | None) -> Iterator[Metric]:
    """The state file --workers share; nothing for a gateway that is one process."""
    if shared is None:
        return
    errors = CounterMetricFamily(
        PREFIX + "shared_state_errors",
        "Problems with the fleet state the --workers share, by operation and reason: a read "
        "that found the file damaged (not adopted; rebuilt) or unreadable, a change that "
        "could not be written (its call answered 503), an acknowledgement not written.",
        labels=["operation", "reason"],
    )
    counts = dict.fromkeys(_SHARED_ERRORS, 0) | shared.errors
    for (operation, reason), count in sorted(counts.items()):
        errors.add_metric([operation, reason], float(count))
    yield errors
    yield CounterMetricFamily(
        PREFIX + "shared_state_repairs",
        "Damaged fleet state files this worker rebuilt from its own view.",
        value=float(shared.repairs),
    )
    relists = getattr(shared, "relists", None)
    if isinstance(relists, int):  # state.backend: etcd
        yield CounterMetricFamily(
            PREFIX + "state_store_relists",
            "Fleet documents read anew from etcd after its history was compacted under the watch.",
            value=float(relists),
        )
    yield from _rid_owner_families(getattr(shared, "rid_publisher", None))
    up = getattr(shared, "store_up", None)
    if isinstance(up, bool):  # state.backend: etcd
        yield GaugeMetricFamily(
            PREFIX + "state_store_up",
            "1 while the fleet state store (etcd) answers; 0 while it cannot be reached: "
            "generation runs on the last known state, fleet-changing calls answer 503.",
            value=1.0 if up else 0.0,
        )
