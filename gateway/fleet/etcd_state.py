"""Fleet state shared by every gateway replica through etcd (`state.backend: etcd`).

The same document the --workers of one host share through a file (gateway/fleet/shared.py:
registry members, each engine's paused, asleep, weight version and LoRA adapters, the
latest version, a generation count) lives under `state.etcd.prefix` as one key, `doc`, so
that every change is one compare-and-swap and concurrent writers through different
replicas serialise: a change is merged into the document as read, and written only if
the key is still at the revision read (else read again and merge again). Every process
(each replica, each of its --workers) follows the key with a watch and adopts each newer
generation whole, as a worker adopts the file.

Each process holds a lease (state.etcd.lease_ttl_s), kept alive while it runs, and puts
under `replicas/` the generation it adopted last, on that lease. The process that made a
change waits (bounded: ACK_TIMEOUT_S) until every live process acknowledged it before the
call is answered, so when /pause_generation returns no replica still routes to the
paused engines. A killed process's key goes with its lease: it holds no one up for longer
than the bound, and never after the lease expired.

Calls that change the fleet (registry changes, pause/continue, memory release/resume,
weight and adapter updates) run under a lock, `lock/control`, taken with a transaction
(create only if absent) on the process's lease: two operators through two replicas
serialise, the second waiting up to state.etcd.lock_wait_s, then refused with 409 (never a
half-applied fleet). A replica killed mid-call leaves the lock to its lease's expiry.

When etcd cannot be reached the process keeps routing on the last document it adopted,
refuses fleet-changing calls with 503 naming the store (StoreDown), and says so in /readyz
and a metric; when the store answers again the watch resumes from the last revision seen,
or the document is read anew when compaction removed that history.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Final

from gateway.fleet.kv import Compacted, EtcdError, Store
from gateway.fleet.rid_owners import RidPublisher
from gateway.fleet.shared import (
    ACK_TIMEOUT_S,
    Change,
    Damaged,
    Document,
    SharingFailed,
    Throttled,
    merge,
    new_document,
    validate,
)

log = logging.getLogger("gateway.fleet.etcd")

# Polling for acknowledgements and a free lock: loopback answers in about a millisecond.
_ACK_POLL_S: Final = 0.02
_LOCK_POLL_S: Final = 0.05
# A broken watch is retried after this, doubling up to _RETRY_MAX_S while it keeps failing.
_RETRY_S: Final = 0.2
_RETRY_MAX_S: Final = 2.0
# Compare-and-swap rounds one change may lose to other writers before it gives up.
_MAX_ROUNDS: Final = 64


class StoreDown(ConnectionError):
    """The store cannot be reached: a fleet-changing call is refused (503) before any
    engine sees it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LockBusy(Exception):
    """Another fleet-changing call holds the control lock for longer than the wait (409)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def replica_name() -> str:
    """This process among the fleet's gateways: host, pid, and a random tail (a pid repeats
    across containers)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class EtcdState:
    """One process's view of the fleet document in etcd."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        *,
        seed: list[str],
        lease_ttl_s: int,
        lock_wait_s: float,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        replica: str | None = None,
    ) -> None:
        self.store = store
        self.replica = replica or replica_name()
        self._doc_key = (prefix + "doc").encode()
        self._replicas = (prefix + "replicas/").encode()
        self._ack_key = self._replicas + self.replica.encode()
        self._lock_key = (prefix + "lock/control").encode()
        self._seed = seed
        self.lease_ttl_s = lease_ttl_s
        self.lock_wait_s = lock_wait_s
        self.ack_timeout_s = ack_timeout_s
        self.generation = -1
        self.pending = 0  # changes applied here and not yet written (see SharedState)
        self._adopt: Callable[[Document], None] | None = None
        self._doc: Document | None = None
        self._revision = 0  # the store's revision this view reflects: the watch goes on after it
        self._lease = 0
        # Why the store cannot be reached now (None: it answers), and since when.
        self.down: str | None = None
        self._down_since = 0.0
        self.errors: dict[tuple[str, str], int] = {}
        self.repairs = 0
        self.relists = 0  # documents read anew after compaction or a broken watch
        self.rid_publisher: RidPublisher | None = None  # rid owners, shared (started by app)
        self._log = Throttled(log)

    @property
    def lease(self) -> int:
        """The lease what this process holds in etcd lives under (0 before the first)."""
        return self._lease

    @property
    def store_up(self) -> bool:
        return self.down is None

    def _count(self, operation: str, reason: str) -> None:
        key = (operation, reason)
        self.errors[key] = self.errors.get(key, 0) + 1

    def _lost(self, exc: Exception) -> None:
        if self.down is None:
            self._down_since = time.monotonic()
            log.error(
                "the fleet state store (%s) is unreachable: %s; routing on the last known "
                "state, fleet-changing calls refused until it answers",
                self.store.describe(),
                exc,
            )
        self.down = str(exc)

    def _back(self) -> None:
        if self.down is not None:
            log.warning(
                "the fleet state store (%s) answers again after %.1f s",
                self.store.describe(),
                time.monotonic() - self._down_since,
            )
        self.down = None

    def problem(self) -> str | None:
        """For /readyz: what is wrong with the store, or None."""
        if self.down is None:
            return None
        since = time.monotonic() - self._down_since
        return (
            f"fleet state store {self.store.describe()} unreachable for {since:.0f} s, "
            "routing on the last known state"
        )

    def refusal(self) -> str:
        return (
            f"The fleet state store ({self.store.describe()}) cannot be reached "
            f"({self.down}): fleet-changing calls are refused until it answers, so that no "
            "replica changes the fleet the others cannot see. Generation requests are "
            "served on the last known state."
        )

    # -- reading -------------------------------------------------------------------------

    def _decode(self, value: bytes) -> Document | None:
        try:
            return validate(json.loads(value))
        except (ValueError, Damaged) as exc:
            self._count("read", "damaged")
            self._log.log(
                logging.ERROR,
                "read",
                "the fleet state in %s is damaged (%s): not adopted",
                self.store.describe(),
                exc if isinstance(exc, Damaged) else f"{len(value)} bytes that are not JSON",
            )
            return None

    async def snapshot(self) -> Document | None:
        """At start: take a lease and the document (the first replica writes it from its
        registry seed). Raises StoreDown naming the store when it cannot be used: a
        gateway that cannot share the fleet's state must not serve as part of it."""
        try:
            self._lease = await self.store.grant(self.lease_ttl_s)
            doc = await self._relist()
            if doc is None:
                fresh = json.dumps(new_document(list(self._seed))).encode()
                await self.store.replace(self._doc_key, fresh, mod_revision=0)
                doc = await self._relist()
        except EtcdError as exc:
            raise StoreDown(
                f"the fleet state store ({self.store.describe()}, state.etcd.endpoints) "
                f"cannot be used: {exc}"
            ) from None
        return doc

    async def _relist(self) -> Document | None:
        kv, revision = await self.store.get(self._doc_key)
        self._revision = revision
        return self._decode(kv.value) if kv is not None else None

    async def _acknowledge(self, generation: int) -> None:
        try:
            await self.store.put(
                self._ack_key, json.dumps({"generation": generation}).encode(), lease=self._lease
            )
        except EtcdError as exc:
            self._count("ack", "unwritable")
            self._lost(exc)

    async def take(self, doc: Document | None, *, mine: bool = False) -> None:
        """Adopt `doc` if it is newer than what this process has, and acknowledge it."""
        if doc is None or self._adopt is None:
            return
        if self.pending > (1 if mine else 0):
            return  # the document holding this process's own change comes next
        generation = int(doc["generation"])
        if generation <= self.generation:
            return
        self.generation = generation
        self._doc = doc
        self._adopt(doc)
        await self._acknowledge(generation)

    def attach(self, adopt: Callable[[Document], None]) -> None:
        self._adopt = adopt

    async def follow(self) -> None:
        """Adopt every new generation for as long as the process runs, and keep the lease."""
        await asyncio.gather(self._watch(), self._keep_lease())

    async def _watch(self) -> None:
        wait = _RETRY_S
        while True:
            try:
                async for events in self.store.watch(
                    self._doc_key, start_revision=self._revision + 1
                ):
                    self._back()
                    wait = _RETRY_S
                    for event in events:
                        self._revision = max(self._revision, event.kv.mod_revision)
                        if not event.deleted:
                            await self.take(self._decode(event.kv.value))
            except asyncio.CancelledError:
                raise
            except Compacted:
                # The history after the last revision seen is gone: read the document as it
                # is now (it holds every change made meanwhile) and watch on from there.
                await self._catch_up()
                continue
            except EtcdError as exc:
                self._lost(exc)
            except Exception as exc:  # a bad event must not end sharing for the process's life
                self._count("read", "unreadable")
                # The type alone: a message could quote the fleet document it choked on.
                self._log.log(
                    logging.ERROR, "follow", "following etcd failed: %s", type(exc).__name__
                )
            await asyncio.sleep(wait)
            wait = min(wait * 2, _RETRY_MAX_S)

    async def _catch_up(self) -> None:
        try:
            doc = await self._relist()
        except EtcdError as exc:
            self._lost(exc)
            return
        self.relists += 1
        await self.take(doc)

    async def _keep_lease(self) -> None:
        """Renew the lease a third of its TTL apart: what this process holds in etcd (its
        acknowledgement, the control lock while a call runs) lives as long as it does."""
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                if await self.store.keepalive(self._lease) <= 0:
                    # Expired while the store was away: a new lease, and the keys anew.
                    self._lease = await self.store.grant(self.lease_ttl_s)
                    await self._acknowledge(self.generation)
                self._back()
            except EtcdError as exc:
                self._lost(exc)

    # -- writing -------------------------------------------------------------------------

    def record(self, change: Change) -> Coroutine[Any, Any, None]:
        """Share a change this process already applied; returns once every live process
        has it (or after ack_timeout_s). Raises SharingFailed when it cannot be written."""
        if not change:
            return _nothing()
        self.pending += 1
        return self._record(change)

    async def _record(self, change: Change) -> None:
        try:
            doc = await self._merge(change)
            await self.take(doc, mine=True)
        finally:
            self.pending -= 1
        await self._wait_acks(int(doc["generation"]))

    async def _merge(self, change: Change) -> Document:
        store = self.store
        try:
            for _ in range(_MAX_ROUNDS):
                kv, _ = await store.get(self._doc_key)
                doc = self._decode(kv.value) if kv is not None else None
                if doc is None:
                    if self._doc is None:
                        raise SharingFailed(
                            f"the fleet state in {store.describe()} is damaged or gone and "
                            "this process has adopted no state to rebuild it from"
                        )
                    doc = copy.deepcopy(self._doc)
                    self.repairs += 1
                merge(doc, change)
                doc["generation"] = max(int(doc["generation"]), self.generation + 1)
                written = await store.replace(
                    self._doc_key,
                    json.dumps(doc).encode(),
                    mod_revision=kv.mod_revision if kv is not None else 0,
                )
                if written is not None:
                    self._back()
                    return doc
        except EtcdError as exc:
            self._count("write", "unwritable")
            self._lost(exc)
            raise SharingFailed(
                f"the fleet state store ({store.describe()}) cannot be written: {exc}"
            ) from None
        self._count("write", "contended")
        raise SharingFailed(
            f"the fleet state in {store.describe()} changed under {_MAX_ROUNDS} writes in a row"
        )

    async def _wait_acks(self, generation: int) -> None:
        deadline = time.monotonic() + self.ack_timeout_s
        while True:
            try:
                kvs, _ = await self.store.get_prefix(self._replicas)
            except EtcdError:
                return  # written: the others take it from the watch when they can
            behind = [
                kv.key for kv in kvs if kv.key != self._ack_key and _acked(kv.value) < generation
            ]
            if not behind:
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "fleet change %d not yet adopted by %d other gateway process(es) after %.1f s",
                    generation,
                    len(behind),
                    self.ack_timeout_s,
                )
                return
            await asyncio.sleep(_ACK_POLL_S)

    # -- the control lock ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def exclusive(self, what: str) -> AsyncIterator[None]:
        """Hold the fleet's control lock while a fleet-changing call runs. Raises StoreDown
        when the store cannot be reached, LockBusy after lock_wait_s."""
        if self.down is not None:
            raise StoreDown(self.refusal())
        store = self.store
        value = json.dumps({"replica": self.replica, "call": what}).encode()
        deadline = time.monotonic() + self.lock_wait_s
        try:
            while True:
                revision = await store.replace(
                    self._lock_key, value, mod_revision=0, lease=self._lease
                )
                if revision is not None:
                    break
                if time.monotonic() >= deadline:
                    holder, _ = await store.get(self._lock_key)
                    raise LockBusy(_busy(holder.value if holder else b"", self.lock_wait_s))
                await asyncio.sleep(_LOCK_POLL_S)
        except EtcdError as exc:
            self._lost(exc)
            raise StoreDown(self.refusal()) from None
        try:
            yield
        finally:
            try:
                await store.delete_if(self._lock_key, mod_revision=revision)
            except EtcdError as exc:
                # Left to the lease: it goes when this process's lease expires.
                self._lost(exc)

    async def close(self) -> None:
        """Give back the lease (the acknowledgement and any lock go with it) and the client."""
        if self.rid_publisher is not None:
            await self.rid_publisher.close()
        if self._lease:
            with contextlib.suppress(EtcdError):
                await self.store.revoke(self._lease)
        await self.store.close()


def _acked(value: bytes) -> int:
    try:
        generation = json.loads(value).get("generation")
    except (ValueError, AttributeError):
        return -1
    return generation if type(generation) is int else -1


def _busy(holder: bytes, waited_s: float) -> str:
    try:
        held = json.loads(holder)
        call, replica = str(held.get("call")), str(held.get("replica"))
    except (ValueError, AttributeError):
        call, replica = "a call", "another gateway"
    return (
        f"Another fleet-changing call ({call}, through gateway {replica}) is still running: "
        f"this one waited {waited_s:g} s (state.etcd.lock_wait_s) and was not sent to any "
        "engine. Repeat it once that call is answered."
    )


async def _nothing() -> None:
    return None
