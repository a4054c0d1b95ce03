"""Engine state: which engines are paused or asleep, and which weights each one serves.

Control calls through the gateway change it (gateway/edge/control.py), the document the
--workers processes share replaces it (gateway/fleet/membership.py), and each engine's own
report of its weights, read on every good health probe (gateway/fleet/health.py) and after
each update through the gateway, keeps the weight versions true even when an RL framework
updates an engine directly. The LoRA adapters each engine holds follow its answers to load
and unload calls, and its /v1/models when a request names an adapter no engine is known to
hold (gateway/edge/adapters.py); the worker type it was registered with comes from the
registry. This module is the one writer of Backend.paused, Backend.asleep,
Backend.weight_version, Backend.adapters, Backend.worker_type and
BackendPool.latest_version: a change made here
lets the requests held for a paused or asleep fleet look again when it frees an engine, and
comes back as the Change the other worker processes take.

Which version wins: the latest word, in the order the gateway learnt it. A control call
that got 2xx records the version it sent (the engine took it: SGLang sets its
weight_version on a successful update that names one), and the engine's own report, read
afterwards, confirms or replaces it. A report whose read began before another write (a
probe's /model_info answered just before an update through the gateway) is older than that
write and is dropped, so it never undoes it.

The latest version (routing.weight_version: latest) follows the fleet: an update through
the gateway sets it, and so does an engine seen moving to a version no member served
before. An engine that comes back at a version the fleet already had (a restart at its
launch weights, a rollback) does not move it, unless no member serves the latest any more:
then it follows what the engines serve.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Final

from gateway.fleet.pool import REGULAR, Backend, BackendPool
from gateway.fleet.shared import Change, Document

log = logging.getLogger("gateway.fleet.engines")

# The fields of a backend's entry in a Change and in the shared document.
PAUSED: Final = "paused"
ASLEEP: Final = "asleep"
WEIGHT_VERSION: Final = "weight_version"
LORA_ADAPTERS: Final = "lora_adapters"


def hold(pool: BackendPool, backends: Sequence[Backend], flag: str, value: bool) -> Change:
    """Set `flag` (PAUSED or ASLEEP) to `value` on `backends`: what a pause, continue,
    release or resume that they answered 2xx did to them."""
    for b in backends:
        if flag == PAUSED:
            b.paused = value
        else:
            b.asleep = value
    if not value:
        pool.wake_waiters()  # requests held for a paused or asleep fleet may go now
    return Change(states={b.url: {flag: value} for b in backends})


# How many distinct weight versions the pool remembers having seen (a string each).
VERSIONS_KEPT: Final = 4096


def serve(pool: BackendPool, versions: Mapping[str, str], latest: str | None) -> Change:
    """Record the weights each engine (by URL) serves now, and `latest` as the version
    routing.weight_version: latest follows (None: it stays as it was)."""
    for b in pool.backends:
        version = versions.get(b.url)
        if version is not None:
            _record(pool, b, version)
    if latest is not None:
        pool.latest_version = latest
    return Change(
        states={url: {WEIGHT_VERSION: v} for url, v in versions.items()}, latest_version=latest
    )


def mark(backend: Backend) -> int:
    """Taken before reading an engine's weight version; `reported` drops the answer if
    anything wrote the version since."""
    return backend.version_writes


def reported(pool: BackendPool, backend: Backend, version: str | None, since: int) -> None:
    """What an engine itself says it serves (its /model_info), read from `since` (a
    `mark`) on; None: it did not say. Not shared with the other worker processes: each
    reads every engine itself."""
    if version is None or backend.version_writes != since:
        return
    before = backend.weight_version
    if version == before:
        return
    # Its first report (None before) is where it starts, not an update.
    newer = before is not None and version not in pool.versions_seen
    _record(pool, backend, version)
    latest = pool.latest_version
    if newer or (latest is not None and all(b.weight_version != latest for b in pool.backends)):
        pool.latest_version = version
    if before is not None:
        log.info(
            "backend %s: serves weight version %r (was %r), by its own report%s",
            backend.url,
            version,
            before,
            "; now the latest" if pool.latest_version == version else "",
        )


def _record(pool: BackendPool, backend: Backend, version: str) -> None:
    backend.weight_version = version
    backend.version_writes += 1
    seen = pool.versions_seen
    if version not in seen:
        seen[version] = None
        if len(seen) > VERSIONS_KEPT:
            del seen[next(iter(seen))]


def hold_adapters(pool: BackendPool, adapters: Mapping[str, frozenset[str]]) -> Change:
    """Record the LoRA adapters each engine (by URL) holds now, as its answer to a load or
    unload call (or its /v1/models) said."""
    for b in pool.backends:
        held = adapters.get(b.url)
        if held is not None:
            b.adapters = held
    return Change(states={url: {LORA_ADAPTERS: sorted(names)} for url, names in adapters.items()})


def typed(
    pool: BackendPool,
    worker_types: Mapping[str, object],
    bootstrap_ports: Mapping[str, object] | None = None,
) -> None:
    """The worker type each member (by URL) was registered with; anything but a string
    (not registered with one) is a regular worker. A prefill worker's bootstrap_port: an
    int from 1 to 65535, else None (the engine's default)."""
    ports = bootstrap_ports or {}
    for b in pool.backends:
        kind = worker_types.get(b.url)
        b.worker_type = kind if isinstance(kind, str) else REGULAR
        port = ports.get(b.url)
        b.bootstrap_port = (
            port
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
            else None
        )


def adopt(
    pool: BackendPool,
    doc: Document,
    backends: Sequence[Backend] | None = None,
    before: Document | None = None,
) -> None:
    """Take the shared document's engine states on `backends` (None: every member, and the
    document's latest version too); `before`: the document adopted last, if any.

    Paused and asleep as the document says, absent meaning neither: what only this worker
    holds (a change it could not share) gives way, so every worker that took the same
    document routes alike. A weight version is also read from each engine by each worker,
    and an engine may have moved on since a control call wrote the document: so a version
    (and the latest one) is taken only where the document changed it since `before`, or
    for an engine this worker adopts for the first time."""
    states = doc.get("backends") or {}
    # What the document said before, for engines this worker already took it for.
    prior = (before.get("backends") or {}) if before is not None and backends is None else None
    woke = False
    for b in pool.backends if backends is None else backends:
        st = states.get(b.url) or {}
        held = b.paused or b.asleep
        b.paused = st.get("paused", False)
        b.asleep = st.get("asleep", False)
        version = st.get(WEIGHT_VERSION)
        said = None if prior is None else (prior.get(b.url) or {}).get(WEIGHT_VERSION)
        if isinstance(version, str) and (prior is None or said != version):
            _record(pool, b, version)
        if isinstance(names := st.get(LORA_ADAPTERS), list):
            b.adapters = frozenset(n for n in names if isinstance(n, str))
        woke = woke or (held and not (b.paused or b.asleep))
    if backends is None:
        latest = doc.get("latest_version")
        if before is None or before.get("latest_version") != latest:
            pool.latest_version = latest
    if woke:
        pool.wake_waiters()
