"""Which replica's engine serves which rid, shared through etcd (state.backend: etcd).

The request path only notes rid -> backend in a dict (RidOwners in
gateway/edge/fleet_control.py). This module writes what changed every FLUSH_S, in
transactions of at most BATCH keys, under the replica's own lease (the one EtcdState keeps
alive for its acknowledgement and the control lock): one lease, so the keys of a replica
that dies go in the same revocation as its lock. A request that ends before its batch is
written never reaches etcd. An abort by rid through another replica reads the key, within
LOOKUP_S, and goes to that owner alone; unknown, or etcd away: to every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from gateway.fleet.kv import EtcdError, EtcdUnavailable, Store

if TYPE_CHECKING:
    from gateway.edge.fleet_control import RidOwners

log = logging.getLogger("gateway.fleet")

FLUSH_S: Final = 0.05
BATCH: Final = 128
LOOKUP_S: Final = 0.5
RETRY_MAX_S: Final = 2.0  # the longest pause between tries while etcd is away

# ok: written; failed: etcd away, kept for the next try; refused: etcd refused the batch
# itself (too large for its request limit, say), dropped so it cannot block the others.
FLUSH_RESULTS: Final = ("ok", "failed", "refused")
LOOKUP_RESULTS: Final = ("local", "found", "unknown", "failed")


class RidPublisher:
    """Writes one replica's rid owners to etcd and reads other replicas' on an abort."""

    def __init__(
        self,
        owners: RidOwners,
        store: Store,
        prefix: str,
        lease: Callable[[], int],
        *,
        store_up: Callable[[], bool] = lambda: True,
        flush_s: float = FLUSH_S,
        batch: int = BATCH,
        lookup_s: float = LOOKUP_S,
    ) -> None:
        self.owners = owners
        self.store = store
        self._prefix = (prefix + "rids/").encode()
        self._lease = lease  # the replica's lease now: 0 until granted
        self._written_under = 0  # the lease the written keys live under
        self._store_up = store_up  # false while the replica knows etcd is away
        self.flush_s = flush_s
        self.batch = batch
        self.lookup_s = lookup_s
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
        pause = self.flush_s
        while True:
            await asyncio.sleep(pause)
            try:
                await self._flush()
                pause = self.flush_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the task must outlive any one failure
                self.flushes["failed"] += 1
                pause = min(pause * 2, RETRY_MAX_S)
                log.debug("rid owners not written: %s", type(exc).__name__)

    async def _flush(self) -> None:
        lease = self._lease()
        if not lease:
            return  # no lease yet: nothing could be written under it
        owners = self.owners
        if lease != self._written_under:
            if self._written_under:
                # The lease lapsed while etcd was away: what was written under it is gone.
                owners.rewrite_all()
            self._written_under = lease
        while True:
            batch = owners.take(self.batch)
            if not batch:
                return
            puts = [(self.key(rid), url.encode()) for rid, url in batch if url is not None]
            deletes = [self.key(rid) for rid, url in batch if url is None]
            try:
                await self.store.write_many(puts, deletes, lease=lease)
            except EtcdUnavailable:
                owners.unwritten_again(batch)
                raise
            except EtcdError as exc:
                # Refused for what it holds, it would be refused again on every try.
                owners.written(batch)
                self.flushes["refused"] += 1
                log.debug("rid owners refused by etcd: %s", type(exc).__name__)
                continue
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
        if not self._store_up():
            # Known away: the abort goes to every engine now, not after LOOKUP_S.
            self.lookups["failed"] += 1
            return None
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
        """Stop writing. The keys go when the replica gives back its lease (EtcdState)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
