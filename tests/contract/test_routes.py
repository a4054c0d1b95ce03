"""Path classification as SGLang's router sees it (docs/sglang-contract.md sections 1 and 7).

Starlette matches the once-percent-decoded path and redirects trailing slashes away, so every
spelling it would serve as a generation route must be classified (and inspected) as one here.
Anything else is unknown (None): refused by the gateway, never forwarded uninspected.
"""

from __future__ import annotations

import pytest

from gateway.contract.routes import ErrorShape, Kind, RouteTable

TABLE = RouteTable()

INSPECTED = [
    pytest.param("/generate", "/generate", Kind.GENERATE, id="generate"),
    pytest.param("/%67enerate", "/generate", Kind.GENERATE, id="generate-percent-g"),
    pytest.param("/%67%65nerate", "/generate", Kind.GENERATE, id="generate-percent-ge"),
    pytest.param("/generate/", "/generate", Kind.GENERATE, id="generate-trailing-slash"),
    pytest.param("/generate//", "/generate", Kind.GENERATE, id="generate-two-trailing-slashes"),
    pytest.param("/generate%2F", "/generate", Kind.GENERATE, id="generate-encoded-trailing-slash"),
    pytest.param("/v1/chat/completions", "/v1/chat/completions", Kind.CHAT, id="chat"),
    pytest.param("/v1%2Fchat%2Fcompletions", "/v1/chat/completions", Kind.CHAT, id="chat-%2F"),
    pytest.param("/v1%2fchat%2fcompletions", "/v1/chat/completions", Kind.CHAT, id="chat-%2f"),
    pytest.param("/v1/chat/completions/", "/v1/chat/completions", Kind.CHAT, id="chat-slash"),
    pytest.param("/invocations", "/invocations", Kind.CHAT, id="invocations"),
    pytest.param("/vertex_generate", "/vertex_generate", Kind.VERTEX, id="vertex"),
    pytest.param("/vertex_generate/", "/vertex_generate", Kind.VERTEX, id="vertex-slash"),
    pytest.param("/v1/completions", "/v1/completions", Kind.COMPLETIONS, id="completions"),
    pytest.param("/v1/completions/", "/v1/completions", Kind.COMPLETIONS, id="completions-slash"),
    pytest.param("/v1/responses", "/v1/responses", Kind.RESPONSES, id="responses"),
    pytest.param("/v1/%72esponses", "/v1/responses", Kind.RESPONSES, id="responses-percent"),
]

FAMILIES = {
    Kind.GENERATE: ErrorShape.GENERATE,
    Kind.VERTEX: ErrorShape.GENERATE,
    Kind.CHAT: ErrorShape.OPENAI,
    Kind.COMPLETIONS: ErrorShape.OPENAI,
    Kind.RESPONSES: ErrorShape.OPENAI,
}


@pytest.mark.parametrize(("raw", "canonical", "kind"), INSPECTED)
def test_generation_routes_are_inspected(raw: str, canonical: str, kind: Kind) -> None:
    route = TABLE.match(raw)
    assert route is not None
    assert route.kind is kind
    assert route.path == canonical
    assert route.inspected
    assert route.shape is FAMILIES[kind]
    assert "POST" in route.methods


def test_generate_accepts_put() -> None:
    route = TABLE.match("/generate")
    assert route is not None
    assert route.methods == frozenset({"POST", "PUT"})


OPERATIONAL = [
    "/health",
    "/health_generate",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/v1/models",
]
CONTROL = [
    "/abort_request",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/start_profile",
    "/stop_profile",
    "/v1/loads",
    "/get_loads",
]


@pytest.mark.parametrize("path", OPERATIONAL + [p + "/" for p in OPERATIONAL[:2]])
def test_operational_routes_pass_through(path: str) -> None:
    route = TABLE.match(path)
    assert route is not None
    assert route.kind is Kind.PASSTHROUGH
    assert route.path == path.rstrip("/")
    assert not route.inspected
    assert route.shape is ErrorShape.PLAIN


@pytest.mark.parametrize("path", CONTROL)
def test_fleet_control_routes_are_their_own_kind(path: str) -> None:
    route = TABLE.match(path)
    assert route is not None and route.kind is Kind.CONTROL and not route.inspected


def test_a_control_route_cannot_be_made_passthrough() -> None:
    with pytest.raises(ValueError, match="fleet control route"):
        RouteTable(extra_passthrough=["/pause_generation"])


@pytest.mark.parametrize(
    "path", ["/workers", "/add_worker", "/init_weights_update_group", "/workers/abc/x"]
)
def test_registry_and_per_engine_routes_cannot_be_made_passthrough(path: str) -> None:
    """A passthrough would forward them to one backend without the operator check."""
    with pytest.raises(ValueError, match="fleet control route"):
        RouteTable(extra_passthrough=[path])


def test_operational_methods() -> None:
    routes = {p: TABLE.match(p) for p in ("/health", "/abort_request", "/flush_cache")}
    assert {p: r.methods for p, r in routes.items() if r is not None} == {
        "/health": frozenset({"GET", "HEAD"}),
        "/abort_request": frozenset({"POST"}),
        "/flush_cache": frozenset({"GET", "POST"}),
    }


UNKNOWN = [
    pytest.param("/Generate", id="wrong-case"),
    pytest.param("/GENERATE", id="upper-case"),
    pytest.param("//generate", id="leading-double-slash"),
    pytest.param("/x/../generate", id="dot-segments-not-resolved"),
    pytest.param("/./generate", id="dot-segment"),
    pytest.param("/%2567enerate", id="double-encoded"),
    pytest.param("/generate;x", id="path-params"),
    pytest.param("/generate%3Bx", id="encoded-semicolon"),
    pytest.param("/generatex", id="suffix"),
    pytest.param("/v1/chat", id="prefix"),
    pytest.param("/v1/chat/completions/x", id="sub-path"),
    pytest.param("generate", id="no-leading-slash"),
    pytest.param("", id="empty"),
    pytest.param("/", id="root"),
    pytest.param("/docs", id="unlisted-route"),
]


@pytest.mark.parametrize("path", UNKNOWN)
def test_unknown_paths(path: str) -> None:
    assert TABLE.match(path) is None


def test_custom_vertex_path() -> None:
    table = RouteTable(vertex_path="/predict")
    for raw in ("/predict", "/predict/", "/%70redict"):
        route = table.match(raw)
        assert route is not None, raw
        assert (route.kind, route.path, route.shape) == (
            Kind.VERTEX,
            "/predict",
            ErrorShape.GENERATE,
        )
    # The default spelling is not served by that backend: unknown, so refused.
    assert table.match("/vertex_generate") is None
    assert table.match("/generate") is not None


def test_extra_passthrough() -> None:
    table = RouteTable(extra_passthrough=["/custom", "/health"])
    for path in ("/custom", "/custom/", "/health"):
        route = table.match(path)
        assert route is not None, path
        assert route.kind is Kind.PASSTHROUGH
        assert not route.inspected


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        pytest.param({}, "/generate", id="generate"),
        pytest.param({}, "/v1/chat/completions", id="chat"),
        pytest.param({}, "/invocations", id="invocations"),
        pytest.param({}, "/v1/completions", id="completions"),
        pytest.param({}, "/v1/responses", id="responses"),
        pytest.param({}, "/vertex_generate", id="vertex"),
        pytest.param({"vertex_path": "/predict"}, "/predict", id="custom-vertex"),
    ],
)
def test_generation_route_cannot_be_passthrough(kwargs: dict[str, str], path: str) -> None:
    with pytest.raises(ValueError, match="generation route"):
        RouteTable(extra_passthrough=[path], **kwargs)
