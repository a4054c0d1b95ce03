"""Reliability checklist, "Bad inputs" (shared/reliability-checklist.md), one test per row.

The adversarial-body row is tests/hardening/corpus.py + test_differential.py; the rest is here:
unreadable bodies on every route, encodings and media types, routes and methods, hop-by-hop
and forwarding headers, request smuggling over raw sockets, and size caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os

import aiohttp
import orjson
import pytest
from multidict import CIMultiDictProxy

from gateway.app import Gateway
from gateway.contract.policy import MASK_MESSAGE
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url, proxied
from tests.hardening.checks import assert_no_internals
from tests.hardening.rawnet import (
    FaultBackend,
    parse_responses,
    raw_exchange,
    raw_first_response,
)

JSON = {"Content-Type": "application/json"}
GENERATION_ROUTES = [
    ("POST", "/generate"),
    ("PUT", "/generate"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/invocations"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/vertex_generate"),
]
UNREADABLE = {
    "utf-8 BOM": b'\xef\xbb\xbf{"text": "x"}',
    "utf-16": '{"text": "x"}'.encode("utf-16"),
    "utf-16-le": '{"text": "x"}'.encode("utf-16-le"),
    "utf-32": '{"text": "x"}'.encode("utf-32"),
    "invalid utf-8": b'{"text": "\xc3\x28"}',
    "lone surrogate": b'{"text": "\\udc00"}',
    "NaN": b'{"text": "x", "top_k": NaN}',
    "-Infinity": b'{"text": "x", "top_k": -Infinity}',
    "1e400": b'{"text": "x", "top_k": 1e400}',
    "trailing data": b'{"text": "x"}{"return_sampling_mask": true}',
    "deep nesting": b'{"x":' * 1100 + b"1" + b"}" * 1100,
    "top-level array": b'[{"text": "x"}]',
    "top-level string": b'"{\\"text\\": \\"x\\"}"',
    "empty": b"",
    "whitespace only": b" \n ",
}

META = {"return_meta_info": True}


def _vmrss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# -- unreadable bodies: 400 from the gateway on every generation route, never forwarded -----------


@pytest.mark.parametrize(("method", "path"), GENERATION_ROUTES)
async def test_unreadable_bodies_never_forwarded_on_any_route(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession, method: str, path: str
) -> None:
    for name, body in UNREADABLE.items():
        async with session.request(method, gw_url(gateway, path), data=body, headers=JSON) as r:
            assert r.status == 400, name
            assert_no_internals(await r.read(), addresses=[stub.url])
    assert stub.generation_requests() == []


# -- encodings and media types --------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Encoding": "gzip"},
        {"Content-Encoding": "br"},
        {"Content-Encoding": "deflate"},
        {"Content-Encoding": "GZIP"},
        {"Content-Encoding": "identity, gzip"},
        {"Content-Encoding": "x-custom"},
        {"Content-Type": "application/json; charset=latin-1"},
        {"Content-Type": "application/json; charset=utf-16"},
        {"Content-Type": 'application/json; charset="iso-8859-1"'},
        {"Content-Type": "text/plain"},
        {"Content-Type": "text/json"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {"Content-Type": "application/jsonx"},
        {"Content-Type": "application/json, text/plain"},
    ],
)
@pytest.mark.parametrize(("method", "path"), GENERATION_ROUTES[::2])
async def test_encodings_and_media_types_are_415(
    stub: StubBackend,
    gateway: Gateway,
    session: aiohttp.ClientSession,
    headers: dict[str, str],
    method: str,
    path: str,
) -> None:
    body = orjson.dumps({"text": "x", "messages": [], "sampling_params": {"top_k": 2}})
    async with session.request(
        method, gw_url(gateway, path), data=body, headers={**JSON, **headers}
    ) as r:
        assert r.status == 415
    assert stub.generation_requests() == []


async def test_identity_encoding_and_utf8_charsets_pass(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    body = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    for headers in (
        {"Content-Encoding": "identity"},
        {"Content-Type": "application/json; charset=utf-8"},
        {"Content-Type": "Application/JSON; Charset=UTF8"},
        {"Content-Type": "application/problem+json"},
    ):
        async with session.post(
            gw_url(gateway, "/generate"), data=body, headers={**JSON, **headers}
        ) as r:
            assert r.status == 200, headers
    assert len(stub.generation_requests()) == 4


# -- routes and methods ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        *[(m, p, {"text": "x", "return_sampling_mask": True}) for m, p in GENERATION_ROUTES[:2]],
        ("POST", "/generate/", {"text": "x", "return_sampling_mask": True}),
        ("POST", "/%67enerate", {"text": "x", "return_sampling_mask": True}),
        ("POST", "/%67%65%6e%65%72%61%74%65", {"text": "x", "return_sampling_mask": True}),
        ("POST", "/generate%2F", {"text": "x", "return_sampling_mask": True}),
        ("PUT", "/generate/", {"text": "x", "return_sampling_mask": True}),
        # Chat asks for return_meta_info first (as SGLang's serving layer does): set it, so
        # that the top_k rule is what refuses.
        ("POST", "/v1/chat/completions", {"messages": [], "return_sampling_mask": "yes"} | META),
        ("POST", "/v1/chat/completions/", {"messages": [], "return_sampling_mask": "yes"} | META),
        ("POST", "/v1/chat/%63ompletions", {"messages": [], "return_sampling_mask": "yes"} | META),
        ("POST", "/invocations", {"messages": [], "return_sampling_mask": 1} | META),
        ("POST", "/v1/completions", {"prompt": "x", "return_sampling_mask": True}),
        ("POST", "/v1/responses", {"input": "x", "return_sampling_mask": True}),
        ("POST", "/vertex_generate", {"instances": [{"text": "x"}], "parameters": {}}),
    ],
)
async def test_the_rule_applies_on_every_generation_route(
    stub: StubBackend,
    gateway: Gateway,
    session: aiohttp.ClientSession,
    method: str,
    path: str,
    body: dict[str, object],
) -> None:
    if path == "/vertex_generate":
        body = {"instances": [{"text": "x"}], "parameters": {"return_sampling_mask": True}}
    async with session.request(
        method, gw_url(gateway, path), data=orjson.dumps(body), headers=JSON
    ) as r:
        assert r.status == 400
        assert MASK_MESSAGE in (await r.text())
    assert stub.generation_requests() == []


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/admin", 404),
        ("POST", "/generate2", 404),
        ("POST", "/GENERATE", 404),
        ("POST", "/%2567enerate", 404),
        ("POST", "//generate", 404),
        ("POST", "/v1/chat/completions/x", 404),
        ("POST", "/encode", 404),  # SGLang routes the gateway does not know are not forwarded
        ("GET", "/generate", 405),
        ("DELETE", "/generate", 405),
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("POST", "/health", 405),
    ],
)
async def test_unknown_paths_and_methods_are_refused(
    stub: StubBackend,
    gateway: Gateway,
    session: aiohttp.ClientSession,
    method: str,
    path: str,
    status: int,
) -> None:
    body = orjson.dumps({"text": "x", "return_sampling_mask": True})
    async with session.request(method, gw_url(gateway, path), data=body, headers=JSON) as r:
        assert r.status == status
    assert proxied(stub) == []


async def test_backend_redirect_goes_back_to_the_client(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    """SGLang answers /generate/ with a 307; the gateway returns it, never re-posts it."""
    body = orjson.dumps({"text": "x", "sampling_params": {"top_k": 3}, "return_sampling_mask": 1})
    async with session.post(
        gw_url(gateway, "/generate/"), data=body, headers=JSON, allow_redirects=False
    ) as r:
        assert r.status == 307
        assert r.headers["Location"].endswith("/generate")
    assert [r.raw_path for r in stub.generation_requests()] == []
    assert [r.raw_path for r in proxied(stub)] == ["/generate/"]


# -- forwarded bytes ------------------------------------------------------------------------------


@pytest.mark.property
async def test_forwarded_bytes_hash_identical_for_thousands_of_bodies(
    stub: StubBackend, gateway: Gateway, session: aiohttp.ClientSession
) -> None:
    """Random valid bodies (random bytes in strings, odd spacing, big numbers): same sha256."""
    rng = __import__("random").Random(5)
    for i in range(1500):
        text = os.urandom(rng.randint(0, 64)).hex()
        params = {"top_k": rng.choice([1, 7, 40]), "max_new_tokens": 1}
        raw = orjson.dumps(
            {"text": text, "sampling_params": params, "return_sampling_mask": rng.random() < 0.5}
        )
        raw = raw.replace(b",", b" ,\t") if i % 2 else raw
        raw = raw[:-1] + b', "n2": 18446744073709551616, "e": "\\u00e9\\ud83d\\ude00"}'
        headers = {**JSON, "X-Request-Id": f"bytes-{i}"}
        async with session.post(gw_url(gateway, "/generate"), data=raw, headers=headers) as r:
            assert r.status == 200
            assert r.headers["X-Stub-Body-Sha256"] == hashlib.sha256(raw).hexdigest()
    sent = stub.generation_requests()
    assert len(sent) == 1500
    assert all(r.headers["Content-Length"] == str(len(r.body)) for r in sent)
    assert not any("Transfer-Encoding" in r.headers for r in sent)


# -- hop-by-hop and forwarding headers ------------------------------------------------------------


async def test_hop_by_hop_and_forwarding_headers_on_a_generation_request(
    stub: StubBackend, gateway: Gateway
) -> None:
    body = b'{"text": "x", "sampling_params": {"top_k": 2}}'
    request = (
        b"POST /generate HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Connection: keep-alive, X-Hop-A, x-hop-b\r\nConnection: X-Hop-C\r\n"
        b"X-Hop-A: 1\r\nX-Hop-B: 1\r\nX-Hop-C: 1\r\nKeep-Alive: timeout=99\r\nTE: trailers\r\n"
        b"Trailer: X-T\r\nUpgrade: websocket\r\nProxy-Authorization: Basic eDp5\r\n"
        b"Proxy-Connection: keep-alive\r\nX-Forwarded-For: 6.6.6.6\r\nX-Forwarded-For: 7.7.7.7\r\n"
        b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: evil\r\nForwarded: for=6.6.6.6\r\n"
        b"X-Request-Id: hop-1\r\nX-End-To-End: kept\r\nAuthorization: Bearer k\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    (resp,) = parse_responses(await raw_exchange(gateway.port, request))
    assert resp.status == 200
    got = stub.generation_requests()[-1].headers
    for name in (
        "X-Hop-A",
        "X-Hop-B",
        "X-Hop-C",
        "Keep-Alive",
        "TE",
        "Trailer",
        "Upgrade",
        "Proxy-Authorization",
        "Proxy-Connection",
        "X-Forwarded-Host",
        "Forwarded",
    ):
        assert name not in got, name
    assert got.getall("X-Forwarded-For") == ["127.0.0.1"]  # the real peer, nothing appended
    assert got.getall("X-Forwarded-Proto") == ["http"]
    assert got["X-Request-Id"] == "hop-1"
    assert got["X-End-To-End"] == "kept" and got["Authorization"] == "Bearer k"
    assert stub.generation_requests()[-1].body == body


async def test_hop_by_hop_response_headers_are_dropped(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    backend = FaultBackend(mode="hop_headers")
    await backend.start()
    try:
        gw = await make_gateway(backend.url, backends={"health": {"enabled": False}})
        async with session.get(gw_url(gw, "/model_info")) as r:
            assert r.status == 200
            assert await r.read() == b'{"ok": true}'
            for name in ("X-Hop", "Keep-Alive", "Proxy-Authenticate", "Upgrade", "Trailer"):
                assert name not in r.headers, name
            assert r.headers["X-End-To-End"] == "kept"
            assert r.headers["X-Request-Id"] != "backend-chosen"
    finally:
        await backend.stop()


async def test_trusted_proxy_chain_is_appended_untrusted_replaced(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    hdrs = {"X-Forwarded-For": "203.0.113.7, 10.0.0.1", "X-Forwarded-Proto": "https"}
    trusted = await make_gateway(stub.url, forwarding={"trusted_proxies": ["127.0.0.1/32"]})
    untrusted = await make_gateway(stub.url, forwarding={"trusted_proxies": ["10.0.0.0/8"]})

    def last() -> CIMultiDictProxy[str]:
        return [r for r in stub.received if r.path == "/v1/models"][-1].headers

    async with session.get(gw_url(trusted, "/v1/models"), headers=hdrs) as r:
        assert r.status == 200
    assert last()["X-Forwarded-For"] == "203.0.113.7, 10.0.0.1, 127.0.0.1"
    async with session.get(gw_url(untrusted, "/v1/models"), headers=hdrs) as r:
        assert r.status == 200
    assert last()["X-Forwarded-For"] == "127.0.0.1"
    assert last()["X-Forwarded-Proto"] == "http"


# -- request smuggling over raw sockets -----------------------------------------------------------

SMUGGLED = b"GET /get_server_info?smuggled=1 HTTP/1.1\r\nHost: x\r\n\r\n"
POST = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
OK_BODY = b'{"text": "x", "sampling_params": {"top_k": 2}}'
CHUNKED_SMUGGLE = b"0\r\n\r\n" + SMUGGLED

SMUGGLING = {
    "CL+TE": POST
    + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(CHUNKED_SMUGGLE)
    + CHUNKED_SMUGGLE,
    "TE+CL": POST
    + b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(CHUNKED_SMUGGLE)
    + CHUNKED_SMUGGLE,
    "duplicate CL": POST
    + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(OK_BODY), len(OK_BODY) + 10)
    + OK_BODY
    + SMUGGLED,
    "CL list": POST + b"Content-Length: %d, 0\r\n\r\n" % len(OK_BODY) + OK_BODY + SMUGGLED,
    "CL with plus": POST + b"Content-Length: +%d\r\n\r\n" % len(OK_BODY) + OK_BODY,
    "CL negative": POST + b"Content-Length: -1\r\n\r\n" + SMUGGLED,
    "CL hex": POST + b"Content-Length: 0x2e\r\n\r\n" + OK_BODY,
    "obs-fold TE": POST + b"Transfer-Encoding: identity\r\n chunked\r\n\r\n" + CHUNKED_SMUGGLE,
    "obs-fold header": POST
    + b"X-A: a\r\n b\r\nContent-Length: %d\r\n\r\n" % len(OK_BODY)
    + OK_BODY
    + SMUGGLED,
    "TE xchunked": POST + b"Transfer-Encoding: xchunked\r\n\r\n" + CHUNKED_SMUGGLE,
    "TE chunked, identity": POST
    + b"Transfer-Encoding: chunked, identity\r\n\r\n"
    + CHUNKED_SMUGGLE,
    "TE space before colon": POST + b"Transfer-Encoding : chunked\r\n\r\n" + CHUNKED_SMUGGLE,
    "TE vertical tab": POST + b"Transfer-Encoding:\x0bchunked\r\n\r\n" + CHUNKED_SMUGGLE,
    "TE twice": POST
    + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
    + CHUNKED_SMUGGLE,
    "chunk size not hex": POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + SMUGGLED,
    "chunk size negative": POST + b"Transfer-Encoding: chunked\r\n\r\n-5\r\n" + SMUGGLED,
    "chunk size 0x": POST + b"Transfer-Encoding: chunked\r\n\r\n0x2e\r\n" + OK_BODY,
    "chunk size overflow": POST
    + b"Transfer-Encoding: chunked\r\n\r\n10000000000000000\r\n"
    + SMUGGLED,
    "chunk size with space": POST + b"Transfer-Encoding: chunked\r\n\r\n2e \r\n" + OK_BODY,
    "chunk without CRLF": POST
    + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%sXX0\r\n\r\n" % (len(OK_BODY), OK_BODY)
    + SMUGGLED,
    "bare LF request line": b"POST /generate HTTP/1.1\nHost: x\nContent-Length: 0\n\n" + SMUGGLED,
    "bare LF in headers": POST + b"Content-Length: %d\n\r\n" % len(OK_BODY) + OK_BODY + SMUGGLED,
    "bare LF chunk line": POST + b"Transfer-Encoding: chunked\r\n\r\n0\n\n" + SMUGGLED,
    "bare CR": POST + b"X-A: a\rContent-Length: 0\r\n\r\n" + SMUGGLED,
    "NUL in header": POST + b"X-A: a\x00\r\nContent-Length: 0\r\n\r\n" + SMUGGLED,
    "space in header name": POST + b"Content Length: 0\r\n\r\n" + SMUGGLED,
    "HTTP/1.0 TE": b"POST /generate HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED_SMUGGLE,
    "HTTP/0.9": b"GET /health\r\n" + SMUGGLED,
    "bad version": b"GET /health HTTP/1.1.1\r\nHost: x\r\n\r\n" + SMUGGLED,
}


@pytest.mark.parametrize("name", list(SMUGGLING))
async def test_smuggling_attempts_never_reach_the_backend(
    stub: StubBackend, gateway: Gateway, name: str
) -> None:
    raw = await raw_exchange(gateway.port, SMUGGLING[name], timeout=2)
    responses = parse_responses(raw)
    assert responses, raw
    statuses = [r.status for r in responses]
    # Either refused outright, or read as exactly one message (then the rest is refused).
    assert statuses[0] == 400 or statuses[1:] in ([], [400]), statuses
    smuggled = [r for r in stub.received if "smuggled" in r.raw_path]
    assert smuggled == [], name
    for r in stub.received:
        if r.path == "/generate":
            assert r.body == OK_BODY  # a forwarded message is the intended one, intact
    for resp in responses:
        if resp.status == 400:
            assert_no_internals(resp.body, addresses=[stub.url])


async def test_pipelined_requests_are_answered_in_order(
    stub: StubBackend, gateway: Gateway
) -> None:
    """Legitimate pipelining still works: n requests in one write, n answers in order."""
    one = POST + b"Content-Length: %d\r\n" % len(OK_BODY)
    data = b"".join(one + b"X-Request-Id: p%d\r\n\r\n" % i + OK_BODY for i in range(5))
    data += b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: p5\r\nConnection: close\r\n\r\n"
    responses = parse_responses(await raw_exchange(gateway.port, data))
    assert [r.headers["x-request-id"] for r in responses] == [f"p{i}" for i in range(6)]
    assert [r.status for r in responses] == [200] * 6
    assert [r.headers["X-Request-Id"] for r in stub.generation_requests()] == [
        f"p{i}" for i in range(5)
    ]


# -- size caps ------------------------------------------------------------------------------------


async def test_declared_length_over_the_cap_is_413_before_the_body(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url, limits={"max_body_bytes": 1 << 20})
    for extra in (b"", b"Expect: 100-continue\r\n"):
        head = POST + b"Content-Length: 68719476736\r\n" + extra + b"\r\n"  # 64 GiB, never sent
        loop = asyncio.get_running_loop()
        started = loop.time()
        raw = await raw_first_response(gw.port, head, timeout=3)
        (resp,) = parse_responses(raw)
        assert resp.status == 413
        assert not raw.startswith(b"HTTP/1.1 100")  # no Continue for an oversized upload
        assert loop.time() - started < 1.5
    assert stub.generation_requests() == []


async def test_chunked_body_growing_over_the_cap_is_413_mid_read_with_bounded_memory(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url, limits={"max_body_bytes": 1 << 20})
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    rss_before = _vmrss_kib()
    writer.write(POST + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
    sent = 0
    try:
        for _ in range(1024):  # up to 64 MiB offered
            writer.write(chunk)
            await writer.drain()
            sent += 1 << 16
    except ConnectionError:
        pass
    head = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head[:100]
    grown_mib = (_vmrss_kib() - rss_before) / 1024
    assert grown_mib < 24, f"RSS grew {grown_mib:.1f} MiB while refusing a 64 MiB body"
    assert stub.generation_requests() == []


@pytest.mark.parametrize(
    ("name", "request_bytes"),
    [
        (
            "huge header line",
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n",
        ),
        (
            "huge header name",
            b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X" * 70000 + b": 1\r\n\r\n",
        ),
        ("huge request line", b"GET /health?" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
        (
            "too many headers",
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-H%d: v\r\n" % i for i in range(500))
            + b"\r\n",
        ),
    ],
)
async def test_oversized_headers_are_400_or_431(
    stub: StubBackend, gateway: Gateway, name: str, request_bytes: bytes
) -> None:
    raw = await raw_exchange(gateway.port, request_bytes, timeout=3)
    (resp,) = parse_responses(raw)
    assert resp.status in (400, 431), name
    assert proxied(stub) == []


async def test_an_unending_head_is_cut_at_its_cap_with_bounded_memory(
    stub: StubBackend, gateway: Gateway
) -> None:
    """A header value that never ends: each field's cap is only checked once it ends, so
    the head as a whole is bounded (8 x limits.max_header_bytes), and refused at that."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    rss_before = _vmrss_kib()
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ")
    block = b"a" * (1 << 16)
    sent = 0
    with contextlib.suppress(ConnectionError):
        for _ in range(512):  # up to 32 MiB offered
            writer.write(block)
            await writer.drain()
            sent += len(block)
            if reader.at_eof() or len(reader._buffer) > 0:  # a reply came
                break
    head = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 431"), head[:100]
    assert sent < 32 << 20  # the reply came before the whole offer was sent
    grown_mib = (_vmrss_kib() - rss_before) / 1024
    assert grown_mib < 24, f"RSS grew {grown_mib:.1f} MiB for an unending head"
    assert proxied(stub) == []


async def test_http_1_0_with_transfer_encoding_is_refused_whole(
    stub: StubBackend, gateway: Gateway
) -> None:
    """RFC 9112 s.6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing. A
    valid chunked body after it is not read as one either: 400, nothing forwarded."""
    request = (
        b"POST /generate HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(OK_BODY), OK_BODY)
    )
    (resp,) = parse_responses(await raw_exchange(gateway.port, request, timeout=2))
    assert resp.status == 400
    assert_no_internals(resp.body, addresses=[stub.url])
    assert proxied(stub) == []


async def test_an_unending_trailer_is_cut_at_the_head_cap(
    stub: StubBackend, gateway: Gateway
) -> None:
    """A chunked body's last trailer field is held by the parser until it ends, like a
    header: bounded by the head's cap (431), and nothing is forwarded."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        POST
        + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\nX-T: "
        % (
            len(OK_BODY),
            OK_BODY,
        )
    )
    block = b"a" * (1 << 16)
    with contextlib.suppress(ConnectionError):
        for _ in range(512):  # up to 32 MiB offered
            writer.write(block)
            await writer.drain()
            if reader.at_eof() or len(reader._buffer) > 0:  # a reply came
                break
    head = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 431"), head[:100]
    assert proxied(stub) == []
