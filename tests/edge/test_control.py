"""Fleet control: SGLang's engine operations go to every backend, operators only.

Three real stubs behind a real gateway; each control call must reach each of them exactly
once with the body byte for byte, answer 200 only when all of them answered 2xx, list every
backend's answer, and refuse callers without an operator credential.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.app import Gateway
from gateway.edge.control import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url, wait_for
from tests.hardening.rawnet import ScriptedBackend

OPERATOR = "op-key-1"
CLIENT = "client-key-1"
FAN_OUT = [
    ("POST", "/abort_request", b'{"abort_all": true}'),
    ("POST", "/flush_cache", b""),
    ("GET", "/flush_cache", b""),
    ("POST", "/pause_generation", b'{"mode": "abort"}'),
    ("POST", "/continue_generation", b"{}"),
    ("POST", "/update_weights_from_disk", b'{"model_path": "/m", "weight_version": "v2"}'),
    ("POST", "/release_memory_occupation", b'{"tags": ["kv_cache"]}'),
    ("POST", "/resume_memory_occupation", b'{"tags": ["kv_cache"]}'),
    ("POST", "/start_profile", b"{}"),
    ("POST", "/stop_profile", b"{}"),
    ("GET", "/v1/loads", b""),
    ("GET", "/get_loads", b""),
]


def _proxied(stub: StubBackend, path: str) -> list[bytes]:
    return [r.body for r in stub.received if r.path == path and "X-Forwarded-For" in r.headers]


@pytest.mark.parametrize(("method", "path", "body"), FAN_OUT)
async def test_each_control_call_reaches_every_backend_once(
    stubs: list[StubBackend], make_gateway: GatewayFactory, method: str, path: str, body: bytes
) -> None:
    gw = await make_gateway(*(s.url for s in stubs))
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, gw_url(gw, path), data=body or None) as r,
    ):
        assert r.status == 200
        reply = await r.json()
    assert reply["success"] is True
    assert [(x["url"], x["status"]) for x in reply["results"]] == [(b.url, 200) for b in stubs]
    assert [x["id"] for x in reply["results"]] == [worker_id(b.url) for b in stubs]
    for stub in stubs:
        assert _proxied(stub, path) == [body]  # once each, byte for byte


class _Failing(ScriptedBackend):
    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 11\r\n\r\nengine died"
        )
        return True


class _Hanging(ScriptedBackend):
    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            return True
        await asyncio.sleep(30)
        return False


async def test_one_failing_engine_turns_the_reply_into_a_502_naming_it(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    failing, hanging = _Failing(), _Hanging()
    bad_url, slow_url = await failing.start(), await hanging.start()
    try:
        gw = await make_gateway(
            stubs[0].url,
            bad_url,
            slow_url,
            backends={"health": {"enabled": False}},
            control={"timeout_s": 0.5},
        )
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw_url(gw, "/pause_generation"), data=b'{"mode": "abort"}') as r,
        ):
            assert r.status == 502
            reply = await r.json()
        assert reply["success"] is False
        by_url = {x["url"]: x for x in reply["results"]}
        assert by_url[stubs[0].url]["status"] == 200
        assert by_url[bad_url] == {
            "id": worker_id(bad_url),
            "url": bad_url,
            "status": 500,
            "body": "engine died",
        }
        assert by_url[slow_url]["status"] == 0
        assert "no answer within 0.5 s" in by_url[slow_url]["body"]
        assert _proxied(stubs[0], "/pause_generation") == [b'{"mode": "abort"}']
        text = await _metrics(gw)
        assert (
            'sglang_gateway_control_requests_total{result="failed",route="/pause_generation"}'
            in (text)
        )
    finally:
        await failing.stop()
        await hanging.stop()


async def _metrics(gw: Gateway) -> str:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{gw.admin_port}/metrics") as r,
    ):
        return await r.text()


async def test_only_operators_control_the_fleet(
    stubs: list[StubBackend], make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "clients.txt"
    keys.write_text(CLIENT + "\n")
    gw = await make_gateway(
        stubs[0].url,
        auth={"enabled": True, "keys_file": str(keys), "upstream_authorization": "Bearer up"},
        control={"keys": [OPERATOR], "trusted_cidrs": []},  # loopback is not trusted here
    )
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": f"Bearer {CLIENT}"}, {"Authorization": "Bearer x"}):
            async with s.post(gw_url(gw, "/start_profile"), headers=headers, data=b"{}") as r:
                assert r.status == 403
                assert "operator key" in (await r.json())["detail"]
        assert _proxied(stubs[0], "/start_profile") == []
        op = {"Authorization": f"Bearer {OPERATOR}"}
        async with s.post(gw_url(gw, "/start_profile"), headers=op, data=b"{}") as r:
            assert r.status == 200
        # The operator's key is not passed on: the backend gets the configured credential.
        sent = [r for r in stubs[0].received if r.path == "/start_profile"][-1]
        assert sent.headers.getall("Authorization") == ["Bearer up"]
        # A client key still works for generation, and never for control.
        client = {"Authorization": f"Bearer {CLIENT}", "Content-Type": "application/json"}
        body = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
        async with s.post(gw_url(gw, "/generate"), headers=client, data=body) as r:
            assert r.status == 200
    text = await _metrics(gw)
    assert (
        'sglang_gateway_control_requests_total{result="forbidden",route="/start_profile"} 3.0'
        in text
    )
    assert 'sglang_gateway_control_requests_total{result="ok",route="/start_profile"} 1.0' in text


async def test_loopback_is_trusted_by_default_and_a_dead_member_is_named(
    make_gateway: GatewayFactory,
) -> None:
    gone = StubBackend()
    await gone.start()
    url = gone.url
    await gone.stop()  # nothing listens there any more
    gw = await make_gateway(url, backends={"health": {"enabled": False}})
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/flush_cache")) as r,
    ):
        assert r.status == 502
        (result,) = (await r.json())["results"]
    assert result["url"] == url and result["status"] == 0
    assert result["body"].startswith("could not connect")
    # A control call that failed to connect never ejects the backend: it is no traffic.
    assert not gw.pool.ejected(gw.pool.backends[0])


async def test_a_per_engine_call_goes_to_the_one_worker_named(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs))
    body = b'{"serialized_named_tensors": ["h0"], "load_format": "direct", "weight_version": "v3"}'
    target = stubs[1]
    async with aiohttp.ClientSession() as s:
        path = f"/workers/{worker_id(target.url)}/update_weights_from_tensor"
        async with s.post(gw_url(gw, path), data=body) as r:
            assert r.status == 200
            relayed = await r.read()
        async with s.post(target.url + "/update_weights_from_tensor", data=body) as r:
            direct = await r.read()
        assert relayed == direct  # the engine's own answer, as it came
        assert _proxied(target, "/update_weights_from_tensor") == [body]
        assert all(
            _proxied(o, "/update_weights_from_tensor") == [] for o in stubs if o is not target
        )
        # Without an address it is refused: no single engine is meant.
        async with s.post(gw_url(gw, "/update_weights_from_tensor"), data=body) as r:
            assert r.status == 400
            assert "/workers/{id}/update_weights_from_tensor" in (await r.json())["detail"]
        async with s.post(gw_url(gw, "/workers/nope/init_weights_update_group"), data=b"{}") as r:
            assert r.status == 404


async def test_an_abort_of_a_known_rid_goes_to_its_owner_only(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs))
    stream = orjson.dumps(
        {"text": "x", "rid": "rollout-7", "stream": True, "sampling_params": {"top_k": 2}}
    )
    slow = {
        "X-Stub-Chunk-Delay-Ms": "100",
        "X-Stub-Events": "100",
        "Content-Type": "application/json",
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/generate"), data=stream, headers=slow) as r,
    ):
        assert r.status == 200
        await r.content.readline()  # under way on one backend
        (owner,) = [b for b in stubs if b.generation_requests()]
        abort = b'{"rid": "rollout-7"}'
        async with s.post(gw_url(gw, "/abort_request"), data=abort) as a:
            assert a.status == 200
            assert [x["url"] for x in (await a.json())["results"]] == [owner.url]
        for stub in stubs:
            assert _proxied(stub, "/abort_request") == ([abort] if stub is owner else [])
        # An unknown rid may be queued anywhere: every backend is asked.
        async with s.post(gw_url(gw, "/abort_request"), data=b'{"rid": "other"}') as a:
            assert len((await a.json())["results"]) == 3
        async with s.post(gw_url(gw, "/abort_request"), data=b'{"abort_all": true}') as a:
            assert len((await a.json())["results"]) == 3
    # The stream ended (the client left): its rid is forgotten.
    assert gw.proxy is not None
    await asyncio.sleep(0.1)
    assert not gw.proxy.owners


async def test_paused_engines_get_no_new_requests_and_weight_versions_are_tracked(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs[:2]), backends={"pause_hold_s": 0.3})
    gen = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    json_ct = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw_url(gw, "/pause_generation"), data=b'{"mode": "abort"}') as r:
            assert r.status == 200
        async with s.get(gw_url(gw, "/workers")) as r:
            assert {w["state"] for w in (await r.json())["workers"]} == {"paused"}
        # Held up to pause_hold_s for a routable engine, then 503: nothing reaches them.
        async with s.post(gw_url(gw, "/generate"), data=gen, headers=json_ct) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert all(b.generation_requests() == [] for b in stubs[:2])
        # A request that arrives while paused goes out as soon as the fleet continues.
        waiting = asyncio.ensure_future(s.post(gw_url(gw, "/generate"), data=gen, headers=json_ct))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        update = b'{"model_path": "/ckpt/step-9", "weight_version": "step-9"}'
        async with s.post(gw_url(gw, "/update_weights_from_disk"), data=update) as r:
            assert r.status == 200
        async with s.post(gw_url(gw, "/continue_generation"), data=b"{}") as r:
            assert r.status == 200
        async with await waiting as r:
            assert r.status == 200
        async with s.get(gw_url(gw, "/workers")) as r:
            workers = (await r.json())["workers"]
        assert {(w["state"], w["weight_version"]) for w in workers} == {("healthy", "step-9")}
        async with s.post(gw_url(gw, "/release_memory_occupation"), data=b"{}") as r:
            assert r.status == 200
        async with s.get(gw_url(gw, "/workers")) as r:
            assert {w["state"] for w in (await r.json())["workers"]} == {"asleep"}
        text = await _metrics(gw)
        assert (
            f'sglang_gateway_backend_state{{backend="{stubs[0].url}",state="asleep"}} 1.0' in text
        )
        # Readiness holds while the fleet sleeps: it is not broken, it is being updated.
        async with s.get(f"http://127.0.0.1:{gw.admin_port}/readyz") as r:
            assert r.status == 200


async def test_every_reply_names_the_weights_that_served_it(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    stub.weight_version = "w1"
    gw = await make_gateway(stub.url)
    await wait_for(lambda: gw.pool.backends[0].weight_version == "w1")  # read from /model_info
    gen = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    json_ct = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw_url(gw, "/generate"), data=gen, headers=json_ct) as r:
            assert r.headers["X-Weight-Version"] == "w1"
            assert (await r.json())["meta_info"]["weight_version"] == "w1"
        update = b'{"model_path": "/ckpt/2", "weight_version": "w2"}'
        async with s.post(gw_url(gw, "/update_weights_from_disk"), data=update) as r:
            assert r.status == 200
        async with s.post(gw_url(gw, "/generate"), data=gen, headers=json_ct) as r:
            assert r.headers["X-Weight-Version"] == "w2"
            assert (await r.json())["meta_info"]["weight_version"] == "w2"  # body untouched


async def test_after_an_update_the_engine_says_which_weights_it_serves(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    # Probes read the weights too: only the first one runs within this test, so what the
    # gateway knows after the update it learnt from the read-back.
    gw = await make_gateway(*(s.url for s in stubs[:2]), backends={"health": {"interval_s": 30}})
    await wait_for(lambda: all(b.weight_version == "default" for b in gw.pool.backends))
    # Updated directly on the engine, behind the gateway's back; then an update through
    # the gateway that names no version: the engine keeps its own, and the gateway asks it.
    stubs[0].weight_version = "direct-3"
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/update_weights_from_disk"), data=b'{"model_path": "/m"}') as r,
    ):
        assert r.status == 200
    assert [b.weight_version for b in gw.pool.backends] == ["direct-3", "default"]
    paths = [r.path for r in stubs[0].received if r.path != "/health"]
    assert paths[-2:] == ["/update_weights_from_disk", "/model_info"]
    text = await _metrics(gw)
    assert (
        f'sglang_gateway_backend_weight_version{{backend="{stubs[0].url}",version="direct-3"}} 1.0'
        in text
    )


async def test_requests_go_to_the_weights_they_ask_for(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    old, new = stubs[0], stubs[1]
    gw = await make_gateway(
        old.url,
        new.url,
        routing={"weight_version": "latest"},
        backends={"queue_timeout_s": 0.2},
    )
    await wait_for(lambda: all(b.weight_version == "default" for b in gw.pool.backends))
    gen = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    json_ct = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        update = b'{"serialized_named_tensors": [], "weight_version": "v2"}'
        path = f"/workers/{worker_id(new.url)}/update_weights_from_tensor"
        async with s.post(gw_url(gw, path), data=update) as r:
            assert r.status == 200
        # latest: only the engine at v2 serves now.
        for _ in range(6):
            async with s.post(gw_url(gw, "/generate"), data=gen, headers=json_ct) as r:
                assert r.status == 200 and r.headers["X-Weight-Version"] == "v2"
        assert old.generation_requests() == [] and len(new.generation_requests()) == 6
        # A request may ask for other weights by name; none at that version: 503.
        pinned = {**json_ct, "X-Weight-Version": "default"}
        async with s.post(gw_url(gw, "/generate"), data=gen, headers=pinned) as r:
            assert r.status == 200 and r.headers["X-Weight-Version"] == "default"
        missing = {**json_ct, "X-Weight-Version": "v9"}
        async with s.post(gw_url(gw, "/generate"), data=gen, headers=missing) as r:
            assert r.status == 503


async def test_a_control_call_whose_caller_leaves_still_completes_and_is_recorded(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs[:2]))
    slow = {"X-Stub-Delay-Ms": "300"}  # the engines take a while to pause
    async with aiohttp.ClientSession() as s:
        with pytest.raises(TimeoutError):
            async with s.post(
                gw_url(gw, "/pause_generation"),
                data=b'{"mode": "retract"}',
                headers=slow,
                timeout=aiohttp.ClientTimeout(total=0.1),
            ) as r:
                await r.read()
    # The engines paused; the gateway knows it, though nobody waited for the answer.
    await wait_for(lambda: all(b.paused for b in gw.pool.backends), timeout=5)
    assert [s.pause_mode for s in stubs[:2]] == ["retract", "retract"]
