"""Metrics, access log and request ids, observed from outside: a real gateway in front of
real stubs on loopback, /metrics scraped over HTTP, the access logger's lines captured."""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import re
import time
from collections.abc import AsyncIterator, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from gateway import build
from gateway.app import Gateway
from gateway.config import TimeoutsConfig
from gateway.testing.stub import StubBackend
from tests.conftest import (
    GatewayFactory,
    abandon_generate,
    admin_url,
    cli_gateway,
    gw_url,
    proxied,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
JSON = {"Content-Type": "application/json"}
OK_BODY = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
MASK_BODY = orjson.dumps({"text": "x", "return_sampling_mask": True})

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# -- helpers ------------------------------------------------------------------------------


async def scrape(session: aiohttp.ClientSession, gw: Gateway) -> tuple[str, Samples]:
    async with session.get(admin_url(gw, "/metrics")) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return text, samples


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def value(gw: Gateway, name: str, **labels: str) -> float | None:
    """A sample straight from the gateway's registry (for polling without HTTP)."""
    assert gw.metrics is not None
    return gw.metrics.registry.get_sample_value(name, labels)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def access() -> Iterator[list[str]]:
    """The gateway.access logger's lines, captured on the logger itself (robust to any
    propagation setting an earlier test or the CLI left behind)."""
    logger = logging.getLogger("gateway.access")
    handler = _Lines()
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def records(lines: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in lines]


def record_for(lines: list[str], request_id: str) -> dict[str, Any]:
    found = [r for r in records(lines) if r["request_id"] == request_id]
    assert len(found) == 1, (request_id, lines)
    return found[0]


async def post(
    session: aiohttp.ClientSession, gw: Gateway, path: str, body: bytes, **headers: str
) -> tuple[int, CIMultiDict[str], bytes]:
    async with session.post(gw_url(gw, path), data=body, headers={**JSON, **headers}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


async def dead_url() -> str:
    dead = StubBackend()
    await dead.start()
    url = dead.url
    await dead.stop()  # nothing listens there any more
    return url


# -- rejections ---------------------------------------------------------------------------


async def test_rejection_counted_and_logged(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession, access: list[str]
) -> None:
    await wait_for(lambda: gateway.pool.backends[0].server_info is not None)  # 0.5.19
    started = time.perf_counter()
    status, headers, raw = await post(
        session, gateway, "/generate", MASK_BODY, **{"X-Request-Id": "rej-1"}
    )
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert status == 400
    assert headers["X-Request-Id"] == "rej-1"
    _, m = await scrape(session, gateway)
    rejections = "sglang_gateway_rejections_total"
    assert (
        sample(
            m, rejections, policy="sampling_mask", reason="unbounded_top_k", profile="finite_top_k"
        )
        == 1.0
    )
    assert (
        sample(
            m,
            "sglang_gateway_requests_total",
            route="/generate",
            method="POST",
            status_class="4xx",
            status_code="400",
        )
        == 1.0
    )
    assert (
        sample(m, "sglang_gateway_request_outcomes_total", outcome="rejected:sampling_mask") == 1.0
    )
    # Nothing went upstream, so nothing upstream was counted.
    assert not [
        k for k, v in m.items() if k[0] == "sglang_gateway_upstream_attempts_total" and v != 0.0
    ]
    assert stub.generation_requests() == []

    line = record_for(access, "rej-1")
    assert line["outcome"] == "rejected:sampling_mask"
    assert line["reason"] == "unbounded_top_k"
    assert line["status"] == 400
    assert line["method"] == "POST"
    assert line["route"] == "/generate"
    assert line["backend"] is None
    assert line["attempts"] == 0
    assert line["bytes_in"] == len(MASK_BODY)
    assert line["bytes_out"] == len(raw)
    assert line["ttfb_ms"] is None
    # Measured inside the client's round trip, so no longer than it.
    assert 0 < line["duration_ms"] <= elapsed_ms
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])


async def test_log_only_counts_what_enforce_would_refuse(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    access: list[str],
) -> None:
    gw = await make_gateway(stub.url, policy={"sampling_mask": {"mode": "log_only"}})
    await wait_for(lambda: gw.pool.backends[0].server_info is not None)
    await post(session, gw, "/generate", MASK_BODY, **{"X-Request-Id": "dry-1"})
    assert len(stub.generation_requests()) == 1  # forwarded
    _, m = await scrape(session, gw)
    assert (
        sample(
            m,
            "sglang_gateway_log_only_rejections_total",
            policy="sampling_mask",
            reason="unbounded_top_k",
            profile="finite_top_k",
        )
        == 1.0
    )
    # Nothing was refused: every refusal's series is there, at 0.
    assert {v for k, v in m.items() if k[0] == "sglang_gateway_rejections_total"} == {0.0}
    line = record_for(access, "dry-1")
    assert line["outcome"] == "ok"
    assert line["log_only"] == "sampling_mask"
    assert line["reason"] == "unbounded_top_k"
    assert line["backend"] == stub.url


# -- backends -----------------------------------------------------------------------------


async def test_killed_backend_shows_unhealthy(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    second = StubBackend()
    await second.start()
    try:
        gw = await make_gateway(stub.url, second.url)  # probes every 0.2 s, 3 failures
        await wait_for(lambda: value(gw, "sglang_gateway_backends", state="healthy") == 2.0)
        _, m = await scrape(session, gw)
        for url in (stub.url, second.url):
            assert sample(m, "sglang_gateway_backend_healthy", backend=url) == 1.0
            assert sample(m, "sglang_gateway_backend_state", backend=url, state="healthy") == 1.0
        await second.stop()
        # Three failed probes 0.2 s apart; the bound only ends a wait that never would.
        async with asyncio.timeout(30):
            while True:
                _, m = await scrape(session, gw)
                if sample(m, "sglang_gateway_backend_healthy", backend=second.url) == 0.0:
                    break
                await asyncio.sleep(0.05)
        assert sample(m, "sglang_gateway_backend_healthy", backend=stub.url) == 1.0
        assert (
            sample(m, "sglang_gateway_backend_state", backend=second.url, state="unhealthy") == 1.0
        )
        assert sample(m, "sglang_gateway_backend_state", backend=second.url, state="healthy") == 0.0
        assert sample(m, "sglang_gateway_backends", state="healthy") == 1.0
        assert sample(m, "sglang_gateway_backends", state="unhealthy") == 1.0
        assert sample(m, "sglang_gateway_backends", state="unknown") == 0.0
    finally:
        await second.stop()


async def test_connect_failure_counts_attempts_retries_errors(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    access: list[str],
) -> None:
    dead = await dead_url()
    gw = await make_gateway(
        dead, stub.url, backends={"balancer": "round_robin", "health": {"enabled": False}}
    )
    status, _, _ = await post(session, gw, "/generate", OK_BODY, **{"X-Request-Id": "retry-1"})
    assert status == 200
    _, m = await scrape(session, gw)
    assert sample(m, "sglang_gateway_upstream_attempts_total", backend=dead) == 1.0
    assert sample(m, "sglang_gateway_upstream_attempts_total", backend=stub.url) == 1.0
    retries = "sglang_gateway_upstream_retries_total"
    assert sample(m, retries, backend=dead, cause="connect_failed") == 1.0
    assert sample(m, retries, backend=stub.url, cause="connect_failed") is None
    errors = "sglang_gateway_upstream_errors_total"
    assert sample(m, errors, backend=dead, cause="connect_failed") == 1.0
    assert sample(m, "sglang_gateway_backend_ejected", backend=dead) == 1.0
    assert sample(m, "sglang_gateway_backend_ejected", backend=stub.url) == 0.0
    assert sample(m, "sglang_gateway_backend_ejections_total", backend=dead) == 1.0
    assert sample(m, "sglang_gateway_backend_ejections_total", backend=stub.url) == 0.0
    responses = "sglang_gateway_upstream_responses_total"
    assert sample(m, responses, backend=stub.url, status_class="2xx") == 1.0
    assert sample(m, responses, backend=dead, status_class="2xx") == 0.0
    line = record_for(access, "retry-1")
    assert (line["outcome"], line["attempts"], line["backend"]) == ("ok", 2, stub.url)


async def test_upstream_error_counted_by_backend_and_cause(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession, access: list[str]
) -> None:
    status, _, _ = await post(
        session,
        gateway,
        "/generate",
        OK_BODY,
        **{"X-Stub-Drop": "before-headers", "X-Request-Id": "drop-1"},
    )
    assert status == 502
    _, m = await scrape(session, gateway)
    errors = "sglang_gateway_upstream_errors_total"
    assert sample(m, errors, backend=stub.url, cause="upstream_error") == 1.0
    assert sample(m, "sglang_gateway_upstream_attempts_total", backend=stub.url) == 1.0
    assert not [k for k in m if k[0] == "sglang_gateway_upstream_retries_total"]
    line = record_for(access, "drop-1")
    assert (line["status"], line["outcome"], line["backend"]) == (502, "upstream_error", stub.url)


# -- clients ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_counted(
    stub: StubBackend, gateway: Gateway, access: list[str], stream: bool
) -> None:
    await abandon_generate(gateway, stream=stream, headers={"X-Request-Id": "gone-1"})
    phase = "streaming" if stream else "waiting"
    name = "sglang_gateway_client_disconnects_total"
    await wait_for(lambda: value(gateway, name, phase=phase) == 1.0)
    other = "waiting" if stream else "streaming"
    assert value(gateway, name, phase=other) == 0.0  # exported at 0 from the start
    assert value(gateway, "sglang_gateway_request_outcomes_total", outcome="client_disconnect") == 1
    line = record_for(access, "gone-1")
    assert line["outcome"] == "client_disconnect"
    assert line["status"] == (200 if stream else 499)
    assert line["backend"] == stub.url
    if stream:
        assert line["bytes_out"] > 0
        assert line["ttfb_ms"] is not None


async def test_inflight_gauges_follow_a_slow_request(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    slow = asyncio.create_task(
        post(session, gateway, "/generate", OK_BODY, **{"X-Stub-Delay-Ms": "500"})
    )
    await wait_for(lambda: value(gateway, "sglang_gateway_inflight_requests") == 1.0)
    _, m = await scrape(session, gateway)
    assert sample(m, "sglang_gateway_inflight_requests") == 1.0
    assert sample(m, "sglang_gateway_backend_inflight_requests", backend=stub.url) == 1.0
    status, _, _ = await slow
    assert status == 200
    _, m = await scrape(session, gateway)
    assert sample(m, "sglang_gateway_inflight_requests") == 0.0
    assert sample(m, "sglang_gateway_backend_inflight_requests", backend=stub.url) == 0.0


# -- histograms ---------------------------------------------------------------------------


async def test_latency_and_size_histograms(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession, access: list[str]
) -> None:
    body = orjson.dumps({"text": "y" * 900, "sampling_params": {"top_k": 2}})
    assert 512 < len(body) <= 1024
    status, _, slow_raw = await post(
        session, gateway, "/generate", body, **{"X-Stub-Delay-Ms": "300", "X-Request-Id": "h-1"}
    )
    assert status == 200
    hdrs = {"X-Stub-Response-Bytes": str(3 << 20), "X-Request-Id": "h-2"}
    status, _, big_raw = await post(session, gateway, "/generate", OK_BODY, **hdrs)
    assert status == 200
    assert 2 << 20 < len(big_raw) <= 4 << 20
    status, _, rejected_raw = await post(session, gateway, "/generate", MASK_BODY)
    assert status == 400
    _, m = await scrape(session, gateway)
    r = {"route": "/generate"}

    ttfb = "sglang_gateway_upstream_ttfb_seconds"
    assert sample(m, ttfb + "_count", **r) == 2.0  # the rejected request had no upstream
    assert sample(m, ttfb + "_bucket", le="0.25", **r) == 1.0  # the fast one only
    assert sample(m, ttfb + "_bucket", le="+Inf", **r) == 2.0
    ttfb_sum = sample(m, ttfb + "_sum", **r)
    assert ttfb_sum is not None and ttfb_sum >= 0.3

    duration = "sglang_gateway_request_duration_seconds"
    assert sample(m, duration + "_count", **r) == 3.0
    duration_sum = sample(m, duration + "_sum", **r)
    assert duration_sum is not None and duration_sum >= ttfb_sum

    bytes_in = "sglang_gateway_request_body_bytes"
    assert sample(m, bytes_in + "_count", **r) == 3.0
    assert sample(m, bytes_in + "_sum", **r) == len(body) + len(OK_BODY) + len(MASK_BODY)
    assert sample(m, bytes_in + "_bucket", le="256.0", **r) == 2.0  # the two small bodies
    assert sample(m, bytes_in + "_bucket", le="1024.0", **r) == 3.0

    bytes_out = "sglang_gateway_response_body_bytes"
    assert sample(m, bytes_out + "_sum", **r) == len(slow_raw) + len(big_raw) + len(rejected_raw)
    assert sample(m, bytes_out + "_bucket", le="1.048576e+06", **r) == 2.0
    assert sample(m, bytes_out + "_bucket", le="4.194304e+06", **r) == 3.0

    line = record_for(access, "h-1")
    assert line["ttfb_ms"] >= 300
    assert line["duration_ms"] >= line["ttfb_ms"]
    assert line["bytes_in"] == len(body)
    assert line["bytes_out"] == len(slow_raw)
    assert record_for(access, "h-2")["bytes_out"] == len(big_raw)


# -- exposition ---------------------------------------------------------------------------


async def test_exposition_has_one_prefix_no_created_and_bounded_methods(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    await post(session, gateway, "/generate", OK_BODY)
    async with session.request("PROPFIND", gw_url(gateway, "/generate")) as resp:
        assert resp.status == 405
    async with session.request("PROPFIND", gw_url(gateway, "/nowhere/at/all")) as resp:
        assert resp.status == 404
    text, m = await scrape(session, gateway)
    assert "_created" not in text
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    # The gateway's own families, and the standard process and Python ones beside them.
    ours = {n for n in names if n.startswith("sglang_gateway_")}
    assert ours and all(n.startswith(("process_", "python_")) for n in names - ours)
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"} <= names
    assert {
        "sglang_gateway_requests_total",
        "sglang_gateway_request_outcomes_total",
        "sglang_gateway_rejections_total",
        "sglang_gateway_log_only_rejections_total",
        "sglang_gateway_upstream_attempts_total",
        "sglang_gateway_upstream_retries_total",
        "sglang_gateway_upstream_errors_total",
        "sglang_gateway_client_disconnects_total",
        "sglang_gateway_upstream_ttfb_seconds",
        "sglang_gateway_request_duration_seconds",
        "sglang_gateway_request_body_bytes",
        "sglang_gateway_response_body_bytes",
        "sglang_gateway_inflight_requests",
        "sglang_gateway_backends",
        "sglang_gateway_backend_healthy",
        "sglang_gateway_backend_state",
        "sglang_gateway_backend_ejected",
        "sglang_gateway_backend_inflight_requests",
    } <= names
    requests = "sglang_gateway_requests_total"
    other = sample(
        m, requests, route="/generate", method="other", status_class="4xx", status_code="405"
    )
    assert other == 1.0
    unmatched = sample(
        m, requests, route="unmatched", method="other", status_class="4xx", status_code="404"
    )
    assert unmatched == 1.0
    assert not [k for k in m if ("method", "PROPFIND") in k[1]]


# -- access log ---------------------------------------------------------------------------


_TEXT_LINE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<rid>\S+) (?P<client>\S+) "
    r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/(?P<http>[\d.]+)" '
    r"(?P<status>\d{3}) (?P<outcome>\S+) route=(?P<route>\S+) reason=(?P<reason>\S+) "
    r"backend=(?P<backend>\S+) "
    r"attempts=(?P<attempts>\d+) in=(?P<bytes_in>\d+) out=(?P<bytes_out>\d+) "
    r"streamed=(?P<streamed>yes|no) ttfb_ms=(?P<ttfb>[\d.]+|-) ms=(?P<ms>[\d.]+)"
    r'(?: trace=[0-9a-f]{32})? ua="(?P<ua>[^"]*)"'
)


async def test_text_access_log_format(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    access: list[str],
) -> None:
    gw = await make_gateway(stub.url, logging={"format": "text"})
    _, _, ok_raw = await post(session, gw, "/generate", OK_BODY, **{"X-Request-Id": "t-ok"})
    await post(session, gw, "/generate", MASK_BODY, **{"X-Request-Id": "t-rej"})
    assert len(access) == 2
    ok, rej = (_TEXT_LINE.fullmatch(line) for line in access)
    assert ok is not None, access[0]
    assert rej is not None, access[1]
    assert ok.group("rid", "method", "route", "status", "outcome", "reason", "backend") == (
        "t-ok",
        "POST",
        "/generate",
        "200",
        "ok",
        "-",
        stub.url,
    )
    assert ok.group("attempts", "bytes_in", "bytes_out") == (
        "1",
        str(len(OK_BODY)),
        str(len(ok_raw)),
    )
    assert ok.group("ttfb") != "-"
    assert rej.group("rid", "status", "outcome", "reason", "backend", "attempts", "ttfb") == (
        "t-rej",
        "400",
        "rejected:sampling_mask",
        "unbounded_top_k",
        "-",
        "0",
        "-",
    )


async def test_access_log_off(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    access: list[str],
) -> None:
    gw = await make_gateway(stub.url, logging={"access_log": False})
    await post(session, gw, "/generate", OK_BODY)
    assert access == []
    assert value(gw, "sglang_gateway_request_outcomes_total", outcome="ok") == 1.0


# -- request ids --------------------------------------------------------------------------


async def _slow_body() -> AsyncIterator[bytes]:
    yield b'{"text": '
    await asyncio.sleep(2)
    yield b'"x"}'


# The time-to-first-byte timeout is timeouts.read_s here and timeouts.ttfb_s after the fleet
# change on main; pick whichever the config model has, so this test survives the merge.
_TTFB_KEY = "ttfb_s" if "ttfb_s" in TimeoutsConfig.model_fields else "read_s"

# (name, method, path, body, extra headers, gateway overrides, expected status, outcome)
_REPLY_KINDS: list[tuple[str, str, str, Any, dict[str, str], str, int, str]] = [
    ("forwarded", "POST", "/generate", OK_BODY, {}, "", 200, "ok"),
    ("passthrough", "GET", "/model_info", None, {}, "", 200, "ok"),
    ("mask", "POST", "/generate", MASK_BODY, {}, "", 400, "rejected:sampling_mask"),
    ("bad_json", "POST", "/v1/chat/completions", b"{", {}, "", 400, "rejected:request_body"),
    ("not_found", "GET", "/nope", None, {}, "", 404, "not_found"),
    ("method", "GET", "/generate", None, {}, "", 405, "method_not_allowed"),
    ("too_large", "POST", "/generate", b" " * 5000, {}, "", 413, "rejected:request_body"),
    (
        "media_type",
        "POST",
        "/generate",
        OK_BODY,
        {"Content-Type": "text/plain"},
        "",
        415,
        "rejected:request_body",
    ),
    ("body_timeout", "POST", "/generate", "slow", {}, "", 408, "rejected:request_body"),
    (
        "dropped",
        "POST",
        "/generate",
        OK_BODY,
        {"X-Stub-Drop": "before-headers"},
        "",
        502,
        "upstream_error",
    ),
    ("no_backend", "POST", "/generate", OK_BODY, {}, "dead", 503, "no_backend"),
    (
        "slow_backend",
        "POST",
        "/generate",
        OK_BODY,
        {"X-Stub-Delay-Ms": "3000"},
        "",
        504,
        "upstream_timeout",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "extra", "backend", "status", "outcome"),
    [k[1:] for k in _REPLY_KINDS],
    ids=[k[0] for k in _REPLY_KINDS],
)
@pytest.mark.parametrize("client_id", [True, False], ids=["client-id", "no-id"])
async def test_request_id_on_every_reply(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    access: list[str],
    method: str,
    path: str,
    body: Any,
    extra: dict[str, str],
    backend: str,
    status: int,
    outcome: str,
    client_id: bool,
) -> None:
    url = await dead_url() if backend == "dead" else stub.url
    gw = await make_gateway(
        url,
        limits={"max_body_bytes": 4096},
        timeouts={_TTFB_KEY: 0.5, "body_read_s": 0.5},
    )
    headers = {**JSON, **extra}
    if client_id:
        headers["X-Request-Id"] = "client:id/1+=_.-"
    data = _slow_body() if body == "slow" else body
    async with session.request(method, gw_url(gw, path), data=data, headers=headers) as r:
        assert r.status == status
        rid = r.headers["X-Request-Id"]
        await r.read()
    if client_id:
        assert rid == "client:id/1+=_.-"
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
    # Passed upstream whenever the request went there.
    upstream = [x for x in proxied(stub) if x.path == path]
    if status in (200, 502, 504):
        assert [x.headers["X-Request-Id"] for x in upstream] == [rid]
    else:
        assert upstream == []
    # Present in the log line, with the status the client got.
    await wait_for(lambda: any(rid in line for line in access))
    line = record_for(access, rid)
    assert (line["status"], line["outcome"]) == (status, outcome)


async def test_request_ids_are_unique_per_request(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    ids = set()
    for _ in range(20):
        async with session.get(gw_url(gateway, "/health")) as r:
            ids.add(r.headers["X-Request-Id"])
    assert len(ids) == 20


# -- nothing secret is logged ------------------------------------------------------------

SECRET_PROMPT = "sk-live-PROMPT-7f3a9c1e2b4d6f80 my password is hunter2-Zq9"
SECRET_TOKEN = "Bearer sk-proj-TOKEN-0a1b2c3d4e5f6a7b8c9d"
SECRET_QUERY = "api_key=QUERYSECRET-5566"


def _secret_requests() -> list[tuple[str, str, bytes, dict[str, str]]]:
    prompt = {"text": SECRET_PROMPT}
    chat = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    auth = {"Authorization": SECRET_TOKEN, "Cookie": f"session={SECRET_PROMPT}"}
    return [
        (
            "POST",
            "/generate",
            orjson.dumps({**prompt, "sampling_params": {"top_k": 2}}),
            {**auth, "X-Request-Id": "s-ok"},
        ),
        (
            "POST",
            "/generate",
            orjson.dumps({**prompt, "return_sampling_mask": True}),
            {**auth, "X-Request-Id": "s-rej"},
        ),
        (
            "POST",
            f"/v1/chat/completions?{SECRET_QUERY}",
            orjson.dumps(chat),
            {**auth, "X-Request-Id": "s-chat"},
        ),
        (
            "POST",
            "/v1/chat/completions",
            b'{"messages": "' + SECRET_PROMPT.encode() + b'",',
            {**auth, "X-Request-Id": "s-badjson"},
        ),
        (
            "POST",
            "/generate",
            orjson.dumps({**prompt, "sampling_params": {"top_k": "many"}}),
            {**auth, "X-Request-Id": "s-badfield"},
        ),
        (
            "POST",
            "/generate",
            orjson.dumps({**prompt, "sampling_params": {"top_k": 2}}),
            {**auth, "X-Stub-Drop": "before-headers", "X-Request-Id": "s-502"},
        ),
        ("GET", f"/{SECRET_QUERY}", b"", {**auth, "X-Request-Id": "s-404"}),
        (
            "POST",
            "/generate",
            orjson.dumps({**prompt, "sampling_params": {"top_k": 2}}),
            {**auth, "X-Request-Id": SECRET_PROMPT},  # not a plain id: replaced, not logged
        ),
    ]


def _assert_no_secrets(text: str) -> None:
    for secret in (SECRET_PROMPT, "hunter2", "sk-live", SECRET_TOKEN, "sk-proj", "QUERYSECRET"):
        assert secret not in text, secret


@pytest.mark.parametrize("fmt", ["json", "text"])
@pytest.mark.parametrize("mode", ["enforce", "log_only"])
async def test_no_prompt_or_credentials_in_logs(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    access: list[str],
    caplog: pytest.LogCaptureFixture,
    fmt: str,
    mode: str,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level
    gw = await make_gateway(
        stub.url, logging={"format": fmt}, policy={"sampling_mask": {"mode": mode}}
    )
    for method, path, body, headers in _secret_requests():
        async with session.request(
            method, gw_url(gw, path), data=body, headers={**JSON, **headers}
        ) as r:
            await r.read()
    # The secrets did reach the backend: the gateway forwards them, it just never logs them.
    assert any(SECRET_PROMPT.encode() in x.body for x in stub.received)
    assert any(x.headers.get("Authorization") == SECRET_TOKEN for x in stub.received)

    everything = "\n".join([*access, caplog.text])
    _assert_no_secrets(everything)
    # The capture worked: every request has its line.
    assert len(access) == len(_secret_requests())
    for rid in ("s-ok", "s-rej", "s-chat", "s-badjson", "s-badfield", "s-502", "s-404"):
        assert rid in everything


async def test_cli_process_output_has_no_secrets(stub: StubBackend, tmp_path: Path) -> None:
    """The real entry point with its real log set-up, at debug level: stdout and stderr."""
    async with (
        cli_gateway(tmp_path, "--backend", stub.url, "--log-level", "debug") as (
            port,
            out_path,
            err_path,
        ),
        aiohttp.ClientSession() as s,
    ):
        for method, path, body, headers in _secret_requests():
            url = f"http://127.0.0.1:{port}{path}"
            async with s.request(method, url, data=body, headers={**JSON, **headers}) as r:
                await r.read()
    stdout, stderr = out_path.read_text(), err_path.read_text()
    _assert_no_secrets(stdout + stderr)
    lines = stdout.splitlines()
    assert len(lines) == len(_secret_requests())  # stdout is the access log, one JSON line each
    assert {orjson.loads(line)["request_id"] for line in lines} >= {"s-ok", "s-rej", "s-404"}


async def test_cli_access_log_does_not_depend_on_log_level(
    stub: StubBackend, tmp_path: Path
) -> None:
    """logging.level: warning quiets the gateway's own messages, not the access log, which
    logging.access_log alone switches (config/rl-filter.yaml runs this way)."""
    async with (
        cli_gateway(tmp_path, "--backend", stub.url, "--log-level", "warning") as (
            port,
            out_path,
            _,
        ),
        aiohttp.ClientSession() as s,
    ):
        for rid in ("lvl-1", "lvl-2"):
            hdrs = {**JSON, "X-Request-Id": rid}
            async with s.post(f"http://127.0.0.1:{port}/generate", data=OK_BODY, headers=hdrs) as r:
                assert r.status == 200
    lines = out_path.read_text().splitlines()
    assert [orjson.loads(line)["request_id"] for line in lines] == ["lvl-1", "lvl-2"]


async def test_build_info_names_what_runs(gateway: Gateway, session: aiohttp.ClientSession) -> None:
    _, m = await scrape(session, gateway)
    (labels,) = [dict(k[1]) for k in m if k[0] == "sglang_gateway_build_info"]
    assert labels["version"] == metadata.version("sglang-gateway")
    assert labels["aiohttp"] == metadata.version("aiohttp")
    assert labels["python"] == platform.python_version()
    assert labels["revision"] == os.environ.get("SGLANG_GATEWAY_REVISION", "unknown")
    assert labels["build"] == build.BUILD
    assert build.BUILD in ("compiled", "pure")


async def test_the_admin_listener_announces_the_gateway(
    gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    for path in ("/livez", "/readyz", "/metrics", "/nope"):
        async with session.get(admin_url(gateway, path)) as r:
            assert r.headers["Server"] == "sglang-gateway", path


async def test_known_series_exist_at_zero_from_the_start(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    """Before any request: `increase()` and absence alerts need a 0, not a missing series."""
    _, m = await scrape(session, gateway)
    outcomes = {
        dict(labels)["outcome"]: v
        for (name, labels), v in m.items()
        if name == "sglang_gateway_request_outcomes_total"
    }
    assert outcomes["ok"] == 0.0
    assert outcomes["upstream_error"] == 0.0
    assert outcomes["rejected:sampling_mask"] == 0.0
    assert outcomes["rejected:auth"] == 0.0
    assert set(outcomes.values()) == {0.0}
    for phase in ("waiting", "streaming"):
        assert sample(m, "sglang_gateway_client_disconnects_total", phase=phase) == 0.0
    for cause in ("connect_failed", "upstream_error", "upstream_timeout", "upstream_broken"):
        errors = sample(m, "sglang_gateway_upstream_errors_total", backend=stub.url, cause=cause)
        assert errors == 0.0, cause
    assert sample(m, "sglang_gateway_upstream_attempts_total", backend=stub.url) == 0.0
    for result in ("ok", "failed", "forbidden"):
        control = sample(
            m, "sglang_gateway_control_requests_total", route="/flush_cache", result=result
        )
        assert control == 0.0, result
    await post(session, gateway, "/generate", OK_BODY)
    _, m = await scrape(session, gateway)
    assert sample(m, "sglang_gateway_request_outcomes_total", outcome="ok") == 1.0
    assert sample(m, "sglang_gateway_upstream_attempts_total", backend=stub.url) == 1.0


# Every refusal the gateway makes that holds for any backend (profile ""), by policy and
# reason, read off the code that makes them; the mask refusals that depend on a backend's
# admission come per profile.
REFUSALS = {
    ("auth", "missing_key"),
    ("auth", "malformed_key"),
    ("auth", "invalid_key"),
    ("control", "forbidden"),
    ("control", "client_abort_off"),
    ("control", "not_addressable"),
    ("registry", "invalid"),
    ("registry", "not_found"),
    ("lora", "adapter_not_loaded"),
    ("routing", "disaggregated_only"),
    ("routing", "pd_unsupported"),
    ("parallel_sampling", "n_too_large"),
    *(
        ("request_body", r)
        for r in (
            "invalid_json",
            "not_an_object",
            "invalid_field",
            "media_type",
            "charset",
            "content_encoding",
            "too_large",
            "body_timeout",
            "too_costly",
            "inspection_busy",
        )
    ),
    *(
        ("sampling_mask", r)
        for r in ("invalid_top_k", "parallel_mask_list", "missing_meta_info", "stream_meta_info")
    ),
}


def rejection_series(m: Samples, name: str) -> dict[tuple[str, str, str], float]:
    return {
        (d["policy"], d["reason"], d["profile"]): v
        for (n, labels), v in m.items()
        if n == name and (d := dict(labels))
    }


async def test_every_refusal_is_exported_at_zero_before_the_first(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    """rejections_total had no series before a refusal, so increase() and absence alerts
    missed the first one. Every known policy and reason is there at 0, and each backend
    profile's mask reasons as the profile becomes known."""
    stubs = [
        StubBackend(version="0.5.18"),
        StubBackend(version="0.5.21", speculative_algorithm="EAGLE"),
    ]
    for stub in stubs:
        await stub.start()
    try:
        gw = await make_gateway(*(s.url for s in stubs))
        profiles = {"top_p_or_top_k", "capped:4096+speculative"}
        await wait_for(lambda: {b.profile.name for b in gw.pool.backends} == profiles)
        _, m = await scrape(session, gw)
        rejections = rejection_series(m, "sglang_gateway_rejections_total")
        assert set(rejections.values()) == {0.0}
        assert {(p, r) for p, r, profile in rejections if profile == ""} == REFUSALS
        by_profile = {(p, r, profile) for p, r, profile in rejections if profile in profiles}
        assert by_profile == {
            ("sampling_mask", "unbounded_top_k_and_top_p", "top_p_or_top_k"),
            ("sampling_mask", "unbounded_top_k", "capped:4096+speculative"),
            ("sampling_mask", "top_k_above_cap", "capped:4096+speculative"),
            ("sampling_mask", "speculative_decoding", "capped:4096+speculative"),
        }
        log_only = rejection_series(m, "sglang_gateway_log_only_rejections_total")
        assert set(log_only.values()) == {0.0}
        assert {k for k in log_only if k[2]} == by_profile
        outcomes = {
            dict(labels)["outcome"]
            for (n, labels), v in m.items()
            if n == "sglang_gateway_request_outcomes_total"
        }
        assert {f"rejected:{p}" for p, _ in REFUSALS} <= outcomes
        # The first refusal (by the backend closest to admitting it): a series that was at
        # 0 reads 1.
        await post(session, gw, "/generate", MASK_BODY)
        _, m = await scrape(session, gw)
        after = rejection_series(m, "sglang_gateway_rejections_total")
        assert {k: v for k, v in after.items() if v} == {
            ("sampling_mask", "unbounded_top_k_and_top_p", "top_p_or_top_k"): 1.0
        }
        assert set(after) == set(rejections)
    finally:
        for stub in stubs:
            await stub.stop()


def test_the_exported_refusals_are_every_refusal_the_code_makes() -> None:
    """The table the metrics export at 0 against the source: every Rejection(status, rule,
    reason, ...) with literal names, and the auth and registry reasons."""
    import ast

    from gateway.contract import policy
    from gateway.ops.metrics import REJECTION_REASONS

    # The sources of the gateway under test: the checkout's, or those the compiled wheel
    # installed beside its modules (the compiled run has no gateway/ in its tree).
    sources = Path(build.__file__).parent
    made: set[tuple[str, str]] = set()
    for path in sources.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Rejection"
                and len(node.args) >= 3
                and isinstance(node.args[2], ast.Constant)
            ):
                rule = node.args[1]
                name = rule.value if isinstance(rule, ast.Constant) else getattr(policy, rule.id)
                made.add((name, node.args[2].value))
    auth = ast.parse((sources / "edge" / "auth.py").read_text())
    for node in ast.walk(auth):
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            for ret in ast.walk(node):
                value = ret.value if isinstance(ret, ast.Return) else None
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    made.add(("auth", value.value))
    made |= {("registry", "invalid"), ("registry", "not_found")}  # gateway/edge/proxy.py
    assert made - set(REJECTION_REASONS) == set()
    assert set(REJECTION_REASONS) == REFUSALS


async def test_openmetrics_when_the_scraper_asks(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    await post(session, gateway, "/generate", OK_BODY)
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    async with session.get(admin_url(gateway, "/metrics"), headers={"Accept": accept}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = await r.text()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in om_parse(text)}  # the strict OpenMetrics parser
    (ok,) = [
        s
        for s in families["sglang_gateway_requests"].samples
        if s.name == "sglang_gateway_requests_total" and s.labels["status_code"] == "200"
    ]
    assert ok.value == 1.0
    # Without that Accept header: the Prometheus text format, as before.
    plain, _ = await scrape(session, gateway)
    assert "# EOF" not in plain


async def test_a_backends_own_5xx_is_counted_apart_from_the_gateways(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    """The backend's 503 is relayed (outcome ok) and counted by backend; a 503 the gateway
    makes itself (no backend) is not a backend response."""
    status, _, _ = await post(session, gateway, "/generate", OK_BODY, **{"X-Stub-Status": "503"})
    assert status == 503
    _, m = await scrape(session, gateway)
    responses = "sglang_gateway_upstream_responses_total"
    assert sample(m, responses, backend=stub.url, status_class="5xx") == 1.0
    assert sample(m, responses, backend=stub.url, status_class="2xx") == 0.0
    assert sample(m, "sglang_gateway_request_outcomes_total", outcome="ok") == 1.0


async def test_an_invented_status_code_is_other_and_a_departed_backend_leaves_no_zeros(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    from gateway import config as config_mod

    dead = await dead_url()
    gw = await make_gateway(stub.url, dead, backends={"health": {"enabled": False}})
    # Served by the stub either way: a refused connect to the dead one is retried.
    status, _, _ = await post(session, gw, "/generate", OK_BODY, **{"X-Stub-Status": "599"})
    assert status == 599
    _, m = await scrape(session, gw)
    codes = {
        dict(labels)["status_code"]
        for (name, labels), v in m.items()
        if name == "sglang_gateway_requests_total" and v
    }
    assert codes == {"other"}
    assert (
        sample(m, "sglang_gateway_upstream_errors_total", backend=dead, cause="upstream_broken")
        == 0.0
    )
    data = config_mod.to_data(gw.cfg)
    data["backends"]["static"] = [stub.url]
    assert await gw.reload(config_mod.build(data))
    _, m = await scrape(session, gw)
    left = [labels for (name, labels), v in m.items() if ("backend", dead) in labels and not v]
    assert left == [], left
