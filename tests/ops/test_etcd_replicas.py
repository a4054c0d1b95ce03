"""Three gateway processes sharing one fleet through a real etcd (state.backend: etcd).

What one replica is told (registration, pause, weights) every replica routes by when the
call returns; two replicas never interleave fleet-changing calls; etcd lost while they
run leaves generation served and fleet changes refused (503), and they catch up when it
returns. The propagation times (a registration, a pause, a weight version through one
replica until the others show it) are printed (run with -s) for docs/fleet-state.md."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.etcd import EtcdClient
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayProcess, free_port, gateway_process, spawn
from tests.etcd import EtcdServer, etcd  # noqa: F401 - the fixture

GEN = orjson.dumps({"text": "x", "sampling_params": {"max_new_tokens": 2}})
JSON = {"Content-Type": "application/json"}
PREFIX = "/replicas-test/"
# Three gateway processes and a real etcd per test, a 10 s etcd outage and lease expiries
# among them: in the bounded suite, not the inner loop.
pytestmark = pytest.mark.heavy


def config(etcd_url: str, seed: str, extra: str = "", lease_ttl_s: int = 3) -> str:
    return (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        "backends:\n  discovery: registry\n"
        f"  static: ['{seed}']\n"
        # A generation for a paused fleet is held this long, then refused: the 503 below.
        "  queue_timeout_s: 0.3\n  pause_hold_s: 0.3\n  health: {interval_s: 0.1}\n"
        "logging: {access_log: false}\n"
        "state:\n  backend: etcd\n  etcd:\n"
        f"    endpoints: ['{etcd_url}']\n    prefix: {PREFIX}\n"
        f"    lease_ttl_s: {lease_ttl_s}\n    lock_wait_s: 1\n    timeout_s: 1\n" + extra
    )


class Replica:
    def __init__(self, proc: GatewayProcess) -> None:
        self.url = f"http://127.0.0.1:{proc.port}"
        self.admin = f"http://127.0.0.1:{proc.admin}"
        self.proc = proc

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.request(method, self.url + path, **kw) as r:
            data = await r.read()
            return r.status, orjson.loads(data) if data else None

    async def urls(self) -> set[str]:
        status, listed = await self.call("GET", "/workers")
        assert status == 200
        return {w["url"] for w in listed["workers"]}

    async def ready(self) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/readyz") as r:
            return r.status, (await r.json())["reason"]

    async def gauge(self, name: str, **labels: str) -> float:
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/metrics") as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        raise AssertionError(f"no {name}")


@contextlib.asynccontextmanager
async def replicas(
    etcd_url: str, seed: str, tmp_path: Path, n: int = 3, lease_ttl_s: int = 3
) -> AsyncIterator[list[Replica]]:
    async with contextlib.AsyncExitStack() as stack:
        made = []
        for i in range(n):
            where = tmp_path / f"replica{i}"
            where.mkdir()
            proc = await stack.enter_async_context(
                gateway_process(config(etcd_url, seed, lease_ttl_s=lease_ttl_s), where)
            )
            made.append(Replica(proc))
        yield made


async def settle(replica: Replica, stubs: list[StubBackend]) -> None:
    """Until the replica routes to every stub it lists (probed healthy)."""
    async with asyncio.timeout(10):
        while True:
            status, listed = await replica.call("GET", "/workers")
            if status == 200 and all(w["healthy"] for w in listed["workers"]):
                return
            await asyncio.sleep(0.05)


async def test_register_pause_and_update_through_different_replicas(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    first, second, third = stubs
    async with replicas(etcd.url, first.url, tmp_path) as (a, b, c):
        # Registered through one: listed by the others at once, and routed to by them.
        status, _ = await a.call("POST", "/workers", json={"url": second.url})
        assert status == 200
        assert await b.urls() == await c.urls() == {first.url, second.url}
        await settle(c, stubs)
        before = second.generations_seen
        for _ in range(8):
            status, _ = await c.call("POST", "/generate", data=GEN, headers=JSON)
            assert status == 200
        assert second.generations_seen > before

        # Propagation: a registration through a, until c lists it (c polls meanwhile).
        times = []
        for stub in (third, second, third):
            if stub.url in await c.urls():
                status, _ = await a.call("DELETE", f"/workers/{_id(stub)}")
                assert status == 200
            t0 = time.perf_counter()
            posted = asyncio.ensure_future(a.call("POST", "/workers", json={"url": stub.url}))
            # Only the watch carries it (nothing relists on a timer): the bound ends a wait
            # that would never end, and the figures below are for reading, not asserting.
            async with asyncio.timeout(30):
                while stub.url not in await c.urls():
                    await asyncio.sleep(0.002)
            times.append(time.perf_counter() - t0)
            assert (await posted)[0] == 200
        print(
            f"\npropagation a -> c: median {statistics.median(times) * 1000:.1f} ms, "
            f"max {max(times) * 1000:.1f} ms"
        )
        await settle(b, stubs)
        await settle(c, stubs)

        # Paused through a while clients send through b and c: after the pause returned,
        # no generation reaches an engine.
        sending = True

        async def client(r: Replica) -> None:
            while sending:
                await r.call("POST", "/generate", data=GEN, headers=JSON)

        clients = [asyncio.ensure_future(client(r)) for r in (b, c, b, c)]
        await asyncio.sleep(0.3)
        status, reply = await a.call("POST", "/pause_generation", json={"mode": "retract"})
        assert status == 200 and len(reply["results"]) == 3  # each engine once
        arrived = [s.arrived_paused for s in stubs]
        seen = [s.generations_seen for s in stubs]
        await asyncio.sleep(0.8)
        sending = False
        assert [s.arrived_paused for s in stubs] == arrived
        assert [s.generations_seen for s in stubs] == seen
        for r in (b, c):
            status, _ = await r.call("POST", "/generate", data=GEN, headers=JSON)
            assert status == 503

        # New weights through b, continue through c: every replica serves the new version.
        update = {"model_path": "/ckpt/step-2", "weight_version": "step-2"}
        status, reply = await b.call("POST", "/update_weights_from_disk", json=update)
        assert status == 200 and reply["success"] and len(reply["results"]) == 3
        status, _ = await c.call("POST", "/continue_generation", json={})
        assert status == 200
        # The generations held on the engines by the pause (retract) end now.
        await asyncio.wait_for(asyncio.gather(*clients), 10)
        for r in (a, b, c):
            status, listed = await r.call("GET", "/workers")
            assert {w["weight_version"] for w in listed["workers"]} == {"step-2"}
            for _ in range(3):
                status, out = await r.call("POST", "/generate", data=GEN, headers=JSON)
                assert status == 200 and out["meta_info"]["weight_version"] == "step-2"
        # Each engine got each control call exactly once, whichever replica took it.
        for s in stubs:
            paths = [r.path for r in s.received]
            assert paths.count("/pause_generation") == 1
            assert paths.count("/update_weights_from_disk") == 1
            assert paths.count("/continue_generation") == 1

        # Compacting etcd's history under the running watches changes nothing.
        await etcd.compact()
        status, _ = await a.call("DELETE", f"/workers/{_id(third)}")
        assert status == 200
        assert await b.urls() == await c.urls() == {first.url, second.url}


def _id(stub: StubBackend) -> str:
    from gateway.fleet.pool import worker_id

    return worker_id(stub.url)


async def test_conflicting_calls_through_two_replicas_serialise(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    first = stubs[0]
    async with replicas(etcd.url, first.url, tmp_path, n=2) as (a, b):
        await settle(a, stubs)
        # Another replica is mid-call: it holds the control lock on its lease.
        holder = EtcdClient([etcd.url])
        try:
            lease = await holder.grant(2)
            taken = await holder.replace(
                (PREFIX + "lock/control").encode(),
                b'{"replica": "gw-x", "call": "/update_weights_from_disk"}',
                mod_revision=0,
                lease=lease,
            )
            assert taken is not None
            status, reply = await a.call("POST", "/pause_generation", json={})
            assert status == 409
            assert "/update_weights_from_disk" in reply["detail"]
            assert "state.etcd.lock_wait_s" in reply["detail"]
            assert not any(r.path == "/pause_generation" for r in first.received)
            # A read needs no lock.
            assert (await b.call("GET", "/workers"))[0] == 200
            # The holder dies mid-call (its lease is never renewed): the lock goes with it.
            await asyncio.sleep(2.5)
        finally:
            await holder.close()
        status, _ = await a.call("POST", "/pause_generation", json={})
        assert status == 200
        # Two operators at once through a and b: both calls run, one after the other.
        results = await asyncio.gather(
            a.call("POST", "/continue_generation", json={}),
            b.call("POST", "/pause_generation", json={}),
        )
        assert [status for status, _ in results] == [200, 200]


async def test_etcd_lost_and_back(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    first, second = stubs[0], stubs[1]
    async with replicas(etcd.url, first.url, tmp_path) as (a, b, c):
        await settle(b, stubs)
        assert await a.gauge("sglang_gateway_state_store_up") == 1.0
        await etcd.stop()
        async with asyncio.timeout(5):
            while (await a.ready())[1] == "ok":
                await asyncio.sleep(0.05)
        status, reason = await a.ready()
        assert status == 200 and etcd.url in reason  # still ready: generation is served
        assert await a.gauge("sglang_gateway_state_store_up") == 0.0
        t_lost = time.monotonic()
        while time.monotonic() - t_lost < 10:  # etcd away for 10 s: past every lease
            for r in (a, b, c):
                status, _ = await r.call("POST", "/generate", data=GEN, headers=JSON)
                assert status == 200
            await asyncio.sleep(0.2)
        for r in (a, b):
            status, reply = await r.call("POST", "/pause_generation", json={})
            assert status == 503 and etcd.url in reply["detail"]
        status, reply = await c.call("POST", "/workers", json={"url": second.url})
        assert status == 503 and etcd.url in reply["detail"]
        assert not any(r.path == "/pause_generation" for r in first.received)
        assert second.url not in await c.urls()

        await etcd.start()
        async with asyncio.timeout(15):
            for r in (a, b, c):
                while (await r.ready())[1] != "ok":
                    await asyncio.sleep(0.1)
        status, _ = await c.call("POST", "/workers", json={"url": second.url})
        assert status == 200
        assert await a.urls() == await b.urls() == {first.url, second.url}
        status, _ = await a.call("POST", "/pause_generation", json={})
        assert status == 200
        await settle(b, stubs)
        status, _ = await b.call("POST", "/generate", data=GEN, headers=JSON)
        assert status == 503  # paused everywhere


class Partition:
    """A TCP relay between some replicas and etcd, real sockets both sides: `cut` drops
    every connection through it and refuses new ones (a network partition), `mend` lets
    them through again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.open = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    def cut(self) -> None:
        self.open = False
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    def mend(self) -> None:
        self.open = True

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


async def test_compaction_under_a_cut_off_replica_makes_it_relist(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    """b and c reach etcd through a relay that is cut while a changes the fleet and the
    history is compacted: the revision their watches resume from is gone, so they read
    the document anew (the relist counter rises) and have a's changes, and later ones."""
    first, second, third = stubs
    relay = Partition(etcd.client_port)
    await relay.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            made = []
            for i, url in enumerate((etcd.url, relay.url, relay.url)):
                where = tmp_path / f"replica{i}"
                where.mkdir()
                proc = await stack.enter_async_context(
                    gateway_process(config(url, first.url), where)
                )
                made.append(Replica(proc))
            a, b, c = made
            status, _ = await a.call("POST", "/workers", json={"url": second.url})
            assert status == 200
            assert await b.urls() == await c.urls() == {first.url, second.url}
            relists = [await r.gauge("sglang_gateway_state_store_relists_total") for r in (b, c)]

            relay.cut()
            async with asyncio.timeout(10):
                for r in (b, c):
                    while await r.gauge("sglang_gateway_state_store_up") != 0.0:
                        await asyncio.sleep(0.05)
            # Changes b and c cannot see, then their history compacted away.
            status, _ = await a.call("POST", "/workers", json={"url": third.url})
            assert status == 200
            status, _ = await a.call("POST", "/pause_generation", json={})
            assert status == 200
            await etcd.compact()
            assert await b.urls() == {first.url, second.url}  # still the last state it saw

            relay.mend()
            every = {first.url, second.url, third.url}
            async with asyncio.timeout(15):
                for r in (b, c):
                    while await r.urls() != every:
                        await asyncio.sleep(0.05)
            after = [await r.gauge("sglang_gateway_state_store_relists_total") for r in (b, c)]
            assert [x - y for x, y in zip(after, relists, strict=True)] == [1.0, 1.0]
            for r in (b, c):
                status, listed = await r.call("GET", "/workers")
                assert all(w["paused"] for w in listed["workers"])
                while (await r.ready())[1] != "ok":
                    await asyncio.sleep(0.05)

            # A change after the compaction, through a cut-off replica, reaches every one.
            status, _ = await b.call("POST", "/continue_generation", json={})
            assert status == 200
            status, _ = await c.call("DELETE", f"/workers/{_id(third)}")
            assert status == 200
            for r in (a, b, c):
                status, listed = await r.call("GET", "/workers")
                assert {w["url"] for w in listed["workers"]} == {first.url, second.url}
                assert not any(w["paused"] for w in listed["workers"])
    finally:
        await relay.stop()


async def test_a_replica_that_cannot_reach_etcd_refuses_to_start(
    stubs: list[StubBackend], tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config(dead, stubs[0].url))
    proc = await spawn(
        "gateway",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert f"cannot start: the fleet state store (etcd at {dead}" in err.decode()
    # What it had opened before the refusal is closed, not reported unclosed at exit.
    assert "Unclosed" not in err.decode()


async def test_workers_of_a_replica_share_through_etcd(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    """--workers 2 on one replica, beside a plain one: each worker is a process of the fleet."""
    first, second = stubs[0], stubs[1]
    port, admin = free_port(), free_port()
    cfg = tmp_path / "workers.yaml"
    cfg.write_text(
        config(etcd.url, first.url)
        .replace("port: 0}\nadmin", f"port: {port}, workers: 2}}\nadmin", 1)
        .replace("admin: {host: 127.0.0.1, port: 0}", f"admin: {{host: 127.0.0.1, port: {admin}}}")
    )
    proc = await spawn(
        "gateway",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as s, asyncio.timeout(30):
            while True:
                try:
                    async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
                        if r.status == 200 and (await r.json())["reason"] == "2/2 workers ready":
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        where = tmp_path / "plain"
        where.mkdir()
        async with gateway_process(config(etcd.url, first.url), where) as plain:
            other = Replica(plain)
            status, _ = await other.call("POST", "/workers", json={"url": second.url})
            assert status == 200
            both = Replica(GatewayProcess(proc, port, admin))
            for _ in range(12):  # fresh connections: the kernel spreads them over both workers
                assert await both.urls() == {first.url, second.url}
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 20) == 0


async def test_an_abort_by_rid_through_another_replica_reaches_the_owner(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    """a writes which engine serves the rid to etcd: b, which did not route it, reads it
    and sends the abort to that engine alone; the rollout ends aborted, at once."""
    first, second = stubs[0], stubs[1]
    async with replicas(etcd.url, first.url, tmp_path, n=2) as (a, b):
        status, _ = await a.call("POST", "/workers", json={"url": second.url})
        assert status == 200
        await settle(a, stubs)
        body = orjson.dumps({"text": "long", "rid": "rollout-7"})
        slow = {**JSON, "X-Stub-Delay-Ms": "30000"}
        rollout = asyncio.ensure_future(a.call("POST", "/generate", data=body, headers=slow))
        async with asyncio.timeout(30):
            while not any(s.generations_seen for s in (first, second)):
                await asyncio.sleep(0.02)
        owner = first.url if first.generations_seen else second.url
        key = PREFIX + "rids/rollout-7"
        async with asyncio.timeout(30):  # written within a flush (50 ms) of its routing
            while await etcd.get(key) is None:
                await asyncio.sleep(0.02)
        assert await etcd.get(key) == owner.encode()
        status, reply = await b.call("POST", "/abort_request", json={"rid": "rollout-7"})
        assert status == 200
        assert [r["url"] for r in reply["results"]] == [owner]
        # Ended by the abort, well before its 30 s delay: the finish reason says which.
        status, out = await asyncio.wait_for(rollout, 20)
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert first.aborted + second.aborted == 1
        assert await b.gauge("sglang_gateway_abort_owner_lookups_total", result="found") == 1
        async with asyncio.timeout(30):  # the request ended: its owner is deleted
            while await etcd.get(key) is not None:
                await asyncio.sleep(0.02)


async def test_a_replica_killed_mid_fan_out_leaves_the_lock_to_its_lease(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    """a is SIGKILLed while it holds the control lock for a weight update to slow engines:
    b is refused with 409 naming the busy call until a's lease (5 s) expires, then b's
    call is served; the rid owners a wrote expire with it."""
    first = stubs[0]
    # 5 s, not 3: a keepalive late on a loaded machine must not let a's lock lapse before
    # b's first try.
    async with replicas(etcd.url, first.url, tmp_path, n=3, lease_ttl_s=5) as (a, b, _):
        await settle(a, stubs)
        slow = {**JSON, "X-Stub-Delay-Ms": "30000"}
        body = orjson.dumps({"text": "long", "rid": "orphan-1"})
        held = asyncio.ensure_future(a.call("POST", "/generate", data=body, headers=slow))
        rid_key = PREFIX + "rids/orphan-1"
        async with asyncio.timeout(30):
            while await etcd.get(rid_key) is None:
                await asyncio.sleep(0.02)
        update = {"model_path": "/ckpt/step-9", "weight_version": "step-9"}
        fan_out = asyncio.ensure_future(
            a.call("POST", "/update_weights_from_disk", json=update, headers=slow)
        )
        async with asyncio.timeout(30):
            while not any(r.path == "/update_weights_from_disk" for r in first.received):
                await asyncio.sleep(0.02)
        assert await etcd.get(PREFIX + "lock/control") is not None
        a.proc.proc.kill()
        await a.proc.proc.wait()
        for lost in (held, fan_out):
            with contextlib.suppress(aiohttp.ClientError):
                await lost
        status, reply = await b.call("POST", "/update_weights_from_disk", json=update)
        assert status == 409
        assert "/update_weights_from_disk" in reply["detail"]
        async with asyncio.timeout(30):
            while True:
                status, reply = await b.call("POST", "/update_weights_from_disk", json=update)
                if status == 200:
                    break
                assert status == 409
        assert reply["success"]
        assert await etcd.get(rid_key) is None  # gone with a's lease
        assert await etcd.get(PREFIX + "lock/control") is None


async def _until_listed(replica: Replica, seen: Any) -> float:
    """Seconds until `seen(workers)` holds on `replica` (polled every 2 ms)."""
    t0 = time.perf_counter()
    async with asyncio.timeout(30):  # bounds the wait only: the figure is what is measured
        while True:
            status, listed = await replica.call("GET", "/workers")
            if status == 200 and seen(listed["workers"]):
                return time.perf_counter() - t0
            await asyncio.sleep(0.002)


async def test_propagation_measured(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    """20 rounds each of a registration, a pause and a weight version through one replica
    until another lists it; figures printed (run with -s) for docs/fleet-state.md."""
    first, second, _ = stubs
    figures: dict[str, list[float]] = {"register": [], "pause": [], "weight version": []}
    async with replicas(etcd.url, first.url, tmp_path) as (a, b, c):
        await settle(a, stubs)
        for i in range(20):
            via, far = (a, b, c)[i % 3], (a, b, c)[(i + 1) % 3]
            if i:
                status, _ = await via.call("DELETE", f"/workers/{_id(second)}")
                assert status == 200
                await _until_listed(far, lambda ws: len(ws) == 1)
            call = via.call("POST", "/workers", json={"url": second.url})
            posted = asyncio.ensure_future(call)
            figures["register"].append(await _until_listed(far, lambda ws: len(ws) == 2))
            assert (await posted)[0] == 200
            paused = asyncio.ensure_future(via.call("POST", "/pause_generation", json={}))
            figures["pause"].append(
                await _until_listed(far, lambda ws: all(w["paused"] for w in ws))
            )
            assert (await paused)[0] == 200
            status, _ = await via.call("POST", "/continue_generation", json={})
            assert status == 200
            version = f"step-{i}"
            update = {"model_path": f"/ckpt/{version}", "weight_version": version}
            updated = asyncio.ensure_future(
                via.call("POST", "/update_weights_from_disk", json=update)
            )
            figures["weight version"].append(
                await _until_listed(
                    far, lambda ws, v=version: all(w["weight_version"] == v for w in ws)
                )
            )
            assert (await updated)[0] == 200
    print()
    for what, times in figures.items():
        assert len(times) == 20
        print(
            f"propagation, {what} (3 replicas, 20 rounds): "
            f"p50 {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms"
        )


async def test_etcd_credentials_never_reach_the_output(
    etcd: EtcdServer,  # noqa: F811
    stubs: list[StubBackend],
    tmp_path: Path,
) -> None:
    """A start whose auth etcd refuses (auth is not enabled on it): the error names the
    endpoint, and the password appears nowhere in what the process printed."""
    password = "pw-Zq81-never-printed"
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        config(etcd.url, stubs[0].url).replace(
            "    lease_ttl_s: 3\n",
            f"    lease_ttl_s: 3\n    username: gw\n    password: {password}\n",
        )
    )
    proc = await spawn(
        "gateway",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    printed = (out + err).decode()
    assert proc.returncode == 1
    assert "refused the credentials" in printed and etcd.url in printed
    assert password not in printed
    assert password.encode().hex() not in printed
