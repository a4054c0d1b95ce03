"""Optional OpenTelemetry tracing: a server span per request, with child spans for the body
inspection and for each upstream exchange, exported over OTLP/HTTP (the `otel` extra).

This is the only module that imports opentelemetry, and only in `build` when tracing is
enabled: a base install never loads it. Disabled, NO_TRACING hands back the very handler,
functions and upstream class it is given, so the request path runs the same code as
without this module, with nothing added per request. Enabled, the request's spans travel
in a context variable from the server wrapper (`serve`) to the inspection and upstream
wrappers, so the proxy passes nothing along.

What goes into a span is the request's shape, never its content: the method, the route
(not the path as sent, which may hold a key pasted in the wrong place), statuses, the
gateway's request id and outcome, the backend. Of the request's headers only the trace
context is read; the body is never looked at here.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, ParamSpec, Protocol
from urllib.parse import urlsplit

from gateway import build as build_info
from gateway.config import TRACING_INSTALL, TracingConfig
from gateway.contract.policy import MaskDemand, Verdict
from gateway.contract.replies import Outcome
from gateway.edge.failures import ConnectFailed, UpstreamFailure, UpstreamTimeout
from gateway.edge.server import Handler, Reply, Request
from gateway.edge.upstream import Upstream, UpstreamResponse
from gateway.ops.observe import Exchange, Observer

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind, StatusCode
    from opentelemetry.trace import Tracer as OtelTracer

P = ParamSpec("P")

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"

# As the metrics count them; anything else the parser accepts is "_OTHER" (semantic
# conventions), so a client's made-up method never names a span.
_METHODS: Final = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"}
)
# Outcomes that are the gateway's or a backend's failure, whatever the status said.
_FAILED: Final = frozenset({Outcome.UPSTREAM_BROKEN, Outcome.GATEWAY_ERROR})


class UnavailableError(ValueError):
    """tracing.enabled on an install without the otel extra (a ValueError: the CLI reports
    it as a start-up failure, like an unreadable key file)."""


class Tracer(Protocol):
    """What the gateway asks of tracing. Each wrapper returns what it is given when
    tracing is off, so the request path pays nothing for it."""

    @property
    def observer(self) -> Observer | None:
        """Sees each finished request before the other observers; None when off."""

    @property
    def upstream_type(self) -> type[Upstream]:
        """The upstream client class to build the request path's pool from."""

    def serve(self, handler: Handler) -> Handler: ...

    def inspection(self, fn: Callable[P, Verdict]) -> Callable[P, Verdict]: ...

    def inspection_async(
        self, fn: Callable[P, Awaitable[Verdict]]
    ) -> Callable[P, Awaitable[Verdict]]: ...

    async def flush(self) -> None:
        """Export every finished span now."""

    async def shutdown(self) -> None:
        """Flush, then stop exporting (the gateway's last step when it stops)."""


class _NoTracing:
    @property
    def observer(self) -> Observer | None:
        return None

    @property
    def upstream_type(self) -> type[Upstream]:
        return Upstream

    def serve(self, handler: Handler) -> Handler:
        return handler

    def inspection(self, fn: Callable[P, Verdict]) -> Callable[P, Verdict]:
        return fn

    def inspection_async(
        self, fn: Callable[P, Awaitable[Verdict]]
    ) -> Callable[P, Awaitable[Verdict]]:
        return fn

    async def flush(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


NO_TRACING: Final[Tracer] = _NoTracing()


def build(cfg: TracingConfig) -> Tracer:
    """NO_TRACING, or an exporting tracer (UnavailableError without the otel extra)."""
    if not cfg.enabled:
        return NO_TRACING
    return _Tracing(cfg)


# The request being handled, from the server wrapper down to the upstream exchange.
_current: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "gateway_trace", default=None
)


class _Tracing:
    """Spans through the OpenTelemetry SDK: a provider of its own (never the process-global
    one, so gateways in one process do not share or replace each other's), exported by a
    BatchSpanProcessor from its own thread, never from the event loop."""

    def __init__(self, cfg: TracingConfig) -> None:
        try:
            # Imported here and only here: a base install must never load opentelemetry.
            from opentelemetry import trace  # noqa: PLC0415
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter,
            )
            from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
            from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
            from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
            from opentelemetry.sdk.trace.sampling import (  # noqa: PLC0415
                ParentBased,
                TraceIdRatioBased,
            )
            from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise UnavailableError(
                f"tracing.enabled needs the otel extra ({exc.name or exc} is missing): "
                f"{TRACING_INSTALL}"
            ) from exc
        self._timeout_s = cfg.timeout_s
        resource = Resource.create(
            {"service.name": cfg.service_name, "service.version": build_info.VERSION}
        )
        self._provider: TracerProvider = TracerProvider(
            resource=resource,
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            # Stopped by Gateway.stop; an exit hook per provider would keep every gateway a
            # test process ever started alive until it exits.
            shutdown_on_exit=False,
        )
        exporter = OTLPSpanExporter(
            endpoint=cfg.endpoint,
            headers={k: v.get_secret_value() for k, v in cfg.headers.items()},
            timeout=cfg.timeout_s,
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: OtelTracer = self._provider.get_tracer(build_info.NAME, build_info.VERSION)
        self.propagator: TextMapPropagator = TraceContextTextMapPropagator()
        self.in_context: Callable[[Span], Context] = trace.set_span_in_context
        self.span_of: Callable[[Context], Span] = trace.get_current_span
        self.kind_server: SpanKind = trace.SpanKind.SERVER
        self.kind_client: SpanKind = trace.SpanKind.CLIENT
        self.error: StatusCode = trace.StatusCode.ERROR
        self._finisher = _Finisher()

    @property
    def observer(self) -> Observer | None:
        return self._finisher

    @property
    def upstream_type(self) -> type[Upstream]:
        return TracedUpstream

    def serve(self, handler: Handler) -> Handler:
        async def traced(request: Request) -> Reply | None:
            headers = request.headers
            parent = None
            if TRACEPARENT in headers:
                # Every line of each: a tracestate split over two lines is one list.
                parent = self.propagator.extract(
                    {
                        TRACEPARENT: headers.getall(TRACEPARENT),
                        TRACESTATE: headers.getall(TRACESTATE, []),
                    }
                )
            method = request.method
            span = self.tracer.start_span(
                method if method in _METHODS else "HTTP", context=parent, kind=self.kind_server
            )
            req = _Request(self, span, parent)
            token = _current.set(req)
            try:
                return await handler(request)
            finally:
                _current.reset(token)
                req.end()

        return traced

    def inspection(self, fn: Callable[P, Verdict]) -> Callable[P, Verdict]:
        @functools.wraps(fn)
        def traced(*args: P.args, **kwargs: P.kwargs) -> Verdict:
            req = _current.get()
            if req is None:
                return fn(*args, **kwargs)
            span = self.tracer.start_span("inspect", context=req.context)
            try:
                verdict = fn(*args, **kwargs)
            except Exception as exc:
                _failed(span, self.error, type(exc).__name__)
                raise
            _describe_verdict(span, verdict)
            return verdict

        return traced

    def inspection_async(
        self, fn: Callable[P, Awaitable[Verdict]]
    ) -> Callable[P, Awaitable[Verdict]]:
        @functools.wraps(fn)
        async def traced(*args: P.args, **kwargs: P.kwargs) -> Verdict:
            req = _current.get()
            if req is None:
                return await fn(*args, **kwargs)
            span = self.tracer.start_span("inspect", context=req.context)
            try:
                verdict = await fn(*args, **kwargs)
            except asyncio.CancelledError:  # the client left while it waited for the budget
                _abandoned(span)
                raise
            except Exception as exc:
                _failed(span, self.error, type(exc).__name__)
                raise
            _describe_verdict(span, verdict)
            return verdict

        return traced

    async def flush(self) -> None:
        # Blocking (it exports in the calling thread): off the loop, which may be the one
        # serving the collector.
        await asyncio.to_thread(self._provider.force_flush, int(self._timeout_s * 1000))

    async def shutdown(self) -> None:
        await self.flush()
        await asyncio.to_thread(self._provider.shutdown)


class _Request:
    """One request's spans: the server span, and the upstream ones still open."""

    __slots__ = ("attempts", "context", "exchange", "keep_state", "open", "span", "tracing")

    def __init__(self, tracing: _Tracing, span: Span, parent: Context | None) -> None:
        self.tracing = tracing
        self.span = span
        self.context = tracing.in_context(span)
        # A tracestate belongs to the trace it came with: forwarded only if that trace goes on.
        self.keep_state = parent is not None and tracing.span_of(parent).get_span_context().is_valid
        self.attempts = 0
        self.open: list[Span] = []  # upstream spans whose response is still being relayed
        self.exchange: Exchange | None = None

    def start_upstream(
        self, url: str, method: str, headers: list[tuple[str, str]]
    ) -> tuple[Span, list[tuple[str, str]]]:
        """The upstream span of one attempt, and the headers that carry it to the backend."""
        self.attempts += 1
        host, port = _address(url)
        tracing = self.tracing
        span = tracing.tracer.start_span(
            "upstream",
            context=self.context,
            kind=tracing.kind_client,
            attributes={
                "http.request.method": method if method in _METHODS else "_OTHER",
                "server.address": host,
                "server.port": port,
                "gateway.backend": url,
                "gateway.attempt": self.attempts,
            },
        )
        # The gateway's span is now the backend's parent: the client's traceparent is
        # replaced, its tracestate kept with the trace it belongs to.
        drop = (TRACEPARENT,) if self.keep_state else (TRACEPARENT, TRACESTATE)
        out = [(k, v) for k, v in headers if k.lower() not in drop]
        out.append((TRACEPARENT, _traceparent(span)))
        return span, out

    def answered(self, span: Span, status: int) -> None:
        span.set_attribute("http.response.status_code", status)
        if status >= 400:  # a client span's error, by the semantic conventions
            span.set_status(self.tracing.error)
            span.set_attribute("error.type", str(status))
        self.open.append(span)

    def finish(self, ex: Exchange) -> None:
        self.exchange = ex
        # The trace id the access log writes: the gateway's trace, also where the client
        # sent no (or no valid) traceparent.
        ex.traceparent = _traceparent(self.span)

    def end(self) -> None:
        span, ex, error = self.span, self.exchange, self.tracing.error
        for i, upstream in enumerate(self.open):
            if ex is not None and ex.outcome is Outcome.UPSTREAM_BROKEN and i == len(self.open) - 1:
                _failed(upstream, error, Outcome.UPSTREAM_BROKEN.value)
            else:
                upstream.end()
        self.open.clear()
        if ex is None:  # the handler never reached its observers
            _failed(span, error, "unfinished")
            return
        known = ex.method in _METHODS
        method = ex.method if known else "_OTHER"
        # "{method} {route}" (semantic conventions), low-cardinality like the metrics' labels.
        name = ex.method if known else "HTTP"
        span.update_name(name if ex.route == "unmatched" else f"{name} {ex.route}")
        attributes: dict[str, str | int | bool] = {
            "http.request.method": method,
            "http.route": ex.route,
            "url.path": ex.route,
            "gateway.request_id": ex.request_id,
            "gateway.outcome": ex.outcome_label,
            "gateway.attempts": ex.attempts,
            "http.request.body.size": ex.bytes_in,
            "http.response.body.size": ex.bytes_out,
        }
        if ex.status:
            attributes["http.response.status_code"] = ex.status
        if ex.backend:
            attributes["gateway.backend"] = ex.backend
        if ex.reason:
            attributes["gateway.reason"] = ex.reason
        if ex.log_only:
            attributes["gateway.log_only"] = ex.log_only
        if ex.profile:
            attributes["gateway.profile"] = ex.profile
        span.set_attributes(attributes)
        if ex.outcome in _FAILED:
            _failed(span, error, ex.outcome.value)
        elif ex.status >= 500:
            _failed(
                span, error, ex.outcome_label if ex.outcome is not Outcome.OK else str(ex.status)
            )
        else:
            span.end()


class _Finisher:
    """The observer half: hands the finished exchange to the request's spans."""

    def finish(self, ex: Exchange) -> None:
        req = _current.get()
        if req is not None:
            req.finish(ex)


class TracedUpstream(Upstream):
    """The upstream client with a span per exchange and the trace context in its headers."""

    async def request(
        self,
        url: str,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        *,
        connect_s: float,
        ttfb_s: float | None,
        total_s: float | None,
    ) -> UpstreamResponse:
        req = _current.get()
        span: Span | None = None
        if req is not None:  # else not on behalf of a client request: no span
            span, headers = req.start_upstream(url, method, headers)
        try:
            resp = await super().request(
                url,
                method,
                target,
                headers,
                body,
                connect_s=connect_s,
                ttfb_s=ttfb_s,
                total_s=total_s,
            )
        except BaseException as exc:
            if span is not None and req is not None:
                _record_failure(span, req.tracing.error, exc)
            raise
        if span is not None and req is not None:
            req.answered(span, resp.status)
        return resp


def _record_failure(span: Span, error: StatusCode, exc: BaseException) -> None:
    if isinstance(exc, ConnectFailed):
        # Nothing was sent; the proxy may try another backend under a span of its own.
        span.add_event("connect_failed", {"gateway.cause": exc.cause})
        _failed(span, error, "connect_failed")
    elif isinstance(exc, UpstreamTimeout):
        _failed(span, error, "timeout")
    elif isinstance(exc, UpstreamFailure):
        _failed(span, error, exc.cause)
    elif isinstance(exc, asyncio.CancelledError):  # the client left: not the backend's failure
        _abandoned(span)
    else:  # a head that could not be sent (ValueError)
        _failed(span, error, type(exc).__name__)


def _traceparent(span: Span) -> str:
    """The W3C traceparent (version 00) naming `span` as the parent: what the TraceContext
    propagator's inject writes, without building a context for it."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def _abandoned(span: Span) -> None:
    span.add_event("cancelled")
    span.end()


def _failed(span: Span, error: StatusCode, error_type: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(error, error_type)
    span.end()


def _describe_verdict(span: Span, verdict: Verdict) -> None:
    if verdict is None:
        span.set_attribute("gateway.verdict", "forward")
    elif isinstance(verdict, MaskDemand):
        span.set_attribute("gateway.verdict", "mask")
    else:
        # Fixed strings (policy.Rejection): never request data.
        span.set_attributes(
            {
                "gateway.verdict": "rejected",
                "gateway.rejected_by": verdict.rule,
                "gateway.reason": verdict.reason,
                "http.response.status_code": verdict.status,
            }
        )
    span.end()


@functools.lru_cache(maxsize=1024)
def _address(url: str) -> tuple[str, int]:
    """server.address and server.port of a backend URL (scheme://host:port, normalised)."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or 0
