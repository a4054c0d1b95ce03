"""Engine calls the RL frameworks mean for the whole fleet, and requests only some engines
can serve, through a real gateway in front of stub engines.

- `/update_weights_from_distributed`, `/load_lora_adapter`, `/unload_lora_adapter` and
  prefix aborts go to every engine; `/init_weights_update_group` (its `rank_offset` is the
  engine's own) stays addressed.
- A request naming a LoRA adapter goes only to an engine holding it (the stubs refuse any
  other, as SGLang does), and one no engine holds gets SGLang's 400 from the gateway.
- A worker registered as prefill or decode never gets a plain request; a fleet of nothing
  else answers 503 saying why.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import aiohttp
import orjson

from gateway.app import Gateway
from gateway.contract.skim import SKIM_MIN_BODY
from gateway.edge import adapters as adapters_mod
from gateway.fleet.pool import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url, proxied, wait_for

JSON = {"Content-Type": "application/json"}


def gen(**fields: Any) -> bytes:
    return orjson.dumps({"text": "x", "sampling_params": {"max_new_tokens": 2}} | fields)


def generations(stub: StubBackend) -> list[dict[str, Any]]:
    return [orjson.loads(r.body) for r in proxied(stub) if r.path == "/generate"]


def calls(stub: StubBackend, path: str) -> list[bytes]:
    return [r.body for r in stub.received if r.path == path]


async def metric(s: aiohttp.ClientSession, gw: Gateway, prefix: str) -> float:
    async with s.get(admin_url(gw, "/metrics")) as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def post(
    s: aiohttp.ClientSession,
    gw: Gateway,
    path: str,
    body: object,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = io.BytesIO(body if isinstance(body, bytes) else orjson.dumps(body))
    async with s.post(gw_url(gw, path), data=data, headers=JSON | (headers or {})) as r:
        raw = await r.read()
        return r.status, orjson.loads(raw) if raw else None


LOAD_A = {"lora_name": "A", "lora_path": "/adapters/A"}


# -- fan-out -----------------------------------------------------------------------------


async def test_lora_load_and_unload_reach_every_engine(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, gw, "/load_lora_adapter", LOAD_A)
        assert status == 200 and body["success"] is True
        assert [r["status"] for r in body["results"]] == [200, 200, 200]
        assert all(stub.adapters == {"A": "/adapters/A"} for stub in stubs)
        async with s.get(gw_url(gw, "/workers")) as r:
            assert [w["lora_adapters"] for w in (await r.json())["workers"]] == [["A"]] * 3
        status, body = await post(s, gw, "/unload_lora_adapter", {"lora_name": "A"})
        assert status == 200 and all(stub.adapters == {} for stub in stubs)
        async with s.get(gw_url(gw, "/workers")) as r:
            assert [w["lora_adapters"] for w in (await r.json())["workers"]] == [[]] * 3


async def test_a_failed_load_is_not_recorded_on_that_engine(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    stubs[2].engine_op_status = 500
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, gw, "/load_lora_adapter", LOAD_A)
        assert status == 502 and [r["status"] for r in body["results"]] == [200, 200, 500]
        for _ in range(9):
            assert (await post(s, gw, "/generate", gen(lora_path="A")))[0] == 200
    assert generations(stubs[2]) == []
    assert len(generations(stubs[0])) + len(generations(stubs[1])) == 9


async def test_update_weights_from_distributed_fans_out(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    # AReaL's and slime's body: the same for every engine of the broadcast group.
    update = {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 2]],
        "group_name": "g",
        "weight_version": "iter-1",
    }
    raw = orjson.dumps(update)
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, gw, "/update_weights_from_distributed", raw)
    assert status == 200 and len(body["results"]) == 3
    for stub in stubs:
        assert calls(stub, "/update_weights_from_distributed") == [raw]  # byte for byte
    assert {b.weight_version for b in gw.pool.backends} == {"iter-1"}


async def test_init_weights_update_group_stays_addressed(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    group = {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 4,
        "group_name": "g",
    }
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, gw, "/init_weights_update_group", group)
        assert status == 400
        assert "/workers/{id}/init_weights_update_group" in body["detail"]
        assert all(calls(stub, "/init_weights_update_group") == [] for stub in stubs)
        one = worker_id(stubs[1].url)
        status, _ = await post(s, gw, f"/workers/{one}/init_weights_update_group", group)
    assert status == 200
    assert [len(calls(stub, "/init_weights_update_group")) for stub in stubs] == [0, 1, 0]


async def test_a_prefix_abort_reaches_every_engine(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    """Miles aborts an adapter's requests by rid prefix. The gateway routed a request whose
    rid is exactly that prefix to one engine: the abort must still reach all of them."""
    gw = await make_gateway(*[s.url for s in stubs])
    async with aiohttp.ClientSession() as s:
        delayed = {"X-Stub-Delay-Ms": "500"}
        held = asyncio.create_task(post(s, gw, "/generate", gen(rid="A::"), delayed))
        await wait_for(lambda: len(gw.proxy.owners) == 1)
        status, _ = await post(s, gw, "/abort_request", {"rid": "A::", "prefix": True})
        assert status == 200
        assert [len(calls(stub, "/abort_request")) for stub in stubs] == [1, 1, 1]
        await held


# -- LoRA routing --------------------------------------------------------------------------


async def test_a_lora_request_goes_only_to_engines_that_loaded_it(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    async with aiohttp.ClientSession() as s:
        for stub in stubs[:2]:  # two of three, by the addressed route
            status, body = await post(
                s, gw, f"/workers/{worker_id(stub.url)}/load_lora_adapter", LOAD_A
            )
            assert status == 200 and body["loaded_adapters"] == {"A": "/adapters/A"}
        for _ in range(12):
            assert (await post(s, gw, "/generate", gen(lora_path="A")))[0] == 200
        # A batch naming A for one item and the base model for the other.
        batch = orjson.dumps({"text": ["x", "y"], "lora_path": ["A", None]})
        assert (await post(s, gw, "/generate", batch))[0] == 200
        # The OpenAI routes' base:adapter spelling.
        chat = {"model": "stub-model:A", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(6):
            assert (await post(s, gw, "/v1/chat/completions", chat))[0] == 200
        # The base model goes anywhere.
        for _ in range(6):
            assert (await post(s, gw, "/generate", gen()))[0] == 200
    chats = [r for r in proxied(stubs[2]) if r.path == "/v1/chat/completions"]
    assert chats == []
    assert all("lora_path" not in g for g in generations(stubs[2]))
    assert generations(stubs[2])  # it still serves the base model
    assert sum(len(generations(stub)) for stub in stubs[:2]) >= 13


async def test_unload_takes_an_engine_out_for_that_adapter(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    async with aiohttp.ClientSession() as s:
        assert (await post(s, gw, "/load_lora_adapter", LOAD_A))[0] == 200
        first = worker_id(stubs[0].url)
        status, _ = await post(s, gw, f"/workers/{first}/unload_lora_adapter", {"lora_name": "A"})
        assert status == 200
        for _ in range(9):
            assert (await post(s, gw, "/generate", gen(lora_path="A")))[0] == 200
        assert all("lora_path" not in g for g in generations(stubs[0]))
        assert (await post(s, gw, "/unload_lora_adapter", {"lora_name": "A"}))[0] == 502
        before = sum(len(generations(stub)) for stub in stubs)
        status, body = await post(s, gw, "/generate", gen(lora_path="A"))
        assert status == 400
        assert body["error"]["message"].startswith(
            "The following requested LoRA adapters are not loaded: 'A'"
        )
        assert sum(len(generations(stub)) for stub in stubs) == before


async def test_an_adapter_no_engine_holds_is_refused_with_sglangs_400(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    async with aiohttp.ClientSession() as s:
        assert (await post(s, gw, "/load_lora_adapter", LOAD_A))[0] == 200
        status, body = await post(s, gw, "/generate", gen(lora_path="nope"))
        assert status == 400
        assert body == {
            "error": {
                "message": "The following requested LoRA adapters are not loaded: 'nope'\n"
                "Loaded adapters: 'A'."
            }
        }
        chat = {"model": "m:nope", "messages": [{"role": "user", "content": "hi"}]}
        status, body = await post(s, gw, "/v1/chat/completions", chat)
        assert status == 400 and body["object"] == "error" and "'nope'" in body["message"]
        refused = (
            'sglang_gateway_rejections_total{policy="lora",profile="",reason="adapter_not_loaded"'
        )
        assert await metric(s, gw, refused) == 2
    assert all(generations(stub) == [] for stub in stubs)
    assert all(not [r for r in proxied(stub) if r.path == "/v1/chat/completions"] for stub in stubs)


async def test_an_adapter_loaded_engine_direct_is_found(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    """Miles loads adapters through its own actors, past the gateway: a request naming one
    the gateway never saw makes it read the engines' /v1/models, once for a burst."""
    gw = await make_gateway(*[s.url for s in stubs])
    stubs[1].adapters["B"] = "/adapters/B"
    async with aiohttp.ClientSession() as s:
        replies = await asyncio.gather(
            *(post(s, gw, "/generate", gen(lora_path="B")) for _ in range(8))
        )
    assert [status for status, _ in replies] == [200] * 8
    assert len(generations(stubs[1])) == 8
    assert gw.proxy.adapters.refreshes == 1
    assert [len(calls(stub, "/v1/models")) for stub in stubs] == [1, 1, 1]


async def test_unknown_names_are_read_for_at_most_every_interval(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*[s.url for s in stubs])
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        started = loop.time()
        for _ in range(3):
            assert (await post(s, gw, "/generate", gen(lora_path="nope")))[0] == 400
        elapsed = loop.time() - started
    assert gw.proxy.adapters.refreshes == 3
    assert elapsed >= 2 * adapters_mod.REFRESH_EVERY_S * 0.9


async def test_a_lora_request_waits_for_a_holder_then_503_naming_it(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(
        *[s.url for s in stubs], backends={"queue_timeout_s": 0.3, "pause_hold_s": 0.3}
    )
    holder = worker_id(stubs[0].url)
    async with aiohttp.ClientSession() as s:
        assert (await post(s, gw, f"/workers/{holder}/load_lora_adapter", LOAD_A))[0] == 200
        assert (await post(s, gw, f"/workers/{holder}/pause_generation", {"mode": "abort"}))[
            0
        ] == 200
        status, body = await post(s, gw, "/generate", gen(lora_path="A"))
        # Held for the paused holder as for any paused engine, then refused naming both.
        message = body["error"]["message"]
        assert status == 503 and "'A'" in message and "backends.pause_hold_s" in message
        assert (await post(s, gw, "/generate", gen()))[0] == 200  # the others serve the base
    assert all("lora_path" not in g for g in generations(stubs[1]) + generations(stubs[2]))


async def test_large_and_unparsed_bodies_are_routed_by_their_adapter(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    """Bodies large enough for the view reader and for the sliced reader, and the RL profile
    that forwards bodies without the mask key unparsed, still name their adapter."""
    stubs[0].adapters["A"] = "/adapters/A"
    bodies = [
        orjson.dumps({"input_ids": list(range(n)), "lora_path": "A"}) for n in (3000, 200_000)
    ]
    assert len(bodies[0]) > 4096 and len(bodies[1]) > SKIM_MIN_BODY
    for skip in (False, True):
        gw = await make_gateway(
            *[s.url for s in stubs], policy={"skip_parse_without_mask_key": skip}
        )
        async with aiohttp.ClientSession() as s:
            for body in bodies * 3:
                assert (await post(s, gw, "/generate", body))[0] == 200
    assert len(generations(stubs[0])) == 12
    assert generations(stubs[1]) == generations(stubs[2]) == []


async def test_unparsed_chat_bodies_are_routed_by_the_adapter_their_model_names(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    """With the RL profile's skip of the parse, a chat body whose `model` names an adapter
    (`base:adapter`) is still read for it, small or past the quote walk (many strings before
    the model), while one naming the plain base model may go anywhere."""
    stubs[0].adapters["A"] = "/adapters/A"
    many = [{"role": "user", "content": f"turn {i}"} for i in range(40)]
    small = {"model": "stub-model:A", "messages": many[:1]}
    large = {"messages": many * 4, "model": "stub-model:A"}
    assert len(orjson.dumps(large)) > 4096
    gw = await make_gateway(*[s.url for s in stubs], policy={"skip_parse_without_mask_key": True})
    async with aiohttp.ClientSession() as s:
        for body in (small, large) * 3:
            assert (await post(s, gw, "/v1/chat/completions", body))[0] == 200
        for body in ({**small, "model": "stub-model"}, {**large, "model": "stub-model"}) * 6:
            assert (await post(s, gw, "/v1/chat/completions", body))[0] == 200

    def chats(stub: StubBackend) -> list[str]:
        return [
            orjson.loads(r.body)["model"] for r in proxied(stub) if r.path == "/v1/chat/completions"
        ]

    assert chats(stubs[0]).count("stub-model:A") == 6
    assert "stub-model:A" not in chats(stubs[1]) + chats(stubs[2])
    assert chats(stubs[1]) and chats(stubs[2])  # the base model spread over the others too


# -- prefill and decode workers ----------------------------------------------------------------


async def test_a_prefill_worker_never_gets_plain_traffic(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    regular, prefill = stubs[0], stubs[1]
    gw = await make_gateway(regular.url, backends={"discovery": "registry"})
    async with aiohttp.ClientSession() as s:
        # slime's registration of a prefill engine.
        reg = {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": 8998}
        status, _ = await post(s, gw, "/workers", reg)
        assert status == 200
        await wait_for(lambda: all(b.health.value == "healthy" for b in gw.pool.backends))
        for _ in range(12):
            assert (await post(s, gw, "/generate", gen()))[0] == 200
        async with s.get(gw_url(gw, "/workers")) as r:
            listed = {w["url"]: w for w in (await r.json())["workers"]}
        # Control calls still reach it: it is an engine of the fleet.
        assert (await post(s, gw, "/flush_cache", b""))[0] == 200
    assert generations(prefill) == []
    assert len(generations(regular)) == 12
    assert listed[prefill.url]["worker_type"] == "prefill"
    assert listed[prefill.url]["bootstrap_port"] == 8998
    assert listed[prefill.url]["state"] == "healthy"
    assert listed[regular.url]["worker_type"] == "regular"
    assert calls(prefill, "/flush_cache")


async def test_only_prefill_and_decode_workers_answer_503(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(backends={"discovery": "registry"})
    async with aiohttp.ClientSession() as s:
        for stub, kind in zip(stubs[:2], ("prefill", "decode"), strict=True):
            assert (await post(s, gw, "/workers", {"url": stub.url, "worker_type": kind}))[0] == 200
        await wait_for(lambda: all(b.health.value == "healthy" for b in gw.pool.backends))
        status, body = await post(s, gw, "/generate", gen())
        assert status == 503 and "prefill and decode" in body["error"]["message"]
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        status, body = await post(s, gw, "/v1/chat/completions", chat)
        assert status == 503 and body["object"] == "error"
        refused = (
            'sglang_gateway_rejections_total{policy="routing",profile="",'
            'reason="disaggregated_only"'
        )
        assert await metric(s, gw, refused) == 2
        # A regular worker joins: plain traffic flows again, to it alone.
        assert (await post(s, gw, "/workers", {"url": stubs[2].url}))[0] == 200
        await wait_for(lambda: all(b.health.value == "healthy" for b in gw.pool.backends))
        assert (await post(s, gw, "/generate", gen()))[0] == 200
    assert generations(stubs[0]) == generations(stubs[1]) == []
