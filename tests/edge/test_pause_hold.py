"""A paused fleet holds new generations, as a paused SGLang engine queues them.

Real stubs behind a real gateway, paused and continued through /pause_generation and
/continue_generation from loopback (an operator by address): a generation sent meanwhile
waits in the gateway, counted in the metrics, and goes out once the fleet continues; one
whose client leaves is dropped at once, and one whose hold runs out gets a 503 naming
backends.pause_hold_s. Nothing ever reaches a paused engine.
"""

from __future__ import annotations

import asyncio
import io
import time

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import Gateway
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url, wait_for

JSON = {"Content-Type": "application/json"}


def _gen(text: str) -> bytes:
    return orjson.dumps({"text": text, "sampling_params": {"top_k": 2}})


async def _control(gw: Gateway, path: str, body: bytes) -> None:
    async with aiohttp.ClientSession() as s, s.post(gw_url(gw, path), data=body) as r:
        assert r.status == 200, await r.text()


async def _holds(gw: Gateway) -> dict[str, float]:
    """The hold metrics as scraped: the gauge as "now", the counter by event."""
    async with aiohttp.ClientSession() as s, s.get(admin_url(gw, "/metrics")) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang_gateway_held_requests":
                out["now"] = sample.value
            elif sample.name == "sglang_gateway_request_holds_total":
                out[sample.labels["event"]] = sample.value
    return out


def _generations(stubs: list[StubBackend]) -> int:
    return sum(len(s.generation_requests()) for s in stubs)


async def test_a_generation_sent_during_a_pause_is_held_then_served(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    engines = stubs[:2]
    # The wait for a free slot is short; the hold is not bound by it.
    gw = await make_gateway(*(s.url for s in engines), backends={"queue_timeout_s": 0.1})
    assert gw.proxy is not None
    assert gw.proxy.settings.pause_hold == 120  # unset: control.timeout_s
    await _control(gw, "/pause_generation", b'{"mode": "abort"}')
    async with aiohttp.ClientSession() as s:
        held = asyncio.ensure_future(s.post(gw_url(gw, "/generate"), data=_gen("x"), headers=JSON))
        await wait_for(lambda: gw.pool.holding == 1)
        assert await _holds(gw) == {
            "now": 1,
            "held": 1,
            "released": 0,
            "expired": 0,
            "abandoned": 0,
            "refused": 0,
        }
        await asyncio.sleep(0.3)  # well past queue_timeout_s: still held
        assert not held.done()
        assert _generations(stubs) == 0
        await _control(gw, "/continue_generation", b"{}")
        async with await held as r:
            assert r.status == 200
            await r.read()
    assert _generations(engines) == 1
    assert all(s.arrived_paused == 0 for s in engines)
    after = await _holds(gw)
    assert (after["now"], after["held"], after["released"]) == (0, 1, 1)


async def test_a_held_client_that_leaves_is_dropped_at_once(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    engines = stubs[:2]
    gw = await make_gateway(*(s.url for s in engines))
    await _control(gw, "/pause_generation", b'{"mode": "abort"}')
    body = _gen("leaving")
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await wait_for(lambda: gw.pool.holding == 1)
    writer.close()
    await writer.wait_closed()
    # The close is seen while held: the hold ends within moments, not when the fleet
    # continues or the hold runs out.
    await wait_for(lambda: gw.pool.holding == 0, timeout=30)
    holds = await _holds(gw)
    assert (holds["now"], holds["abandoned"], holds["released"]) == (0, 1, 0)
    await _control(gw, "/continue_generation", b"{}")
    await asyncio.sleep(0.2)
    assert _generations(stubs) == 0  # no upstream request was ever opened for it
    assert reader.at_eof() or not await reader.read()


@pytest.mark.heavy
async def test_a_hold_that_runs_out_is_a_503_naming_the_setting(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    engines = stubs[:2]
    gw = await make_gateway(*(s.url for s in engines), backends={"pause_hold_s": 0.4})
    await _control(gw, "/pause_generation", b'{"mode": "retract"}')
    async with aiohttp.ClientSession() as s:
        started = time.monotonic()
        async with s.post(gw_url(gw, "/generate"), data=_gen("late"), headers=JSON) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "1"
            message = (await r.json())["error"]["message"]
        assert time.monotonic() - started >= 0.4
        assert "backends.pause_hold_s (0.4 s)" in message
        # The OpenAI routes answer in their own shape.
        chat = orjson.dumps({"messages": [{"role": "user", "content": "x"}]})
        async with s.post(gw_url(gw, "/v1/chat/completions"), data=chat, headers=JSON) as r:
            assert r.status == 503
            reply = await r.json()
            assert reply["object"] == "error" and "backends.pause_hold_s" in reply["message"]
        # Other routes wait no longer than for a free slot (queue_timeout_s, 5 s by default:
        # longer than this hold, so the hold bounds them here).
        async with s.get(gw_url(gw, "/model_info")) as r:
            assert r.status == 503
    holds = await _holds(gw)
    assert (holds["now"], holds["held"], holds["expired"]) == (0, 3, 3)
    assert _generations(stubs) == 0


async def test_a_hold_of_zero_answers_at_once(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stubs[0].url, stubs[1].url, backends={"pause_hold_s": 0})
    await _control(gw, "/pause_generation", b'{"mode": "abort"}')
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/generate"), data=_gen("x"), headers=JSON) as r,
    ):
        assert r.status == 503
        assert "backends.pause_hold_s is 0" in (await r.json())["error"]["message"]
    # Refused, never held: the counters say so whatever the machine's load.
    holds = await _holds(gw)
    assert holds["refused"] == 1 and holds.get("held", 0) == 0 and holds["now"] == 0


async def test_held_generations_go_out_in_arrival_order(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    # One engine, so its arrival order is the order the gateway sent them in.
    gw = await make_gateway(stub.url)
    await _control(gw, "/pause_generation", b'{"mode": "in_place"}')
    texts = [f"held-{i}" for i in range(8)]
    async with aiohttp.ClientSession() as s:
        held = []
        for i, text in enumerate(texts):
            held.append(
                asyncio.ensure_future(
                    s.post(gw_url(gw, "/generate"), data=_gen(text), headers=JSON)
                )
            )
            await wait_for(lambda n=i + 1: gw.pool.holding == n)  # type: ignore[misc]
        await _control(gw, "/continue_generation", b"{}")
        for future in held:
            async with await future as r:
                assert r.status == 200
                await r.read()
    sent = [orjson.loads(r.body)["text"] for r in stub.generation_requests()]
    assert sent == texts


async def test_holds_are_bounded_by_the_slots_the_paused_engines_will_have(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    engines = stubs[:2]
    gw = await make_gateway(
        *(s.url for s in engines), backends={"max_inflight_per_backend": 1, "queue_timeout_s": 2}
    )
    await _control(gw, "/pause_generation", b'{"mode": "abort"}')
    async with aiohttp.ClientSession() as s:
        held = [
            asyncio.ensure_future(s.post(gw_url(gw, "/generate"), data=_gen(t), headers=JSON))
            for t in ("a", "b")
        ]
        await wait_for(lambda: gw.pool.holding == 2)
        # Two engines, one slot each: a third would only wait for a slot after the continue.
        async with s.post(gw_url(gw, "/generate"), data=_gen("c"), headers=JSON) as r:
            assert r.status == 503
            assert "backends.max_inflight_per_backend" in (await r.json())["error"]["message"]
        await _control(gw, "/continue_generation", b"{}")
        for future in held:
            async with await future as r:
                assert r.status == 200
    holds = await _holds(gw)
    assert (holds["held"], holds["released"], holds["refused"]) == (2, 2, 1)


@pytest.mark.heavy
async def test_a_held_body_takes_from_the_memory_bound(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    # Token ids are skimmed, not parsed: inspecting this body costs the budget little, but
    # holding it would keep its 18 MB while the budget is 16 MiB.
    big = b'{"input_ids": [' + b",".join([b"7"] * 9_000_000) + b"]}"
    engines = stubs[:2]
    gw = await make_gateway(*(s.url for s in engines), limits={"max_inspecting_bytes": 16 << 20})
    await _control(gw, "/pause_generation", b'{"mode": "abort"}')
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/generate"), data=io.BytesIO(big), headers=JSON) as r,
    ):
        assert r.status == 503
        assert "limits.max_inspecting_bytes" in (await r.json())["error"]["message"]
    assert gw.proxy is not None and gw.proxy.budget.used == 0
    assert (await _holds(gw))["refused"] == 1


async def test_held_generations_whose_engines_fail_are_answered_at_once(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    """The hold is for a paused engine, not a dead one: once the paused engines fail their
    probes the held request gets the no-backend 503 at once, not at the end of its hold."""
    engines = stubs[:2]
    gw = await make_gateway(
        *(s.url for s in engines),
        backends={
            "health": {"interval_s": 0.05, "timeout_s": 0.2, "unhealthy_threshold": 1},
            # Far longer than any wait below: an answer at the hold's end fails the test.
            "pause_hold_s": 300,
        },
    )
    await _control(gw, "/pause_generation", b'{"mode": "abort"}')
    async with aiohttp.ClientSession() as s:
        held = asyncio.ensure_future(s.post(gw_url(gw, "/generate"), data=_gen("x"), headers=JSON))
        await wait_for(lambda: gw.pool.holding == 1)
        for engine in engines:
            await engine.stop()
        async with asyncio.timeout(60), await held as r:
            assert r.status == 503
            assert "No healthy backend" in (await r.json())["error"]["message"]
    holds = await _holds(gw)
    assert (holds["now"], holds["released"]) == (0, 1)
