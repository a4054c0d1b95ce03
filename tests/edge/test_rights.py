"""Who may do what, in a cluster: membership from the engines' network, the abort of one rid
for any client that may generate, everything fleet-wide for operators only.

Real stubs behind a real gateway listening on 127.0.0.1; the callers are real aiohttp
clients bound to other loopback addresses (127.0.0.5, 127.0.0.6), which the gateway sees as
their peers: only 127.0.0.1 is an operator's address here, as an RL driver's would be.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway import cli
from gateway import config as config_mod
from gateway.app import Gateway
from gateway.fleet.pool import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url

DRIVER = "127.0.0.1/32"  # the operator's address: the RL driver on the gateway's host
ENGINE_NODE = "127.0.0.5"  # a GPU node of the cluster
ELSEWHERE = "127.0.0.6"  # an agent, or anyone else
OPERATOR = "op-key-1"
CLIENT = "client-key-1"
JSON = {"Content-Type": "application/json"}

# What only an operator may do, with a body an RL framework would send.
FLEET_WIDE = [
    ("POST", "/abort_request", b'{"abort_all": true}'),
    ("POST", "/pause_generation", b'{"mode": "abort"}'),
    ("POST", "/continue_generation", b"{}"),
    ("POST", "/update_weights_from_disk", b'{"model_path": "/m", "weight_version": "v2"}'),
    ("POST", "/flush_cache", b""),
    ("POST", "/release_memory_occupation", b'{"tags": ["kv_cache"]}'),
    ("POST", "/resume_memory_occupation", b'{"tags": ["kv_cache"]}'),
    ("POST", "/start_profile", b"{}"),
    ("GET", "/v1/loads", b""),
    ("POST", "/init_weights_update_group", b'{"rank_offset": 1}'),
]
# Abort bodies that do not name one rid: each acts on more than one request.
NOT_ONE_RID = [
    b'{"abort_all": true}',
    b'{"rid": "r", "abort_all": true}',
    b'{"rid": "r", "abort_all": "yes"}',  # SGLang's lax bool: abort all
    b'{"rid": "r", "abort_all": 1}',
    b'{"rid": "rollout-", "prefix": true}',
    b"{}",
    b'{"rid": ""}',  # SGLang's scheduler matches rids by prefix: "" is every request
    b'{"rid": ["a", "b"]}',
    b'{"rid": 7}',
    b'["r"]',
    b"rid=r",
    b"",
    orjson.dumps({"rid": "r" * 70000}),  # larger than any abort of one rid
]


@asynccontextmanager
async def _from(address: str) -> AsyncIterator[aiohttp.ClientSession]:
    """A client whose connections come from `address` (a loopback alias)."""
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with aiohttp.ClientSession(connector=connector) as session:
        yield session


def _forwarded(stubs: list[StubBackend], path: str) -> list[bytes]:
    return [
        r.body
        for stub in stubs
        for r in stub.received
        if r.path == path and "X-Forwarded-For" in r.headers
    ]


async def _metrics(gw: Gateway) -> str:
    async with aiohttp.ClientSession() as s, s.get(admin_url(gw, "/metrics")) as r:
        return await r.text()


async def _cluster(make_gateway: GatewayFactory, **control: object) -> Gateway:
    return await make_gateway(
        backends={"discovery": "registry"},
        control={
            "trusted_cidrs": [DRIVER],
            "membership": {"trusted_cidrs": [f"{ENGINE_NODE}/32"]},
            **control,
        },
    )


async def test_engines_register_list_and_leave_from_their_network_with_no_header(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await _cluster(make_gateway)
    async with _from(ENGINE_NODE) as node:
        # slime / Miles: POST /workers from each engine's own node.
        reg = {"url": stubs[0].url, "worker_type": "regular", "bootstrap_port": None}
        async with node.post(gw_url(gw, "/workers"), json=reg) as r:
            assert r.status == 200, await r.text()
            worker = await r.json()
        assert worker["id"] == worker_id(stubs[0].url)
        # Older sglang-router clients (verl): POST /add_worker?url=.
        async with node.post(gw_url(gw, "/add_worker"), params={"url": stubs[1].url}) as r:
            assert r.status == 200
        async with node.get(gw_url(gw, "/workers")) as r:
            assert [w["url"] for w in (await r.json())["workers"]] == [s.url for s in stubs[:2]]
        async with node.get(gw_url(gw, "/list_workers")) as r:
            assert await r.json() == {"urls": [s.url for s in stubs[:2]]}
        async with node.get(gw_url(gw, f"/workers/{worker['id']}")) as r:
            assert r.status == 200 and (await r.json())["url"] == stubs[0].url
        async with node.delete(gw_url(gw, f"/workers/{worker['id']}")) as r:
            assert r.status == 200
        async with node.post(gw_url(gw, "/remove_worker"), params={"url": stubs[1].url}) as r:
            assert r.status == 200
    assert gw.pool.backends == ()


async def test_membership_is_refused_elsewhere_naming_the_setting(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await _cluster(make_gateway)
    reg = {"url": stubs[0].url}
    async with _from(ELSEWHERE) as other:
        for method, path, kwargs in (
            ("POST", "/workers", {"json": reg}),
            ("POST", "/add_worker", {"params": {"url": stubs[0].url}}),
            ("GET", "/workers", {}),
            ("GET", "/list_workers", {}),
        ):
            async with other.request(method, gw_url(gw, path), **kwargs) as r:
                assert r.status == 403, path
                detail = (await r.json())["detail"]
                assert "control.membership.trusted_cidrs" in detail and "control key" in detail
    assert gw.pool.backends == ()
    # A request relayed by a proxy from the engines' network: the address is the proxy's.
    async with (
        _from(ENGINE_NODE) as node,
        node.post(gw_url(gw, "/workers"), json=reg, headers={"X-Forwarded-For": "10.1.1.1"}) as r,
    ):
        assert r.status == 403
        assert "relayed" in (await r.json())["detail"]
    assert gw.pool.backends == ()
    # The operator's address still grants it.
    async with (
        aiohttp.ClientSession() as driver,
        driver.post(gw_url(gw, "/workers"), json=reg) as r,
    ):
        assert r.status == 200
    text = await _metrics(gw)
    assert 'sglang_gateway_control_requests_total{result="forbidden",route="/workers"} 3.0' in text
    assert (
        'sglang_gateway_rejections_total{policy="control",profile="",reason="forbidden"} 5.0'
        in text
    )


@pytest.mark.parametrize(("method", "path", "body"), FLEET_WIDE)
async def test_the_engines_network_never_acts_on_the_fleet(
    stubs: list[StubBackend], make_gateway: GatewayFactory, method: str, path: str, body: bytes
) -> None:
    gw = await _cluster(make_gateway)
    async with (
        aiohttp.ClientSession() as driver,
        driver.post(gw_url(gw, "/workers"), json={"url": stubs[0].url}) as r,
    ):
        assert r.status == 200
    async with (
        _from(ENGINE_NODE) as node,
        node.request(method, gw_url(gw, path), data=body or None) as r,
    ):
        assert r.status == 403
        assert r.headers["Content-Type"].startswith("application/json")
        detail = (await r.json())["detail"]
    assert "operator key (control.keys)" in detail and "control.trusted_cidrs" in detail
    assert _forwarded(stubs, path) == []


async def test_an_addressed_call_from_the_engines_network_is_refused(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await _cluster(make_gateway)
    async with (
        aiohttp.ClientSession() as driver,
        driver.post(gw_url(gw, "/workers"), json={"url": stubs[0].url}) as r,
    ):
        assert r.status == 200
    target = f"/workers/{worker_id(stubs[0].url)}/pause_generation"
    async with _from(ENGINE_NODE) as node, node.post(gw_url(gw, target), data=b"{}") as r:
        assert r.status == 403
        assert "control.keys" in (await r.json())["detail"]
    assert _forwarded(stubs, "/pause_generation") == []


async def _streaming(
    session: aiohttp.ClientSession, gw: Gateway, rid: str
) -> aiohttp.ClientResponse:
    body = orjson.dumps({"text": "x", "rid": rid, "stream": True, "sampling_params": {"top_k": 2}})
    slow = {"X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "100", **JSON}
    r = await session.post(gw_url(gw, "/generate"), data=body, headers=slow)
    assert r.status == 200
    await r.content.readline()  # under way on one backend
    return r


async def test_a_generation_client_aborts_its_rid_with_no_header(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), control={"trusted_cidrs": [DRIVER]})
    rid = "5f0c3e2a9b7d4e1f8a6c2b3d4e5f6a7b"
    async with _from(ELSEWHERE) as agent:
        stream = await _streaming(agent, gw, rid)
        try:
            (owner,) = [b for b in stubs if b.generation_requests()]
            abort = orjson.dumps({"rid": rid})
            async with agent.post(gw_url(gw, "/abort_request"), data=abort) as a:
                assert a.status == 200, await a.text()
                assert [x["url"] for x in (await a.json())["results"]] == [owner.url]
            assert _forwarded(stubs, "/abort_request") == [abort]
        finally:
            stream.close()
        # SGLang's own spelling of the same, and a rid this gateway does not know.
        explicit = b'{"rid": "unknown-rid", "abort_all": false}'
        async with agent.post(gw_url(gw, "/abort_request"), data=explicit) as a:
            assert a.status == 200
            assert len((await a.json())["results"]) == 3


@pytest.mark.parametrize("body", NOT_ONE_RID)
async def test_a_client_abort_of_more_than_one_rid_is_an_operators(
    stubs: list[StubBackend], make_gateway: GatewayFactory, body: bytes
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), control={"trusted_cidrs": [DRIVER]})
    async with (
        _from(ELSEWHERE) as agent,
        agent.post(gw_url(gw, "/abort_request"), data=body or None) as r,
    ):
        assert r.status == 403
        detail = (await r.json())["detail"]
    assert "control.keys" in detail and '{"rid": "<id>"}' in detail
    assert _forwarded(stubs, "/abort_request") == []
    # The operator's address may send it (it reaches the engines as it came).
    async with (
        aiohttp.ClientSession() as driver,
        driver.post(gw_url(gw, "/abort_request"), data=body or None) as r,
    ):
        assert r.status in (200, 502)
    assert len(_forwarded(stubs, "/abort_request")) == 3


async def test_client_abort_can_be_turned_off(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(
        stubs[0].url, control={"trusted_cidrs": [DRIVER], "client_abort": False}
    )
    abort = b'{"rid": "r-1"}'
    async with _from(ELSEWHERE) as agent, agent.post(gw_url(gw, "/abort_request"), data=abort) as r:
        assert r.status == 403
        assert "control.client_abort" in (await r.json())["detail"]
    assert _forwarded(stubs, "/abort_request") == []
    async with (
        aiohttp.ClientSession() as driver,
        driver.post(gw_url(gw, "/abort_request"), data=abort) as r,
    ):
        assert r.status == 200
    text = await _metrics(gw)
    assert (
        'sglang_gateway_rejections_total{policy="control",profile="",reason="client_abort_off"} 1.0'
        in text
    )
    assert (
        'sglang_gateway_control_requests_total{result="forbidden",route="/abort_request"} 1.0'
        in text
    )


async def test_a_client_key_grants_the_abort_of_a_rid_and_nothing_else(
    stubs: list[StubBackend], make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "clients.txt"
    keys.write_text(CLIENT + "\n")
    gw = await make_gateway(
        backends={"discovery": "registry", "static": [stubs[0].url]},
        auth={"enabled": True, "keys_file": str(keys), "upstream_authorization": "Bearer up"},
        control={
            "keys": [OPERATOR],
            "trusted_cidrs": [],
            "membership": {"trusted_cidrs": [f"{ENGINE_NODE}/32"]},
        },
    )
    client = {"Authorization": f"Bearer {CLIENT}"}
    abort = b'{"rid": "r-1"}'
    async with _from(ELSEWHERE) as agent:
        async with agent.post(gw_url(gw, "/abort_request"), data=abort, headers=client) as r:
            assert r.status == 200
        sent = [r for r in stubs[0].received if r.path == "/abort_request"]
        assert [r.headers.getall("Authorization") for r in sent] == [["Bearer up"]]
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with agent.post(gw_url(gw, "/abort_request"), data=abort, headers=headers) as r:
                assert r.status == 403
                assert "client key (auth.keys)" in (await r.json())["detail"]
        refused = [
            ("POST", "/workers", orjson.dumps({"url": stubs[1].url}), "membership"),
            ("GET", "/workers", b"", "membership"),
            ("POST", "/abort_request", b'{"abort_all": true}', "control.keys"),
            ("POST", "/pause_generation", b"{}", "control.keys"),
        ]
        for method, path, body, needle in refused:
            async with agent.request(
                method, gw_url(gw, path), data=body or None, headers=client
            ) as r:
                assert r.status == 403, path
                assert needle in (await r.json())["detail"]
    # The engines' network registers with no header, but may not abort without a client key.
    async with _from(ENGINE_NODE) as node:
        async with node.post(gw_url(gw, "/workers"), json={"url": stubs[1].url}) as r:
            assert r.status == 200
        async with node.post(gw_url(gw, "/abort_request"), data=abort) as r:
            assert r.status == 403
    assert len([r for r in stubs[0].received if r.path == "/abort_request"]) == 1
    assert _forwarded(stubs, "/pause_generation") == []


def test_a_bad_membership_network_is_a_clear_startup_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {
        "backends": {"static": ["http://h:1"]},
        "control": {"membership": {"trusted_cidrs": ["10.0.0.0/24", "10.0.0.300/24"]}},
    }
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.build(data)
    assert (
        "control.membership.trusted_cidrs[1]: value '10.0.0.300/24': must be an IP address "
        "or CIDR network" in str(err.value)
    )
    path = tmp_path / "bad.yaml"
    path.write_text(
        "backends: {static: [http://h:1]}\ncontrol: {membership: {trusted_cidrs: [nope]}}\n"
    )
    assert cli.main(["--check-config", "--config", str(path)]) == 2
    assert "control.membership.trusted_cidrs[0]" in capsys.readouterr().err
    with pytest.raises(config_mod.ConfigError, match=r"control\.client_abort"):
        config_mod.build({**data, "control": {"client_abort": "sometimes"}})


def test_the_defaults_grant_membership_to_no_address_and_abort_to_clients() -> None:
    control = config_mod.build({"backends": {"static": ["http://h:1"]}}).control
    assert control.membership.trusted_cidrs == [] and control.client_abort is True


def test_the_rl_config_ships_a_multi_node_setting() -> None:
    cfg = config_mod.load(Path(__file__).parents[2] / "config" / "rl-filter.yaml", environ={})
    control = cfg.control
    assert control.membership.trusted_cidrs and control.client_abort is True
    assert not set(control.trusted_cidrs) & set(control.membership.trusted_cidrs)
