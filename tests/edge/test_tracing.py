"""Tracing, observed from outside: a real gateway exporting over OTLP/HTTP to an in-process
collector on loopback (the protobuf bodies decoded as a collector would), in front of the
stub backend, which shows the trace context the gateway sent it."""

from __future__ import annotations

import asyncio
import gzip
import logging
import secrets
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from gateway import config as config_mod
from gateway.app import Gateway
from gateway.edge import tracing
from gateway.edge.upstream import Upstream
from gateway.testing.stub import StubBackend
from tests.conftest import ROOT, GatewayFactory, free_port, gw_url, last_proxied, proxied

JSON = {"Content-Type": "application/json"}
OK_BODY = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
# A mask with top_p alone: top_k unbounded, which every SGLang release refuses.
TOP_P_MASK = orjson.dumps(
    {"text": "hi", "sampling_params": {"top_p": 0.9}, "return_sampling_mask": True}
)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"

SERVER = Span.SpanKind.SPAN_KIND_SERVER
CLIENT = Span.SpanKind.SPAN_KIND_CLIENT
INTERNAL = Span.SpanKind.SPAN_KIND_INTERNAL
ERROR = Status.StatusCode.STATUS_CODE_ERROR
UNSET = Status.StatusCode.STATUS_CODE_UNSET


# -- the collector ------------------------------------------------------------------------


@dataclass
class Collector:
    """An OTLP/HTTP traces receiver: what a real collector would be sent."""

    url: str = ""
    spans: list[Span] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)  # as exported, decompressed
    headers: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest()
        export.ParseFromString(raw)
        self.bodies.append(raw)
        self.headers.append(dict(request.headers))
        for rs in export.resource_spans:
            self.resources.append(_attrs(rs.resource.attributes))
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture
async def collector(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Collector]:
    # The exporter's HTTP client honours proxy variables; the collector is on loopback.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    col = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", col.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    col.url = f"http://127.0.0.1:{port}/v1/traces"
    yield col
    await runner.cleanup()


async def traced_gateway(
    make_gateway: GatewayFactory, collector: Collector, *urls: str, **overrides: Any
) -> Gateway:
    tracing_cfg = {"enabled": True, "endpoint": collector.url, **overrides.pop("tracing", {})}
    return await make_gateway(*urls, tracing=tracing_cfg, **overrides)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def parent_of(traceparent: str) -> tuple[str, str, bool]:
    """(trace id, parent id, sampled) of a traceparent header."""
    version, trace_id, parent_id, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, parent_id, bool(int(flags, 16) & 1)


def ids(span: Span) -> tuple[str, str, bool]:
    """What a traceparent naming `span` as the parent holds (a recorded span: sampled)."""
    return span.trace_id.hex(), span.span_id.hex(), True


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


async def post(
    session: aiohttp.ClientSession, gw: Gateway, body: bytes, **headers: str
) -> aiohttp.ClientResponse:
    async with session.post(gw_url(gw, "/generate"), data=body, headers={**JSON, **headers}) as r:
        await r.read()
        return r


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access() -> Iterator[list[str]]:
    logger = logging.getLogger("gateway.access")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


# -- spans of a forwarded request ---------------------------------------------------------


async def test_forwarded_request_spans_continue_the_callers_trace(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    gw = await traced_gateway(make_gateway, collector, stub.url)
    secret = secrets.token_hex(16)
    body = orjson.dumps({"text": f"prompt-{secret}", "sampling_params": {"top_k": 2}})
    r = await post(
        session,
        gw,
        body,
        traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01",
        tracestate="vendor=opaque-1",
        Authorization=f"Bearer key-{secret}",
        Cookie=f"session={secret}",
    )
    assert r.status == 200
    await gw.tracer.flush()

    spans = collector.trace(TRACE_ID)
    assert sorted(s.name for s in spans) == ["POST /generate", "inspect", "upstream"]
    server, inspect, upstream = (one(spans, n) for n in ("POST /generate", "inspect", "upstream"))
    assert server.kind == SERVER and inspect.kind == INTERNAL and upstream.kind == CLIENT
    # The caller's span is the server span's parent; the server span parents the rest.
    assert server.parent_span_id.hex() == PARENT_ID
    assert inspect.parent_span_id == server.span_id
    assert upstream.parent_span_id == server.span_id
    assert server.start_time_unix_nano <= inspect.start_time_unix_nano
    assert inspect.end_time_unix_nano <= upstream.start_time_unix_nano
    assert upstream.end_time_unix_nano <= server.end_time_unix_nano

    attrs = _attrs(server.attributes)
    assert attrs["http.request.method"] == "POST"
    assert attrs["url.path"] == attrs["http.route"] == "/generate"
    assert attrs["http.response.status_code"] == 200
    assert attrs["gateway.request_id"] == r.headers["X-Request-Id"]
    assert attrs["gateway.outcome"] == "ok"
    assert attrs["gateway.backend"] == stub.url
    assert attrs["gateway.attempts"] == 1
    assert attrs["http.request.body.size"] == len(body)
    assert server.status.code == UNSET
    assert _attrs(inspect.attributes)["gateway.verdict"] == "forward"
    up = _attrs(upstream.attributes)
    assert up["server.address"] == "127.0.0.1"
    assert up["server.port"] == int(stub.url.rsplit(":", 1)[1])
    assert up["gateway.attempt"] == 1
    assert up["http.response.status_code"] == 200
    assert upstream.status.code == UNSET
    assert collector.resources[0]["service.name"] == "sglang-gateway"

    # The backend's parent is the upstream span, in the caller's trace; its tracestate and
    # the body went on as they came.
    got = last_proxied(stub)
    assert got.headers.getall("traceparent") == [f"00-{TRACE_ID}-{upstream.span_id.hex()}-01"]
    assert got.headers.getall("tracestate") == ["vendor=opaque-1"]
    assert got.body == body
    # Nothing of the body or of the other headers went to the collector.
    for raw in collector.bodies:
        assert secret.encode() not in raw


async def test_a_request_without_trace_context_starts_a_trace_the_log_names(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
    access: list[str],
) -> None:
    gw = await traced_gateway(make_gateway, collector, stub.url)
    # A tracestate without a traceparent belongs to no trace: it is not passed on.
    r = await post(session, gw, OK_BODY, tracestate="vendor=orphan")
    assert r.status == 200
    await gw.tracer.flush()

    server = one(collector.spans, "POST /generate")
    upstream = one(collector.spans, "upstream")
    assert server.parent_span_id == b""
    trace_id = server.trace_id.hex()
    assert upstream.trace_id.hex() == trace_id
    got = last_proxied(stub)
    assert len(got.headers.getall("traceparent")) == 1
    assert parent_of(got.headers["traceparent"]) == ids(upstream)
    assert "tracestate" not in got.headers
    line = next(orjson.loads(x) for x in access if r.headers["X-Request-Id"] in x)
    assert line["trace_id"] == trace_id


async def test_an_invalid_traceparent_is_replaced_by_a_new_trace(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    gw = await traced_gateway(make_gateway, collector, stub.url)
    bad = f"00-{'0' * 32}-{PARENT_ID}-01"  # an all-zero trace id is invalid
    r = await post(session, gw, OK_BODY, traceparent=bad, tracestate="vendor=stale")
    assert r.status == 200
    await gw.tracer.flush()

    server = one(collector.spans, "POST /generate")
    assert server.parent_span_id == b""
    got = last_proxied(stub)
    assert got.headers.getall("traceparent") != [bad]
    assert parent_of(got.headers["traceparent"])[0] == server.trace_id.hex()
    assert "tracestate" not in got.headers


# -- refusals and failures ---------------------------------------------------------------


async def test_a_refused_request_has_no_upstream_span(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    gw = await traced_gateway(make_gateway, collector, stub.url)
    r = await post(session, gw, TOP_P_MASK, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    assert r.status == 400
    other = "4bf92f3577b34da6a3ce929d0e0e4737"
    r = await post(session, gw, b'{"text": ', traceparent=f"00-{other}-{PARENT_ID}-01")
    assert r.status == 400
    await gw.tracer.flush()

    # A mask: the body asks for one (inspect), no backend's admission allows top_p alone.
    spans = collector.trace(TRACE_ID)
    assert sorted(s.name for s in spans) == ["POST /generate", "inspect"]
    server, inspect = one(spans, "POST /generate"), one(spans, "inspect")
    assert inspect.parent_span_id == server.span_id
    attrs = _attrs(server.attributes)
    assert attrs["gateway.outcome"] == "rejected:sampling_mask"
    assert attrs["gateway.reason"] == "unbounded_top_k"
    assert attrs["http.response.status_code"] == 400
    assert attrs["gateway.attempts"] == 0
    assert "gateway.backend" not in attrs
    assert server.status.code == UNSET  # a 4xx is the client's error, not the server's
    assert _attrs(inspect.attributes)["gateway.verdict"] == "mask"

    # A body the inspection itself refuses.
    spans = collector.trace(other)
    assert sorted(s.name for s in spans) == ["POST /generate", "inspect"]
    server, inspect = one(spans, "POST /generate"), one(spans, "inspect")
    assert _attrs(server.attributes)["gateway.outcome"] == "rejected:request_body"
    verdict = _attrs(inspect.attributes)
    assert verdict["gateway.verdict"] == "rejected"
    assert verdict["gateway.rejected_by"] == "request_body"
    assert verdict["gateway.reason"] == "invalid_json"
    assert verdict["http.response.status_code"] == 400
    assert proxied(stub) == []


async def test_a_dead_backend_shows_as_an_error(
    make_gateway: GatewayFactory, collector: Collector, session: aiohttp.ClientSession
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await traced_gateway(
        make_gateway, collector, dead, backends={"health": {"enabled": False}}
    )
    r = await post(session, gw, OK_BODY)
    assert r.status == 503
    await gw.tracer.flush()

    server, upstream = one(collector.spans, "POST /generate"), one(collector.spans, "upstream")
    assert upstream.parent_span_id == server.span_id
    assert upstream.status.code == ERROR
    up = _attrs(upstream.attributes)
    assert up["error.type"] == "connect_failed"
    assert up["gateway.attempt"] == 1
    assert [e.name for e in upstream.events] == ["connect_failed"]
    assert server.status.code == ERROR
    attrs = _attrs(server.attributes)
    assert attrs["gateway.outcome"] == attrs["error.type"] == "no_backend"
    assert attrs["http.response.status_code"] == 503


async def test_a_refused_connect_then_a_live_backend_are_two_attempts(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await traced_gateway(
        make_gateway,
        collector,
        dead,
        stub.url,
        backends={"balancer": "round_robin", "health": {"enabled": False}},
    )
    # Round robin sends one of the two to the dead backend first, whichever it starts at.
    for _ in range(2):
        assert (await post(session, gw, OK_BODY)).status == 200
    await gw.tracer.flush()

    retried = [
        s
        for s in collector.spans
        if s.name == "POST /generate"
        if _attrs(s.attributes)["gateway.attempts"] == 2
    ]
    assert len(retried) == 1
    tries = sorted(
        (
            s
            for s in collector.spans
            if s.name == "upstream" and s.parent_span_id == retried[0].span_id
        ),
        key=lambda s: _attrs(s.attributes)["gateway.attempt"],
    )
    assert [_attrs(s.attributes)["gateway.backend"] for s in tries] == [dead, stub.url]
    assert [s.status.code for s in tries] == [ERROR, UNSET]
    assert retried[0].status.code == UNSET
    # The backend that answered saw the span of the attempt that reached it.
    assert ids(tries[1]) in [parent_of(r.headers["traceparent"]) for r in proxied(stub)]


async def test_a_backend_dying_mid_body_fails_both_spans(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    gw = await traced_gateway(make_gateway, collector, stub.url)
    body = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 2}})
    with pytest.raises(aiohttp.ClientPayloadError):
        await post(session, gw, body, **{"X-Stub-Drop": "mid-body"})
    await gw.tracer.flush()

    server, upstream = one(collector.spans, "POST /generate"), one(collector.spans, "upstream")
    assert _attrs(upstream.attributes)["http.response.status_code"] == 200
    assert upstream.status.code == server.status.code == ERROR
    assert _attrs(upstream.attributes)["error.type"] == "upstream_broken"
    assert _attrs(server.attributes)["gateway.outcome"] == "upstream_broken"


async def test_a_control_call_has_an_upstream_span_per_backend(
    stubs: list[StubBackend],
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    gw = await traced_gateway(make_gateway, collector, *(b.url for b in stubs))
    async with session.post(
        gw_url(gw, "/flush_cache"), headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    ) as r:
        assert r.status == 200
    await gw.tracer.flush()

    spans = collector.trace(TRACE_ID)
    server = one(spans, "POST /flush_cache")
    upstreams = [s for s in spans if s.name == "upstream"]
    assert {_attrs(s.attributes)["gateway.backend"] for s in upstreams} == {b.url for b in stubs}
    assert all(s.parent_span_id == server.span_id for s in upstreams)
    # Each engine saw the span of its own call.
    for b in stubs:
        got = next(x for x in reversed(b.received) if x.path == "/flush_cache")
        assert parent_of(got.headers["traceparent"]) in [ids(s) for s in upstreams]


# -- sampling, flushing, and tracing off --------------------------------------------------


async def test_sampling_follows_the_parent(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    gw = await traced_gateway(make_gateway, collector, stub.url, tracing={"sample_ratio": 0})
    assert (await post(session, gw, OK_BODY)).status == 200  # a new trace: never sampled
    unsampled = last_proxied(stub).headers["traceparent"]
    assert not parent_of(unsampled)[2]
    sampled = f"00-{TRACE_ID}-{PARENT_ID}-01"
    assert (await post(session, gw, OK_BODY, traceparent=sampled)).status == 200
    await gw.tracer.flush()

    assert {s.trace_id.hex() for s in collector.spans} == {TRACE_ID}
    assert len(collector.spans) == 3
    assert parent_of(unsampled)[0] != TRACE_ID


async def test_spans_are_flushed_when_the_gateway_stops(
    monkeypatch: pytest.MonkeyPatch,
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    # The batch processor would wait a minute: only the stop can have sent them in time.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    gw = await traced_gateway(make_gateway, collector, stub.url)
    assert (await post(session, gw, OK_BODY)).status == 200
    assert collector.spans == []
    await gw.stop()
    assert sorted(s.name for s in collector.spans) == ["POST /generate", "inspect", "upstream"]


async def test_tracing_off_forwards_the_trace_context_untouched_and_exports_nothing(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    collector: Collector,
    session: aiohttp.ClientSession,
) -> None:
    gw = await make_gateway(stub.url, tracing={"enabled": False, "endpoint": collector.url})
    # The request path runs the undecorated code: nothing is checked per request.
    assert gw.tracer is tracing.NO_TRACING
    assert gw.proxy is not None
    assert gw.proxy.traced_inspect is None  # the module's own function is called
    assert gw.proxy.traced_inspect_large is None
    assert type(gw.upstream_stats) is Upstream
    sent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    r = await post(session, gw, OK_BODY, traceparent=sent, tracestate="vendor=opaque-1")
    assert r.status == 200
    got = last_proxied(stub)
    assert got.headers.getall("traceparent") == [sent]
    assert got.headers.getall("tracestate") == ["vendor=opaque-1"]
    await gw.stop()
    assert collector.bodies == []


# -- without the extra --------------------------------------------------------------------


def test_enabled_without_the_extra_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    data = {"backends": {"static": ["http://127.0.0.1:30000"]}, "tracing": {"enabled": True}}
    cfg = config_mod.build(data)  # installed here
    # None in sys.modules: what importing a package that is not installed amounts to.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.build(data)
    assert "tracing" in str(err.value)
    assert "pip install 'sglang-gateway[otel]'" in str(err.value)
    # A config validated where the extra was installed still refuses to start without it.
    with pytest.raises(tracing.UnavailableError, match=r"sglang-gateway\[otel\]"):
        tracing.build(cfg.tracing)


async def test_the_cli_names_the_extra(tmp_path: Any) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("backends: {static: ['http://127.0.0.1:30000']}\ntracing: {enabled: true}\n")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["opentelemetry.sdk.trace"] = None  # the extra, not installed
        from gateway.cli import main
        sys.exit(main(["--config", {str(cfg)!r}, "--check-config"]))
        """
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, cwd=ROOT, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "pip install 'sglang-gateway[otel]'" in err.decode()


async def test_a_gateway_without_tracing_never_loads_opentelemetry(stub: StubBackend) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        import aiohttp
        from gateway import config
        from gateway.app import Gateway

        async def main():
            cfg = config.build({{
                "listen": {{"host": "127.0.0.1", "port": 0}},
                "admin": {{"host": "127.0.0.1", "port": 0}},
                "backends": {{"static": [{stub.url!r}], "health": {{"enabled": False}}}},
            }})
            gw = Gateway(cfg)
            await gw.start()
            async with aiohttp.ClientSession() as s:
                async with s.post(
                    f"http://127.0.0.1:{{gw.port}}/generate",
                    data=b'{{"text": "x", "sampling_params": {{"top_k": 2}}}}',
                    headers={{"Content-Type": "application/json",
                              "traceparent": "00-{TRACE_ID}-{PARENT_ID}-01"}},
                ) as r:
                    assert r.status == 200, r.status
            await gw.stop()

        asyncio.run(main())
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        assert not loaded, loaded
        print("clean")
        """
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "clean"
