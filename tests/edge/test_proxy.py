"""The proxy path end to end: a real gateway in front of a real stub, a real aiohttp client."""

from __future__ import annotations

import asyncio
import hashlib
import random

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from gateway.app import Gateway
from gateway.contract.policy import MASK_MESSAGE
from gateway.testing.stub import StubBackend
from tests.conftest import (
    GatewayFactory,
    abandon_generate,
    admin_url,
    gw_url,
    last_proxied,
    proxied,
    wait_for,
)

JSON = {"Content-Type": "application/json"}


async def post(
    session: aiohttp.ClientSession, gw: Gateway, path: str, body: bytes, **headers: str
) -> tuple[int, CIMultiDict[str], bytes]:
    async with session.post(gw_url(gw, path), data=body, headers={**JSON, **headers}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


# -- rejections: status, exact message, SGLang's shape per route, never forwarded ----------


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        (
            "/generate",
            {"text": "hi", "sampling_params": {"top_p": 0.9}, "return_sampling_mask": True},
            "generate",
        ),
        (
            "/generate",
            {
                "text": "hi",
                "stream": True,
                "sampling_params": {"top_p": 0.9},
                "return_sampling_mask": "yes",
            },
            "generate",
        ),
        (
            "/vertex_generate",
            {"instances": [{"text": "a"}], "parameters": {"return_sampling_mask": 1}},
            "generate",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [], "return_sampling_mask": True, "return_meta_info": True},
            "openai",
        ),
        (
            "/invocations",
            {"messages": [], "return_sampling_mask": "on", "return_meta_info": True},
            "openai",
        ),
        ("/v1/responses", {"input": "x", "return_sampling_mask": True}, "openai"),
        ("/%67enerate", {"text": "x", "return_sampling_mask": True}, "generate"),
        ("/generate/", {"text": "x", "return_sampling_mask": True}, "generate"),
    ],
)
async def test_unbounded_mask_rejected_in_route_shape(
    stub: StubBackend,
    gateway: Gateway,
    session: aiohttp.ClientSession,
    path: str,
    body: dict[str, object],
    shape: str,
) -> None:
    status, headers, raw = await post(session, gateway, path, orjson.dumps(body))
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    assert headers["X-Request-Id"]
    assert headers["Server"] == "sglang-gateway"  # not aiohttp's name and version
    got = orjson.loads(raw)
    if shape == "generate":
        assert got == {"error": {"message": MASK_MESSAGE}}
    else:
        assert got == {
            "object": "error",
            "message": MASK_MESSAGE,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    assert stub.generation_requests() == []


async def test_put_generate_is_inspected(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    body = orjson.dumps({"text": "x", "return_sampling_mask": True})
    async with session.put(gw_url(gateway, "/generate"), data=body, headers=JSON) as r:
        assert r.status == 400
    ok = orjson.dumps({"text": "x", "sampling_params": {"top_k": 4}, "return_sampling_mask": 1})
    async with session.put(gw_url(gateway, "/generate"), data=ok, headers=JSON) as r:
        assert r.status == 200
    assert [r.method for r in stub.generation_requests()] == ["PUT"]


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b'{"text": "x",', {}, 400),
        (b"\xef\xbb\xbf{}", {}, 400),
        (b"[1, 2]", {}, 400),
        (b'{"a": NaN}', {}, 400),
        (b'{"text": "x"}', {"Content-Type": "text/plain"}, 415),
        (b'{"text": "x"}', {"Content-Type": "application/json; charset=latin-1"}, 415),
        (b'{"text": "x"}', {"Content-Encoding": "gzip"}, 415),
    ],
)
async def test_unreadable_bodies_never_forwarded(
    stub: StubBackend,
    gateway: Gateway,
    session: aiohttp.ClientSession,
    body: bytes,
    headers: dict[str, str],
    status: int,
) -> None:
    got_status, _got_headers, raw = await post(session, gateway, "/generate", body, **headers)
    assert got_status == status
    assert "message" in raw.decode()
    assert stub.generation_requests() == []


async def test_unknown_path_and_method(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    async with session.get(gw_url(gateway, "/admin/secret")) as r:
        assert r.status == 404
        assert await r.json() == {"detail": "Not Found"}
    async with session.get(gw_url(gateway, "/generate")) as r:
        assert r.status == 405
        assert await r.json() == {"detail": "Method Not Allowed"}
        assert "POST" in r.headers["Allow"]
    assert proxied(stub) == []


# -- forwarding: bytes, headers, status and body untouched --------------------------------


def _random_body(rng: random.Random) -> bytes:
    """A valid, forwardable body whose exact bytes (spacing, key order, escapes) vary."""
    params: dict[str, object] = {"max_new_tokens": rng.randint(1, 8)}
    if rng.random() < 0.7:
        params["top_k"] = rng.choice([1, 5, 40, 5.0, True])
    if rng.random() < 0.5:
        params["temperature"] = rng.choice([0, 0.0, 0.7, 1.0])
    mask_on = "top_k" in params or params.get("temperature") in (0, 0.0)
    body = {
        "text": rng.choice(
            ["hi", "h\u00e9llo \u2603", "tab\tnew\nline", "x" * rng.randint(0, 300)]
        ),
        "sampling_params": params,
        "return_sampling_mask": mask_on and rng.random() < 0.5,
        "rid": f"r{rng.randint(0, 10**6)}",
        "big": "BIG",
    }
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS if rng.random() < 0.5 else 0)
    # Numbers orjson cannot write but reads (as floats): re-serialising would change them.
    raw = raw.replace(
        b'"BIG"', rng.choice([b"18446744073709551616", b"-9223372036854775809", b"1e300", b"0.1"])
    )
    if rng.random() < 0.5:
        raw = raw.replace(b",", b" ,\n  ").replace(b":", b" : ")
    if rng.random() < 0.3:
        raw = raw.replace(b'"rid"', b'"\\u0072id"')
    return raw


async def test_forwarded_bytes_equal_sent_bytes(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    rng = random.Random(20261129)
    for _ in range(300):
        body = _random_body(rng)
        status, headers, _ = await post(session, gateway, "/generate", body)
        assert status == 200, body
        assert headers["X-Stub-Body-Sha256"] == hashlib.sha256(body).hexdigest()
        got = last_proxied(stub)
        assert got.body == body
        assert got.headers["Content-Length"] == str(len(body))
        assert "Transfer-Encoding" not in got.headers


async def test_chunked_request_body_forwarded_with_fresh_length(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    parts = [b'{"text": "chunked", ', b'"sampling_params": {"top_k": 3}, ', b'"x": 1}']

    async def gen():  # type: ignore[no-untyped-def]
        for p in parts:
            yield p

    async with session.post(gw_url(gateway, "/generate"), data=gen(), headers=JSON) as r:
        assert r.status == 200
    got = last_proxied(stub)
    assert got.body == b"".join(parts)
    assert got.headers["Content-Length"] == str(len(got.body))
    assert "Transfer-Encoding" not in got.headers


async def test_headers_hop_by_hop_dropped_and_forwarding_added(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    headers = {
        **JSON,
        "Connection": "keep-alive, X-Secret-Hop",
        "X-Secret-Hop": "1",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Trailer": "X-Foo",
        "Upgrade": "h2c",
        "Proxy-Authorization": "Basic Zm9vOmJhcg==",
        "X-Forwarded-For": "6.6.6.6",
        "X-Forwarded-Proto": "https",
        "X-Request-Id": "client-chosen-id-1",
        "Authorization": "Bearer end-to-end",
        "X-Custom": "kept",
        "User-Agent": "rollout-worker/1",
    }
    async with session.get(gw_url(gateway, "/model_info"), headers=headers) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "client-chosen-id-1"
    got = last_proxied(stub).headers
    for name in ("X-Secret-Hop", "Keep-Alive", "TE", "Trailer", "Upgrade", "Proxy-Authorization"):
        assert name not in got, name
    assert got["X-Forwarded-For"] == "127.0.0.1"
    assert got["X-Forwarded-Proto"] == "http"
    assert got["X-Request-Id"] == "client-chosen-id-1"
    assert got["Authorization"] == "Bearer end-to-end"
    assert got["X-Custom"] == "kept"
    assert got.getall("User-Agent") == ["rollout-worker/1"]  # the client's, nothing added


async def test_request_id_created_when_missing_or_unsafe(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    async with session.get(gw_url(gateway, "/health"), headers={"X-Request-Id": "bad id\t"}) as r:
        rid = r.headers["X-Request-Id"]
    assert rid != "bad id\t"
    assert len(rid) == 32
    assert last_proxied(stub).headers["X-Request-Id"] == rid


async def test_trusted_proxy_chain_is_extended(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(stub.url, forwarding={"trusted_proxies": ["127.0.0.0/8"]})
    hdrs = {"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Proto": "https"}
    async with session.get(gw_url(gw, "/v1/models"), headers=hdrs) as r:
        assert r.status == 200
    got = last_proxied(stub).headers
    assert got["X-Forwarded-For"] == "203.0.113.7, 127.0.0.1"
    assert got["X-Forwarded-Proto"] == "https"


CLIENT_ADDRESS_HEADERS = {
    "X-Real-IP": "203.0.113.7",
    "x-client-ip": "203.0.113.8",
    "True-Client-IP": "203.0.113.9",
    "CF-Connecting-IP": "203.0.113.10",
    "X-CLUSTER-CLIENT-IP": "203.0.113.11",
}


@pytest.mark.parametrize("trusted", [None, ["10.0.0.0/8"], ["127.0.0.0/8"]])
async def test_client_address_headers_only_from_a_trusted_proxy(
    stub: StubBackend,
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    trusted: list[str] | None,
) -> None:
    """A client that is no trusted proxy cannot name its own address to the backend in any
    of the spellings load balancers use; a trusted proxy's are passed on as it set them."""
    forwarding = {} if trusted is None else {"forwarding": {"trusted_proxies": trusted}}
    gw = await make_gateway(stub.url, **forwarding)
    hdrs = {**CLIENT_ADDRESS_HEADERS, "X-Custom": "kept"}
    async with session.get(gw_url(gw, "/v1/models"), headers=hdrs) as r:
        assert r.status == 200
    got = last_proxied(stub).headers
    assert got["X-Custom"] == "kept"
    assert got["X-Forwarded-For"] == "127.0.0.1"
    kept = trusted == ["127.0.0.0/8"]
    for name, value in CLIENT_ADDRESS_HEADERS.items():
        assert got.getall(name, []) == ([value] if kept else []), name


@pytest.mark.parametrize(
    "path",
    [
        "/health",
        "/health_generate",
        "/model_info",
        "/get_model_info",
        "/server_info",
        "/get_server_info",
        "/v1/models",
    ],
)
async def test_operational_routes_pass_through(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession, path: str
) -> None:
    async with session.get(gw_url(gateway, path)) as gw_r, session.get(stub.url + path) as direct:
        assert gw_r.status == direct.status == 200
        assert gw_r.headers.get("Content-Type") == direct.headers.get("Content-Type")
        gw_body, direct_body = await gw_r.read(), await direct.read()
    if path.startswith("/health"):
        assert gw_body == direct_body == b""
    else:
        assert orjson.loads(gw_body).keys() == orjson.loads(direct_body).keys()
    assert last_proxied(stub).path == path


async def test_metrics_is_the_fleets_unless_configured_as_passthrough(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    # One engine's counters behind a router read as the fleet's: the gateway answers
    # /metrics itself with every engine's (tests/edge/test_smg_surfaces.py) ...
    gw = await make_gateway(stub.url)
    async with session.get(gw_url(gw, "/metrics")) as r:
        assert r.status == 200 and "worker_addr=" in await r.text()
    assert proxied(stub) == []
    # ... unless routes.passthrough names it: then one backend answers, as before.
    gw = await make_gateway(stub.url, routes={"passthrough": ["/metrics"]})
    async with session.get(gw_url(gw, "/metrics")) as r:
        assert r.status == 200 and "worker_addr=" not in await r.text()
    assert last_proxied(stub).path == "/metrics"


async def test_abort_and_flush_pass_through(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    body = b'{"rid": "abc", "abort_all": false}'
    status, _, _ = await post(session, gateway, "/abort_request", body)
    assert status == 200
    assert last_proxied(stub).body == body
    async with session.post(gw_url(gateway, "/flush_cache")) as r:
        assert r.status == 200


async def test_backend_errors_pass_through_untouched(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    ok = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    for code in (400, 429, 500, 503):
        async with session.post(
            gw_url(gateway, "/generate"), data=ok, headers={**JSON, "X-Stub-Status": str(code)}
        ) as gw_r:
            gw_status, gw_body = gw_r.status, await gw_r.read()
        async with session.post(
            stub.url + "/generate", data=ok, headers={**JSON, "X-Stub-Status": str(code)}
        ) as direct:
            direct_status, direct_body = direct.status, await direct.read()
        assert gw_status == direct_status == code
        assert gw_body == direct_body


async def test_backend_redirect_is_returned_not_followed(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    ok = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    hdrs = {**JSON, "X-Stub-Redirect": "/generate?again=1"}
    async with session.post(
        gw_url(gateway, "/generate"), data=ok, headers=hdrs, allow_redirects=False
    ) as r:
        assert r.status == 307
        assert r.headers["Location"] == "/generate?again=1"
    assert len(stub.generation_requests()) == 1  # the gateway did not re-post it


async def test_sse_streams_event_by_event(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    body = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 5}})
    hdrs = {**JSON, "X-Stub-Chunk-Delay-Ms": "150", "X-Stub-Events": "5"}
    loop = asyncio.get_running_loop()
    arrivals: list[float] = []
    async with session.post(gw_url(gateway, "/generate"), data=body, headers=hdrs) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            arrivals.extend(loop.time() for _ in range(chunk.count(b"\n\n")))
    events = [e for e in buf.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 6
    # Not buffered: the first event arrived long before the last one was produced.
    assert arrivals[-1] - arrivals[0] > 0.4


async def test_large_response_streams_intact(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    body = orjson.dumps(
        {"text": "x", "sampling_params": {"top_k": 8}, "return_sampling_mask": True}
    )
    size = 8 << 20
    hdrs = {**JSON, "X-Stub-Response-Bytes": str(size)}
    async with session.post(stub.url + "/generate", data=body, headers=hdrs) as direct:
        expected = await direct.read()
    async with session.post(gw_url(gateway, "/generate"), data=body, headers=hdrs) as r:
        assert r.status == 200
        got = await r.read()
    assert len(got) >= size * 0.9

    def stable(raw: bytes) -> object:
        obj = orjson.loads(raw)
        for volatile in ("id", "e2e_latency"):
            obj["meta_info"].pop(volatile)
        return obj

    assert stable(got) == stable(expected)


async def test_request_body_over_limit_is_413(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(stub.url, limits={"max_body_bytes": 4096})
    big = orjson.dumps({"text": "x" * 5000})
    status, _headers, raw = await post(session, gw, "/generate", big)
    assert status == 413
    assert "limit" in orjson.loads(raw)["error"]["message"]

    async def gen():  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield b" " * 1000

    async with session.post(gw_url(gw, "/generate"), data=gen(), headers=JSON) as r:
        assert r.status == 413
    assert stub.generation_requests() == []


# -- faults: vanished clients, dying backends, no backend ---------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_closes_upstream(
    stub: StubBackend, gateway: Gateway, stream: bool
) -> None:
    await abandon_generate(gateway, stream=stream, headers={})
    await asyncio.wait_for(stub.disconnect_event.wait(), timeout=30)
    assert stub.cancelled == 1
    await wait_for(lambda: gateway.proxy is not None and gateway.proxy.inflight == 0)
    assert all(b.inflight == 0 for b in gateway.pool.backends)


@pytest.mark.parametrize("stream", [True, False])
async def test_backend_dying_mid_body_breaks_client_transfer(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession, stream: bool
) -> None:
    body = orjson.dumps({"text": "x", "stream": stream, "sampling_params": {"top_k": 2}})
    hdrs = {**JSON, "X-Stub-Drop": "mid-body", "X-Stub-Events": "50"}
    if not stream:
        hdrs["X-Stub-Response-Bytes"] = str(2 << 20)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(gw_url(gateway, "/generate"), data=body, headers=hdrs) as r:
            assert r.status == 200
            await r.read()
    # The gateway keeps serving.
    ok = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    status, _, _ = await post(session, gateway, "/generate", ok)
    assert status == 200


async def test_backend_drops_before_headers_is_502_without_replay(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    ok = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    status, _, raw = await post(
        session, gateway, "/generate", ok, **{"X-Stub-Drop": "before-headers"}
    )
    assert status == 502
    assert b"127.0.0.1" not in raw and str(stub.url).encode() not in raw
    assert len(stub.generation_requests()) == 1  # sent once, never replayed


async def test_connect_failure_retries_on_another_backend(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    dead = StubBackend()
    await dead.start()
    dead_url = dead.url
    await dead.stop()  # nothing listens there any more
    gw = await make_gateway(
        dead_url, stub.url, backends={"balancer": "round_robin", "health": {"enabled": False}}
    )
    ok = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    for _ in range(6):
        status, _, _ = await post(session, gw, "/generate", ok)
        assert status == 200
    assert len(stub.generation_requests()) == 6


async def test_no_backend_is_quick_503(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    dead = StubBackend()
    await dead.start()
    url = dead.url
    await dead.stop()
    gw = await make_gateway(url)
    ok = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    status, headers, raw = await post(session, gw, "/generate", ok)
    assert status == 503
    assert headers["Retry-After"]
    assert url.encode() not in raw
    assert orjson.loads(raw)["error"]["message"]


async def test_readiness_follows_backend_health(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    async def ready() -> int:
        async with session.get(admin_url(gateway, "/readyz")) as r:
            return r.status

    async with session.get(admin_url(gateway, "/livez")) as r:
        assert r.status == 200
    await wait_for(lambda: gateway.pool.ready)
    assert await ready() == 200
    stub.health_status = 503
    await wait_for(lambda: not gateway.pool.ready)
    assert await ready() == 503
    stub.health_status = 200
    await wait_for(lambda: gateway.pool.ready)
    assert await ready() == 200


async def test_log_only_mode_forwards_and_counts(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(stub.url, policy={"sampling_mask": {"mode": "log_only"}})
    body = orjson.dumps({"text": "x", "return_sampling_mask": True})
    status, _, _raw = await post(session, gw, "/generate", body)
    # The stub applies SGLang's own check, so the request reached it and it refused.
    assert status == 400
    assert len(stub.generation_requests()) == 1
    assert last_proxied(stub).body == body


async def test_rejection_counted_in_metrics(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    await wait_for(lambda: gateway.pool.backends[0].server_info is not None)  # 0.5.19
    body = orjson.dumps({"text": "x", "return_sampling_mask": True})
    await post(session, gateway, "/generate", body)
    async with session.get(admin_url(gateway, "/metrics")) as r:
        text = await r.text()
    assert (
        'sglang_gateway_rejections_total{policy="sampling_mask",profile="finite_top_k",'
        'reason="unbounded_top_k"} 1.0' in text
    )


async def test_response_hop_by_hop_headers_are_dropped(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    body = b'{"text": "ok"}'

    async def raw_backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Connection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\nX-Hop: secret\r\n"
            b"Proxy-Authenticate: Basic\r\nUpgrade: h2c\r\nTrailer: X-T\r\nX-End-To-End: kept\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(raw_backend, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await make_gateway(f"http://127.0.0.1:{port}", backends={"health": {"enabled": False}})
        async with session.get(gw_url(gw, "/model_info")) as r:
            assert r.status == 200
            assert await r.read() == body
            for name in ("X-Hop", "Keep-Alive", "Proxy-Authenticate", "Upgrade", "Trailer"):
                assert name not in r.headers, name
            assert r.headers["X-End-To-End"] == "kept"
            assert r.headers["X-Request-Id"]
    finally:
        server.close()
        await server.wait_closed()
