"""The worker registry (backends.discovery: registry), as an RL framework drives it:
register engines over HTTP, list them, route to them once probed, remove them."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from gateway import config as config_mod
from gateway.app import Gateway
from gateway.fleet.pool import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url, wait_for

GEN = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
JSON = {"Content-Type": "application/json"}


async def _registry_gateway(make_gateway: GatewayFactory, **overrides: object) -> Gateway:
    return await make_gateway(backends={"discovery": "registry"}, **overrides)


async def test_register_list_route_and_remove(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await _registry_gateway(make_gateway)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw_url(gw, "/generate"), data=GEN, headers=JSON) as r:
            assert r.status == 503  # nobody registered yet
        reg = {"url": stub.url, "worker_type": "regular", "bootstrap_port": None}
        async with s.post(gw_url(gw, "/workers"), json=reg) as r:
            assert r.status == 200
            worker = await r.json()
        assert worker["id"] == worker_id(stub.url) and worker["url"] == stub.url
        assert worker["worker_type"] == "regular" and "bootstrap_port" in worker
        async with s.post(gw_url(gw, "/workers"), json=reg) as r:
            assert r.status == 200 and (await r.json())["id"] == worker["id"]  # idempotent
        # Routable once its first probe passed, not before.
        await wait_for(lambda: gw.pool.backends[0].health.value == "healthy")
        async with s.get(gw_url(gw, "/workers")) as r:
            (listed,) = (await r.json())["workers"]
        assert listed["healthy"] is True and listed["state"] == "healthy"
        assert listed["inflight"] == 0 and listed["worker_type"] == "regular"
        async with s.post(gw_url(gw, "/generate"), data=GEN, headers=JSON) as r:
            assert r.status == 200
        async with s.get(gw_url(gw, f"/workers/{worker['id']}")) as r:
            assert r.status == 200 and (await r.json())["url"] == stub.url
        async with s.delete(gw_url(gw, f"/workers/{worker['id']}")) as r:
            assert r.status == 200
            assert await r.json() == {"success": True, "id": worker["id"], "url": stub.url}
        for method in ("GET", "DELETE"):
            async with s.request(method, gw_url(gw, f"/workers/{worker['id']}")) as r:
                assert r.status == 404
        async with s.post(gw_url(gw, "/generate"), data=GEN, headers=JSON) as r:
            assert r.status == 503


async def test_a_new_worker_waits_for_its_first_probe(make_gateway: GatewayFactory) -> None:
    starting = StubBackend(health_status=503)  # loading its weights
    await starting.start()
    try:
        gw = await _registry_gateway(make_gateway)
        async with aiohttp.ClientSession() as s:
            async with s.post(gw_url(gw, "/workers"), json={"url": starting.url}) as r:
                assert (await r.json())["state"] == "probation"
            async with s.post(gw_url(gw, "/generate"), data=GEN, headers=JSON) as r:
                assert r.status == 503
            assert starting.generation_requests() == []
            starting.health_status = 200
            await wait_for(lambda: gw.pool.backends[0].health.value == "healthy")
            async with s.post(gw_url(gw, "/generate"), data=GEN, headers=JSON) as r:
                assert r.status == 200
    finally:
        await starting.stop()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"url": "ftp://x:1"}, "must be an http"),
        ({"url": "http://h:1/path"}, "no path"),
        ({"url": 5}, "needs a 'url'"),
        ({}, "needs a 'url'"),
        ([], "JSON object"),
    ],
)
async def test_a_bad_registration_is_400_naming_the_problem(
    make_gateway: GatewayFactory, body: object, needle: str
) -> None:
    gw = await _registry_gateway(make_gateway)
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/workers"), json=body) as r,
    ):
        assert r.status == 400
        assert needle in (await r.json())["detail"]
    assert gw.pool.backends == ()


async def test_legacy_forms_and_a_reload_keeps_the_members(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await _registry_gateway(make_gateway)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw_url(gw, "/add_worker"), params={"url": stub.url}) as r:
            assert r.status == 200
        async with s.get(gw_url(gw, "/list_workers")) as r:
            assert await r.json() == {"urls": [stub.url]}
        assert await gw.reload(config_mod.build(config_mod.to_data(gw.cfg))) is True
        async with s.get(gw_url(gw, "/list_workers")) as r:
            assert await r.json() == {"urls": [stub.url]}  # SIGHUP keeps registrations
        async with s.post(gw_url(gw, "/remove_worker"), params={"url": stub.url}) as r:
            assert r.status == 200
        async with s.post(gw_url(gw, "/remove_worker"), params={"url": stub.url}) as r:
            assert r.status == 404
        async with s.get(gw_url(gw, "/list_workers")) as r:
            assert await r.json() == {"urls": []}


async def test_other_discoveries_list_but_refuse_registration(
    stub: StubBackend, gateway: Gateway
) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw_url(gateway, "/workers")) as r:
            assert [w["url"] for w in (await r.json())["workers"]] == [stub.url]
        async with s.post(gw_url(gateway, "/workers"), json={"url": "http://10.0.0.1:1"}) as r:
            assert r.status == 409
            assert "backends.discovery is static" in (await r.json())["detail"]


async def test_registry_calls_are_for_operators_only(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await _registry_gateway(make_gateway, control={"trusted_cidrs": [], "keys": ["op"]})
    async with aiohttp.ClientSession() as s:
        for path in ("/workers", "/add_worker"):
            async with s.post(gw_url(gw, path), json={"url": stub.url}) as r:
                assert r.status == 403
        async with s.get(gw_url(gw, "/workers")) as r:
            assert r.status == 403
        op = {"Authorization": "Bearer op"}
        async with s.post(gw_url(gw, "/workers"), json={"url": stub.url}, headers=op) as r:
            assert r.status == 200
    assert [b.url for b in gw.pool.backends] == [stub.url]


async def test_a_workers_api_key_is_never_kept_or_shown(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    """SMG's registration may carry the worker's api_key (sgl-model-gateway's
    WorkerConfigRequest): the gateway sends no per-worker credential, and what it keeps is
    listed by GET /workers and shared with the other --workers through a file."""
    gw = await _registry_gateway(make_gateway)
    secret = "sk-worker-credential-0123456789"
    reg = {"url": stub.url, "worker_type": "regular", "api_key": secret, "priority": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw_url(gw, "/workers"), json=reg) as r:
            assert r.status == 200
            assert secret not in await r.text()
        async with s.get(gw_url(gw, "/workers")) as r:
            listing = await r.text()
    assert secret not in listing and '"priority":2' in listing
    assert gw.fleet.registry is not None
    assert "api_key" not in gw.fleet.registry.extras(stub.url)
