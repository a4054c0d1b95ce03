"""Prefill/decode disaggregation (backends.mode: pd) over real sockets: two prefill and two
decode stubs (gateway/testing/stub/pd.py), which answer only when both halves of a room
met, so a request sent to one side alone shows."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.app import Gateway
from gateway.edge import pd as edge_pd
from gateway.testing.stub import StubBackend
from gateway.testing.stub.pd import PdStub
from tests.conftest import GatewayFactory, gw_url, proxied, wait_for

JSON = {"Content-Type": "application/json"}
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class Pairs:
    def __init__(self, prefill: list[StubBackend], decode: list[StubBackend]) -> None:
        self.prefill = prefill
        self.decode = decode

    @property
    def all(self) -> list[StubBackend]:
        return [*self.prefill, *self.decode]

    def config(self, **backends: Any) -> dict[str, Any]:
        return {
            "backends": {
                "mode": "pd",
                "prefill": [
                    {"url": s.url, "bootstrap_port": _pd(s).bootstrap_port} for s in self.prefill
                ],
                "decode": [s.url for s in self.decode],
                **backends,
            }
        }

    def rooms(self, side: list[StubBackend]) -> Counter[int]:
        return Counter(room for s in side for room in _pd(s).rooms)


def _pd(stub: StubBackend) -> PdStub:
    assert stub.pd is not None
    return stub.pd


@pytest.fixture
async def pairs() -> AsyncIterator[Pairs]:
    prefill = [StubBackend(pd=PdStub("prefill", prefill_s=0.01)) for _ in range(2)]
    decode = [StubBackend(pd=PdStub("decode", transfer_timeout_s=10)) for _ in range(2)]
    for s in (*prefill, *decode):
        await s.start()
    yield Pairs(prefill, decode)
    for s in (*prefill, *decode):
        await s.stop()


async def _post(
    session: aiohttp.ClientSession, gw: Gateway, path: str, body: bytes
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    async with session.post(gw_url(gw, path), data=body, headers=headers) as resp:
        return resp.status, await resp.read()


REQUESTS: list[tuple[str, bytes]] = [
    ("/generate", b'{"text": "Hello there", "sampling_params": {"max_new_tokens": 4}}'),
    (
        "/generate",
        b'{"text": "stream me", "stream": true, "sampling_params": {"max_new_tokens": 5}}',
    ),
    ("/generate", b'{"text": ["a batch", "of two"], "sampling_params": {"max_new_tokens": 3}}'),
    (
        "/generate",
        b'{"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2, "n": 2}}',
    ),
    (
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}',
    ),
    (
        "/v1/chat/completions",
        b'{"model":"m","messages":[{"role":"user","content":"s"}],"stream":true,"max_tokens":3}',
    ),
    ("/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"n"}],"n":3}'),
    ("/v1/completions", b'{"model": "m", "prompt": ["one", "two"], "max_tokens": 2}'),
    ("/generate", b'\n{ "text" : "spaced",\t"rid": "r-1" }\n'),
]


def _expected_rooms(path: str, body: bytes) -> int:
    """Rooms SGLang makes of the body: items times parallel samples."""
    from gateway.testing.stub.pd import items_of

    size, parallel = items_of(path, orjson.loads(body))
    return (size or 1) * parallel


async def test_every_request_is_paired_and_changed_only_by_the_bootstrap_keys(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(**pairs.config())
    for path, body in REQUESTS:
        status, answer = await _post(session, gw, path, body)
        assert status == 200, (path, body, answer)
    # Each room met both sides exactly once, and each request made as many as SGLang makes.
    prefill_rooms, decode_rooms = pairs.rooms(pairs.prefill), pairs.rooms(pairs.decode)
    assert prefill_rooms == decode_rooms
    assert set(prefill_rooms.values()) == {1}
    assert sum(prefill_rooms.values()) == sum(_expected_rooms(p, b) for p, b in REQUESTS)
    assert all(_pd(s).failed == 0 for s in pairs.all)
    # Both sides got each request, and spread over both workers of each role.
    for side in (pairs.prefill, pairs.decode):
        seen = [r for s in side for r in proxied(s) if r.path != "/health"]
        assert len(seen) == len(REQUESTS)
        assert all(proxied(s) for s in side)
    prefill_by_room = _by_room(pairs.prefill)
    decode_by_room = _by_room(pairs.decode)
    assert prefill_by_room.keys() == decode_by_room.keys()
    sent = {body for _, body in REQUESTS}
    for key, got in prefill_by_room.items():
        p_body, p_url = got
        d_body, _ = decode_by_room[key]
        assert p_body == d_body  # the very same bytes to both
        original = _unspliced(p_body)
        assert original in sent  # every other byte as the client sent it
        parsed = orjson.loads(p_body)
        assert {k: v for k, v in parsed.items() if k not in BOOTSTRAP_KEYS} == orjson.loads(
            original
        )
        # The prefill worker it went to is the one the keys name.
        port = parsed["bootstrap_port"]
        assert p_url.endswith(f":{_port_of(pairs, port)}")


def _port_of(pairs: Pairs, bootstrap_port: object) -> int:
    ports = bootstrap_port if isinstance(bootstrap_port, list) else [bootstrap_port]
    assert len(set(ports)) == 1
    for s in pairs.prefill:
        if _pd(s).bootstrap_port == ports[0]:
            return int(s.url.rsplit(":", 1)[1])
    raise AssertionError(bootstrap_port)


def _by_room(side: list[StubBackend]) -> dict[str, tuple[bytes, str]]:
    out = {}
    for s in side:
        for r in proxied(s):
            if r.path == "/health":
                continue
            room = orjson.loads(r.body)["bootstrap_room"]
            out[str(room)] = (r.body, s.url)
    return out


def _unspliced(body: bytes) -> bytes:
    """The body without the spliced members: they sit right before the closing brace."""
    at = body.rindex(b'"bootstrap_host":')
    head, tail = body[:at], body[at:]
    close = tail.rindex(b"}")
    head = head.removesuffix(b",")
    return head + tail[close:]


def test_splice_keeps_every_other_byte() -> None:
    fields = b'"bootstrap_room":7'
    assert edge_pd.splice(b'{"a": 1}', fields) == b'{"a": 1,"bootstrap_room":7}'
    assert edge_pd.splice(b"  { }\n", fields) == b'  { "bootstrap_room":7}\n'
    assert edge_pd.splice(b'{"a": {"b": 2}} ', fields) == b'{"a": {"b": 2},"bootstrap_room":7} '
    assert edge_pd.splice(b"[1]", fields) is None
    assert edge_pd.splice(b"", fields) is None
    # Last of a duplicated key wins in SGLang's parser: the gateway's room, not the client's.
    spliced = edge_pd.splice(b'{"bootstrap_room": 1}', fields)
    assert spliced is not None and orjson.loads(spliced)["bootstrap_room"] == 7


def test_rooms_are_63_bit_and_lists_for_a_batch() -> None:
    rooms = {edge_pd.new_room() for _ in range(1000)}
    assert len(rooms) == 1000 and all(0 <= r < 2**63 for r in rooms)
    assert edge_pd.shape(edge_pd.Kind.GENERATE, b'{"text": "x"}').rooms is None
    assert edge_pd.shape(edge_pd.Kind.GENERATE, b'{"text": ["x", "y"]}').rooms == 2
    body = b'{"input_ids": [[1], [2], [3]], "sampling_params": {"n": 2}}'
    assert edge_pd.shape(edge_pd.Kind.GENERATE, body).rooms == 6
    assert edge_pd.shape(edge_pd.Kind.GENERATE, b'{"input_ids": [1, 2]}').rooms is None
    assert edge_pd.shape(edge_pd.Kind.CHAT, b'{"messages": [], "n": 4}').rooms == 4
    assert edge_pd.bootstrap_host("http://[::1]:30000") == "::1"


async def test_a_client_that_leaves_aborts_both_sides(
    pairs: Pairs, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(**pairs.config())
    body = b'{"text": "long", "stream": true, "sampling_params": {"max_new_tokens": 100}}'
    headers = {
        "Content-Type": "application/json",
        "X-Stub-Chunk-Delay-Ms": "100",
        "X-Stub-Events": "100",
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/generate"), data=body, headers=headers) as resp,
    ):
        assert resp.status == 200
        await resp.content.readline()
    decode = next(d for d in pairs.decode if _pd(d).rooms)
    await asyncio.wait_for(decode.disconnect_event.wait(), 30)
    assert sum(d.cancelled for d in pairs.decode) == 1


async def test_a_client_that_leaves_during_prefill_aborts_both(
    make_gateway: GatewayFactory,
) -> None:
    prefill = StubBackend(pd=PdStub("prefill", prefill_s=5))
    decode = StubBackend(pd=PdStub("decode"))
    for s in (prefill, decode):
        await s.start()
    try:
        gw = await make_gateway(**Pairs([prefill], [decode]).config())
        body = b'{"text": "slow prefill"}'
        async with aiohttp.ClientSession() as s:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await s.post(gw_url(gw, "/generate"), data=body, headers=JSON)
        await asyncio.wait_for(prefill.disconnect_event.wait(), 30)
        await asyncio.wait_for(decode.disconnect_event.wait(), 30)
        assert prefill.cancelled == 1 and decode.cancelled == 1
        assert _pd(prefill).failed == 1
    finally:
        for s in (prefill, decode):
            await s.stop()


async def test_a_prefill_failure_is_the_prefills_answer_and_aborts_decode(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    for p in pairs.prefill:
        p.fail_status = 500
    gw = await make_gateway(**pairs.config())
    status, answer = await _post(session, gw, "/generate", b'{"text": "x"}')
    assert status == 500
    assert orjson.loads(answer) == {"error": {"message": "stub: scripted status 500"}}
    decode = next(d for d in pairs.decode if _pd(d).rooms)
    await asyncio.wait_for(decode.disconnect_event.wait(), 30)
    assert sum(d.cancelled for d in pairs.decode) == 1
    text = await _metrics(session, gw)
    assert 'sglang_gateway_pd_failures_total{cause="error_status",side="prefill"} 1.0' in text
    assert "sglang_gateway_pd_pairs_total 1.0" in text
    async with session.get(gw_url(gw, "/workers")) as resp:
        listing = await resp.json()
    assert listing["pd"]["pairs"] == 1
    assert listing["pd"]["failures"]["prefill"]["error_status"] == 1
    failed = [w for w in listing["workers"] if w["pd"]["failed"]]
    assert len(failed) == 1 and failed[0]["worker_type"] == "prefill"
    assert sum(w["pd"]["paired"] for w in listing["workers"]) == 2


async def test_the_prefill_side_follows_its_cached_prefix_and_says_so(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(**pairs.config(prefill_balancer="cache_aware"))
    convo = " ".join(f"w{i}" for i in range(600))
    for turn in range(4):
        convo += f" turn{turn}"
        status, answer = await _post(session, gw, "/generate", orjson.dumps({"text": convo}))
        assert status == 200, answer
    # Every turn reached the prefill worker that held the conversation.
    assert sorted(len(_pd(p).rooms) for p in pairs.prefill) == [0, 4]
    owner = next(p for p in pairs.prefill if _pd(p).rooms)
    async with session.get(gw_url(gw, "/workers")) as resp:
        workers = {w["url"]: w for w in (await resp.json())["workers"]}
    routed = workers[owner.url]["cache_aware"]
    assert routed["decisions"] == {"matched": 3, "balanced": 0, "unmatched": 1, "no_prompt": 0}
    assert 0 < routed["matched_bytes"] < routed["prompt_bytes"]
    assert routed["index_blocks"] > 0
    # The decode side is balanced by load (decode_balancer unset: backends.balancer).
    assert all("cache_aware" not in workers[d.url] for d in pairs.decode)
    text = await _metrics(session, gw)
    matched = (
        f'sglang_gateway_cache_aware_decisions_total{{backend="{owner.url}",'
        'decision="matched"} 3.0'
    )
    assert matched in text
    assert "sglang_gateway_cache_aware_bytes_per_token " in text


async def _metrics(session: aiohttp.ClientSession, gw: Gateway) -> str:
    from tests.conftest import admin_url

    async with session.get(admin_url(gw, "/metrics")) as resp:
        return await resp.text()


async def test_return_logprob_merges_the_prefills_input_logprobs(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(**pairs.config())
    body = orjson.dumps(
        {
            "text": "a b c d",
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2},
        }
    )
    status, answer = await _post(session, gw, "/generate", body)
    assert status == 200
    merged = orjson.loads(answer)["meta_info"]["input_token_logprobs"]
    # The decode stub reports none of its own: what the client gets is the prefill's, which
    # are a regular engine's for that prompt.
    reference = StubBackend()
    await reference.start()
    try:
        async with session.post(reference.url + "/generate", data=body, headers=JSON) as resp:
            expected = (await resp.json())["meta_info"]["input_token_logprobs"]
    finally:
        await reference.stop()
    assert expected and merged == expected


async def test_a_batch_answered_whole_gets_each_items_input_logprobs(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(**pairs.config())
    body = {
        "text": ["one two three", "four five six seven eight"],
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 2},
    }
    status, answer = await _post(session, gw, "/generate", orjson.dumps(body))
    assert status == 200
    got = orjson.loads(answer)
    reference = StubBackend()
    await reference.start()
    try:
        async with session.post(reference.url + "/generate", json=body) as resp:
            want = await resp.json()
    finally:
        await reference.stop()
    assert isinstance(got, list) and len(got) == len(want) == 2
    lists = [item["meta_info"]["input_token_logprobs"] for item in got]
    assert lists[0] != lists[1]
    assert lists == [item["meta_info"]["input_token_logprobs"] for item in want]
    # Everything else is the decode's answer as it came: its text and output logprobs.
    for item, ref in zip(got, want, strict=True):
        assert item["text"] == ref["text"]
        assert (
            item["meta_info"]["output_token_logprobs"]
            == (ref["meta_info"]["output_token_logprobs"])
        )


async def test_registered_workers_are_paired_by_their_worker_type(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(backends={"discovery": "registry", "mode": "pd"})
    # Before any worker: a defined 503 naming the missing role.
    status, answer = await _post(session, gw, "/generate", b'{"text": "x"}')
    assert status == 503 and b"No prefill worker" in answer
    for s in pairs.prefill[:1]:
        reg = {"url": s.url, "worker_type": "prefill", "bootstrap_port": _pd(s).bootstrap_port}
        async with session.post(gw_url(gw, "/workers"), json=reg) as resp:
            assert resp.status in (200, 201, 202)
    async with session.post(
        gw_url(gw, "/workers"), json={"url": pairs.decode[0].url, "worker_type": "decode"}
    ) as resp:
        assert resp.status in (200, 201, 202)
    for _ in range(100):
        status, answer = await _post(session, gw, "/generate", b'{"text": "x"}')
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200, answer
    assert pairs.rooms(pairs.prefill[:1]) == pairs.rooms(pairs.decode[:1])
    # Operational routes go to a prefill worker; unpaired generation routes are refused.
    async with session.get(gw_url(gw, "/model_info")) as resp:
        assert resp.status == 200
    assert proxied(pairs.prefill[0])[-1].path == "/model_info"
    status, _ = await _post(session, gw, "/v1/responses", b'{"input": "x"}')
    assert status == 501


def test_pd_config_is_checked() -> None:
    from gateway import config as config_mod

    url = "http://127.0.0.1:1"
    bad = [
        ({"prefill": [url], "decode": ["http://127.0.0.1:2"]}, "need backends.mode: pd"),
        ({"mode": "pd", "prefill": [url]}, "one in backends.decode"),
        ({"mode": "pd", "prefill": [url], "decode": [url]}, "listed in backends.prefill and"),
        (
            {"mode": "pd", "prefill": [{"url": url, "bootstrap_port": 0}], "decode": [url + "0"]},
            "bootstrap_port",
        ),
        (
            {"mode": "pd", "discovery": "dns", "dns": {"name": "x", "port": 1}, "decode": [url]},
            "static or registry",
        ),
        ({"mode": "pd", "prefill_balancer": "bucket", "static": [url]}, "bucket"),
    ]
    for backends, needle in bad:
        with pytest.raises(config_mod.ConfigError) as exc:
            config_mod.build({"backends": backends})
        assert needle in str(exc.value), (backends, str(exc.value))
    cfg = config_mod.build(
        {
            "backends": {
                "mode": "pd",
                "prefill": [url],
                "decode": [url + "0"],
                "decode_balancer": "least_load",
            }
        }
    )
    assert cfg.backends.decode_balancer == "least_inflight"
    assert cfg.backends.worker_roles()[url] == {"worker_type": "prefill", "bootstrap_port": None}


async def test_a_paused_pd_fleet_holds_a_generation_then_pairs_it(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    """A pause reaches both roles; a generation sent meanwhile waits for them as for a
    paused plain fleet (backends.pause_hold_s), past the queue timeout, and is paired once
    they continue; past its hold it is the paused fleet's 503."""
    gw = await make_gateway(**pairs.config(queue_timeout_s=0.2, pause_hold_s=30))
    status, _ = await _post(session, gw, "/pause_generation", b"{}")
    assert status == 200 and all(s.pause_mode is not None for s in pairs.all)
    body = b'{"text": "held", "sampling_params": {"max_new_tokens": 2}}'
    held = asyncio.ensure_future(_post(session, gw, "/generate", body))
    await wait_for(lambda: gw.pool.holding == 1)
    await asyncio.sleep(0.5)  # past the queue timeout: only a hold keeps it waiting
    assert not held.done()
    assert not any(r.path == "/generate" for s in pairs.all for r in s.received)
    status, _ = await _post(session, gw, "/continue_generation", b"{}")
    assert status == 200
    status, _ = await held
    assert status == 200
    assert len(pairs.rooms(pairs.prefill)) == len(pairs.rooms(pairs.decode)) == 1

    gw2 = await make_gateway(**pairs.config(queue_timeout_s=0.2, pause_hold_s=0.3))
    assert (await _post(session, gw2, "/pause_generation", b"{}"))[0] == 200
    status, reply = await _post(session, gw2, "/generate", body)
    assert status == 503 and b"backends.pause_hold_s" in reply


def sse_events(raw: bytes) -> list[Any]:
    """The data of each SSE event but [DONE], parsed."""
    out = []
    for piece in raw.split(b"\n\n"):
        event = piece.strip()
        if event and event != b"data: [DONE]":
            assert event.startswith(b"data: "), event
            out.append(orjson.loads(event[len(b"data: ") :]))
    return out


async def _reference(session: aiohttp.ClientSession, body: dict[str, Any]) -> list[Any]:
    """What a regular engine streams for the body: the input logprobs SGLang reports."""
    stub = StubBackend()
    await stub.start()
    try:
        async with session.post(stub.url + "/generate", json=body) as resp:
            return sse_events(await resp.read())
    finally:
        await stub.stop()


async def _through(gw: Any, session: aiohttp.ClientSession, body: dict[str, Any]) -> bytes:
    async with session.post(gw_url(gw, "/generate"), json=body, headers=JSON) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return await resp.read()


async def test_a_streamed_answer_gets_the_prefills_input_logprobs_in_each_event(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(**pairs.config())
    body = {
        "text": "a b c d e",
        "stream": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 3},
    }
    got = sse_events(await _through(gw, session, body))
    want = await _reference(session, body)
    assert len(got) == len(want) == 3
    for event, ref in zip(got, want, strict=True):
        lp = event["meta_info"]["input_token_logprobs"]
        assert lp and lp == ref["meta_info"]["input_token_logprobs"]
        # The rest of the event is the decode's own.
        assert (
            event["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]
        )
        assert event["text"] == ref["text"]


async def test_a_streamed_batch_gets_each_items_input_logprobs_by_its_index(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(**pairs.config())
    body = {
        "text": ["one two three", "four five six seven eight"],
        "stream": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 2},
    }
    got = sse_events(await _through(gw, session, body))
    want = {
        e["index"]: e["meta_info"]["input_token_logprobs"] for e in await _reference(session, body)
    }
    assert len(got) == 4 and want[0] != want[1]
    for event in got:
        lp = event["meta_info"]["input_token_logprobs"]
        assert lp and lp == want[event["index"]]


async def test_a_stream_without_return_logprob_is_relayed_as_the_decode_sent_it(
    pairs: Pairs, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(**pairs.config())
    body = {"text": "x y", "stream": True, "sampling_params": {"max_new_tokens": 2}}
    got = sse_events(await _through(gw, session, body))
    assert len(got) == 2 and all("input_token_logprobs" not in e["meta_info"] for e in got)
