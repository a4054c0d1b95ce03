"""A dead backend and a flapping one, through a real gateway in front of stub backends.

Both are ejected again and again; only the flapping one passes probes in between. The
SGLangGatewayEjectionFlapping alert reads sglang_gateway_backend_flaps_total, which must
tell them apart: deploy/monitoring/rules.test.yaml has the same two cases as series.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import Gateway
from gateway.fleet.pool import Health
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url, wait_for

JSON = {"Content-Type": "application/json"}
OK_BODY = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2, "max_new_tokens": 2}})


async def per_backend(session: aiohttp.ClientSession, gw: Gateway, name: str) -> dict[str, float]:
    async with session.get(admin_url(gw, "/metrics")) as r:
        text = await r.text()
    return {
        s.labels["backend"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


async def traffic(session: aiohttp.ClientSession, gw: Gateway, until: asyncio.Event) -> None:
    while not until.is_set():
        async with session.post(gw_url(gw, "/generate"), data=OK_BODY, headers=JSON) as r:
            await r.read()
        await asyncio.sleep(0.01)  # let ejections run out, so the dead one is tried again


async def test_a_dead_backend_is_ejected_again_and_again_but_flaps_once(
    stubs: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(
        stubs[0].url,
        stubs[1].url,
        backends={
            "balancer": "round_robin",
            "health": {"interval_s": 0.2, "unhealthy_threshold": 4},
            "passive": {"base_eject_s": 0.05, "max_eject_s": 1},
        },
    )
    await wait_for(lambda: all(b.health is Health.HEALTHY for b in gw.pool.backends))
    dead = gw.pool.backends[1]
    port = int(stubs[1].url.rsplit(":", 1)[1])
    await stubs[1].stop()
    done = asyncio.Event()
    load = asyncio.ensure_future(traffic(session, gw, done))
    try:
        # Refused connects eject it, each time for longer, until its probes fail.
        await wait_for(lambda: dead.health is Health.UNHEALTHY, timeout=10)
    finally:
        done.set()
        await load
    ejections = await per_backend(session, gw, "sglang_gateway_backend_ejections_total")
    assert ejections[dead.url] >= 3  # what the alert counted before: it fired on this
    flaps = await per_backend(session, gw, "sglang_gateway_backend_flaps_total")
    assert flaps == {stubs[0].url: 0, dead.url: 1}  # once: when it died

    await stubs[1].start(port=port)  # the outage ends
    await wait_for(lambda: dead.health is Health.HEALTHY, timeout=10)
    flaps = await per_backend(session, gw, "sglang_gateway_backend_flaps_total")
    assert flaps[dead.url] == 1


async def test_a_backend_that_passes_probes_but_fails_requests_flaps(
    stubs: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(
        stubs[0].url,
        stubs[1].url,
        backends={
            "balancer": "round_robin",
            "health": {"interval_s": 0.02},
            "passive": {"consecutive_5xx": 2, "base_eject_s": 0.15, "max_eject_s": 0.15},
        },
    )
    await wait_for(lambda: all(b.health is Health.HEALTHY for b in gw.pool.backends))
    flaky = gw.pool.backends[0]
    stubs[0].fail_status = 500  # its /health still passes
    done = asyncio.Event()
    load = asyncio.ensure_future(traffic(session, gw, done))
    try:
        await wait_for(lambda: flaky.ejections_total >= 4, timeout=10)
    finally:
        done.set()
        await load
    flaps = await per_backend(session, gw, "sglang_gateway_backend_flaps_total")
    # Every ejection but perhaps one had a passing probe before it.
    assert flaps[flaky.url] >= 3
    assert flaps[flaky.url] >= flaky.ejections_total - 1
    assert flaps[stubs[1].url] == 0
