"""SMG's surfaces on the main port: /liveness, /readiness, /engine_metrics (and /metrics),
GET /workers' total and stats, PUT/PATCH /workers/{id}. Real stubs, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.pool import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url, wait_for

# A caller outside control.trusted_cidrs (the default trusts loopback): no operator.
UNTRUSTED = {"control": {"trusted_cidrs": []}}


@contextlib.asynccontextmanager
async def silent_engine() -> AsyncIterator[str]:
    """An engine that takes connections and never answers: a listening socket nobody
    accepts from (the kernel completes the handshake)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


async def test_liveness_is_the_process_and_readiness_a_healthy_worker(
    make_gateway: GatewayFactory,
) -> None:
    engine = StubBackend(health_status=503)  # still loading
    await engine.start()
    try:
        gw = await make_gateway(engine.url)
        async with aiohttp.ClientSession() as s:
            async with s.get(gw_url(gw, "/liveness")) as r:
                assert r.status == 200 and await r.read() == b"OK"
            async with s.get(gw_url(gw, "/readiness")) as r:
                assert r.status == 503
                assert await r.json() == {
                    "status": "not ready",
                    "reason": "insufficient healthy workers",
                }
            engine.health_status = 200
            await wait_for(lambda: gw.pool.ready)
            async with s.get(gw_url(gw, "/readiness")) as r:
                assert r.status == 200
                assert await r.json() == {
                    "status": "ready",
                    "healthy_workers": 1,
                    "total_workers": 1,
                }
            # Answered by the gateway: the engine never saw these paths.
            assert not [q for q in engine.received if q.path in ("/readiness", "/liveness")]
            gw.draining = True
            async with s.get(gw_url(gw, "/readiness")) as r:
                assert r.status == 503 and (await r.json())["reason"] == "draining"
            async with s.get(gw_url(gw, "/liveness")) as r:
                assert r.status == 200
            gw.draining = False
    finally:
        await engine.stop()


async def test_engine_metrics_merges_every_engine_with_its_worker_label(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    first, second, _ = stubs
    gw = await make_gateway(first.url, second.url)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw_url(gw, "/engine_metrics")) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
        async with s.get(gw_url(gw, "/metrics")) as r:
            assert r.status == 200
            sglang_names = await r.text()
    # Prometheus' own parser reads it: each family once, a sample per engine.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["sglang_num_running_reqs"]
    assert running.type == "gauge"
    assert {x.labels["worker_addr"] for x in running.samples} == {first.url, second.url}
    assert {x.labels["worker_id"] for x in running.samples} == {
        worker_id(first.url),
        worker_id(second.url),
    }
    assert all(x.labels["model_name"] for x in running.samples)  # the engine's own labels kept
    assert text.count("# TYPE sglang_num_running_reqs gauge") == 1
    scraped = families["sglang_gateway_engine_metrics_scraped"]
    assert {x.value for x in scraped.samples} == {1.0}
    # /metrics: the same merge under SGLang's own names.
    assert "sglang:num_running_reqs{worker_addr=" in sglang_names
    assert "sglang_num_running_reqs" not in sglang_names
    # Each engine was read once per request, at /metrics.
    assert [q.path for q in first.received if q.path == "/metrics"] == ["/metrics", "/metrics"]


async def test_a_dead_and_a_silent_engine_are_reported_and_the_rest_answered(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    dead = StubBackend()
    await dead.start()
    dead_url = dead.url
    await dead.stop()  # refuses connections from now on
    async with silent_engine() as silent:
        gw = await make_gateway(stub.url, dead_url, silent, engine_metrics={"timeout_s": 0.5})
        async with aiohttp.ClientSession() as s:
            # The silent engine never answers: only its deadline (0.5 s) can end this wait,
            # which the bound, far above it, leaves room for on a loaded machine.
            async with asyncio.timeout(30), s.get(gw_url(gw, "/engine_metrics")) as r:
                assert r.status == 200
                text = await r.text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            addrs = {x.labels["worker_addr"] for x in families["sglang_num_running_reqs"].samples}
            assert addrs == {stub.url}
            scraped = {
                x.labels["worker_addr"]: x.value
                for x in families["sglang_gateway_engine_metrics_scraped"].samples
            }
            assert scraped == {stub.url: 1.0, dead_url: 0.0, silent: 0.0}
            assert f"# sglang-gateway: {silent} ({worker_id(silent)}) left out: no whole " in text
            assert f"# sglang-gateway: {dead_url} ({worker_id(dead_url)}) left out: could " in text
            async with s.get(admin_url(gw, "/metrics")) as r:
                own = await r.text()
            assert 'sglang_gateway_engine_metrics_scrapes_total{result="timeout"} 1.0' in own
            assert 'sglang_gateway_engine_metrics_scrapes_total{result="unreachable"} 1.0' in own
            assert 'sglang_gateway_engine_metrics_scrapes_total{result="ok"} 1.0' in own


async def test_engine_metrics_fails_only_when_every_engine_did(
    make_gateway: GatewayFactory,
) -> None:
    async with silent_engine() as silent:
        gw = await make_gateway(silent, engine_metrics={"timeout_s": 0.3})
        async with aiohttp.ClientSession() as s, s.get(gw_url(gw, "/engine_metrics")) as r:
            assert r.status == 502
            body = await r.json()
    assert body["failures"] == [
        {"id": worker_id(silent), "result": "timeout", "error": "no whole answer within 0.3 s"}
    ]


async def test_an_engine_over_its_byte_bound_is_left_out(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    first, second, _ = stubs
    first.model = "m" * 4096  # its /metrics text is now over 4 KiB
    gw = await make_gateway(first.url, second.url, engine_metrics={"max_bytes_per_engine": 4096})
    async with aiohttp.ClientSession() as s, s.get(gw_url(gw, "/engine_metrics")) as r:
        assert r.status == 200
        text = await r.text()
    assert f'worker_addr="{first.url}",worker_id="{worker_id(first.url)}"}} 0' in text
    assert "more than 4096 bytes (engine_metrics.max_bytes_per_engine)" in text
    assert f'sglang_num_running_reqs{{worker_addr="{second.url}"' in text


async def test_concurrent_scrapes_share_one_read_of_each_engine(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url)
    async with aiohttp.ClientSession() as s:

        async def one() -> int:
            async with s.get(gw_url(gw, "/engine_metrics")) as r:
                await r.read()
                return r.status

        before = len([q for q in stub.received if q.path == "/metrics"])
        statuses = await asyncio.gather(*(one() for _ in range(20)))
    assert statuses == [200] * 20
    reads = len([q for q in stub.received if q.path == "/metrics"]) - before
    assert reads < 20  # a burst costs the engine far fewer reads than requests


async def test_engine_metrics_are_an_operators(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url, **UNTRUSTED)
    async with aiohttp.ClientSession() as s:
        for path in ("/engine_metrics", "/metrics"):
            async with s.get(gw_url(gw, path)) as r:
                assert r.status == 403
                assert "control.trusted_cidrs" in (await r.json())["detail"]
        # The probes are not: an orchestrator has no operator key.
        async with s.get(gw_url(gw, "/readiness")) as r:
            assert r.status in (200, 503)
    assert not [q for q in stub.received if q.path == "/metrics"]


async def test_metrics_label_clash_keeps_the_engines_label_as_exported() -> None:
    from gateway.edge.engine_metrics import Scrape, merge

    text = '# TYPE x gauge\nx{worker_addr="theirs",a="worker_id=\\"q\\""} 1\nx{} 2\ny 3\n# EOF\n'
    out = merge([Scrape("http://e:1", text, "ok")], smg_names=True)
    ours = f'worker_addr="http://e:1",worker_id="{worker_id("http://e:1")}"'
    assert f'x{{{ours},exported_worker_addr="theirs",a="worker_id=\\"q\\""}} 1' in out
    assert f"x{{{ours}}} 2" in out
    assert f"y{{{ours}}} 3" in out
    assert "# EOF" not in out
    families = {f.name for f in text_string_to_metric_families(out)}
    assert {"x", "y"} <= families


async def test_workers_listing_carries_smgs_total_and_stats(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(backends={"discovery": "registry"})
    kinds = ["regular", "prefill", None]
    async with aiohttp.ClientSession() as s:
        for engine, kind in zip(stubs, kinds, strict=True):
            reg = {"url": engine.url} | ({"worker_type": kind} if kind else {})
            async with s.post(gw_url(gw, "/workers"), json=reg) as r:
                assert r.status == 200
        async with s.get(gw_url(gw, "/workers")) as r:
            listing = await r.json()
    assert listing["total"] == 3
    assert listing["stats"] == {"prefill_count": 1, "decode_count": 0, "regular_count": 2}
    worker = listing["workers"][0]
    assert {"id", "url", "healthy", "state", "inflight", "is_healthy", "load"} <= set(worker)


async def test_patch_changes_what_smg_lets_a_client_change(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(backends={"discovery": "registry"})
    async with aiohttp.ClientSession() as s:
        reg = {"url": stub.url, "worker_type": "regular", "labels": {"zone": "a"}}
        async with s.post(gw_url(gw, "/workers"), json=reg) as r:
            wid = (await r.json())["id"]
        url = gw_url(gw, f"/workers/{wid}")
        async with s.patch(url, json={"priority": 7, "cost": 0.5, "labels": {"rack": "r1"}}) as r:
            assert r.status == 200
            worker = await r.json()
        assert worker["priority"] == 7 and worker["cost"] == 0.5
        assert worker["labels"] == {"zone": "a", "rack": "r1"}  # merged, as SMG merges
        assert worker["worker_type"] == "regular"  # kept
        async with s.get(url) as r:
            assert (await r.json())["priority"] == 7
        for bad, needle in [
            ({"api_key": "k"}, "auth.upstream_authorization"),
            ({"health": {"disable_health_check": True}}, "backends.health"),
            ({"worker_type": "decode"}, "Accepted: priority, cost, labels"),
            ({"priority": -1}, "priority must be an integer"),
            ({"priority": True}, "priority must be an integer"),
            ({"cost": "cheap"}, "cost must be a finite number"),
            ({"labels": {"a": 1}}, "labels must be an object of string values"),
        ]:
            async with s.patch(url, json=bad) as r:
                assert r.status == 400, bad
                assert needle in (await r.json())["detail"], bad
        async with s.patch(url, data=b"[1]") as r:
            assert r.status == 400
        async with s.get(url) as r:
            assert (await r.json())["priority"] == 7  # nothing refused changed anything


async def test_put_replaces_the_registration_under_the_same_url(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(backends={"discovery": "registry"})
    async with aiohttp.ClientSession() as s:
        reg = {"url": stub.url, "worker_type": "regular", "priority": 3}
        async with s.post(gw_url(gw, "/workers"), json=reg) as r:
            wid = (await r.json())["id"]
        url = gw_url(gw, f"/workers/{wid}")
        async with s.put(url, json={"url": stub.url, "worker_type": "regular", "cost": 2}) as r:
            assert r.status == 200
            worker = await r.json()
        assert worker["cost"] == 2 and "priority" not in worker  # replaced, not merged
        async with s.put(url, json={"url": "http://127.0.0.1:1"}) as r:
            assert r.status == 400
            assert "URL mismatch" in (await r.json())["detail"]
        async with s.put(url, json={"url": stub.url, "api_key": "k"}) as r:
            assert r.status == 400
        async with s.put(gw_url(gw, "/workers/nope"), json={}) as r:
            assert r.status == 404


async def test_worker_changes_need_an_operator_and_the_registry(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url, **UNTRUSTED)
    url = gw_url(gw, f"/workers/{worker_id(stub.url)}")
    async with aiohttp.ClientSession() as s:
        for method in ("PUT", "PATCH"):
            async with s.request(method, url, json={"priority": 1}) as r:
                assert r.status == 403
    static = await make_gateway(stub.url)
    url = gw_url(static, f"/workers/{worker_id(stub.url)}")
    async with aiohttp.ClientSession() as s, s.patch(url, json={"priority": 1}) as r:
        assert r.status == 409
        assert "backends.discovery: registry" in (await r.json())["detail"]


async def test_consistent_hashing_routes_by_the_smg_routing_key(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), backends={"balancer": "consistent_hashing"})
    body = b'{"text": "x", "sampling_params": {"top_k": 2}}'
    async with aiohttp.ClientSession() as s:
        for episode in ("e-1", "e-2", "e-3", "e-4"):
            for _ in range(4):
                async with s.post(
                    gw_url(gw, "/generate"),
                    data=body,
                    headers={"Content-Type": "application/json", "X-SMG-Routing-Key": episode},
                ) as r:
                    assert r.status == 200
    # Each episode stayed on one engine: every engine saw a multiple of 4 generations.
    assert all(len(e.generation_requests()) % 4 == 0 for e in stubs)
    assert sum(len(e.generation_requests()) for e in stubs) == 16
