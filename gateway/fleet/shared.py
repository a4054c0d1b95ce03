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


def new_document(members: list[str]) -> Document:
    """The document a supervisor starts with; `members` is the registry seed."""
    return {
        "generation": 0,
        "members": {url: {} for url in members},
        "backends": {},
        "latest_version": None,
    }


def merge(doc: Document, change: Change) -> Document:
    """`doc` with `change` applied, generation counted up."""
    members: dict[str, Any] = doc.setdefault("members", {})
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


def update_locked(path: Path, change: Callable[[Document], Document]) -> Document:
    """Read, change and replace the document under an exclusive lock (blocking), so that
    changes made at once by several processes all land. Returns the new document."""
    with path.with_name(path.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            doc = change(read_document(path))
            write_document(path, doc)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return doc


def reseed(path: Path, members: list[str]) -> Document:
    """A reload turned registry discovery on: the registry starts from the new seed."""

    def change(doc: Document) -> Document:
        doc["members"] = {url: {} for url in members}
        doc["generation"] = int(doc.get("generation", 0)) + 1
        return doc

    return update_locked(path, change)


class SharedState:
    """One worker's view of the shared document."""

    def __init__(self, path: str | os.PathLike[str], index: int, workers: int) -> None:
        self.path = Path(path)
        self.index = index
        self.workers = workers
        # The newest generation this worker adopted. Only newer documents are taken, so a
        # poll that read the file just before this worker's own change never reverts it.
        self.generation = -1
        self._adopt: Callable[[Document], None] | None = None

    @classmethod
    def from_env(cls, index: int | None) -> SharedState | None:
        path = os.environ.get(STATE_ENV)
        if path is None or index is None:
            return None
        return cls(path, index, int(os.environ.get(WORKERS_ENV, "1")))

    def _ack_path(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.ack{index}")

    # -- reading -------------------------------------------------------------------------

    def load(self) -> Document | None:
        """The document as it is now (blocking; run in a thread). Read whole every time:
        it is small, and a file's mtime and inode can repeat across two quick writes."""
        try:
            return read_document(self.path)
        except (OSError, ValueError):
            return None  # missing, or replaced under us: the next poll reads the new one

    def _acknowledge(self, generation: int) -> None:
        ack = self._ack_path(self.index)
        tmp = ack.with_name(ack.name + ".new")
        tmp.write_text(str(generation))
        os.replace(tmp, ack)

    async def take(self, doc: Document | None) -> None:
        """Adopt `doc` if it is newer than what this worker has, and say so."""
        if doc is None or self._adopt is None:
            return
        generation = int(doc.get("generation", 0))
        if generation <= self.generation:
            return
        # Checked and adopted in one step of the loop: nothing runs in between.
        self.generation = generation
        self._adopt(doc)
        await asyncio.to_thread(self._acknowledge, generation)

    def attach(self, adopt: Callable[[Document], None]) -> None:
        """Who takes the documents this worker adopts (its Fleet)."""
        self._adopt = adopt

    async def follow(self) -> None:
        """Adopt every new generation of the document, for as long as the worker runs."""
        while True:
            try:
                await self.take(await asyncio.to_thread(self.load))
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad read must not end sharing for the worker's life
                log.exception("reading the shared fleet state failed")
            await asyncio.sleep(POLL_S)

    # -- writing -------------------------------------------------------------------------

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
        (or after ACK_TIMEOUT_S: a sibling that is restarting adopts it when it starts).
        This worker adopts the merged document at once (siblings' changes included)."""
        if not change:
            return
        try:
            doc = await asyncio.to_thread(update_locked, self.path, lambda d: merge(d, change))
        except (OSError, ValueError):
            # The change holds in this worker; its siblings miss it until the next one lands.
            log.exception("sharing a fleet change with the other workers failed")
            return
        await self.take(doc)
        generation = int(doc["generation"])
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while behind := await asyncio.to_thread(self._acked, generation):
            if time.monotonic() >= deadline:
                log.warning(
                    "fleet change %d not yet adopted by worker(s) %s after %.1f s",
                    generation,
                    ", ".join(map(str, behind)),
                    ACK_TIMEOUT_S,
                )
                return
            await asyncio.sleep(POLL_S / 2)
