"""Truth tables: the headers sent upstream (hop-by-hop, forwarding chain, credentials) and
the headers sent back to the client."""

from __future__ import annotations

import pytest

from gateway.edge.headers import REQUEST_ID, ForwardedHeaders

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


@pytest.mark.parametrize(
    "connection",
    [
        # A plain option in one header and a named header in another: the second still counts.
        [("Connection", "Keep-Alive"), ("Connection", "X-Secret")],
        [("Connection", "close"), ("Connection", " x-secret , keep-alive")],
        [("Connection", "X-SECRET")],
    ],
)
def test_headers_a_connection_header_names_are_dropped_both_ways(
    connection: list[tuple[str, str]],
) -> None:
    incoming = [*connection, ("X-Secret", "s"), ("X-Kept", "k")]
    up = ForwardedHeaders().upstream(incoming, peer="10.0.0.1", scheme="http", request_id="r")
    down = ForwardedHeaders.downstream(incoming, "r")
    for out in (up, down):
        names = {name.lower() for name, _ in out}
        assert "x-secret" not in names and "connection" not in names
        assert "x-kept" in names


def test_a_plain_connection_header_drops_only_itself() -> None:
    incoming = [("Connection", "keep-alive"), ("X-Kept", "k"), ("Close", "c")]
    down = ForwardedHeaders.downstream(incoming, "r")
    assert [name for name, _ in down] == ["X-Kept", "Close", REQUEST_ID]


def test_connection_close_drops_a_header_named_close() -> None:
    # RFC 9110 s.7.6.1: every option is a name to remove, "close" too.
    down = ForwardedHeaders.downstream([("Connection", "close"), ("Close", "c")], "r")
    assert [name for name, _ in down] == [REQUEST_ID]
