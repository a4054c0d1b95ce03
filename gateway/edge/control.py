"""Fleet control: SGLang's engine operations sent to every backend at once.

An RL framework pauses, updates weights, continues and aborts its whole fleet; behind a
router that picks one backend, each such call reaches one engine of N. Here each control
route (contract/routes.py CONTROL_ROUTES) goes to every member of the pool concurrently,
the body byte for byte, each with its own deadline, and the reply lists what every backend
answered: 200 only when every one answered 2xx, else 502, so a failure on one engine of
many is never hidden.

Three rights, each with its own grant. An operator (a key from `control.keys` or a
caller from `control.trusted_cidrs`) may do everything. The cluster's engines, from
`control.membership.trusted_cidrs`, may register, list and remove workers: they register
themselves from their own nodes and cannot send a header. Any client that may send
generation requests may abort one request by its rid (`control.client_abort`). Everything
that acts on the fleet as a whole (abort_all, pause, weight updates...) stays the
operator's; a client key never grants it. Every call is logged with its caller and each
backend's status, and counted.

This module holds the parts: who may call, the fan-out, and what a call does to the
engines' state (written by gateway/fleet/engines.py). gateway/edge/fleet_control.py
answers the routes with them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from gateway.contract.routes import REGISTRY_ROUTES, WORKER_PATH
from gateway.edge.auth import ApiKeys
from gateway.edge.failures import ConnectFailed, UpstreamFailure, UpstreamTimeout
from gateway.edge.headers import CLIENT_ADDRESS, peer_in
from gateway.edge.upstream import Upstream, UpstreamResponse
from gateway.fleet import engines
from gateway.fleet.pool import BackendPool, worker_id
from gateway.fleet.shared import Change

log = logging.getLogger("gateway.control")

# Bytes of a backend's answer kept in the reply when it is not JSON (or too large to relay).
EXCERPT_BYTES: Final = 4096
# A backend's JSON answer is relayed whole up to this size.
MAX_RELAYED_BYTES: Final = 1 << 20

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class ControlAccess:
    """Who may call control routes: operators (`keys`, `trusted`), the engines' network for
    membership (`members`), clients for the abort of one rid (`client_abort`)."""

    keys: ApiKeys | None
    trusted: tuple[Network, ...]
    members: tuple[Network, ...] = ()
    client_abort: bool = True

    @classmethod
    def build(
        cls,
        keys: Sequence[str],
        trusted_cidrs: Iterable[str],
        membership_cidrs: Iterable[str] = (),
        *,
        client_abort: bool = True,
    ) -> ControlAccess:
        return cls(
            ApiKeys(keys) if keys else None,
            _networks(trusted_cidrs),
            _networks(membership_cidrs),
            client_abort,
        )

    def caller(
        self, authorization: str | None, peer: str | None, *, relayed: bool = False
    ) -> str | None:
        """How the caller is allowed ("key" or "trusted"), or None when it is not.

        An address vouches only for a request its owner sent: one that a proxy relayed
        (`relayed`: it carries forwarding headers) comes from the proxy's address whoever
        the client is, and a TLS terminator on the gateway's host would make every client a
        loopback caller. Such a request needs a key."""
        if self.keys is not None and authorization and self.keys.check(authorization) is None:
            return "key"
        if not relayed and self.trusted_address(peer):
            return "trusted"
        return None

    def trusted_address(self, peer: str | None) -> bool:
        return peer_in(peer, self.trusted)

    def member(self, peer: str | None, *, relayed: bool = False) -> bool:
        """Whether the caller may change and read the membership by its address alone: the
        same rule as an operator's address, relayed requests never vouched for."""
        return not relayed and peer_in(peer, self.members)


def _networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


# The registry routes that read or change the membership, which the engines' network may
# call. The per-engine paths answered beside them (a weight update group) are an operator's.
MEMBERSHIP_ROUTES: Final = frozenset({*REGISTRY_ROUTES, WORKER_PATH})
# A client's abort names one rid in a small object; anything larger is not one.
CLIENT_ABORT_MAX_BYTES: Final = 64 << 10


def names_one_rid(body: bytes) -> bool:
    """Whether an /abort_request body aborts one request by its rid and nothing else: a JSON
    object with a non-empty string `rid`, and `abort_all` and `prefix` absent or false.

    Fails closed: SGLang reads `abort_all` as a lax bool ("true", 1 and "yes" abort all), so
    any value other than false is the fleet-wide abort here, as is a body orjson cannot
    read (SGLang's JSON parser accepts some that orjson refuses, such as a UTF-16 body)."""
    if len(body) > CLIENT_ABORT_MAX_BYTES:
        return False
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return False
    if not isinstance(parsed, dict):
        return False
    rid = parsed.get("rid")
    return (
        isinstance(rid, str)
        and rid != ""
        and parsed.get("abort_all", False) is False
        and parsed.get("prefix", False) is False
    )


# Headers a proxy adds to what it relays (RFC 7239, the de facto X- forms, RFC 9110 Via,
# and the client-address spellings of load balancers and CDNs the forwarding drops from
# untrusted peers): a caller that sends one is not the peer the gateway sees.
RELAY_HEADERS: Final = (
    "Forwarded",
    "X-Forwarded-For",
    "X-Forwarded-Proto",
    "X-Forwarded-Host",
    "Via",
    *sorted(CLIENT_ADDRESS),
)


def relayed(headers: Mapping[str, str]) -> bool:
    """`headers` match names case-insensitively (the request's multidict)."""
    return any(name in headers for name in RELAY_HEADERS)


_LOOPBACK: Final = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def _has_loopback(cidrs: Iterable[str]) -> bool:
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    return any(n.version == lo.version and n.overlaps(lo) for n in nets for lo in _LOOPBACK)


def trust_warning(
    trusted_cidrs: Iterable[str], keys: Sequence[object], trusted_proxies: Iterable[str]
) -> str | None:
    """A line for the start-up log when the configuration suggests a proxy on this host
    forwards clients while loopback callers are trusted without a key."""
    if not (_has_loopback(trusted_cidrs) and _has_loopback(trusted_proxies)):
        return None
    return (
        "control.trusted_cidrs trusts loopback callers and forwarding.trusted_proxies names a "
        "proxy on loopback: every client that proxy relays connects from loopback. Requests "
        "carrying forwarding headers are refused address trust, but a proxy that adds none "
        "makes its clients operators: set control.keys (or control.keys_file) and remove "
        "loopback from control.trusted_cidrs." + ("" if keys else " No operator key is configured.")
    )


@dataclass(frozen=True, slots=True)
class BackendResult:
    url: str
    status: int  # the backend's status; 0 when it could not be asked or did not answer
    body: Any  # its JSON answer, or an excerpt of its text, or the gateway's explanation
    raw: bytes = b""  # its answer as sent, for a call addressed to this one backend
    content_type: str = "application/json"

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def as_json(self) -> dict[str, Any]:
        return {
            "id": worker_id(self.url),
            "url": self.url,
            "status": self.status,
            "body": self.body,
        }


@dataclass(frozen=True, slots=True)
class ControlCall:
    """One control call as every backend receives it, and how long each may take."""

    method: str
    target: str  # path and query, as the backend gets it
    headers: list[tuple[str, str]]
    body: bytes | None
    connect_s: float
    timeout_s: float


class FanOut:
    """Send one control call to every backend and gather their answers."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        # (route, result) -> count; result is ok, failed or forbidden.
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, route: str, result: str) -> None:
        key = (route, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    async def call(self, urls: Sequence[str], call: ControlCall) -> list[BackendResult]:
        return list(await asyncio.gather(*(self._one(url, call) for url in urls)))

    async def _one(self, url: str, call: ControlCall) -> BackendResult:
        timeout_s = call.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._upstream.request(
                    url,
                    call.method,
                    call.target,
                    call.headers,
                    call.body,
                    connect_s=call.connect_s,
                    ttfb_s=timeout_s,
                    total_s=timeout_s,
                )
                try:
                    data = await _read_bounded(resp, MAX_RELAYED_BYTES)
                except BaseException:
                    resp.close()
                    raise
                if data is None:
                    resp.close()
                    return BackendResult(url, resp.status, "answer too large to relay")
                content_type = resp.header("Content-Type", "application/json") or "application/json"
                resp.release()
        except ConnectFailed as exc:
            return BackendResult(url, 0, f"could not connect ({exc.cause})")
        except (TimeoutError, UpstreamTimeout):  # the call's own bound, or the client's
            return BackendResult(url, 0, f"no answer within {timeout_s:g} s")
        except UpstreamFailure as exc:
            return BackendResult(url, 0, f"broken answer ({exc.cause})")
        except ValueError:  # a header that would split the request head: nothing was sent
            return BackendResult(url, 0, "request not sent (a header with CR or LF)")
        return BackendResult(url, resp.status, _decode(data), data, content_type)


async def _read_bounded(resp: UpstreamResponse, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while chunk := await resp.read():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(data: bytes) -> Any:
    if not data:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:EXCERPT_BYTES].decode("utf-8", "replace")


def reply_body(results: Sequence[BackendResult]) -> bytes:
    return orjson.dumps(
        {"success": all(r.ok for r in results), "results": [r.as_json() for r in results]}
    )


def log_action(route: str, caller: str, peer: str | None, results: Sequence[BackendResult]) -> None:
    """One line per control call: who, what, and each backend's status (no bodies)."""
    outcome = ", ".join(f"{r.url}={r.status or 'failed'}" for r in results) or "no backends"
    log.info("control %s by %s (%s): %s", route, caller, peer or "-", outcome)


# What a successful call does to an engine's state, as the gateway tracks it.
_STATE_CHANGES: Final = {
    "/pause_generation": (engines.PAUSED, True),
    "/continue_generation": (engines.PAUSED, False),
    "/release_memory_occupation": (engines.ASLEEP, True),
    "/resume_memory_occupation": (engines.ASLEEP, False),
}
_WEIGHT_UPDATES: Final = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
    }
)


def apply_state(
    pool: BackendPool, target: str, body: bytes, results: Sequence[BackendResult]
) -> Change:
    """Record on each backend that answered 2xx what the call did to it: paused, asleep, the
    LoRA adapters it holds, or the weight version it now serves (the `weight_version` the
    caller sent), and return it as a change the other worker processes take too."""
    path = target.partition("?")[0]
    ok = {r.url for r in results if r.ok}
    backends = [b for b in pool.backends if b.url in ok]
    change = _STATE_CHANGES.get(path)
    if change is not None:
        flag, value = change
        return engines.hold(pool, backends, flag, value)
    if path in _ADAPTER_CALLS:
        return _adapters(pool, path, body, results)
    version = _sent_version(body) if path in _WEIGHT_UPDATES else None
    if version is None or not backends:
        return Change()
    return engines.serve(pool, {b.url: version for b in backends}, version)


_LOAD_ADAPTER: Final = "/load_lora_adapter"
_ADAPTER_CALLS: Final = frozenset({_LOAD_ADAPTER, "/unload_lora_adapter"})


def _adapters(
    pool: BackendPool, path: str, body: bytes, results: Sequence[BackendResult]
) -> Change:
    """The adapters each engine holds after a load or unload it answered 2xx: the
    `loaded_adapters` its answer lists (SGLang's LoRAUpdateOutput: every adapter it holds),
    else what it held with the call's `lora_name` added or removed."""
    try:
        sent = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        sent = None
    name = sent.get("lora_name") if isinstance(sent, dict) else None
    held: dict[str, frozenset[str]] = {}
    for r in results:
        backend = pool.find(r.url)
        if not r.ok or backend is None:
            continue
        listed = r.body.get("loaded_adapters") if isinstance(r.body, dict) else None
        if isinstance(listed, dict):
            held[r.url] = frozenset(k for k in listed if isinstance(k, str))
        elif isinstance(name, str):
            adapters = backend.adapters
            held[r.url] = adapters | {name} if path == _LOAD_ADAPTER else adapters - {name}
    return engines.hold_adapters(pool, held) if held else Change()


def changes_fleet(path: str) -> bool:
    """Whether a call on this engine path changes the state the gateway keeps of the fleet
    (paused, asleep, weights, adapters): across replicas such calls run one at a time."""
    return path in _STATE_CHANGES or path in _WEIGHT_UPDATES or path in _ADAPTER_CALLS


def updated_weights(target: str, results: Sequence[BackendResult]) -> list[str]:
    """The backends a weight update succeeded on (their version is then read back)."""
    if target.partition("?")[0] not in _WEIGHT_UPDATES:
        return []
    return [r.url for r in results if r.ok]


def _sent_version(body: bytes) -> str | None:
    try:
        sent = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None
    version = sent.get("weight_version") if isinstance(sent, dict) else None
    return version if isinstance(version, str) else None
