"""Which SGLang route a request path names, matched the way SGLang's router matches it.

SGLang serves HTTP through Starlette behind uvicorn: the path is percent-decoded once
(`/%67enerate` is `/generate`, `%2F` is a slash) and a path with trailing slashes is
redirected to the path without them. The gateway must classify a path exactly so, or a
spelling the backend treats as `/generate` could slip past inspection as "unknown".
Unknown paths are refused (404), never forwarded uninspected.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote


class Kind(enum.Enum):
    """How a route's body is read by SGLang, and so how the gateway inspects it."""

    # Enum's own __hash__ is Python code (the hash of the name), run on every lookup of a
    # member in a dict or set on the request path; members are singletons compared by
    # identity, so the identity hash agrees with == and costs nothing.
    __hash__ = object.__hash__

    GENERATE = "generate"  # GenerateReqInput: sampling_params dict/list, batch forms
    VERTEX = "vertex"  # {"instances": [...], "parameters": {...GenerateReqInput kwargs}}
    CHAT = "chat"  # ChatCompletionRequest: top-level top_k/temperature/mask
    COMPLETIONS = "completions"  # CompletionRequest: no mask field (ignored by SGLang)
    RESPONSES = "responses"  # ResponsesRequest: read like chat, fail closed
    PASSTHROUGH = "passthrough"  # operational routes, forwarded uninspected
    CONTROL = "control"  # fleet operations: sent to every backend, operators only
    REGISTRY = "registry"  # the worker registry (/workers...): answered here, operators only
    GATEWAY = "gateway"  # answered by the gateway itself for its clients (probes, fleet metrics)


class ErrorShape(enum.Enum):
    """The error-body shape SGLang uses on a route (docs/sglang-contract.md section 6)."""

    GENERATE = "generate"  # {"error": {"message": ...}}
    OPENAI = "openai"  # {"object": "error", "message", "type", "param", "code"}
    PLAIN = "plain"  # FastAPI's {"detail": ...}


_SHAPE = {
    Kind.GENERATE: ErrorShape.GENERATE,
    Kind.VERTEX: ErrorShape.GENERATE,
    Kind.CHAT: ErrorShape.OPENAI,
    Kind.COMPLETIONS: ErrorShape.OPENAI,
    Kind.RESPONSES: ErrorShape.OPENAI,
    Kind.PASSTHROUGH: ErrorShape.PLAIN,
}


@dataclass(frozen=True, slots=True)
class Route:
    path: str  # canonical (decoded, no trailing slash) path
    kind: Kind
    methods: frozenset[str]
    shape: ErrorShape

    @property
    def inspected(self) -> bool:
        return self.kind not in (Kind.PASSTHROUGH, Kind.CONTROL, Kind.REGISTRY, Kind.GATEWAY)


GENERATION_ROUTES: Mapping[str, tuple[Kind, frozenset[str]]] = {
    "/generate": (Kind.GENERATE, frozenset({"POST", "PUT"})),
    "/v1/chat/completions": (Kind.CHAT, frozenset({"POST"})),
    "/invocations": (Kind.CHAT, frozenset({"POST"})),  # SageMaker alias of chat
    "/v1/completions": (Kind.COMPLETIONS, frozenset({"POST"})),
    "/v1/responses": (Kind.RESPONSES, frozenset({"POST"})),
}

_GET = frozenset({"GET", "HEAD"})
OPERATIONAL_ROUTES: Mapping[str, frozenset[str]] = {
    "/health": _GET,
    "/health_generate": _GET,
    "/model_info": _GET,
    "/get_model_info": _GET,
    "/server_info": _GET,
    "/get_server_info": _GET,
    "/v1/models": _GET,
}

# Answered by the gateway itself, as SMG answers them (gateway/edge/surfaces.py): its
# probes, and every engine's Prometheus text at once. /metrics is here too: one engine's
# counters, from whichever engine the balancer picked, would read as the fleet's.
GATEWAY_ROUTES: Mapping[str, frozenset[str]] = {
    "/liveness": _GET,
    "/readiness": _GET,
    "/engine_metrics": _GET,
    "/metrics": _GET,
}

_POST = frozenset({"POST"})
# SGLang's engine operations that act on an engine as a whole (docs/sglang-contract.md s.9):
# an RL framework means them for the whole fleet, so each is sent to every backend
# (gateway/edge/control.py), and only operators may call them.
CONTROL_ROUTES: Mapping[str, frozenset[str]] = {
    "/abort_request": _POST,
    "/flush_cache": frozenset({"GET", "POST"}),
    "/pause_generation": _POST,
    "/continue_generation": _POST,
    "/update_weights_from_disk": _POST,
    # Same body for every engine in AReaL and slime (names, dtypes, shapes, group name): the
    # engines join one broadcast, so each must get it at once.
    "/update_weights_from_distributed": _POST,
    "/load_lora_adapter": _POST,
    "/unload_lora_adapter": _POST,
    "/release_memory_occupation": _POST,
    "/resume_memory_occupation": _POST,
    "/start_profile": _POST,
    "/stop_profile": _POST,
    "/v1/loads": _GET,
    "/get_loads": _GET,
}


# The worker registry, at the paths sglang-router and SMG serve it (newer and older forms).
REGISTRY_ROUTES: Mapping[str, frozenset[str]] = {
    "/workers": frozenset({"GET", "POST"}),
    "/list_workers": _GET,
    "/add_worker": _POST,
    "/remove_worker": _POST,
}
# An engine's read routes the gateway answers for the whole fleet from what it knows of
# each engine (gateway/edge/fleet_reads.py), operators only like the registry.
FLEET_READ_ROUTES: Mapping[str, frozenset[str]] = {
    "/get_weight_version": _GET,
}
WORKER_PATH: Final = "/workers/{id}"  # GET, PUT, PATCH, DELETE one worker; the route's label
# An engine call with parameters of its own per engine (a rank offset, tensor handles on that
# engine's GPUs), sent to the one worker named: POST /workers/{id}/<SGLang path>.
ADDRESSED_PATH: Final = "/workers/{id}/*"
_WORKER_PREFIX: Final = "/workers/"
_WORKER_ROUTE_METHODS: Final = frozenset({"GET", "PUT", "PATCH", "DELETE"})
# Per-engine calls: without an address they are refused, since no one engine is meant.
PER_ENGINE_ROUTES: Mapping[str, frozenset[str]] = {
    "/init_weights_update_group": _POST,  # rank_offset differs by engine
    "/update_weights_from_tensor": _POST,
    "/destroy_weights_update_group": _POST,
    "/weights_checker": _POST,
    "/init_weights_send_group_for_remote_instance": _POST,
    "/send_weights_to_remote_instance": _POST,
}


# What an addressed call may name after the worker id: the per-engine calls, and the
# engine-wide operations, each for one engine (profile it, flush its cache, pause, abort or
# update it alone, read its load). The route is uninspected and trusted as an operator's, so
# this is a fixed list: a generation route here would carry a mask past the inspection its
# own path applies. The fanned-out calls stay addressable (one engine's LoRA, say).
ADDRESSABLE_ROUTES: Mapping[str, frozenset[str]] = {**CONTROL_ROUTES, **PER_ENGINE_ROUTES}


def addressed(path: str) -> tuple[str, str] | None:
    """(worker id, engine path) of a canonical `/workers/{id}/...` path, the engine path
    exactly as the backend's router will match it; None for any other path."""
    if not path.startswith(_WORKER_PREFIX):
        return None
    worker, slash, rest = path[len(_WORKER_PREFIX) :].partition("/")
    return (worker, "/" + rest) if slash else None


def canonical_path(raw_path: str) -> str:
    """The path SGLang's router would match for a raw request target (query excluded).

    One percent-decoding pass like uvicorn's, then trailing slashes removed as Starlette's
    redirect does (`rstrip`, so `/generate//` also lands on `/generate`).
    """
    path = unquote(raw_path) if "%" in raw_path else raw_path
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/") or "/"
    return path


_WORKER_ROUTE: Final = Route(WORKER_PATH, Kind.REGISTRY, _WORKER_ROUTE_METHODS, ErrorShape.PLAIN)
_ADDRESSED_ROUTE: Final = Route(
    ADDRESSED_PATH, Kind.CONTROL, frozenset({"GET", "POST"}), ErrorShape.PLAIN
)


class RouteTable:
    """Immutable map from canonical path to Route, built once from config."""

    __slots__ = ("_by_path",)

    def __init__(
        self,
        *,
        vertex_path: str = "/vertex_generate",
        extra_passthrough: Iterable[str] = (),
    ) -> None:
        by_path: dict[str, Route] = {}
        for path, (kind, methods) in GENERATION_ROUTES.items():
            by_path[path] = Route(path, kind, methods, _SHAPE[kind])
        by_path[vertex_path] = Route(
            vertex_path, Kind.VERTEX, frozenset({"POST"}), _SHAPE[Kind.VERTEX]
        )
        for path, methods in OPERATIONAL_ROUTES.items():
            by_path[path] = Route(path, Kind.PASSTHROUGH, methods, ErrorShape.PLAIN)
        for path, methods in GATEWAY_ROUTES.items():
            by_path[path] = Route(path, Kind.GATEWAY, methods, ErrorShape.PLAIN)
        for path, methods in CONTROL_ROUTES.items():
            by_path[path] = Route(path, Kind.CONTROL, methods, ErrorShape.PLAIN)
        for path, methods in REGISTRY_ROUTES.items():
            by_path[path] = Route(path, Kind.REGISTRY, methods, ErrorShape.PLAIN)
        for path, methods in PER_ENGINE_ROUTES.items():
            by_path[path] = Route(path, Kind.REGISTRY, methods, ErrorShape.PLAIN)
        for path, methods in FLEET_READ_ROUTES.items():
            by_path[path] = Route(path, Kind.REGISTRY, methods, ErrorShape.PLAIN)
        for configured in extra_passthrough:
            # Stored canonical, so an encoded spelling of a generation route cannot be
            # configured past the check below and then match before decoding.
            path = canonical_path(configured)
            if path in by_path and by_path[path].inspected:
                # An inspected route configured as passthrough would be a hole in the filter.
                raise ValueError(f"{path} is a generation route and cannot be passthrough")
            if (path in by_path and by_path[path].kind in (Kind.CONTROL, Kind.REGISTRY)) or (
                path.startswith(_WORKER_PREFIX)
            ):
                # Forwarded to one backend, a fleet operation would reach one engine of N, and
                # without the operator check the gateway applies to it.
                raise ValueError(f"{path} is a fleet control route and cannot be passthrough")
            by_path[path] = Route(
                path,
                Kind.PASSTHROUGH,
                frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"}),
                ErrorShape.PLAIN,
            )
        self._by_path = by_path

    def match(self, raw_path: str) -> Route | None:
        """The route for a raw path (without query), or None for an unknown path."""
        route = self._by_path.get(raw_path)
        if route is not None:
            return route
        path = canonical_path(raw_path)
        route = self._by_path.get(path)
        if route is None and path.startswith(_WORKER_PREFIX) and len(path) > len(_WORKER_PREFIX):
            rest = path[len(_WORKER_PREFIX) :]
            return _ADDRESSED_ROUTE if "/" in rest else _WORKER_ROUTE
        return route
