"""Fleet state shared by the worker processes of one gateway (`--workers N`).

Registry membership, paused/asleep and weight versions change through control calls, and a
control call reaches one worker: without sharing, a worker registered through one process
would be unknown to the others, and a paused engine would still get the others' traffic.

The supervisor owns one small JSON document in its private directory (created before any
worker starts, removed when it exits). A worker that changes the fleet applies the change
locally, then merges it into the document under an exclusive lock (read, change, write a
new file, rename), so concurrent changes from two workers both land. Every worker polls the
document and adopts it, then acknowledges the generation it adopted. The worker that made a
change waits (bounded) until every sibling has acknowledged it before answering the
operator: when `/pause_generation` returns, no worker still routes to the paused engines.
A worker restarted by the supervisor adopts the document before it serves.

File I/O runs in a thread: the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("gateway.fleet.shared")

# Set by the supervisor on its workers: the document's path, and how many workers share it.
STATE_ENV: Final = "SGLANG_GATEWAY_FLEET_STATE"
WORKERS_ENV: Final = "SGLANG_GATEWAY_WORKERS"

POLL_S: Final = 0.05
ACK_TIMEOUT_S: Final = 1.0

Document = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Change:
    """What one control or registry call did to the fleet."""

    added: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # url -> extras
    removed: frozenset[str] = frozenset()
    # url -> the fields it changed: paused, asleep, weight_version
    states: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    latest_version: str | None = None

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.states or self.latest_version)

    def then(self, later: Change) -> Change:
        """This change followed by `later` (whose fields win)."""
        states = {url: dict(fields) for url, fields in self.states.items()}
        for url, fields in later.states.items():
            states.setdefault(url, {}).update(fields)
        return Change(
            added={**self.added, **later.added},
            removed=self.removed | later.removed,
            states=states,
            latest_version=later.latest_version or self.latest_version,
        )


def new_document(members: list[str] | None) -> Document:
    """The document a supervisor starts with; `members` is the registry seed (None when
    membership comes from another discovery source)."""
    return {
        "generation": 0,
        "members": None if members is None else {url: {} for url in members},
        "backends": {},
        "latest_version": None,
    }


def merge(doc: Document, change: Change) -> Document:
    """`doc` with `change` applied, generation counted up."""
    members = doc.get("members")
    if members is not None:
        for url, extras in change.added.items():
            members.setdefault(url, dict(extras))
        for url in change.removed:
            members.pop(url, None)
    backends: dict[str, dict[str, Any]] = doc.setdefault("backends", {})
    for url in change.removed:
        backends.pop(url, None)
    for url, fields in change.states.items():
        backends.setdefault(url, {}).update(fields)
    if change.latest_version is not None:
        doc["latest_version"] = change.latest_version
    doc["generation"] = int(doc.get("generation", 0)) + 1
    return doc


def write_document(path: Path, doc: Document) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(doc, out)
    os.replace(tmp, path)  # readers see the old document or the new one, never half


def read_document(path: Path) -> Document:
    with path.open() as f:
        doc: Document = json.load(f)
    return doc


class SharedState:
    """One worker's view of the shared document."""

    def __init__(self, path: str | os.PathLike[str], index: int, workers: int) -> None:
        self.path = Path(path)
        self.index = index
        self.workers = workers
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self.generation = -1  # the generation this worker adopted last
        self._stamp: tuple[int, int] | None = None
        self.acks_missed = 0  # changes some sibling had not adopted when the wait ended

    @classmethod
    def from_env(cls, index: int | None) -> SharedState | None:
        path = os.environ.get(STATE_ENV)
        if path is None or index is None:
            return None
        return cls(path, index, int(os.environ.get(WORKERS_ENV, "1")))

    def _ack_path(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.ack{index}")

    # -- reading -------------------------------------------------------------------------

    def load_if_changed(self) -> Document | None:
        """The document when it changed since the last call (blocking; run in a thread)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp == self._stamp:
            return None
        try:
            doc = read_document(self.path)
        except (OSError, ValueError):
            return None  # replaced under us: the next poll reads the new one
        self._stamp = stamp
        return doc

    def acknowledge(self, generation: int) -> None:
        """Say this worker adopted `generation` (blocking)."""
        self.generation = generation
        ack = self._ack_path(self.index)
        tmp = ack.with_name(ack.name + ".new")
        tmp.write_text(str(generation))
        os.replace(tmp, ack)

    async def follow(self, adopt: Callable[[Document], None]) -> None:
        """Adopt every new generation of the document, for as long as the worker runs."""
        while True:
            try:
                doc = await asyncio.to_thread(self.load_if_changed)
                if doc is not None and int(doc.get("generation", 0)) != self.generation:
                    adopt(doc)
                    await asyncio.to_thread(self.acknowledge, int(doc["generation"]))
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad read must not end sharing for the worker's life
                log.exception("reading the shared fleet state failed")
            await asyncio.sleep(POLL_S)

    # -- writing -------------------------------------------------------------------------

    def _merge_locked(self, change: Change) -> int:
        with self._lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                doc = merge(read_document(self.path), change)
                write_document(self.path, doc)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return int(doc["generation"])

    def _acked(self, generation: int) -> list[int]:
        """The sibling workers that have not yet adopted `generation`."""
        behind = []
        for i in range(self.workers):
            if i == self.index:
                continue
            try:
                seen = int(self._ack_path(i).read_text() or -1)
            except (OSError, ValueError):
                seen = -1
            if seen < generation:
                behind.append(i)
        return behind

    async def record(self, change: Change) -> None:
        """Share a change this worker already applied; return once every sibling has it
        (or after ACK_TIMEOUT_S: a sibling that is restarting adopts it when it starts)."""
        if not change:
            return
        try:
            generation = await asyncio.to_thread(self._merge_locked, change)
        except (OSError, ValueError):
            # The change holds in this worker; its siblings miss it until the next one lands.
            log.exception("sharing a fleet change with the other workers failed")
            return
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while behind := await asyncio.to_thread(self._acked, generation):
            if time.monotonic() >= deadline:
                self.acks_missed += 1
                log.warning(
                    "fleet change %d not yet adopted by worker(s) %s after %.1f s",
                    generation,
                    ", ".join(map(str, behind)),
                    ACK_TIMEOUT_S,
                )
                return
            await asyncio.sleep(POLL_S / 2)
