"""A fleet of real stub backends behind one gateway: discovery, health, balancing, retries,
timeouts, limits, reload. DNS answers come from an injected resolver and the Kubernetes
API from a fake API server on loopback: those are the only seams."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest

from gateway import config as config_mod
from gateway.app import Gateway
from gateway.edge.clients import KubernetesApi
from gateway.fleet.discovery import ApiError
from gateway.fleet.pool import Health
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url, wait_for
from tests.fleet.kubeapi import FakeKubernetesApi

JSON = {"Content-Type": "application/json"}
OK_BODY = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2, "max_new_tokens": 2}})


async def send(session: aiohttp.ClientSession, gw: Gateway, **headers: str) -> int:
    async with session.post(
        gw_url(gw, "/generate"), data=OK_BODY, headers={**JSON, **headers}
    ) as r:
        await r.read()
        return r.status


def served(stubs: list[StubBackend]) -> list[int]:
    return [len(s.generation_requests()) for s in stubs]


# -- balancing through the gateway ---------------------------------------------------------


async def test_consistent_hash_keeps_a_session_on_one_worker(
    stubs: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), backends={"balancer": "consistent_hash"})
    for _turn in range(5):
        for sid in range(12):
            assert await send(session, gw, **{"X-Session-Id": f"rollout-{sid}"}) == 200
    owners: dict[str, set[int]] = {}
    for i, stub in enumerate(stubs):
        for r in stub.generation_requests():
            owners.setdefault(r.headers["X-Session-Id"], set()).add(i)
    assert len(owners) == 12
    assert all(len(v) == 1 for v in owners.values())  # every turn on the same worker
    assert len({next(iter(v)) for v in owners.values()}) > 1  # and sessions are spread


async def test_least_inflight_avoids_a_busy_backend(
    stubs: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(stubs[0].url, stubs[1].url)
    slow = asyncio.ensure_future(send(session, gw, **{"X-Stub-Delay-Ms": "200"}))
    await wait_for(lambda: sum(b.inflight for b in gw.pool.backends) == 1)
    busy = next(i for i, b in enumerate(gw.pool.backends) if b.inflight)
    # Counted in flight before it is sent: the engine's own count shows it arrived.
    await wait_for(lambda: sum(served(stubs)) == 1)
    # Paused in place, the busy engine keeps the slow request until it continues, however
    # long the quick ones take on a loaded machine.
    pause = {"mode": "in_place"}
    async with session.post(stubs[busy].url + "/pause_generation", json=pause) as r:
        assert r.status == 200
    before = served(stubs)
    statuses = [await send(session, gw) for _ in range(10)]
    assert statuses == [200] * 10
    after = served(stubs)
    assert after[1 - busy] - before[1 - busy] == 10  # every quick one went to the idle one
    assert after[busy] == before[busy]
    assert not slow.done()
    async with session.post(stubs[busy].url + "/continue_generation", json={}) as r:
        assert r.status == 200
    assert await slow == 200


# -- health: active probes and passive ejection ---------------------------------------------


async def test_dead_backend_is_skipped_and_a_returning_one_rejoins(
    stubs: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), backends={"balancer": "round_robin"})
    await wait_for(lambda: all(b.health is Health.HEALTHY for b in gw.pool.backends))
    victim = stubs[1]
    port = int(victim.url.rsplit(":", 1)[1])
    await victim.stop()
    statuses = [await send(session, gw) for _ in range(30)]
    assert statuses == [200] * 30  # connect failures were retried elsewhere
    await wait_for(lambda: gw.pool.backends[1].health is Health.UNHEALTHY, timeout=10)
    before = len(victim.generation_requests())
    await victim.start(port=port)
    await wait_for(lambda: gw.pool.backends[1].health is Health.HEALTHY, timeout=10)
    await wait_for(lambda: gw.pool.backends[1].ejected_until == 0.0, timeout=10)
    for _ in range(30):
        assert await send(session, gw) == 200
    assert len(victim.generation_requests()) > before


async def test_repeated_5xx_eject_a_backend_but_400s_do_not(
    stubs: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(
        *(s.url for s in stubs[:2]),
        backends={
            "balancer": "round_robin",
            "health": {"enabled": False},
            "passive": {"consecutive_5xx": 3, "base_eject_s": 30},
        },
    )
    stubs[0].fail_status = 400
    for _ in range(20):
        await send(session, gw)
    assert all(b.ejected_until == 0 for b in gw.pool.backends)
    stubs[0].fail_status = 500
    for _ in range(12):
        await send(session, gw)
    assert gw.pool.backends[0].ejected_until > 0
    before = served(stubs)
    statuses = [await send(session, gw) for _ in range(10)]
    assert statuses == [200] * 10
    assert served(stubs)[0] == before[0]  # no traffic while ejected


async def test_hung_backend_gets_504_and_loses_health(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    hung = StubBackend(delay_s=30, health_delay_s=30)
    await hung.start()
    try:
        gw = await make_gateway(
            hung.url,
            timeouts={"ttfb_s": 0.3},
            backends={"health": {"interval_s": 0.1, "timeout_s": 0.2}},
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        status = await send(session, gw)
        assert status == 504
        assert loop.time() - started < 2
        # Probes of a path that hangs time out: the backend is marked unhealthy.
        await wait_for(lambda: gw.pool.backends[0].health is Health.UNHEALTHY, timeout=5)
    finally:
        await hung.stop()


async def test_idle_stream_is_cut_and_total_deadline_applies(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(stub.url, timeouts={"idle_s": 0.3, "ttfb_s": 5})
    body = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 2}})
    hdrs = {**JSON, "X-Stub-Chunk-Delay-Ms": "1000", "X-Stub-Events": "4"}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(gw_url(gw, "/generate"), data=body, headers=hdrs) as r:
            assert r.status == 200  # a slow first byte within ttfb_s is fine
            await r.read()
    gw2 = await make_gateway(stub.url, timeouts={"total_s": 0.5})
    hdrs = {**JSON, "X-Stub-Chunk-Delay-Ms": "200", "X-Stub-Events": "10"}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(gw_url(gw2, "/generate"), data=body, headers=hdrs) as r:
            await r.read()


# -- limits ----------------------------------------------------------------------------------


@pytest.mark.heavy
async def test_concurrency_cap_queues_briefly_then_503(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(
        stub.url, backends={"max_inflight_per_backend": 2, "queue_timeout_s": 0.4}
    )
    # Two slots: four requests of 150 ms finish, the last two after waiting for a slot.
    quick = await asyncio.gather(
        *(send(session, gw, **{"X-Stub-Delay-Ms": "150"}) for _ in range(4))
    )
    assert quick == [200] * 4
    loop = asyncio.get_running_loop()
    started = loop.time()
    slow = await asyncio.gather(
        *(send(session, gw, **{"X-Stub-Delay-Ms": "1500"}) for _ in range(3))
    )
    assert sorted(slow) == [200, 200, 503]
    async with session.get(admin_url(gw, "/metrics")) as r:
        assert 'outcome="no_capacity"' in await r.text()
    assert loop.time() - started < 3


# -- discovery -------------------------------------------------------------------------------


class FakeResolver:
    """Scripted DNS answers: a list of addresses, or an exception to raise."""

    def __init__(self) -> None:
        self.answer: list[str] | Exception = []
        self.calls = 0

    async def resolve(self, host: str, port: int) -> list[str]:
        self.calls += 1
        assert host == "sglang.llm.svc.cluster.local"
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


async def test_dns_discovery_follows_answers_and_keeps_last_good(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    # Three stubs on one port, on three loopback addresses: like pods behind a headless
    # Service.
    stubs = [StubBackend() for _ in range(3)]
    port = await stubs[0].start("127.0.0.1", 0)
    for i, s in enumerate(stubs[1:], start=2):
        await s.start(f"127.0.0.{i}", port)
    resolver = FakeResolver()
    resolver.answer = ["127.0.0.1", "127.0.0.2"]
    try:
        gw = await make_gateway(
            resolver=resolver,
            backends={
                "discovery": "dns",
                "dns": {"name": "sglang.llm.svc.cluster.local", "port": port, "interval_s": 0.05},
                "balancer": "round_robin",
            },
        )
        await wait_for(lambda: len(gw.pool.backends) == 2)
        for _ in range(10):
            assert await send(session, gw) == 200
        assert served(stubs) == [5, 5, 0]

        resolver.answer = ["127.0.0.2", "127.0.0.3"]  # a pod replaced
        await wait_for(
            lambda: (
                {b.url for b in gw.pool.backends}
                == {f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"}
            )
        )
        for _ in range(10):
            assert await send(session, gw) == 200
        assert served(stubs) == [5, 10, 5]

        errors_before = sum(gw.fleet.discovery.errors.values()) if gw.fleet.discovery else 0
        resolver.answer = OSError("SERVFAIL")
        calls = resolver.calls
        await wait_for(lambda: resolver.calls > calls + 2)
        resolver.answer = []
        calls = resolver.calls
        await wait_for(lambda: resolver.calls > calls + 2)
        assert len(gw.pool.backends) == 2  # the last good set stays
        for _ in range(4):
            assert await send(session, gw) == 200
        assert gw.fleet.discovery is not None
        assert sum(gw.fleet.discovery.errors.values()) >= errors_before + 4
        async with session.get(admin_url(gw, "/metrics")) as r:
            text = await r.text()
        assert 'sglang_gateway_discovery_errors_total{cause="empty",source="dns"}' in text
    finally:
        for s in stubs:
            await s.stop()


async def test_kubernetes_discovery_tracks_ready_endpoints(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession, tmp_path: Any
) -> None:
    stubs = [StubBackend() for _ in range(3)]
    port = await stubs[0].start("127.0.0.1", 0)
    for i, s in enumerate(stubs[1:], start=2):
        await s.start(f"127.0.0.{i}", port)
    api = FakeKubernetesApi()
    api.put(
        api.endpoint_slice("sglang-a", [("127.0.0.1", True), ("127.0.0.2", False)], port), "ADDED"
    )
    await api.start()
    token = tmp_path / "token"
    token.write_text("sa-token-1\n")
    try:
        gw = await make_gateway(
            backends={
                "discovery": "kubernetes",
                "kubernetes": {
                    "namespace": "llm",
                    "service": "sglang",
                    "port_name": "http",
                    "api_server": api.url,
                    "token_file": str(token),
                    "ca_file": None,
                    "resync_s": 0.5,
                },
            }
        )
        await wait_for(lambda: [b.url for b in gw.pool.backends] == [f"http://127.0.0.1:{port}"])
        assert api.auth[0] == "Bearer sa-token-1"
        assert api.selectors[0] == "kubernetes.io/service-name=sglang"
        # The second pod becomes ready, a third slice appears: the watch delivers both.
        api.put(api.endpoint_slice("sglang-a", [("127.0.0.1", True), ("127.0.0.2", True)], port))
        api.put(api.endpoint_slice("sglang-b", [("127.0.0.3", None)], port), "ADDED")
        await wait_for(lambda: len(gw.pool.backends) == 3)
        for _ in range(9):
            assert await send(session, gw) == 200
        assert all(n > 0 for n in served(stubs))
        # A slice deleted without an event (missed by the watch) is gone after the relist.
        del api.slices["sglang-b"]
        lists = api.lists
        await wait_for(lambda: api.lists > lists and len(gw.pool.backends) == 2, timeout=5)
        # Terminating endpoints report ready=false and drop out.
        api.put(api.endpoint_slice("sglang-a", [("127.0.0.1", False), ("127.0.0.2", True)], port))
        await wait_for(lambda: [b.url for b in gw.pool.backends] == [f"http://127.0.0.2:{port}"])
    finally:
        await api.stop()
        for s in stubs:
            await s.stop()


async def test_kubernetes_list_is_bounded_and_a_timeout_counts_as_an_error() -> None:
    """A wedged API server fails the list within its own bound (not ttfb_s, 900 s), as an
    error discovery counts and backs off from rather than a silent relist loop."""
    api = FakeKubernetesApi()
    url = await api.start()
    try:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=900)
        ) as http:
            client = KubernetesApi(
                http,
                api_server=url,
                namespace="llm",
                label_selector="app=sglang",
                token_file=None,
                ca_file=None,
                list_timeout_s=0.3,
            )
            assert await client.list() == ([], "1")
            api.hang_lists = True
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(ApiError, match="timed out") as refused:
                await client.list()
            assert refused.value.cause == "unreachable"
            assert loop.time() - started < 2
    finally:
        await api.stop()


async def test_in_flight_request_on_a_removed_backend_finishes(
    stubs: list[StubBackend], make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(stubs[0].url)
    body = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 2}})
    hdrs = {**JSON, "X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "8"}
    async with session.post(gw_url(gw, "/generate"), data=body, headers=hdrs) as r:
        await r.content.readuntil(b"\n\n")
        gw.fleet._publish((stubs[1].url,))  # discovery says the first pod is gone
        rest = await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert await send(session, gw) == 200
    assert len(stubs[1].generation_requests()) == 1


# -- reload ----------------------------------------------------------------------------------


async def test_reload_under_load_swaps_policy_and_refuses_bad_config(
    stubs: list[StubBackend],
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    tmp_path: Any,
) -> None:
    path = tmp_path / "gw.yaml"

    def write(mode: str, urls: list[str], extra: str = "") -> None:
        path.write_text(
            "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
            f"backends: {{static: [{', '.join(urls)}], health: {{interval_s: 0.2}}}}\n"
            f"policy: {{sampling_mask: {{mode: {mode}}}}}\n{extra}"
        )

    write("log_only", [stubs[0].url])
    gw = Gateway(config_mod.load(str(path)), config_path=str(path))
    await gw.start()
    unbounded = orjson.dumps({"text": "x", "return_sampling_mask": True})
    try:
        stop = asyncio.Event()
        statuses: Counter[int] = Counter()

        async def load() -> None:
            while not stop.is_set():
                statuses[await send(session, gw)] += 1

        workers = [asyncio.ensure_future(load()) for _ in range(8)]
        await wait_for(lambda: sum(statuses.values()) > 50)
        async with session.post(gw_url(gw, "/generate"), data=unbounded, headers=JSON) as r:
            assert r.status == 400  # log_only: forwarded, the stub (as SGLang) refused it
        assert len([x for x in stubs[0].received if x.body == unbounded]) == 1

        write("enforce", [stubs[1].url, stubs[2].url])
        assert await gw.reload()
        count = sum(statuses.values())
        await wait_for(lambda: sum(statuses.values()) > count + 50)
        async with session.post(gw_url(gw, "/generate"), data=unbounded, headers=JSON) as r:
            assert r.status == 400
        assert len([x for x in stubs[0].received if x.body == unbounded]) == 1  # not forwarded

        path.write_text("listen: {prot: 1}\n")
        assert not await gw.reload()  # refused; the running config stays
        count = sum(statuses.values())
        await wait_for(lambda: sum(statuses.values()) > count + 50)
        stop.set()
        await asyncio.gather(*workers)
        assert set(statuses) == {200}
        assert len(stubs[1].generation_requests()) > 0 and len(stubs[2].generation_requests()) > 0
        assert gw.reloads == 1 and gw.reload_failures == 1
    finally:
        await gw.stop()
