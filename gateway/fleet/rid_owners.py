"""Which replica's engine serves which rid, shared through etcd (state.backend: etcd).

The request path only notes rid -> backend in a dict (RidOwners in
gateway/edge/fleet_control.py). This module writes what changed every FLUSH_S, in
transactions of at most BATCH keys, under a lease of this replica's own, kept alive: keys
of a replica that dies go with its lease. A request that ends before its batch is written
never reaches etcd. An abort by rid through another replica reads the key, within
LOOKUP_S, and goes to that owner alone; unknown, or etcd away: to every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Final

from gateway.fleet.kv import EtcdError, Store

if TYPE_CHECKING:
    from gateway.edge.fleet_control import RidOwners

log = logging.getLogger("gateway.fleet")

FLUSH_S: Final = 0.05
BATCH: Final = 128
LOOKUP_S: Final = 0.5
LEASE_TTL_S: Final = 5

FLUSH_RESULTS: Final = ("ok", "failed")
LOOKUP_RESULTS: Final = ("local", "found", "unknown", "failed")


class RidPublisher:
    """Writes one replica's rid owners to etcd and reads other replicas' on an abort."""

    def __init__(
        self,
        owners: RidOwners,
        store: Store,
        prefix: str,
        *,
        lease_ttl_s: int = LEASE_TTL_S,
        flush_s: float = FLUSH_S,
        batch: int = BATCH,
        lookup_s: float = LOOKUP_S,
    ) -> None:
        self.owners = owners
        self.store = store
        self._prefix = (prefix + "rids/").encode()
        self.lease_ttl_s = lease_ttl_s
        self.flush_s = flush_s
        self.batch = batch
        self.lookup_s = lookup_s
        self._lease = 0
        self.flushes: dict[str, int] = dict.fromkeys(FLUSH_RESULTS, 0)
        self.writes = 0  # keys put or deleted
        self.lookups: dict[str, int] = dict.fromkeys(LOOKUP_RESULTS, 0)
        self._task: asyncio.Task[None] | None = None

    def key(self, rid: str) -> bytes:
        return self._prefix + rid.encode()

    def start(self) -> None:
        self.owners.share()
        self._task = asyncio.create_task(self._run(), name="rid-owners")

    async def _run(self) -> None:
        renew_at = 0.0
        while True:
            await asyncio.sleep(self.flush_s)
            now = time.monotonic()
            try:
                if now >= renew_at:
                    await self._keep_lease()
                    renew_at = now + self.lease_ttl_s / 3
                await self._flush()
            except asyncio.CancelledError:
                raise
            except EtcdError as exc:
                self.flushes["failed"] += 1
                renew_at = 0.0  # the lease may have lapsed meanwhile: check it first
                log.debug("rid owners not written: %s", type(exc).__name__)

    async def _keep_lease(self) -> None:
        if self._lease and await self.store.keepalive(self._lease) > 0:
            return
        if self._lease:
            # Expired while etcd was away: what was written under it is gone.
            self.owners.rewrite_all()
        self._lease = await self.store.grant(self.lease_ttl_s)

    async def _flush(self) -> None:
        owners = self.owners
        while True:
            batch = owners.take(self.batch)
            if not batch:
                return
            puts = [(self.key(rid), url.encode()) for rid, url in batch if url is not None]
            deletes = [self.key(rid) for rid, url in batch if url is None]
            try:
                await self.store.write_many(puts, deletes, lease=self._lease)
            except BaseException:
                owners.unwritten_again(batch)
                raise
            owners.written(batch)
            self.flushes["ok"] += 1
            self.writes += len(batch)

    async def lookup(self, rid: str) -> str | None:
        """The backend serving `rid` anywhere in the fleet, if known within lookup_s."""
        local = self.owners.owner(rid)
        if local is not None:
            self.lookups["local"] += 1
            return local
        try:
            async with asyncio.timeout(self.lookup_s):
                kv, _ = await self.store.get(self.key(rid))
        except (EtcdError, TimeoutError):
            self.lookups["failed"] += 1
            return None
        if kv is None:
            self.lookups["unknown"] += 1
            return None
        self.lookups["found"] += 1
        return kv.value.decode(errors="replace")

    async def close(self) -> None:
        """Stop writing and give back the lease: this replica's keys go with it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._lease:
            with contextlib.suppress(EtcdError):
                await self.store.revoke(self._lease)
            self._lease = 0
