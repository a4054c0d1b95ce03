"""The engines' own truth, read through the gateway as if it were one engine.

slime and Miles update weights engine-direct (a Ray actor per engine calls its
/update_weights_from_*), so the gateway learns the new version from the engine itself, on
its health probes: GET /workers, X-Weight-Version and routing.weight_version: latest follow
within one probe interval. The fleet's /v1/loads is one engine's answer for the whole fleet,
so slime's own parsing rule counts every engine's requests; /get_weight_version answers
like an engine, with the version only when the whole fleet serves it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from gateway.config import HealthConfig
from gateway.contract.profiles import ServerInfo
from gateway.edge.control import BackendResult
from gateway.edge.fleet_reads import merged_loads
from gateway.fleet import engines
from gateway.fleet.balancers import BALANCERS
from gateway.fleet.health import HealthChecker, ProbeResult
from gateway.fleet.pool import BackendPool, worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url, wait_for
from tests.hardening.rawnet import ScriptedBackend

INTERVAL = 0.5  # the health probe interval these gateways run with
GEN = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
JSON = {"Content-Type": "application/json"}


def slime_num_requests(load: Any) -> int:
    """slime's rule for how many requests an SGLang answer holds (THUDM/slime,
    slime/backends/sglang_utils/server_control.py, num_requests_from_load, at 15b8e50),
    restated: a list sums its items; an object with `loads` counts those; an entry counts
    its first integer of num_reqs / num_total_reqs / total_reqs, else num_running_reqs +
    num_waiting_reqs, or a larger live counter (an int under a live-request key or a
    *_queue_reqs key, or the count of a nested disagg/queues/inflight section)."""
    if isinstance(load, list):
        return sum(slime_num_requests(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return slime_num_requests(load["loads"])
    ints = {k: v for k, v in load.items() if isinstance(v, int) and not isinstance(v, bool)}
    core = next((ints[k] for k in ("num_reqs", "num_total_reqs", "total_reqs") if k in ints), None)
    if core is None:
        core = ints.get("num_running_reqs", ints.get("total_running_reqs", 0)) + ints.get(
            "num_waiting_reqs", ints.get("total_waiting_reqs", 0)
        )
    live = {
        "num_reqs",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_total_reqs",
        "total_reqs",
        "total_running_reqs",
        "total_waiting_reqs",
        "waiting",
        "grammar",
    }
    counts = [core, *(v for k, v in ints.items() if k in live or k.endswith("_queue_reqs"))]
    counts += [
        slime_num_requests(v)
        for k, v in load.items()
        if k in ("disaggregation", "disagg", "queues", "inflight")
    ]
    return max(counts)


def _model_reads(stub: StubBackend) -> int:
    """The /model_info reads (the probe's weight-version read) the engine has answered."""
    return sum(r.path in ("/model_info", "/get_model_info") for r in stub.received)


async def _get(s: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with s.get(url) as r:
        return r.status, await r.json(content_type=None)


async def test_an_engine_updated_behind_the_gateway_is_seen_within_one_probe_interval(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    a, b = stubs[0], stubs[1]
    gw = await make_gateway(
        a.url,
        b.url,
        routing={"weight_version": "latest"},
        backends={"health": {"interval_s": INTERVAL}, "queue_timeout_s": 0.2},
    )
    await wait_for(lambda: all(x.weight_version == "default" for x in gw.pool.backends))
    async with aiohttp.ClientSession() as s:
        status, answer = await _get(s, gw_url(gw, "/get_weight_version"))
        assert status == 200
        assert answer["weight_version"] == "default" and answer["latest"] is None
        # What slime's Ray actor does: the engine itself, never through the gateway.
        update = {"model_path": "/ckpt/iter-1", "weight_version": "iter-1"}
        async with s.post(a.url + "/update_weights_from_disk", json=update) as r:
            assert r.status == 200
        reads = _model_reads(a)
        async with asyncio.timeout(30):
            while True:
                _, listed = await _get(s, gw_url(gw, "/workers"))
                seen = {w["url"]: w["weight_version"] for w in listed["workers"]}
                if seen[a.url] == "iter-1":
                    break
                await asyncio.sleep(0.02)
        # The next probe's read carries it, counted in probes rather than seconds so that a
        # loaded machine passes too: the read in flight at the update, the next one, and at
        # most one more that ran before this loop looked again.
        assert 1 <= _model_reads(a) - reads <= 3
        assert seen == {a.url: "iter-1", b.url: "default"}
        # Mid-update the fleet has no one version; latest names the new one.
        status, answer = await _get(s, gw_url(gw, "/get_weight_version"))
        assert status == 200 and answer["weight_version"] is None
        assert answer["latest"] == "iter-1"
        assert {w["id"]: w["weight_version"] for w in answer["workers"]} == {
            worker_id(a.url): "iter-1",
            worker_id(b.url): "default",
        }
        # routing.weight_version: latest: only the updated engine serves, and says so.
        for _ in range(6):
            async with s.post(gw_url(gw, "/generate"), data=GEN, headers=JSON) as r:
                assert r.status == 200 and r.headers["X-Weight-Version"] == "iter-1"
                assert (await r.json())["meta_info"]["weight_version"] == "iter-1"
        assert b.generation_requests() == [] and len(a.generation_requests()) == 6
        # The other engine follows; now the whole fleet serves one version.
        async with s.post(b.url + "/update_weights_from_disk", json=update) as r:
            assert r.status == 200
        await wait_for(lambda: gw.pool.backends[1].weight_version == "iter-1", timeout=5)
        status, answer = await _get(s, gw_url(gw, "/get_weight_version"))
        assert answer["weight_version"] == answer["latest"] == "iter-1"


class _Prober:
    """The Prober seam (gateway/fleet/health.py): the engine's /model_info answers only
    when released, with the version it served when the read was sent."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def probe(self, url: str, timeout_s: float) -> ProbeResult:
        return ProbeResult(True, "probe succeeded")

    async def weight_version(self, url: str, timeout_s: float) -> str | None:
        self.asked.set()
        await self.release.wait()
        return "default"

    async def server_info(self, url: str, timeout_s: float) -> ServerInfo | None:
        return None


def _pool(*urls: str) -> BackendPool:
    return BackendPool(urls, BALANCERS["round_robin"](None))


async def test_a_weight_read_older_than_an_update_does_not_undo_it() -> None:
    pool = _pool("http://e1")
    (backend,) = pool.backends
    prober = _Prober()
    checker = HealthChecker(pool, prober, HealthConfig())
    probing = asyncio.create_task(checker.probe_once(backend))
    await prober.asked.wait()
    # Meanwhile an update through the gateway got 2xx: the engine serves v2 now.
    engines.serve(pool, {backend.url: "v2"}, "v2")
    prober.release.set()  # the read sent before it answers with what was true then
    assert await probing
    assert backend.weight_version == "v2" and pool.latest_version == "v2"


def test_an_engine_back_at_weights_the_fleet_had_does_not_become_the_latest() -> None:
    pool = _pool("http://e1", "http://e2")
    e1, e2 = pool.backends
    for b in (e1, e2):
        engines.reported(pool, b, "default", engines.mark(b))
    assert pool.latest_version is None  # where they start is not an update
    for b in (e1, e2):
        engines.reported(pool, b, "iter-1", engines.mark(b))
    assert pool.latest_version == "iter-1"
    # e1 restarts at its launch weights: the fleet had them before, so not newer.
    engines.reported(pool, e1, "default", engines.mark(e1))
    assert (e1.weight_version, pool.latest_version) == ("default", "iter-1")
    # Once no engine serves the latest, it follows what they serve.
    engines.reported(pool, e2, "default", engines.mark(e2))
    assert pool.latest_version == "default"
    engines.reported(pool, e2, "iter-2", engines.mark(e2))
    assert pool.latest_version == "iter-2"


def test_a_shared_document_does_not_undo_what_an_engine_reported_since() -> None:
    pool = _pool("http://e1")
    (e1,) = pool.backends
    first = {"backends": {e1.url: {"weight_version": "v1"}}, "latest_version": "v1"}
    engines.adopt(pool, first)
    assert (e1.weight_version, pool.latest_version) == ("v1", "v1")
    engines.reported(pool, e1, "v2", engines.mark(e1))  # updated engine-direct
    # Another worker pauses the engine: the document still carries the v1 it wrote then.
    paused = {
        "backends": {e1.url: {"weight_version": "v1", "paused": True}},
        "latest_version": "v1",
    }
    engines.adopt(pool, paused, before=first)
    assert e1.paused and (e1.weight_version, pool.latest_version) == ("v2", "v2")
    # A version the document changes is taken (an update through another worker).
    updated = {
        "backends": {e1.url: {"weight_version": "v3", "paused": True}},
        "latest_version": "v3",
    }
    engines.adopt(pool, updated, before=paused)
    assert (e1.weight_version, pool.latest_version) == ("v3", "v3")


async def test_the_fleets_loads_read_like_one_engines(
    stubs: list[StubBackend], make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), backends={"balancer": "round_robin"})
    slow = {**JSON, "X-Stub-Delay-Ms": "30000"}  # generations held open on the engines
    async with aiohttp.ClientSession() as s:
        held = [
            asyncio.ensure_future(s.post(gw_url(gw, "/generate"), data=GEN, headers=slow))
            for _ in range(4)
        ]
        try:
            async with asyncio.timeout(5):
                while True:
                    # slime reads /v1/loads?include=core,disagg,queues.
                    url = gw_url(gw, "/v1/loads?include=core,disagg,queues")
                    status, reply = await _get(s, url)
                    assert status == 200
                    if slime_num_requests(reply) == 4:
                        break
                    await asyncio.sleep(0.02)
            assert reply["success"] is True and reply["dp_rank_count"] == len(stubs)
            by_worker = {e["worker_id"]: e for e in reply["loads"]}
            assert {(e["worker_id"], e["worker_url"]) for e in reply["loads"]} == {
                (worker_id(x.url), x.url) for x in stubs
            }
            assert sum(e["num_running_reqs"] for e in by_worker.values()) == 4
            assert reply["aggregate"]["total_reqs"] == reply["aggregate"]["total_running_reqs"] == 4
            # Each engine's status beside it, its loads moved up (never counted twice).
            assert [(x["url"], x["status"]) for x in reply["results"]] == [
                (x.url, 200) for x in stubs
            ]
            assert all("loads" not in x["body"] for x in reply["results"])
            assert slime_num_requests(reply["results"]) == 0
            for x in stubs:  # each engine was asked with the query the client sent
                asked = [r.raw_path for r in x.received if r.path == "/v1/loads"]
                assert asked[-1] == "/v1/loads?include=core,disagg,queues"
            status, older = await _get(s, gw_url(gw, "/get_loads"))
            assert status == 200 and slime_num_requests(older) == 4
        finally:
            async with s.post(gw_url(gw, "/abort_request"), json={"abort_all": True}) as r:
                assert r.status == 200
            for h in held:
                (await h).close()
        async with asyncio.timeout(5):  # aborted: the fleet reads idle, as slime waits for
            while slime_num_requests((await _get(s, gw_url(gw, "/v1/loads")))[1]):
                await asyncio.sleep(0.02)


class _Health(ScriptedBackend):
    """Passes its probes; answers every other GET with `answer`."""

    def __init__(self, answer: bytes) -> None:
        super().__init__()
        self._answer = answer

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        else:
            writer.write(self._answer)
        return True


def _http(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def test_a_fleet_load_short_of_an_engine_is_a_502_naming_it(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    failing = _Health(_http("500 Internal Server Error", b"engine died", "text/plain"))
    silent = _Health(_http("200 OK", b'{"status": "ok"}'))  # no loads list in it
    bad_url, odd_url = await failing.start(), await silent.start()
    try:
        gw = await make_gateway(stub.url, bad_url, odd_url)
        async with aiohttp.ClientSession() as s:
            status, reply = await _get(s, gw_url(gw, "/v1/loads"))
        assert status == 502 and reply["success"] is False
        # What did come is there, in the engine's shape; the gaps are named.
        assert [e["worker_url"] for e in reply["loads"]] == [stub.url]
        assert f"{worker_id(bad_url)} ({bad_url}): status 500" in reply["detail"]
        assert (
            f"{worker_id(odd_url)} ({odd_url}): answered without a loads list" in (reply["detail"])
        )
        by_url = {x["url"]: x for x in reply["results"]}
        assert by_url[bad_url]["body"] == "engine died"
        assert by_url[odd_url]["body"] == {"status": "ok"}
    finally:
        await failing.stop()
        await silent.stop()


def test_the_aggregate_sums_like_sglangs() -> None:
    entry = {
        "dp_rank": 0,
        "num_running_reqs": 3,
        "num_waiting_reqs": 1,
        "num_used_tokens": 100,
        "num_total_tokens": 1000,
        "token_usage": 0.1,
        "gen_throughput": 10.0,
        "utilization": 0.5,
    }
    results = [
        BackendResult("http://e1", 200, {"version": "0.5.20", "loads": [entry, entry]}),
        BackendResult("http://e2", 200, {"loads": [{"num_running_reqs": 1, "flag": True}]}),
    ]
    ok, body = merged_loads(results)
    reply = orjson.loads(body)
    assert ok and reply["dp_rank_count"] == 3
    assert reply["aggregate"] == {
        "total_running_reqs": 7,
        "total_waiting_reqs": 2,
        "total_used_tokens": 200,
        "total_tokens": 2000,
        "total_reqs": 9,
        "avg_token_usage": round(0.2 / 3, 4),
        "avg_throughput": round(20.0 / 3, 2),
        "avg_utilization": round(1.0 / 3, 4),
    }
    assert reply["results"][0]["body"] == {"version": "0.5.20"}


class _OlderRelease(ScriptedBackend):
    """An SGLang from before the /model_info rename: its weights at /get_model_info."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        path = head.split(b" ", 2)[1].decode()
        self.paths.append(path)
        if path == "/health":
            writer.write(_http("200 OK", b""))
        elif path == "/get_model_info":
            writer.write(_http("200 OK", b'{"model_path": "m", "weight_version": "old-7"}'))
        else:
            writer.write(_http("404 Not Found", b'{"detail": "Not Found"}'))
        return True


async def test_an_older_release_is_read_at_its_own_path_after_one_404(
    make_gateway: GatewayFactory,
) -> None:
    engine = _OlderRelease()
    url = await engine.start()
    try:
        gw = await make_gateway(url, backends={"health": {"interval_s": 0.05}})
        await wait_for(lambda: engine.paths.count("/health") >= 6)
        assert gw.pool.backends[0].weight_version == "old-7"
        assert engine.paths.count("/model_info") == 1
        assert engine.paths.count("/get_model_info") >= 5
    finally:
        await engine.stop()
