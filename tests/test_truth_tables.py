"""Truth tables for three pure functions the request path and discovery rely on:
EndpointSlice parsing, forwarding headers both ways, and error rendering per route family."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.contract.policy import Rejection
from gateway.contract.replies import render, render_rejection
from gateway.contract.routes import Family
from gateway.edge.headers import REQUEST_ID, ForwardedHeaders
from gateway.fleet.discovery import slice_urls

# -- discovery: EndpointSlice -> backend URLs ---------------------------------------------------


def _slice(endpoints: list[dict[str, Any]], ports: list[dict[str, Any]] | None = None) -> dict:
    return {"metadata": {"name": "s"}, "endpoints": endpoints, "ports": ports or []}


SLICES = [
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}]), 30000, None, ["http://10.0.0.1:30000"],
                 id="ready-unknown-counts-as-ready"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}]), 30000, None,
                 ["http://10.0.0.1:30000"], id="ready"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"], "conditions": {"ready": False}}]), 30000, None,
                 [], id="not-ready-or-terminating"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"], "conditions": {"ready": None}}]), 30000, None,
                 ["http://10.0.0.1:30000"], id="ready-null-counts-as-ready"),
    pytest.param(_slice([{"addresses": ["10.0.0.1", "10.0.0.2"]}]), 1, None,
                 ["http://10.0.0.1:1", "http://10.0.0.2:1"], id="every-address"),
    pytest.param(_slice([{"addresses": ["fd00::1"]}]), 30000, None, ["http://[fd00::1]:30000"],
                 id="ipv6-bracketed"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}], [{"name": "http", "port": 8000}]), None,
                 "http", ["http://10.0.0.1:8000"], id="named-port"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}], [{"name": "grpc", "port": 9000}]), None,
                 "http", [], id="named-port-absent"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}], [{"name": "http", "port": "8000"}]), None,
                 "http", [], id="named-port-not-an-int"),
    pytest.param({"metadata": {"name": "s"}, "endpoints": None}, 30000, None, [],
                 id="endpoints-null"),
    pytest.param({"metadata": {"name": "s"}}, 30000, None, [], id="endpoints-missing"),
    pytest.param(_slice([{"conditions": {"ready": True}}]), 30000, None, [],
                 id="no-addresses"),
]  # fmt: skip


@pytest.mark.parametrize(("item", "port", "port_name", "urls"), SLICES)
def test_slice_urls(item: dict, port: int | None, port_name: str | None, urls: list[str]) -> None:
    assert slice_urls(item, scheme="http", port=port, port_name=port_name) == urls


# -- forwarding headers -------------------------------------------------------------------------

HOP = [
    ("Connection", "keep-alive, X-Hop"),
    ("Keep-Alive", "timeout=5"),
    ("X-Hop", "1"),
    ("Transfer-Encoding", "chunked"),
    ("TE", "trailers"),
    ("Upgrade", "h2c"),
    ("Proxy-Authorization", "Basic x"),
]


@pytest.mark.parametrize(
    ("peer", "trusted", "incoming", "forwarded_for", "proto"),
    [
        ("10.1.1.1", [], [], "10.1.1.1", "http"),
        # An untrusted peer's claims are replaced, never extended.
        ("10.1.1.1", [], [("X-Forwarded-For", "1.2.3.4"), ("X-Forwarded-Proto", "https")],
         "10.1.1.1", "http"),
        # A trusted load balancer's chain is extended, its proto kept (the last one).
        ("10.1.1.1", ["10.0.0.0/8"], [("X-Forwarded-For", "1.2.3.4"),
         ("X-Forwarded-Proto", "https")], "1.2.3.4, 10.1.1.1", "https"),
        ("10.1.1.1", ["10.0.0.0/8"], [("X-Forwarded-For", "1.2.3.4"),
         ("X-Forwarded-For", "5.6.7.8")], "1.2.3.4, 5.6.7.8, 10.1.1.1", "http"),
        ("192.168.1.1", ["10.0.0.0/8"], [("X-Forwarded-For", "1.2.3.4")], "192.168.1.1",
         "http"),
        ("::1", ["::1/128"], [("X-Forwarded-For", "1.2.3.4")], "1.2.3.4, ::1", "http"),
        (None, ["10.0.0.0/8"], [("X-Forwarded-For", "1.2.3.4")], "", "http"),
        ("not-an-ip", ["10.0.0.0/8"], [("X-Forwarded-For", "1.2.3.4")], "not-an-ip", "http"),
    ],
)  # fmt: skip
def test_forwarded_for_and_proto(
    peer: str | None,
    trusted: list[str],
    incoming: list[tuple[str, str]],
    forwarded_for: str,
    proto: str,
) -> None:
    out = ForwardedHeaders(trusted).upstream(incoming, peer=peer, scheme="http", request_id="r")
    assert [v for k, v in out if k == "X-Forwarded-For"] == [forwarded_for]
    assert [v for k, v in out if k == "X-Forwarded-Proto"] == [proto]
    assert out[-1] == (REQUEST_ID, "r")


@pytest.mark.parametrize(
    ("upstream_auth", "strip", "authorization_sent"),
    [
        (None, False, ["Bearer client"]),  # passes through: no client auth, no own credential
        (None, True, []),  # client auth on: the client's key is not the backend's credential
        ("Bearer backend", False, ["Bearer backend"]),  # replaced by the configured one
        ("Bearer backend", True, ["Bearer backend"]),
    ],
)
def test_authorization_upstream(
    upstream_auth: str | None, strip: bool, authorization_sent: list[str]
) -> None:
    rules = ForwardedHeaders(upstream_authorization=upstream_auth, strip_client_authorization=strip)
    incoming = [("Authorization", "Bearer client"), ("Content-Type", "application/json"), *HOP]
    out = rules.upstream(incoming, peer="10.0.0.1", scheme="http", request_id="r")
    assert [v for k, v in out if k.lower() == "authorization"] == authorization_sent
    names = {k.lower() for k, _ in out}
    assert names.isdisjoint({k.lower() for k, _ in HOP})  # hop-by-hop and Connection-named
    assert ("Content-Type", "application/json") in out  # end-to-end ones kept, in order


def test_downstream_drops_hop_by_hop_and_the_backends_request_id() -> None:
    incoming = [("Content-Type", "text/event-stream"), (REQUEST_ID, "backend-chosen"), *HOP]
    out = ForwardedHeaders.downstream(incoming, "ours")
    assert out == [("Content-Type", "text/event-stream"), (REQUEST_ID, "ours")]


# -- error rendering ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "status", "expected"),
    [
        (Family.GENERATE, 400, {"error": {"message": "m"}}),
        (Family.GENERATE, 503, {"error": {"message": "m"}}),
        (Family.OPENAI, 400, {"object": "error", "message": "m", "type": "BadRequestError",
                              "param": None, "code": 400}),
        (Family.OPENAI, 413, {"object": "error", "message": "m",
                              "type": "RequestEntityTooLarge", "param": None, "code": 413}),
        (Family.OPENAI, 418, {"object": "error", "message": "m", "type": "Error", "param": None,
                              "code": 418}),
        (Family.PLAIN, 404, {"detail": "m"}),
        (Family.PLAIN, 500, {"detail": "m"}),
    ],
)  # fmt: skip
def test_render(family: Family, status: int, expected: dict) -> None:
    assert orjson.loads(render(family, status, "m")) == expected


@pytest.mark.parametrize("family", list(Family))
def test_validation_rejections_use_the_openai_shape_on_every_route(family: Family) -> None:
    rule = Rejection(400, "sampling_mask", "unbounded_top_k", "rule says no")
    invalid = Rejection(400, "request_body", "invalid_json", "bad json", validation=True)
    assert orjson.loads(render_rejection(family, rule)) == orjson.loads(
        render(family, 400, "rule says no")
    )
    body = orjson.loads(render_rejection(family, invalid))
    assert body == {
        "object": "error",
        "message": "bad json",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
