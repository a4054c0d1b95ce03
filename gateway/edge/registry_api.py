"""The worker registry's HTTP face, at sglang-router's and SMG's paths.

    GET    /workers             {"workers": [worker, ...], "total", "stats": {"prefill_count",
                                "decode_count", "regular_count"}} (SMG's counts)
    POST   /workers             {"url": ..., extra keys kept} -> the worker (idempotent)
    GET    /workers/{id}        the worker, or 404
    PATCH  /workers/{id}        {"priority", "cost", "labels"} (SMG's WorkerUpdateRequest)
                                changed, labels merged -> the worker
    PUT    /workers/{id}        what it is registered with, anew ("url" must be its own)
                                -> the worker
    DELETE /workers/{id}        {"success": true, "id", "url"}, or 404
    GET    /list_workers        {"urls": [...]}                       (older sglang-router)
    POST   /add_worker?url=     the worker                           (older sglang-router)
    POST   /remove_worker?url=  {"success": true, "id", "url"}, or 404

A worker is `{"id", "url", "healthy", "state", "weight_version", "inflight", ...}` plus what
it was registered with, and SMG's `is_healthy` and `load` (its requests in flight).
PATCH and PUT change only what the gateway keeps of a registration: SMG's priority, cost and
labels are kept and shown (no SMG policy routes by them either); a per-worker api_key or
health check has nothing here to map to (auth.upstream_authorization and backends.health
hold for every worker), so naming one is a 400.
Listing works with any discovery; changing membership needs `backends.discovery:
registry` (409 otherwise: the membership comes from elsewhere). The caller is an operator:
the proxy checks that before it gets here.
"""

from __future__ import annotations

import math
from typing import Any, Final
from urllib.parse import parse_qs

import orjson

from gateway.config import normalize_backend_url
from gateway.contract.routes import PER_ENGINE_ROUTES, WORKER_PATH
from gateway.fleet.cache_aware import DECISIONS
from gateway.fleet.membership import Fleet
from gateway.fleet.pool import Backend, Health, worker_id
from gateway.fleet.registry import RegistryError
from gateway.fleet.shared import Change

# The status, the body, and what the call changed (for the gateway's other workers).
Answer = tuple[int, bytes, Change]
_UNCHANGED = Change()


def _worker(fleet: Fleet, backend: Backend) -> dict[str, Any]:
    pool = fleet.pool
    if pool.ejected(backend):
        state = "ejected"
    elif backend.asleep:
        state = "asleep"
    elif backend.paused:
        state = "paused"
    elif backend.health is Health.UNKNOWN and not pool.available(backend, pool.now()):
        state = "probation"  # registered, not yet probed healthy
    else:
        state = backend.health.value
    extras = dict(fleet.registry.extras(backend.url)) if fleet.registry is not None else {}
    return {
        **extras,
        "id": backend.id,
        "url": backend.url,
        "healthy": backend.health is Health.HEALTHY,
        "state": state,
        "weight_version": backend.weight_version,
        "version": backend.server_info.version if backend.server_info is not None else None,
        "profile": backend.profile.name,
        "paused": backend.paused,
        "asleep": backend.asleep,
        "inflight": backend.inflight,
        "worker_type": backend.worker_type,
        **_pd_counters(fleet, backend),
        **_cache_aware_counters(fleet, backend),
        "lora_adapters": sorted(backend.adapters),
        # SMG's names for the same (sgl-model-gateway WorkerInfo), for its clients.
        "is_healthy": backend.health is Health.HEALTHY,
        "load": backend.inflight,
    }


def _pd_counters(fleet: Fleet, backend: Backend) -> dict[str, Any]:
    """A prefill or decode worker's side of the pairs, on a PD fleet (backends.mode: pd)."""
    pd = fleet.pool.pd
    if pd is None or backend.plain:
        return {}
    stats = pd.stats.get(backend.url)
    counters = {"paired": stats.paired if stats else 0, "failed": stats.failed if stats else 0}
    return {"bootstrap_port": backend.bootstrap_port, "pd": counters}


def _cache_aware_counters(fleet: Fleet, backend: Backend) -> dict[str, Any]:
    """What cache_aware sent the worker and why, and what it remembers the worker holds
    (the same figures as the sglang_gateway_cache_aware_* series); none with another
    balancer."""
    prefix = fleet.pool.prefix_of(backend)
    if prefix is None:
        return {}
    url = backend.url
    stats = prefix.stats.get(url)
    return {
        "cache_aware": {
            "decisions": dict(stats.decisions) if stats else dict.fromkeys(DECISIONS, 0),
            "matched_bytes": stats.matched_bytes if stats else 0,
            "prompt_bytes": stats.prompt_bytes if stats else 0,
            "index_blocks": prefix.held_blocks(url),
            "cache_limit_bytes": prefix.cache_limit(url),
        }
    }


def _listing(fleet: Fleet) -> dict[str, Any]:
    """GET /workers: every member, and SMG's counts by worker_type (an encode worker, or
    one of a type SMG does not know, is in the total only, as in SMG)."""
    workers = [_worker(fleet, b) for b in fleet.pool.backends]
    counts = {"prefill": 0, "decode": 0, "regular": 0}
    for worker in workers:
        kind = worker.get("worker_type", "regular")
        if isinstance(kind, str) and kind in counts:
            counts[kind] += 1
    stats = {f"{kind}_count": n for kind, n in counts.items()}
    listing: dict[str, Any] = {"workers": workers, "total": len(workers), "stats": stats}
    pd = fleet.pool.pd
    if pd is not None:
        failures: dict[str, dict[str, int]] = {}
        for (side, cause), n in pd.failures.items():
            failures.setdefault(side, {})[cause] = n
        listing["pd"] = {"pairs": pd.pairs, "failures": failures}
    return listing


def _json(status: int, obj: object, change: Change = _UNCHANGED) -> Answer:
    return status, orjson.dumps(obj), change


def _error(status: int, message: str) -> Answer:
    return _json(status, {"detail": message})


def handle(fleet: Fleet, method: str, path: str, raw_path: str, body: bytes) -> Answer:
    """Answer one registry call; `path` is the route (WORKER_PATH for /workers/{id})."""
    query = parse_qs(raw_path.partition("?")[2])
    if path in PER_ENGINE_ROUTES:
        return _error(
            400,
            f"{path} takes parameters of one engine: send it to that worker, "
            f"POST /workers/{{id}}{path} (ids from GET /workers).",
        )
    if path == WORKER_PATH:
        worker = raw_path.partition("?")[0].rstrip("/").rsplit("/", 1)[1]
        backend = fleet.pool.find(worker)
        if backend is None:
            return _error(404, f"No worker {worker!r}.")
        if method == "GET":
            return _json(200, _worker(fleet, backend))
        if method in ("PUT", "PATCH"):
            return _update(fleet, backend, body, replace=method == "PUT")
        return _remove(fleet, backend.url)
    if method == "GET" and path == "/workers":
        return _json(200, _listing(fleet))
    if method == "GET" and path == "/list_workers":
        return _json(200, {"urls": [b.url for b in fleet.pool.backends]})
    if path == "/remove_worker":
        url = (query.get("url") or [""])[0]
        backend = fleet.pool.find(_normal(url))
        if backend is None:
            return _error(404, f"No worker at {url!r}.")
        return _remove(fleet, backend.url)
    # POST /workers, POST /add_worker
    if path == "/add_worker":
        fields: dict[str, Any] = {"url": (query.get("url") or [""])[0]}
    else:
        try:
            parsed = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            return _error(400, "The body must be a JSON object with a 'url'.")
        if not isinstance(parsed, dict):
            return _error(400, "The body must be a JSON object with a 'url'.")
        fields = parsed
    registry = fleet.registry
    if registry is None:
        return _error(409, _NOT_REGISTRY.format(fleet.cfg.discovery))
    # SMG's registration may carry the worker's own api_key. Nothing here sends it (one
    # credential for every backend: auth.upstream_authorization), and what is kept is shown
    # by GET /workers and written to the shared state file: so it is dropped, never kept.
    extras = {k: v for k, v in fields.items() if k not in _NOT_KEPT}
    try:
        url, _ = registry.add(fields.get("url"), extras)
    except RegistryError as exc:
        return _error(400, str(exc))
    backend = fleet.pool.find(url)
    assert backend is not None  # published to the pool at once
    # Shared even when this worker knew it already: it may be the one worker that does (a
    # registration whose sharing failed), and a retry must reach the others. Merging a
    # member the document has changes nothing there.
    change = Change(added={url: registry.extras(url)})
    return _json(200, _worker(fleet, backend), change)


# Fields of a registration never kept: url is the key itself, api_key a credential.
_NOT_KEPT: Final = frozenset({"url", "api_key"})

_NOT_REGISTRY = (
    "backends.discovery is {}: the membership comes from it, not from this call "
    "(set backends.discovery: registry to register workers over HTTP)."
)


def _normal(url: str) -> str:
    try:
        return normalize_backend_url(url)
    except ValueError:
        return url


# What PATCH /workers/{id} changes, as SMG's WorkerUpdateRequest names it.
UPDATABLE: Final = ("priority", "cost", "labels")
# SMG's other fields, which hold for every worker here: the setting that does.
_FLEET_WIDE: Final = {
    "api_key": "auth.upstream_authorization (one credential for every backend)",
    "health": "backends.health (one probe for every backend)",
}


def _fields_problem(fields: dict[str, Any], *, patch: bool) -> str | None:
    """Why these registration fields cannot be taken, or None."""
    fleet_wide = [k for k in fields if k in _FLEET_WIDE]
    if fleet_wide:
        why = "; ".join(f"{k}: {_FLEET_WIDE[k]}" for k in fleet_wide)
        return (
            f"Per-worker {', '.join(fleet_wide)} cannot be set here: the gateway has one "
            f"setting for all workers ({why}). Accepted: {', '.join(UPDATABLE)}."
        )
    if patch and (unknown := sorted(set(fields) - set(UPDATABLE))):
        return (
            f"PATCH /workers/{{id}} cannot change {', '.join(map(repr, unknown))}. Accepted: "
            f"{', '.join(UPDATABLE)} (PUT /workers/{{id}} replaces the whole registration)."
        )
    priority = fields.get("priority")
    if "priority" in fields and (
        not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority < 2**32
    ):
        return "priority must be an integer from 0 to 4294967295."
    cost = fields.get("cost")
    if "cost" in fields and (
        not isinstance(cost, int | float) or isinstance(cost, bool) or not math.isfinite(cost)
    ):
        return "cost must be a finite number."
    labels = fields.get("labels")
    if "labels" in fields and not (
        isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())
    ):
        return "labels must be an object of string values."
    return None


def _update(fleet: Fleet, backend: Backend, body: bytes, *, replace: bool) -> Answer:
    """PATCH: the fields given change (labels merged, as SMG merges them); PUT: the
    registration is the body, its url the worker's own."""
    registry = fleet.registry
    if registry is None:
        return _error(409, _NOT_REGISTRY.format(fleet.cfg.discovery))
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        return _error(400, "The body must be a JSON object.")
    if replace and "url" in parsed:
        url = parsed.pop("url")
        if not isinstance(url, str) or _normal(url) != backend.url:
            return _error(
                400,
                f"URL mismatch: worker {backend.id} has URL {backend.url!r} but the body has "
                f"{url!r}. URL changes are not supported via PUT. Use DELETE + POST instead.",
            )
    if (problem := _fields_problem(parsed, patch=not replace)) is not None:
        return _error(400, problem)
    if replace:
        extras = parsed
    else:
        extras = dict(registry.extras(backend.url))
        labels = parsed.pop("labels", None)
        if labels is not None:
            old = extras.get("labels")
            extras["labels"] = {**(old if isinstance(old, dict) else {}), **labels}
        extras.update(parsed)
    registry.update(backend.url, extras)
    change = Change(updated={backend.url: registry.extras(backend.url)})
    return _json(200, _worker(fleet, backend), change)


def _remove(fleet: Fleet, url: str) -> Answer:
    registry = fleet.registry
    if registry is None:
        return _error(409, _NOT_REGISTRY.format(fleet.cfg.discovery))
    registry.remove(url)
    change = Change(removed=frozenset({url}))
    return _json(200, {"success": True, "id": worker_id(url), "url": url}, change)
