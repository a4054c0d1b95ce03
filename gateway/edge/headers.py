"""Which headers cross the proxy, both ways (RFC 9110 section 7.6.1).

Hop-by-hop headers describe one connection and must not be forwarded; neither may the
framing headers (Content-Length, Transfer-Encoding), which the proxy sets afresh for the
bytes it actually sends. Forwarding headers are rebuilt from what the gateway saw, so a
client cannot claim to be someone else unless it is a configured trusted proxy.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Final

from gateway import build

HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Set by the proxy for the bytes it sends, or rebuilt from what it saw.
_REQUEST_DROP: Final = HOP_BY_HOP | {
    "content-length",
    "expect",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "forwarded",
    "x-request-id",
}
_RESPONSE_DROP: Final = HOP_BY_HOP | {"x-request-id"}
# Other spellings of "the client's address" that load balancers and CDNs set and backends
# or their logs may believe: kept only from a trusted proxy, which set them itself; from
# anyone else they are a client's claim, and dropped (the gateway adds none).
CLIENT_ADDRESS: Final = frozenset(
    {"x-real-ip", "x-client-ip", "true-client-ip", "cf-connecting-ip", "x-cluster-client-ip"}
)

REQUEST_ID: Final = "X-Request-Id"
WEIGHT_VERSION: Final = "X-Weight-Version"  # the serving backend's weights, on replies
# On the gateway's own replies, and on relayed ones whose backend named no server: aiohttp
# would otherwise announce itself with its and Python's versions.
SERVER: Final = ("Server", build.NAME)
# A client-chosen id is kept only if it is short and plain, since it lands in logs and headers.
_REQUEST_ID_OK: Final = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}\Z")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


# What nearly every Connection header says: an option naming a header dropped anyway.
_PLAIN_CONNECTION: Final = "keep-alive"


def _connection_drop(
    items: list[tuple[str, str]], names: list[str], drop: frozenset[str]
) -> frozenset[str]:
    """`drop` and the headers a Connection header names (RFC 9110 s.7.6.1)."""
    tokens: set[str] = set()
    for (_, value), name in zip(items, names, strict=True):
        if name == "connection":
            lowered = value.lower()
            if lowered == _PLAIN_CONNECTION:
                continue  # one plain option: no set to build per request
            tokens.update(t.strip() for t in lowered.split(","))
    return drop | tokens if tokens else drop


def peer_in(peer: str | None, networks: tuple[Network, ...]) -> bool:
    """Whether a peer address (as the transport gives it) lies in one of `networks`."""
    if peer is None or not networks:
        return False
    try:
        addr = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(addr in net for net in networks)


def valid_request_id(value: str | None) -> bool:
    return value is not None and _REQUEST_ID_OK.match(value) is not None


class ForwardedHeaders:
    """Builds upstream request headers and downstream response headers."""

    __slots__ = ("_authorization", "_drop", "_drop_untrusted", "_trusted")

    def __init__(
        self,
        trusted_proxies: Iterable[str] = (),
        *,
        upstream_authorization: str | None = None,
        strip_client_authorization: bool = False,
    ) -> None:
        self._trusted: tuple[Network, ...] = tuple(
            ipaddress.ip_network(cidr, strict=False) for cidr in trusted_proxies
        )
        self._authorization = upstream_authorization
        replace = upstream_authorization is not None or strip_client_authorization
        # The client's key for the gateway is not a credential for the backend.
        self._drop = _REQUEST_DROP | {"authorization"} if replace else _REQUEST_DROP
        self._drop_untrusted = self._drop | CLIENT_ADDRESS

    @property
    def authorization(self) -> str | None:
        """The Authorization sent to backends in the client's place, if configured."""
        return self._authorization

    def upstream(
        self,
        headers: Iterable[tuple[str, str]],
        *,
        peer: str | None,
        scheme: str,
        request_id: str,
    ) -> list[tuple[str, str]]:
        """Request headers to send upstream: end-to-end ones kept in order, ours added."""
        items = list(headers)
        names = [name.lower() for name, _ in items]  # once: this runs for every request
        trusted = peer_in(peer, self._trusted)
        drop = self._drop if trusted else self._drop_untrusted
        if "connection" in names:
            drop = _connection_drop(items, names, drop)
        out = [item for item, name in zip(items, names, strict=True) if name not in drop]
        if self._authorization is not None:
            out.append(("Authorization", self._authorization))
        forwarded_for = peer or ""
        forwarded_proto = scheme
        if trusted:
            # A trusted load balancer in front: extend its chain instead of replacing it.
            prior = [v for k, v in items if k.lower() == "x-forwarded-for"]
            if prior:
                forwarded_for = ", ".join([*prior, forwarded_for])
            proto = [v for k, v in items if k.lower() == "x-forwarded-proto"]
            if proto:
                forwarded_proto = proto[-1]
        out.append(("X-Forwarded-For", forwarded_for))
        out.append(("X-Forwarded-Proto", forwarded_proto))
        out.append((REQUEST_ID, request_id))
        return out

    @staticmethod
    def downstream(
        headers: Iterable[tuple[str, str]],
        request_id: str,
        server: tuple[str, str] | None = None,
    ) -> list[tuple[str, str]]:
        """Response headers to send to the client; framing is re-derived by the server.
        `server` is added where the backend named none. (One pass of lowering, as this
        runs for every relayed response.)"""
        items = list(headers)
        names = [name.lower() for name, _ in items]
        drop = _RESPONSE_DROP
        if "connection" in names:
            drop = _connection_drop(items, names, drop)
        out = [item for item, name in zip(items, names, strict=True) if name not in drop]
        out.append((REQUEST_ID, request_id))
        if server is not None and "server" not in names:
            out.append(server)
        return out
