"""Engine state: which engines are paused or asleep, and which weights each one serves.

Control calls through the gateway change it (gateway/edge/control.py), the document the
--workers processes share replaces it (gateway/fleet/membership.py), an engine's own
/model_info confirms its weights after an update, and a probe reads them once when an
engine joins (gateway/fleet/health.py). The LoRA adapters each engine holds follow its
answers to load and unload calls, and its /v1/models when a request names an adapter no
engine is known to hold (gateway/edge/adapters.py); the worker type it was registered with
comes from the registry. This module is the one writer of Backend.paused, Backend.asleep,
Backend.weight_version, Backend.adapters, Backend.worker_type and
BackendPool.latest_version: a change made here
lets the requests held for a paused or asleep fleet look again when it frees an engine, and
comes back as the Change the other worker processes take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from gateway.fleet.pool import REGULAR, Backend, BackendPool
from gateway.fleet.shared import Change, Document

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


def serve(pool: BackendPool, versions: Mapping[str, str], latest: str | None) -> Change:
    """Record the weights each engine (by URL) serves now, and `latest` as the version
    routing.weight_version: latest follows (None: it stays as it was)."""
    for b in pool.backends:
        version = versions.get(b.url)
        if version is not None:
            b.weight_version = version
    if latest is not None:
        pool.latest_version = latest
    return Change(
        states={url: {WEIGHT_VERSION: v} for url, v in versions.items()}, latest_version=latest
    )


def joined(backend: Backend, version: str | None) -> None:
    """The weights an engine said it serves when it joined (None: it did not say); later
    updates through the gateway set them."""
    backend.weight_version = version


def hold_adapters(pool: BackendPool, adapters: Mapping[str, frozenset[str]]) -> Change:
    """Record the LoRA adapters each engine (by URL) holds now, as its answer to a load or
    unload call (or its /v1/models) said."""
    for b in pool.backends:
        held = adapters.get(b.url)
        if held is not None:
            b.adapters = held
    return Change(states={url: {LORA_ADAPTERS: sorted(names)} for url, names in adapters.items()})


def typed(pool: BackendPool, worker_types: Mapping[str, object]) -> None:
    """The worker type each member (by URL) was registered with; anything but a string
    (not registered with one) is a regular worker."""
    for b in pool.backends:
        kind = worker_types.get(b.url)
        b.worker_type = kind if isinstance(kind, str) else REGULAR


def adopt(pool: BackendPool, doc: Document, backends: Sequence[Backend] | None = None) -> None:
    """Take the shared document's engine states on `backends` (None: every member, and the
    document's latest version too).

    Paused and asleep as the document says, absent meaning neither: what only this worker
    holds (a change it could not share) gives way, so every worker that took the same
    document routes alike. A weight version is also read from each engine by each worker,
    so only one the document names replaces it."""
    states = doc.get("backends") or {}
    woke = False
    for b in pool.backends if backends is None else backends:
        st = states.get(b.url) or {}
        held = b.paused or b.asleep
        b.paused = st.get("paused", False)
        b.asleep = st.get("asleep", False)
        if isinstance(version := st.get(WEIGHT_VERSION), str):
            b.weight_version = version
        if isinstance(names := st.get(LORA_ADAPTERS), list):
            b.adapters = frozenset(n for n in names if isinstance(n, str))
        woke = woke or (held and not (b.paused or b.asleep))
    if backends is None:
        pool.latest_version = doc.get("latest_version")
    if woke:
        pool.wake_waiters()
