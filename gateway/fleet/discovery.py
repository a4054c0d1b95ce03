"""Where the backends are: static lists, DNS names, Kubernetes EndpointSlices (and Pods,
for prefill/decode roles: gateway/fleet/pods.py).

Each discovery runs as one owned task and publishes immutable snapshots (a tuple of
backend URLs) to a callback; the pool turns snapshots into membership changes. A failed
or empty answer never empties the fleet: the last good snapshot stays, and the failure is
logged (with what an operator needs to fix it), counted by cause, and named by /readyz.

Seams for tests: DNS answers come from a `Resolver`, the Kubernetes API through a
`ListWatchApi` (over HTTP to a configurable address: a loopback fake in tests, the
in-cluster API otherwise).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

log = logging.getLogger("gateway.fleet.discovery")

Publish = Callable[[tuple[str, ...]], None]

# Why an answer was not taken: the `cause` label of sglang_gateway_discovery_errors_total
# and the word /readyz names. A fixed set, so the series count stays bounded.
UNAUTHORIZED: Final = "unauthorized"  # 401: no token, or one the API server does not accept
FORBIDDEN: Final = "forbidden"  # 403: RBAC does not grant the call
GONE: Final = "gone"  # 410: the watch's resource version expired; routine, relisted at once
UNREACHABLE: Final = "unreachable"  # no answer, or a server not serving now (5xx, 408, 429)
BAD_RESPONSE: Final = "bad_response"  # an answer that is not what the API promises
EMPTY: Final = "empty"  # nothing ready, no address: kept as a fault, not a fleet of zero
CAUSES: Final = (UNAUTHORIZED, FORBIDDEN, GONE, UNREACHABLE, BAD_RESPONSE, EMPTY)

# The API's Status message names the user and the permission it lacks; it never carries a
# credential, but it is the server's text, so it is cut to this and kept on one line.
MESSAGE_LIMIT: Final = 300


def backend_url(scheme: str, host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{scheme}://{host}:{port}"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a discovery's last answer was not taken, for /readyz: the cause and the call,
    never the API's own message (that goes to the log)."""

    cause: str
    what: str


class Discovery(Protocol):
    name: str
    # The causes its errors can have: each is exported at 0 from the start.
    causes: tuple[str, ...]
    updates: int  # snapshots published
    errors: dict[str, int]  # failed or empty answers by cause (the last good set was kept)
    failing: Failure | None  # set while its answers are not taken

    async def run(self, publish: Publish) -> None: ...


def describe_failure(d: Discovery | None) -> str | None:
    """The readiness detail of a failing discovery, or None. No age: with --workers the
    supervisor shows each distinct reason once, and the workers' ages differ."""
    if d is None or d.failing is None:
        return None
    return f"{d.name} discovery failing: {d.failing.cause} ({d.failing.what})"


class StaticDiscovery:
    name = "static"
    causes: tuple[str, ...] = ()

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = tuple(urls)
        self.updates = 0
        self.errors: dict[str, int] = {}
        self.failing: Failure | None = None

    async def run(self, publish: Publish) -> None:
        publish(self._urls)
        self.updates += 1


# -- DNS -----------------------------------------------------------------------------------


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """The IP addresses (A and AAAA) of a name."""
        ...


class SystemResolver:
    """getaddrinfo in the loop's executor: never blocks the event loop."""

    async def resolve(self, host: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        return [str(info[4][0]) for info in infos]


class _Publishing:
    """The set of backends a discovery last published, its counters and its failure."""

    causes: tuple[str, ...] = CAUSES

    def __init__(self) -> None:
        self._last: tuple[str, ...] | None = None
        self.updates = 0
        self.errors = dict.fromkeys(self.causes, 0)
        self.failing: Failure | None = None

    def _offer(self, urls: set[str], publish: Publish) -> bool:
        """Publish the set if it changed; False (nothing published) if it is empty, since an
        empty answer is far likelier a fault than a fleet scaled to zero."""
        if not urls:
            return False
        ordered = tuple(sorted(urls))
        if ordered != self._last:
            self._last = ordered
            self.updates += 1
            publish(ordered)
        return True

    @property
    def kept(self) -> int:
        return len(self._last) if self._last else 0

    def _count(self, cause: str, what: str, *, failing: bool = True) -> None:
        self.errors[cause] = self.errors.get(cause, 0) + 1
        if failing:
            self.failing = Failure(cause, what)


# getaddrinfo's "no such name" (NXDOMAIN, and a name without addresses): what CoreDNS
# answers for a headless Service with no ready pod. The rest is a resolver not answering.
_NO_NAME: Final = frozenset(
    e for e in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if e is not None
)


class DnsDiscovery(_Publishing):
    """Every A/AAAA record of a name is a backend (a Kubernetes headless Service)."""

    name = "dns"
    causes: tuple[str, ...] = (UNREACHABLE, BAD_RESPONSE, EMPTY)

    def __init__(
        self,
        host: str,
        port: int,
        *,
        scheme: str = "http",
        interval_s: float = 5.0,
        resolver: Resolver | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._scheme = scheme
        self._interval = interval_s
        self._resolver = resolver or SystemResolver()
        super().__init__()

    async def resolve_once(self, publish: Publish) -> None:
        try:
            addresses = await self._resolver.resolve(self._host, self._port)
        except socket.gaierror as exc:
            cause = EMPTY if exc.errno in _NO_NAME else UNREACHABLE
            self._failed(cause, f"resolution failed: {exc.strerror or type(exc).__name__}")
            return
        except OSError as exc:
            self._failed(UNREACHABLE, f"resolution failed: {exc.strerror or type(exc).__name__}")
            return
        except UnicodeError:
            self._failed(BAD_RESPONSE, "the name is not a valid host name")
            return
        try:
            ips = [str(ipaddress.ip_address(a)) for a in addresses]
        except ValueError:
            self._failed(BAD_RESPONSE, "the resolver answered something that is not an address")
            return
        if not self._offer({backend_url(self._scheme, a, self._port) for a in ips}, publish):
            self._failed(EMPTY, "no address")
            return
        self.failing = None

    def _failed(self, cause: str, why: str) -> None:
        self._count(cause, f"resolving {self._host}: {why}")
        log.warning(
            "dns %s: %s (%s); keeping the last good set (%d backends)",
            self._host,
            why,
            cause,
            self.kept,
        )

    async def run(self, publish: Publish) -> None:
        while True:
            await self.resolve_once(publish)
            await asyncio.sleep(self._interval)


# -- Kubernetes ------------------------------------------------------------------------------


def slice_urls(
    item: dict[str, Any], *, scheme: str, port: int | None, port_name: str | None
) -> list[str]:
    """Backend URLs of one EndpointSlice: ready endpoints only.

    `conditions.ready` absent means "unknown", which the Kubernetes API says to read as
    ready; a terminating endpoint reports ready=false and so drops out.
    """
    chosen = port
    if port_name is not None:
        chosen = None
        for p in item.get("ports") or ():
            if p.get("name") == port_name and isinstance(p.get("port"), int):
                chosen = p["port"]
    if chosen is None:
        return []
    out: list[str] = []
    for endpoint in item.get("endpoints") or ():
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False:
            continue
        out.extend(backend_url(scheme, a, chosen) for a in endpoint.get("addresses") or ())
    return out


def cause_of_status(status: int) -> str:
    """The cause an HTTP status (or a Status object's code) of the API stands for."""
    if status == 401:
        return UNAUTHORIZED
    if status == 403:
        return FORBIDDEN
    if status == 410:
        return GONE
    if status in (408, 429) or status >= 500:
        return UNREACHABLE  # the server is there but not serving now (restarting, throttling)
    return BAD_RESPONSE


def api_message(payload: object) -> str:
    """The `message` of a Kubernetes Status object, on one line and at most MESSAGE_LIMIT
    characters; "" for anything else, since no other part of an answer is ever logged."""
    if not isinstance(payload, dict) or payload.get("kind") != "Status":
        return ""
    message = payload.get("message")
    if not isinstance(message, str):
        return ""
    # A control character would let the server's text forge a log line of its own.
    text = " ".join("".join(c if c.isprintable() else " " for c in message[:1000]).split())
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


class ApiError(Exception):
    """A Kubernetes API call that failed, with what an operator needs to act on it: the
    cause, the verb, the HTTP status (None when nothing answered) and the API's message (or,
    without one, the gateway's own words for what went wrong)."""

    def __init__(
        self,
        cause: str,
        verb: str,
        status: int | None = None,
        message: str = "",
        *,
        resource: str = "endpointslices",
    ) -> None:
        self.cause = cause
        self.verb = verb
        self.resource = resource
        self.status = status
        self.message = message
        super().__init__(self.describe())

    @classmethod
    def answered(
        cls, verb: str, status: int, payload: object, resource: str = "endpointslices"
    ) -> ApiError:
        """From an error answer (or a watch's ERROR event): its status and Status object."""
        error = cls(cause_of_status(status), verb, status, api_message(payload))
        error.resource = resource
        return error

    def describe(self) -> str:
        said = f": {self.message}" if self.message else ""
        if self.status is None:
            return f"{self.cause}{said}"
        return f"HTTP {self.status} ({self.cause}){said}"

    @property
    def brief(self) -> str:
        """For /readyz: the status and the call, not the message."""
        if self.status is None:
            return f"no answer to {self.verb} {self.resource}"
        return f"HTTP {self.status} on {self.verb} {self.resource}"


class ListWatchApi(Protocol):
    """The two calls discovery needs of one resource, EndpointSlices or Pods
    (gateway/edge/clients.py makes them over HTTP). A refused or failed call raises
    ApiError; OSError (a timeout included) and ValueError/KeyError/TypeError from another
    implementation count as unreachable and bad_response. A watch's ERROR events are yielded
    like any other."""

    # What the calls read, for the log: the resource, its namespace, the selector.
    target: str
    resource: str  # the resource's plural name: endpointslices, pods

    async def list(self) -> tuple[list[dict[str, Any]], str]: ...

    def watch(
        self, resource_version: str, timeout_s: float
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]: ...


Sleep = Callable[[float], Awaitable[None]]


class KubernetesDiscovery(_Publishing):
    """Ready endpoints of the EndpointSlices matching a label selector.

    A full list, then a watch for changes; the watch ends every `resync_s` and a fresh
    full list replaces the state, so a missed event cannot leave a stale pod behind. A
    failed call is retried after a capped exponential backoff with jitter; an expired watch
    (410) is relisted at once.
    """

    name = "kubernetes"
    nothing = "no ready endpoints"  # what an empty answer lacks, for the log and /readyz

    def __init__(
        self,
        api: ListWatchApi,
        *,
        scheme: str,
        port: int | None,
        port_name: str | None,
        resync_s: float,
        retry_base_s: float = 1.0,
        retry_max_s: float = 30.0,
        sleep: Sleep = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._api = api
        self._scheme = scheme
        self._port = port
        self._port_name = port_name
        self._resync = resync_s
        self._retry_base = retry_base_s
        self._retry_max = retry_max_s
        self._sleep = sleep
        self._jitter = jitter
        # The URLs of each listed object (a slice, or a pod) by its name.
        self._slices: dict[str, list[str]] = {}
        # Failed calls since discovery last worked in full (a list and a watch that ran);
        # a list that works while its watch keeps failing does not reset the backoff.
        self._streak = 0
        self._gone_again = False  # the last watch ended 410 with no event since
        super().__init__()

    def _urls(self, item: dict[str, Any]) -> list[str]:
        return slice_urls(item, scheme=self._scheme, port=self._port, port_name=self._port_name)

    def _publish(self, publish: Publish) -> None:
        if self._offer({u for urls in self._slices.values() for u in urls}, publish):
            self.failing = None
            return
        self._count(EMPTY, self.nothing)
        log.warning(
            "kubernetes discovery: %s in %s; keeping the last good set (%d backends)",
            self.nothing,
            self._api.target,
            self.kept,
        )

    async def sync_once(self, publish: Publish) -> str:
        items, version = await self._api.list()
        self._take(items)
        self._publish(publish)
        return version

    def _take(self, items: list[dict[str, Any]]) -> None:
        """A full list replaces what the watch built."""
        self._slices = {item["metadata"]["name"]: self._urls(item) for item in items}

    def _drop(self, name: str) -> None:
        self._slices.pop(name, None)

    def backoff(self, streak: int) -> float:
        """The wait after `streak` failures in a row: doubling from retry_base_s up to
        retry_max_s, the second half of each step at random, so gateway replicas that failed
        together (an API-server restart) do not come back in step."""
        step = min(self._retry_max, self._retry_base * 2.0 ** min(streak - 1, 60))
        return step / 2 + self._jitter() * step / 2

    async def _watch(self, version: str, publish: Publish) -> None:
        async with asyncio.timeout(self._resync):
            async for kind, item in self._api.watch(version, self._resync):
                if kind == "ERROR":
                    code = item.get("code")
                    status = code if isinstance(code, int) else 0
                    raise ApiError.answered("watch", status, item, self._api.resource)
                self._worked()
                name = (item.get("metadata") or {}).get("name")
                if kind in ("ADDED", "MODIFIED") and name:
                    self._slices[name] = self._urls(item)
                elif kind == "DELETED" and name:
                    self._drop(name)
                else:
                    continue  # BOOKMARK
                self._publish(publish)

    async def run(self, publish: Publish) -> None:
        resource = self._api.resource
        while True:
            verb = "list"
            try:
                version = await self.sync_once(publish)
                verb = "watch"
                await self._watch(version, publish)
                self._worked()  # the server ended the watch: relist
                continue
            except TimeoutError:
                if verb == "watch":
                    self._worked()  # the periodic relist
                    continue
                error = ApiError(UNREACHABLE, verb, message="timed out", resource=resource)
            except ApiError as exc:
                error = exc
            except OSError as exc:
                error = ApiError(UNREACHABLE, verb, message=type(exc).__name__, resource=resource)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                # Malformed items included: the task must outlive any answer.
                error = ApiError(BAD_RESPONSE, verb, message=_bad(exc, resource), resource=resource)
            if error.cause == GONE and not self._gone_again:
                # The watch's resource version was compacted away: relist and watch anew.
                self._gone_again = True
                self._count(GONE, error.brief, failing=False)
                log.info(
                    "kubernetes discovery: %s %s: %s; relisting",
                    error.verb,
                    self._api.target,
                    error.describe(),
                )
                continue
            await self._sleep(self._failed(error))

    def _worked(self) -> None:
        self._streak = 0
        self._gone_again = False

    def _failed(self, error: ApiError) -> float:
        """Count and log a failed call; the wait before the next."""
        self._streak += 1
        self._count(error.cause, error.brief)
        delay = self.backoff(self._streak)
        log.warning(
            "kubernetes discovery: %s %s failed, %s; retrying in %.2f s (failure %d in a "
            "row), keeping the last good set (%d backends)",
            error.verb,
            self._api.target,
            error.describe(),
            delay,
            self._streak,
            self.kept,
        )
        return delay


# The kind each resource's list and watch should have given, for the log.
KINDS: Final = {"endpointslices": "an EndpointSlice", "pods": "a Pod"}


def _bad(exc: BaseException, resource: str) -> str:
    """An answer's fault in the gateway's words: the exception's type, never its text,
    which may quote the answer."""
    kind = KINDS.get(resource, resource)
    return f"not {kind} list or watch event ({type(exc).__name__})"
