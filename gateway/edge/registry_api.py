"""The worker registry's HTTP face, at sglang-router's and SMG's paths.

    GET    /workers             {"workers": [worker, ...]}
    POST   /workers             {"url": ..., extra keys kept} -> the worker (idempotent)
    GET    /workers/{id}        the worker, or 404
    DELETE /workers/{id}        {"success": true, "id", "url"}, or 404
    GET    /list_workers        {"urls": [...]}                       (older sglang-router)
    POST   /add_worker?url=     the worker                           (older sglang-router)
    POST   /remove_worker?url=  {"success": true, "id", "url"}, or 404

A worker is `{"id", "url", "healthy", "state", "weight_version", "inflight", ...}` plus what
it was registered with. Listing works with any discovery; changing membership needs
`backends.discovery: registry` (409 otherwise: the membership comes from elsewhere).
The caller is an operator: the proxy checks that before it gets here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

import orjson

from gateway.config import normalize_backend_url
from gateway.contract.routes import PER_ENGINE_ROUTES, WORKER_PATH
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
        "lora_adapters": sorted(backend.adapters),
    }


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
        return _remove(fleet, backend.url)
    if method == "GET" and path == "/workers":
        return _json(200, {"workers": [_worker(fleet, b) for b in fleet.pool.backends]})
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
    extras = {k: v for k, v in fields.items() if k != "url"}
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


_NOT_REGISTRY = (
    "backends.discovery is {}: the membership comes from it, not from this call "
    "(set backends.discovery: registry to register workers over HTTP)."
)


def _normal(url: str) -> str:
    try:
        return normalize_backend_url(url)
    except ValueError:
        return url


def _remove(fleet: Fleet, url: str) -> Answer:
    registry = fleet.registry
    if registry is None:
        return _error(409, _NOT_REGISTRY.format(fleet.cfg.discovery))
    registry.remove(url)
    change = Change(removed=frozenset({url}))
    return _json(200, {"success": True, "id": worker_id(url), "url": url}, change)
