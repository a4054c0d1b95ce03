"""Addressed calls (`/workers/{id}/<path>`) reach only the per-engine control paths.

An addressed call goes to one engine uninspected, with the operator's trust: were any path
allowed after the id, `/workers/<id>/generate` would carry an unbounded mask past the
inspection that `/generate` itself applies. Every spelling is sent here as raw bytes (HTTP
libraries normalise `./`, `//` and `%67` before sending), through a real gateway, to three
recording stubs, and none of them may ever see it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from gateway.app import Gateway
from gateway.contract.routes import ADDRESSABLE_ROUTES, CONTROL_ROUTES, PER_ENGINE_ROUTES
from gateway.edge.control import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, cli_gateway, proxied
from tests.hardening.rawnet import RawResponse, parse_responses, raw_exchange

# Refused on /generate with 400: a mask over the whole vocabulary.
UNBOUNDED = orjson.dumps(
    {"text": "hi", "return_sampling_mask": True, "sampling_params": {"top_k": 2**30 + 1}}
)

# What follows /workers/<id> in the request target.
BYPASSES = [
    "/generate",
    "/%67enerate",
    "/%67%65%6e%65%72%61%74%65",
    "//generate",
    "/generate/",
    "/generate//",
    "/./generate",
    "/x/../generate",
    "/init_weights_update_group/../generate",
    "/%2e/generate",
    "/%2fgenerate",
    "/%2Fgenerate",
    "/generate?x=1",
    "/generate/?x=1",
    "/generate;x",
    "/generate%3Fx=1",
    "/%2567enerate",
    "/GENERATE",
    "/v1/chat/completions",
    "/v1/chat/completions?x=1",
    "/v1%2Fchat%2Fcompletions",
    "/v1//chat/completions",
    "/invocations",
    "/v1/completions",
    "/v1/responses",
    "/vertex_generate",
    "/health_generate",
    "/server_info",
    "/docs",
    "/%20generate",
    "/generate%00",
]


def request(method: str, target: str, body: bytes = b"", headers: str = "") -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"{headers}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


async def send(gw: Gateway, method: str, target: str, body: bytes = b"") -> RawResponse:
    (response,) = parse_responses(await raw_exchange(gw.port, request(method, target, body)))
    return response


async def _metrics(gw: Gateway) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.admin_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    return raw.decode()


@pytest.mark.parametrize("rest", BYPASSES)
async def test_no_spelling_of_a_generation_route_reaches_an_engine_through_an_address(
    stubs: list[StubBackend], make_gateway: GatewayFactory, rest: str
) -> None:
    gw = await make_gateway(*(s.url for s in stubs))
    target = stubs[1]
    for worker in (worker_id(target.url), "nope"):
        for method in ("POST", "PUT", "GET"):
            reply = await send(gw, method, f"/workers/{worker}{rest}", UNBOUNDED)
            assert reply.status == 404, (method, rest, reply.raw[:300])
            detail = orjson.loads(reply.body)["detail"]
            assert (
                "/init_weights_update_group" in detail
                and "/generate" not in detail.split("Allowed")[-1]
            )
    # Nothing the gateway forwarded for a client, on any engine.
    assert all(proxied(s) == [] for s in stubs)
    text = await _metrics(gw)
    assert 'control_requests_total{result="refused",route="/workers/{id}/*"} 6.0' in text
    assert 'rejections_total{policy="control",profile="",reason="not_addressable"} 6.0' in text


async def test_the_per_engine_paths_still_reach_the_one_engine_named(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs))
    target = stubs[2]
    wid = worker_id(target.url)
    served = [
        ("POST", "/init_weights_update_group", "/init_weights_update_group"),
        ("POST", "/%69nit_weights_update_group", "/init_weights_update_group"),
        ("POST", "/init_weights_update_group/", "/init_weights_update_group"),
        ("POST", "/update_weights_from_distributed?x=1", "/update_weights_from_distributed"),
        ("POST", "/destroy_weights_update_group", "/destroy_weights_update_group"),
        ("POST", "/weights_checker", "/weights_checker"),
        ("POST", "/start_profile", "/start_profile"),
        ("POST", "/flush_cache", "/flush_cache"),
        ("GET", "/flush_cache", "/flush_cache"),
        ("GET", "/v1/loads", "/v1/loads"),
    ]
    body = b'{"master_address": "10.0.0.1", "rank_offset": 8}'
    for method, rest, path in served:
        reply = await send(gw, method, f"/workers/{wid}{rest}", body)
        assert reply.status == 200, (rest, reply.raw[:300])
        sent = proxied(target)[-1]
        # The canonical path (the one the list names), the query as it came.
        assert (sent.method, sent.path) == (method, path)
        assert sent.raw_path == path + (rest.partition("?")[1] + rest.partition("?")[2])
        assert sent.body == body
    assert proxied(stubs[0]) == [] and proxied(stubs[1]) == []
    # A listed path with a method it does not take: 405, not forwarded.
    reply = await send(gw, "GET", f"/workers/{wid}/init_weights_update_group")
    assert reply.status == 405 and reply.headers["allow"] == "POST"
    assert len(proxied(target)) == len(served)


def test_the_list_is_the_per_engine_and_control_routes_and_holds_no_generation() -> None:
    assert set(ADDRESSABLE_ROUTES) == set(PER_ENGINE_ROUTES) | set(CONTROL_ROUTES)
    # The cluster work fans this one out too; one engine at a time must stay possible.
    assert "/update_weights_from_distributed" in ADDRESSABLE_ROUTES
    for path in ADDRESSABLE_ROUTES:
        assert "generate" not in path and "completions" not in path


async def test_a_relayed_caller_is_not_trusted_by_its_proxys_address(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    """A proxy on the gateway's host (a TLS terminator) connects from loopback for every
    client it relays: the forwarding headers it adds show the caller is not the peer."""
    gw = await make_gateway(stubs[0].url, control={"keys": ["op-1"]})
    wid = worker_id(stubs[0].url)
    relayed = [
        "X-Forwarded-For: 203.0.113.9\r\n",
        "Forwarded: for=203.0.113.9;proto=https\r\n",
        "X-Real-IP: 203.0.113.9\r\n",
        # A CDN's or load balancer's own spelling of the client's address.
        "CF-Connecting-IP: 203.0.113.9\r\n",
        "True-Client-IP: 203.0.113.9\r\n",
        "X-Client-IP: 203.0.113.9\r\n",
        "X-Cluster-Client-IP: 203.0.113.9\r\n",
        "X-Forwarded-For: 127.0.0.1\r\n",  # still a relayed request: who sent it is unknown
    ]
    for headers in relayed:
        for target in ("/pause_generation", f"/workers/{wid}/init_weights_update_group"):
            raw = await raw_exchange(gw.port, request("POST", target, b"{}", headers))
            (reply,) = parse_responses(raw)
            assert reply.status == 403, (headers, target)
            assert "relayed" in orjson.loads(reply.body)["detail"]
    assert proxied(stubs[0]) == []
    # The operator's key is trusted however the request came.
    key = "Authorization: Bearer op-1\r\n"
    raw = await raw_exchange(gw.port, request("POST", "/start_profile", b"{}", relayed[0] + key))
    assert parse_responses(raw)[0].status == 200
    # Straight from loopback, as before.
    assert (await send(gw, "POST", "/stop_profile", b"{}")).status == 200


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("proxies", "warned"),
    [("[127.0.0.1/32]", True), ("['::1/128']", True), ("[10.0.0.0/8]", False), ("[]", False)],
)
async def test_a_warning_at_start_when_loopback_is_both_a_proxy_and_trusted(
    stub: StubBackend, tmp_path: Path, proxies: str, warned: bool
) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"backends: {{static: ['{stub.url}']}}\nforwarding: {{trusted_proxies: {proxies}}}\n"
    )
    async with cli_gateway(tmp_path, "--config", str(cfg)) as (_, _, err_path):
        pass
    err = err_path.read_text()
    lines = [ln for ln in err.splitlines() if "control.trusted_cidrs" in ln]
    assert len(lines) == (1 if warned else 0), err
    if warned:
        assert "control.keys" in lines[0]
