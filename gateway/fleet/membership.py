"""The backend fleet of one gateway: discovery -> membership -> health, kept in step.

Owns the discovery task and the prober tasks, and applies a new config on reload
without losing backend state or dropping in-flight requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from gateway.config import BackendsConfig, KubernetesConfig
from gateway.contract.profiles import MaskProfile
from gateway.fleet import engines
from gateway.fleet.balancers import BALANCERS, Balancer, BalanceRule, ConsistentHash
from gateway.fleet.cache_aware import CacheAware, CacheAwareRules
from gateway.fleet.discovery import (
    Discovery,
    DnsDiscovery,
    KubernetesDiscovery,
    ListWatchApi,
    Resolver,
    StaticDiscovery,
)
from gateway.fleet.etcd_state import EtcdState
from gateway.fleet.health import HealthChecker, Prober
from gateway.fleet.pd import PdRouting
from gateway.fleet.pods import PodDiscovery
from gateway.fleet.pool import BackendPool, EjectionRules, PoolRules
from gateway.fleet.registry import WorkerRegistry
from gateway.fleet.shared import Change, Document, SharedState
from gateway.runtime import Shielded

log = logging.getLogger("gateway.fleet.membership")


class FleetClients(Prober, Protocol):
    """What the fleet asks of the network: probes, and the Kubernetes API."""

    def endpoint_slices(self, cfg: KubernetesConfig) -> ListWatchApi: ...

    def pods(self, cfg: KubernetesConfig) -> ListWatchApi: ...


class RoleSource(Protocol):
    """Who says what each worker is (worker_type, bootstrap_port): the worker registry, or
    the pods' labels and annotations."""

    def extras(self, url: str) -> Mapping[str, Any]: ...


def make_balancer(cfg: BackendsConfig, name: str | None = None) -> Balancer:
    """The balancer `name` (None: backends.balancer) with the thresholds of `cfg`."""
    name = name or cfg.balancer
    rule = BalanceRule(cfg.balance_abs_threshold, cfg.balance_rel_threshold)
    if name == "cache_aware":
        c = cfg.cache_aware
        tokens = c.engine_cache_tokens
        rules = CacheAwareRules(
            rule,
            c.cache_threshold,
            c.max_blocks_per_backend,
            c.max_prompt_bytes,
            engine_cache_tokens=tokens if isinstance(tokens, int) else None,
            reported=tokens == "reported",
            bytes_per_token=c.bytes_per_token,
            place_by_pressure=c.place_by_pressure,
        )
        return CacheAware(rules, cfg.seed)
    if name == "consistent_hash":
        return ConsistentHash(cfg.seed, spill=rule)
    return BALANCERS[name](cfg.seed)


def make_pd(cfg: BackendsConfig) -> PdRouting | None:
    """backends.mode pd: each role's balancer; None for a plain fleet."""
    if cfg.mode != "pd":
        return None
    return PdRouting(
        make_balancer(cfg, cfg.prefill_balancer), make_balancer(cfg, cfg.decode_balancer)
    )


def pool_rules(cfg: BackendsConfig, pinned: MaskProfile | None = None) -> PoolRules:
    p = cfg.passive
    return PoolRules(
        healthy_threshold=cfg.health.healthy_threshold,
        unhealthy_threshold=cfg.health.unhealthy_threshold,
        passive=EjectionRules(
            consecutive_connect_failures=p.consecutive_connect_failures,
            consecutive_5xx=p.consecutive_5xx,
            base_eject_s=p.base_eject_s,
            max_eject_s=p.max_eject_s,
        ),
        max_inflight=cfg.max_inflight_per_backend,
        probes=cfg.health.enabled,
        probation=cfg.discovery == "registry" and cfg.health.enabled,
        pinned_profile=pinned,
    )


class Fleet:
    def __init__(
        self,
        cfg: BackendsConfig,
        *,
        resolver: Resolver | None = None,
        pinned: MaskProfile | None = None,
    ) -> None:
        self.cfg = cfg
        self._resolver = resolver
        initial = cfg.members if cfg.discovery in ("static", "registry") else ()
        self.pool = BackendPool(initial, make_balancer(cfg), pool_rules(cfg, pinned))
        self.pool.pd = pd = make_pd(cfg)
        if pd is not None:
            pd.set_members(list(initial))
        # Kept for the gateway's life once made: a reload never forgets registered workers.
        self.registry: WorkerRegistry | None = (
            WorkerRegistry(cfg.members, cfg.worker_roles()) if cfg.discovery == "registry" else None
        )
        self.discovery: Discovery | None = None
        self._type()
        self._discovery_task: asyncio.Task[None] | None = None
        self._health: HealthChecker | None = None
        self._clients: FleetClients | None = None
        self.shared: SharedState | EtcdState | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._doc: Document | None = None
        self._sharing = Shielded()

    def _make_discovery(self, cfg: BackendsConfig, clients: FleetClients) -> Discovery:
        if cfg.discovery == "dns":
            assert cfg.dns is not None
            return DnsDiscovery(
                cfg.dns.name,
                cfg.dns.port,
                scheme=cfg.dns.scheme,
                interval_s=cfg.dns.interval_s,
                resolver=self._resolver,
            )
        if cfg.discovery == "kubernetes":
            k = cfg.kubernetes
            assert k is not None
            if k.roles:
                return PodDiscovery(
                    clients.pods(k),
                    prefill_selector=k.prefill_selector,
                    decode_selector=k.decode_selector,
                    bootstrap_port_annotation=k.bootstrap_port_annotation,
                    scheme=k.scheme,
                    port=k.port,
                    port_name=k.port_name,
                    resync_s=k.resync_s,
                    retry_base_s=k.retry_base_s,
                    retry_max_s=k.retry_max_s,
                )
            return KubernetesDiscovery(
                clients.endpoint_slices(k),
                scheme=k.scheme,
                port=k.port,
                port_name=k.port_name,
                resync_s=k.resync_s,
                retry_base_s=k.retry_base_s,
                retry_max_s=k.retry_max_s,
            )
        if cfg.discovery == "registry":
            if self.registry is None:
                self.registry = WorkerRegistry(cfg.members, cfg.worker_roles())
            return self.registry
        return StaticDiscovery(cfg.members)

    def _type(self) -> None:
        """Each member's worker_type and bootstrap_port: as registered (or as its pod's
        labels say), else as backends.prefill and backends.decode list it, else a regular
        worker."""
        roles = self.cfg.worker_roles()
        source: RoleSource | None = self.registry
        if source is None and isinstance(self.discovery, PodDiscovery):
            source = self.discovery
        extras = {
            b.url: {**roles.get(b.url, {}), **(source.extras(b.url) if source else {})}
            for b in self.pool.backends
        }
        engines.typed(
            self.pool,
            {u: e.get("worker_type") for u, e in extras.items()},
            {u: e.get("bootstrap_port") for u, e in extras.items()},
        )

    def _publish(self, urls: tuple[str, ...]) -> None:
        added, _ = self.pool.update(urls)
        self._type()
        if self._health is not None:
            self._health.sync(self.pool.backends)
        if self._doc is not None and added:
            engines.adopt(self.pool, self._doc, added)

    def start(self, clients: FleetClients) -> None:
        self._clients = clients
        self._health = HealthChecker(self.pool, clients, self.cfg.health)
        self._start_discovery(self.cfg, clients)
        self._health.sync(self.pool.backends)

    def _start_discovery(self, cfg: BackendsConfig, clients: FleetClients) -> None:
        self.discovery = self._make_discovery(cfg, clients)
        self._discovery_task = asyncio.create_task(
            self.discovery.run(self._publish), name=f"discovery:{self.discovery.name}"
        )

    async def _stop_discovery(self) -> None:
        task, self._discovery_task = self._discovery_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def reconfigure(self, cfg: BackendsConfig, pinned: MaskProfile | None = None) -> None:
        """Apply a reloaded config: policies swap now, backend state is kept."""
        assert self._clients is not None and self._health is not None
        old = self.cfg
        self.cfg = cfg
        self.pool.reconfigure(make_balancer(cfg), pool_rules(cfg, pinned), make_pd(cfg))
        self._type()
        if cfg.health != old.health:
            await self._health.stop()
            self._health = HealthChecker(self.pool, self._clients, cfg.health)
        discovery_keys = ("discovery", "static", "prefill", "decode", "dns", "kubernetes")
        kept_registry = cfg.discovery == "registry" and old.discovery == "registry"
        if not kept_registry and any(getattr(cfg, k) != getattr(old, k) for k in discovery_keys):
            await self._stop_discovery()
            self._start_discovery(cfg, self._clients)
        self._health.sync(self.pool.backends)

    # -- state shared by the worker processes of one gateway (gateway/fleet/shared.py) -------

    async def join(self, shared: SharedState | EtcdState) -> None:
        """Adopt the fleet the other workers (or replicas, through etcd) know, then follow
        its changes. Raises StoreDown when etcd cannot be used."""
        self.shared = shared
        shared.attach(self.adopt)
        if isinstance(shared, EtcdState):
            await shared.take(await shared.snapshot())
        else:
            await shared.take(await asyncio.to_thread(shared.load))
        self._follow_task = asyncio.create_task(shared.follow(), name="fleet-shared")

    def adopt(self, doc: Document) -> None:
        """Take the shared document's membership and engine states as this worker's."""
        before, self._doc = self._doc, doc  # kept: backends discovery adds later take it too
        members = doc.get("members")
        if self.registry is not None and isinstance(members, dict):
            self.registry.replace(members)
        engines.adopt(self.pool, doc, before=before)

    async def share(self, change: Change) -> None:
        """Hand a change this worker made to its siblings (nothing to do when alone). The
        sharing runs to its end even if the caller is cancelled (its client went away):
        a change applied here and never shared would leave the workers apart. Raises
        SharingFailed when it could not be shared: the caller must say so."""
        if self.shared is None or not change:
            return
        await self._sharing.run(self.shared.record(change))

    def exclusive(self, what: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Held around a fleet-changing call: across replicas (etcd) one such call runs at a
        time; nothing to hold for one process or the --workers of one host."""
        if isinstance(self.shared, EtcdState):
            return self.shared.exclusive(what)
        return contextlib.nullcontext()

    def store_problem(self) -> str | None:
        """What /readyz says of the shared store (etcd) when it cannot be reached."""
        return self.shared.problem() if isinstance(self.shared, EtcdState) else None

    async def confirm_versions(self, urls: list[str], timeout_s: float) -> Change:
        """Ask each engine which weights it serves now (its /model_info) and take its
        answer, whatever the call that changed them said. Shared, unlike a probe's read:
        the other workers take the update from it at once, not a probe interval later."""
        if self._clients is None:
            return Change()
        clients = self._clients
        found = await asyncio.gather(*(clients.weight_version(u, timeout_s) for u in urls))
        read = {u: v for u, v in zip(urls, found, strict=True) if v is not None}
        # routing.weight_version: latest must name what the engines serve.
        agreed = set(read.values())
        return engines.serve(self.pool, read, agreed.pop() if len(agreed) == 1 else None)

    async def stop(self) -> None:
        if self._follow_task is not None:
            self._follow_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow_task
            self._follow_task = None
        if isinstance(self.shared, EtcdState):
            await self.shared.close()
        await self._stop_discovery()
        if self._health is not None:
            await self._health.stop()
