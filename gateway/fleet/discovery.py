"""Where the backends are: static lists, DNS names, Kubernetes EndpointSlices.

Each discovery runs as one owned task and publishes immutable snapshots (a tuple of
backend URLs) to a callback; the pool turns snapshots into membership changes. A failed
or empty answer never empties the fleet: the last good snapshot stays, and the failure is
logged and counted.

Seams for tests: DNS answers come from a `Resolver`, the Kubernetes API through an
`EndpointSliceApi` (over HTTP to a configurable address: a loopback fake in tests, the
in-cluster API otherwise).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("gateway.fleet.discovery")

Publish = Callable[[tuple[str, ...]], None]

_SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def backend_url(scheme: str, host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{scheme}://{host}:{port}"


class Discovery(Protocol):
    name: str
    updates: int  # snapshots published
    errors: int  # failed or empty answers (the last good snapshot was kept)

    async def run(self, publish: Publish) -> None: ...


class StaticDiscovery:
    name = "static"

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = tuple(urls)
        self.updates = 0
        self.errors = 0

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
    """The set of backends a discovery last published, and its counters."""

    def __init__(self) -> None:
        self._last: tuple[str, ...] | None = None
        self.updates = 0
        self.errors = 0

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


class DnsDiscovery(_Publishing):
    """Every A/AAAA record of a name is a backend (a Kubernetes headless Service)."""

    name = "dns"

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
        except (OSError, UnicodeError) as exc:
            self._failed(f"resolution failed: {exc}")
            return
        urls = {backend_url(self._scheme, a, self._port) for a in addresses}
        if not self._offer(urls, publish):
            self._failed("empty answer")

    def _failed(self, why: str) -> None:
        self.errors += 1
        kept = len(self._last) if self._last else 0
        log.warning("dns %s: %s; keeping the last good set (%d backends)", self._host, why, kept)

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


class EndpointSliceApi(Protocol):
    """The two EndpointSlice calls discovery needs (gateway/edge/clients.py makes them over
    HTTP). Failures raise OSError (a timeout included), or ValueError/KeyError for an
    answer that is not what the API promises."""

    async def list(self) -> tuple[list[dict[str, Any]], str]: ...

    def watch(
        self, resource_version: str, timeout_s: float
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]: ...


class KubernetesDiscovery(_Publishing):
    """Ready endpoints of the EndpointSlices matching a label selector.

    A full list, then a watch for changes; the watch ends every `resync_s` and a fresh
    full list replaces the state, so a missed event cannot leave a stale pod behind.
    """

    name = "kubernetes"

    def __init__(
        self,
        api: EndpointSliceApi,
        *,
        scheme: str,
        port: int | None,
        port_name: str | None,
        resync_s: float,
        retry_s: float = 5.0,
    ) -> None:
        self._api = api
        self._scheme = scheme
        self._port = port
        self._port_name = port_name
        self._resync = resync_s
        self._retry = retry_s
        self._slices: dict[str, list[str]] = {}
        super().__init__()

    def _urls(self, item: dict[str, Any]) -> list[str]:
        return slice_urls(item, scheme=self._scheme, port=self._port, port_name=self._port_name)

    def _publish(self, publish: Publish) -> None:
        if not self._offer({u for urls in self._slices.values() for u in urls}, publish):
            self.errors += 1
            log.warning("kubernetes: no ready endpoints; keeping the last good set")

    async def sync_once(self, publish: Publish) -> str:
        items, version = await self._api.list()
        self._slices = {item["metadata"]["name"]: self._urls(item) for item in items}
        self._publish(publish)
        return version

    async def run(self, publish: Publish) -> None:
        while True:
            try:
                version = await self.sync_once(publish)
                async with asyncio.timeout(self._resync):
                    async for kind, item in self._api.watch(version, self._resync):
                        name = (item.get("metadata") or {}).get("name")
                        if kind in ("ADDED", "MODIFIED") and name:
                            self._slices[name] = self._urls(item)
                        elif kind == "DELETED" and name:
                            self._slices.pop(name, None)
                        elif kind == "ERROR":
                            break  # e.g. 410 Gone: resource version too old; relist
                        else:
                            continue  # BOOKMARK
                        self._publish(publish)
            except TimeoutError:
                continue  # periodic full relist
            except (OSError, ValueError, KeyError) as exc:
                self.errors += 1
                log.warning("kubernetes discovery failed (%s); retrying, last good set kept", exc)
                await asyncio.sleep(self._retry)
