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

The document is the workers' one truth: each adopts it whole (paused, asleep and members
as it says), so after any change that lands every worker holds the same view. A write is
atomic (a new file, fsynced, renamed over the old), so a full disk never leaves half a
document. A change that cannot be written (ENOSPC, EACCES, ...) raises SharingFailed: the
caller says so to the operator instead of answering as if every worker knew. A document
damaged from outside (truncated, not an object, wrong types) is never adopted; the first
worker that notices rebuilds it from its own view (every change answered as shared is in
it: the answer waits for every sibling to adopt it) and the others adopt the rebuilt one.
Reading and writing problems are counted, and logged at most once per LOG_EVERY_S.

File I/O runs in a thread: the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("gateway.fleet.shared")

# Set by the supervisor on its workers: the document's path, and how many workers share it.
STATE_ENV: Final = "SGLANG_GATEWAY_FLEET_STATE"
WORKERS_ENV: Final = "SGLANG_GATEWAY_WORKERS"

POLL_S: Final = 0.05
ACK_TIMEOUT_S: Final = 1.0
# A problem that repeats (a damaged file read every poll, every write on a full disk) is
# logged once per this many seconds, with the count of lines held back in between.
LOG_EVERY_S: Final = 10.0
# How often a worker tries again to rebuild a damaged document it could not rebuild.
REPAIR_EVERY_S: Final = 1.0

Document = dict[str, Any]


class Damaged(ValueError):
    """The document is not one a gateway wrote: truncated, not an object, wrong types."""


class SharingFailed(Exception):
    """A change applied in this worker could not be handed to its siblings."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Throttled:
    """At most one log line per key every `every_s`; the next one says how many were held."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self._log = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return
        self._last[key] = now
        if held := self._held.pop(key, 0):
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, held, now - (last or now))
        self._log.log(level, msg, *args)


@dataclass(frozen=True, slots=True)
class Change:
    """What one control or registry call did to the fleet."""

    added: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # url -> extras
    removed: frozenset[str] = frozenset()
    # url -> its extras anew, for a member whose registration was changed (PUT/PATCH)
    updated: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # url -> the fields it changed: paused, asleep, weight_version, lora_adapters
    states: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    latest_version: str | None = None

    def __bool__(self) -> bool:
        return bool(
            self.added or self.removed or self.updated or self.states or self.latest_version
        )


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
    for url, extras in change.updated.items():
        if url in members:  # a member removed meanwhile stays removed
            members[url] = dict(extras)
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
    """Replace the document atomically: readers see the old one or the new one, and a
    crash or a full disk never leaves a part of it (the data is on disk before the rename,
    and a write that fails leaves the old file and no temporary one)."""
    data = json.dumps(doc).encode()
    tmp = path.with_name(path.name + f".{os.getpid()}.new")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # The rename itself, durable too; readers already see the new file either way.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def validate(doc: object) -> Document:
    """`doc` if it has the shape new_document and merge give it, else Damaged saying why."""
    if not isinstance(doc, dict):
        raise Damaged(f"the document is a JSON {type(doc).__name__}, not an object")
    generation = doc.get("generation")
    if type(generation) is not int or generation < 0:
        raise Damaged("generation is not a count")
    members, backends = doc.get("members"), doc.get("backends")
    if not isinstance(members, dict) or not all(isinstance(e, dict) for e in members.values()):
        raise Damaged("members is not an object of objects")
    if not isinstance(backends, dict) or not all(isinstance(e, dict) for e in backends.values()):
        raise Damaged("backends is not an object of objects")
    for state in backends.values():
        for flag in ("paused", "asleep"):
            if not isinstance(state.get(flag, False), bool):
                raise Damaged(f"a backend's {flag} is not a boolean")
        if not isinstance(state.get("weight_version", ""), (str, type(None))):
            raise Damaged("a backend's weight_version is not a string")
        adapters = state.get("lora_adapters", [])
        if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
            raise Damaged("a backend's lora_adapters is not a list of names")
    if not isinstance(doc.get("latest_version"), (str, type(None))):
        raise Damaged("latest_version is not a string")
    return doc


def read_document(path: Path) -> Document:
    """The document, validated; Damaged if it is not one a gateway wrote, OSError if it
    cannot be read (FileNotFoundError: it is gone)."""
    data = path.read_bytes()
    try:
        doc = json.loads(data)
    except ValueError:
        # Not quoted: the file may hold anything.
        raise Damaged(f"{len(data)} bytes that are not a JSON document") from None
    return validate(doc)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The exclusive lock every change to the document is made under (blocking), so that
    changes made at once by several processes all land."""
    with path.with_name(path.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ack_path(path: Path, index: int) -> Path:
    """Where worker `index` writes the generation it adopted last."""
    return path.with_name(f"{path.name}.ack{index}")


def acknowledged(path: Path, workers: int) -> list[int]:
    """Each worker's last adopted generation (-1: none yet, or unreadable)."""
    seen = []
    for i in range(workers):
        try:
            seen.append(int(ack_path(path, i).read_text() or -1))
        except (OSError, ValueError):
            seen.append(-1)
    return seen


def reseed(path: Path, members: list[str], workers: int) -> Document:
    """A reload turned registry discovery on: the registry starts from the new seed. A
    damaged document is replaced by a new one, counted above what any worker adopted."""

    def change(doc: Document) -> Document:
        doc["members"] = {url: {} for url in members}
        doc["generation"] = max(doc["generation"], *acknowledged(path, workers)) + 1
        return doc

    with _locked(path):
        try:
            doc = read_document(path)
        except (Damaged, FileNotFoundError):
            doc = new_document([])
        doc = change(doc)
        write_document(path, doc)
    return doc


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
        self._doc: Document | None = None  # the last document adopted: a damaged one's repair
        # Changes applied here and not yet written: until this worker adopts its own merged
        # document, a sibling's (without the change) must not undo it here.
        self.pending = 0
        self._damaged: str | None = None  # why the last read found no document to adopt
        self._next_repair = 0.0
        # (operation, reason) -> count: read / write / ack, damaged / unreadable / unwritable.
        self.errors: dict[tuple[str, str], int] = {}
        self.repairs = 0  # damaged documents this worker rebuilt
        self._log = Throttled(log)

    @classmethod
    def from_env(cls, index: int | None) -> SharedState | None:
        path = os.environ.get(STATE_ENV)
        if path is None or index is None:
            return None
        return cls(path, index, int(os.environ.get(WORKERS_ENV, "1")))

    def _count(self, operation: str, reason: str) -> None:
        key = (operation, reason)
        self.errors[key] = self.errors.get(key, 0) + 1

    # -- reading -------------------------------------------------------------------------

    def load(self) -> Document | None:
        """The document as it is now, or None when there is none to adopt (blocking; run in
        a thread). Read whole every time: it is small, and a file's mtime and inode can
        repeat across two quick writes. Never raises: a bad read is counted and logged."""
        try:
            doc = read_document(self.path)
        except (Damaged, FileNotFoundError) as exc:
            self._damaged = _why(exc)
            self._count("read", "damaged")
            self._log.log(
                logging.ERROR,
                "read",
                "the shared fleet state %s is damaged (%s): not adopted",
                self.path,
                self._damaged,
            )
            return None
        except OSError as exc:
            self._damaged = None  # not known to be damaged: nothing to rebuild
            self._count("read", "unreadable")
            self._log.log(
                logging.ERROR,
                "read",
                "the shared fleet state %s cannot be read: %s",
                self.path,
                _os_error(exc),
            )
            return None
        self._damaged = None
        return doc

    def _acknowledge(self, generation: int) -> None:
        ack = ack_path(self.path, self.index)
        tmp = ack.with_name(ack.name + ".new")
        try:
            tmp.write_text(str(generation))
            os.replace(tmp, ack)
        except OSError as exc:
            # Siblings waiting for this worker give up after ACK_TIMEOUT_S and say so.
            self._count("ack", "unwritable")
            self._log.log(
                logging.ERROR,
                "ack",
                "cannot acknowledge fleet state %d: %s",
                generation,
                _os_error(exc),
            )

    async def take(self, doc: Document | None, *, mine: bool = False) -> None:
        """Adopt `doc` if it is newer than what this worker has, and say so. `mine`: the
        document this worker just wrote, which holds its own change."""
        if doc is None or self._adopt is None:
            return
        if self.pending > (1 if mine else 0):
            # A change of this worker's is applied and not yet in a document; the one that
            # holds it comes next (and holds this one's changes as well).
            return
        generation = int(doc["generation"])
        if generation <= self.generation:
            return
        # Checked and adopted in one step of the loop: nothing runs in between.
        self.generation = generation
        self._doc = doc
        self._adopt(doc)
        await asyncio.to_thread(self._acknowledge, generation)

    def attach(self, adopt: Callable[[Document], None]) -> None:
        """Who takes the documents this worker adopts (its Fleet)."""
        self._adopt = adopt

    async def follow(self) -> None:
        """Adopt every new generation of the document, for as long as the worker runs."""
        while True:
            try:
                doc = await asyncio.to_thread(self.load)
                if doc is None and self._damaged is not None and self._doc is not None:
                    doc = await self._repair()
                await self.take(doc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad read must not end sharing for the worker's life
                self._count("read", "unreadable")
                self._log.log(
                    logging.ERROR,
                    "follow",
                    "following the shared fleet state failed: %s",
                    type(exc).__name__,
                )
            await asyncio.sleep(POLL_S)

    async def _repair(self) -> Document | None:
        """Rebuild a damaged document from this worker's view (at most every
        REPAIR_EVERY_S while it cannot be written)."""
        now = time.monotonic()
        if now < self._next_repair:
            return None
        self._next_repair = now + REPAIR_EVERY_S
        try:
            doc, _ = await asyncio.to_thread(self._merge, None)
        except SharingFailed:
            return None
        return doc

    # -- writing -------------------------------------------------------------------------

    def _highest(self) -> int:
        """Above every generation a worker adopted: a document restored from an older copy
        (or rebuilt) must still be newer to each of them."""
        return max(self.generation, *acknowledged(self.path, self.workers))

    def _merge(self, change: Change | None) -> tuple[Document, bool]:
        """Under the lock: merge `change` into the document (None: only rebuild it if it is
        damaged) and write it; (the document, whether it was rebuilt). Blocking; raises
        SharingFailed, already counted and logged."""
        try:
            with _locked(self.path):
                try:
                    doc, rebuilt = read_document(self.path), None
                except (Damaged, FileNotFoundError) as exc:
                    if self._doc is None:
                        raise SharingFailed(
                            f"the shared state file is damaged ({_why(exc)}) and this "
                            "worker has adopted no state to rebuild it from"
                        ) from None
                    doc, rebuilt = copy.deepcopy(self._doc), _why(exc)
                if change is None and rebuilt is None:
                    return doc, False  # repaired meanwhile by another worker
                if change is not None:
                    merge(doc, change)
                doc["generation"] = max(int(doc["generation"]), self._highest() + 1)
                write_document(self.path, doc)
        except SharingFailed as exc:
            self._count("write", "damaged")
            self._log_failure(change, exc.reason)
            raise
        except OSError as exc:
            self._count("write", "unwritable")
            reason = f"the shared state file cannot be written: {_os_error(exc)}"
            self._log_failure(change, reason)
            raise SharingFailed(reason) from None
        if rebuilt is not None:
            self.repairs += 1
            self._log.log(
                logging.WARNING,
                "repair",
                "the shared fleet state was damaged (%s): rebuilt from worker %d's view as "
                "generation %d",
                rebuilt,
                self.index,
                doc["generation"],
            )
        return doc, rebuilt is not None

    def _log_failure(self, change: Change | None, reason: str) -> None:
        if change is None:
            self._log.log(logging.ERROR, "write", "rebuilding the shared fleet state: %s", reason)
        else:
            self._log.log(
                logging.ERROR,
                "write",
                "a fleet change was not shared (%s): it holds in worker %d only, and its call "
                "is answered 503",
                reason,
                self.index,
            )

    def record(self, change: Change) -> Coroutine[Any, Any, None]:
        """Share a change this worker already applied; the coroutine returns once every
        sibling has it (or after ACK_TIMEOUT_S: a sibling that is restarting adopts it when
        it starts). This worker adopts the merged document at once (siblings' changes
        included).

        Counted as pending from this call on, so no sibling's document (which lacks the
        change) undoes it here before it is written. The coroutine raises SharingFailed when
        the change could not be written: it then holds in this worker alone, until the next
        document any worker shares replaces it."""
        if not change:
            return _nothing()
        self.pending += 1
        return self._record(change)

    async def _record(self, change: Change) -> None:
        try:
            doc, _ = await asyncio.to_thread(self._merge, change)
            await self.take(doc, mine=True)
        finally:
            self.pending -= 1
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

    def _acked(self, generation: int) -> list[int]:
        """The sibling workers that have not yet adopted `generation`."""
        seen = acknowledged(self.path, self.workers)
        return [i for i in range(self.workers) if i != self.index and seen[i] < generation]


async def _nothing() -> None:
    return None


def _why(exc: Exception) -> str:
    """Why there is no document to read, naming no path."""
    return "the file is gone" if isinstance(exc, FileNotFoundError) else str(exc)


def _os_error(exc: OSError) -> str:
    """The error's name and text, without the path it names (the private directory)."""
    name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return f"{name} ({exc.strerror})" if exc.strerror else name
