"""The cycle an RL framework runs, through the gateway only, in front of four stub engines.

Register the engines, run rollouts (plain, streaming, multi-turn on a session key), abort
them all and poll /v1/loads until every engine is idle, pause, update the weights with a new
version, continue, and roll out again; then one engine fails a weight update and another
dies. The gateway is a real process (one worker, and --workers 2), or three replicas sharing
the fleet through a real etcd (state.backend: etcd) with each call sent through the next
replica in turn: the same cycle, the same results. The engines are stubs playing SGLang's RL
endpoints (gateway/testing/stub), which record what reached them.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.fleet.pool import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import free_port, gateway_process, spawn
from tests.etcd import EtcdServer, etcd_binary

pytestmark = pytest.mark.heavy

ENGINES = 4
SESSION_HEADER = "X-SMG-Routing-Key"  # what slime sends to keep a multi-turn rollout on one engine
CONTROL_PATHS = (
    "/abort_request",
    "/pause_generation",
    "/update_weights_from_disk",
    "/continue_generation",
)


class Client:
    """What the RL driver and its rollout workers do, over HTTP to the gateway.

    With several replicas each call goes to the next one: registered through one, routed
    through another, paused through a third, and so on."""

    def __init__(self, urls: list[str], session: aiohttp.ClientSession) -> None:
        self.urls = urls
        self.calls = 0
        self.s = session

    @property
    def url(self) -> str:
        self.calls += 1
        return self.urls[self.calls % len(self.urls)]

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.s.request(method, self.url + path, json=body) as r:
            data = await r.read()
            return r.status, orjson.loads(data) if data else None

    async def generate(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, Any, str | None]:
        """(status, the answer: one JSON or the list of stream events, X-Weight-Version)."""
        async with (
            aiohttp.ClientSession() as fresh,  # new connections: spread over --workers
            fresh.post(self.url + "/generate", json=body, headers=headers or {}) as r,
        ):
            version = r.headers.get("X-Weight-Version")
            if body.get("stream"):
                events = [
                    orjson.loads(line[6:])
                    async for line in r.content
                    if line.startswith(b"data: {")
                ]
                return r.status, events, version
            return r.status, await r.json(content_type=None), version

    async def loads(self) -> list[tuple[int, int]]:
        status, reply = await self.call("GET", "/v1/loads")
        assert status == 200 and reply["success"]
        # One engine's answer for the fleet: every engine's entries in `loads`.
        return [(load["num_running_reqs"], load["num_waiting_reqs"]) for load in reply["loads"]]


def _proxied(stub: StubBackend, path: str) -> int:
    return sum(1 for r in stub.received if r.path == path and "X-Forwarded-For" in r.headers)


@pytest.fixture
async def engines() -> AsyncIterator[list[StubBackend]]:
    backends = [StubBackend() for _ in range(ENGINES)]
    for b in backends:
        await b.start()
    yield backends
    for b in backends:
        await b.stop()


@pytest.fixture(params=[1, 2, "replicas-3"], ids=["one-process", "workers-2", "replicas-3"])
async def gateway(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[str]]:
    fleet = (
        "backends:\n"
        "  discovery: registry\n"  # empty at start: the driver registers its engines
        "  balancer: consistent_hash\n"
        f"  hash_header: {SESSION_HEADER}\n"
        "  queue_timeout_s: 5\n"
        "  health: {interval_s: 0.1}\n"
        "logging: {access_log: false}\n"
    )
    if request.param == "replicas-3":
        etcd = EtcdServer(etcd_binary(), tmp_path / "etcd-data")
        await etcd.start()
        try:
            async with replicas(etcd, fleet, tmp_path) as urls:
                yield urls
        finally:
            await etcd.stop()
        return
    port, admin = free_port(), free_port()
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}, workers: {request.param}}}\n"
        f"admin: {{host: 127.0.0.1, port: {admin}}}\n" + fleet
    )
    proc = await spawn(
        "gateway", "--config", str(cfg), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s, asyncio.timeout(30):
            while True:
                try:
                    async with s.get(url + "/workers") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        yield [url]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0


@contextlib.asynccontextmanager
async def replicas(etcd: EtcdServer, fleet: str, tmp_path: Path) -> AsyncIterator[list[str]]:
    """Three gateway processes on one etcd; each stops on SIGTERM with status 0."""
    state = f"state:\n  backend: etcd\n  etcd: {{endpoints: ['{etcd.url}'], prefix: /rl-cycle/}}\n"
    async with contextlib.AsyncExitStack() as stack:
        procs = []
        for i in range(3):
            where = tmp_path / f"replica{i}"
            where.mkdir()
            cfg = "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
            procs.append(
                await stack.enter_async_context(gateway_process(cfg + fleet + state, where))
            )
        yield [f"http://127.0.0.1:{p.port}" for p in procs]
        for p in procs:
            p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            assert await asyncio.wait_for(p.proc.wait(), timeout=30) == 0


async def test_an_rl_training_cycle_through_the_gateway(
    gateway: list[str], engines: list[StubBackend]
) -> None:
    figures: dict[str, Any] = {}
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        rl = Client(gateway, session)

        # 1. Register the engines, as slime does; registering again changes nothing.
        ids = []
        for e in engines:
            status, worker = await rl.call(
                "POST", "/workers", {"url": e.url, "worker_type": "regular"}
            )
            assert status == 200 and worker["url"] == e.url
            ids.append(worker["id"])
        status, again = await rl.call("POST", "/workers", {"url": engines[0].url})
        assert status == 200 and again["id"] == ids[0] == worker_id(engines[0].url)
        async with asyncio.timeout(10):
            while True:  # routable once each has passed its first probe
                _, listed = await rl.call("GET", "/workers")
                # Its weights are read from /model_info beside the probe, not before it.
                known = [(w["state"], w["weight_version"] is not None) for w in listed["workers"]]
                if known == [("healthy", True)] * ENGINES:
                    break
                await asyncio.sleep(0.05)
        assert [w["id"] for w in listed["workers"]] == ids
        assert {w["worker_type"] for w in listed["workers"]} == {"regular"}
        assert {w["weight_version"] for w in listed["workers"]} == {"default"}

        # 2. Rollouts: plain, streaming, and multi-turn sessions pinned to one engine.
        plain = await asyncio.gather(
            *(rl.generate({"text": f"q{i}", "rid": f"r-{i}"}) for i in range(16))
        )
        assert {(s, out["meta_info"]["weight_version"], v) for s, out, v in plain} == {
            (200, "default", "default")
        }
        streams = await asyncio.gather(
            *(rl.generate({"text": f"s{i}", "stream": True}) for i in range(8))
        )
        for status, events, version in streams:
            assert status == 200 and version == "default"
            assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        for turn in range(3):
            for session_key in ("episode-a", "episode-b", "episode-c", "episode-d"):
                status, _, _ = await rl.generate(
                    {"text": f"turn {turn}"}, {SESSION_HEADER: session_key}
                )
                assert status == 200
        for session_key in ("episode-a", "episode-b", "episode-c", "episode-d"):
            served = [
                sum(1 for r in e.received if r.headers.get(SESSION_HEADER) == session_key)
                for e in engines
            ]
            assert sorted(served) == [0, 0, 0, 3], (session_key, served)
        figures["rollouts_before_update"] = 16 + 8 + 12
        figures["engines_serving"] = sum(1 for e in engines if e.generations_seen)

        # 3. Long rollouts in flight, then abort them all and poll until every engine is idle.
        slow = {"X-Stub-Delay-Ms": "30000"}
        dripping = {"X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "1000"}
        in_flight = [
            asyncio.ensure_future(rl.generate({"text": "long", "rid": f"long-{i}"}, slow))
            for i in range(8)
        ] + [
            asyncio.ensure_future(rl.generate({"text": "drip", "stream": True}, dripping))
            for _ in range(4)
        ]
        async with asyncio.timeout(10):
            while sum(running for running, _ in await rl.loads()) < 12:
                await asyncio.sleep(0.05)
        abort_at = time.monotonic()
        status, reply = await rl.call("POST", "/abort_request", {"abort_all": True})
        assert status == 200 and reply["success"] and len(reply["results"]) == ENGINES
        polls = 0
        async with asyncio.timeout(10):
            while True:
                polls += 1
                if await rl.loads() == [(0, 0)] * ENGINES:
                    break
                await asyncio.sleep(0.02)
        figures["abort_to_idle_ms"] = round((time.monotonic() - abort_at) * 1000)
        figures["loads_polls_until_idle"] = polls
        for status, out, _ in await asyncio.gather(*in_flight[:8]):
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        for status, events, _ in await asyncio.gather(*in_flight[8:]):
            assert status == 200 and events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(events) < 1000
        figures["rollouts_aborted"] = sum(e.aborted for e in engines)
        assert figures["rollouts_aborted"] == 12

        # 4. Pause, update the weights with a new version, continue. Rollouts sent while
        # the fleet is paused wait in the gateway (never on a paused engine), then get the
        # new weights.
        status, reply = await rl.call("POST", "/pause_generation", {"mode": "abort"})
        assert status == 200 and reply["success"]
        _, listed = await rl.call("GET", "/workers")
        assert {w["state"] for w in listed["workers"]} == {"paused"}
        held = [asyncio.ensure_future(rl.generate({"text": f"held {i}"})) for i in range(6)]
        await asyncio.sleep(0.3)
        assert not any(h.done() for h in held)
        update = {"model_path": "/ckpt/iter-1", "weight_version": "iter-1", "flush_cache": True}
        status, reply = await rl.call("POST", "/update_weights_from_disk", update)
        assert status == 200 and reply["success"]
        assert [r["status"] for r in reply["results"]] == [200] * ENGINES
        _, listed = await rl.call("GET", "/workers")
        assert {(w["state"], w["weight_version"]) for w in listed["workers"]} == {
            ("paused", "iter-1")
        }
        status, reply = await rl.call("POST", "/continue_generation", {})
        assert status == 200 and reply["success"]
        for status, out, version in await asyncio.gather(*held):
            assert status == 200 and out["meta_info"]["weight_version"] == version == "iter-1"

        # 5. Every later response carries the new version.
        after = await asyncio.gather(
            *(rl.generate({"text": f"q{i}"}, {SESSION_HEADER: f"ep-{i}"}) for i in range(16)),
            *(rl.generate({"text": f"s{i}", "stream": True}) for i in range(4)),
        )
        for status, out, version in after:
            assert status == 200 and version == "iter-1"
            metas = [e["meta_info"] for e in out] if isinstance(out, list) else [out["meta_info"]]
            assert {m["weight_version"] for m in metas} == {"iter-1"}
        figures["rollouts_after_update"] = len(after) + len(held)

        # Nothing reached a paused engine, and each control call reached each engine once.
        assert [e.arrived_paused for e in engines] == [0] * ENGINES
        for path in CONTROL_PATHS:
            assert [_proxied(e, path) for e in engines] == [1] * ENGINES, path

        # 6. One engine fails the next update: 502, naming it; the others took it.
        engines[2].engine_op_status = 500
        update = {"model_path": "/ckpt/iter-2", "weight_version": "iter-2"}
        status, reply = await rl.call("POST", "/update_weights_from_disk", update)
        assert status == 502 and reply["success"] is False
        failed = [r for r in reply["results"] if r["status"] != 200]
        assert [(r["id"], r["url"], r["status"]) for r in failed] == [(ids[2], engines[2].url, 500)]
        assert failed[0]["body"]["success"] is False
        _, listed = await rl.call("GET", "/workers")
        assert [w["weight_version"] for w in listed["workers"]] == [
            "iter-2",
            "iter-2",
            "iter-1",
            "iter-2",
        ]
        # And an engine that died: the fan-out names it, with why it could not be asked.
        await engines[3].stop()
        status, reply = await rl.call("POST", "/flush_cache")
        assert status == 502
        dead = [r for r in reply["results"] if r["status"] == 0]
        assert [r["id"] for r in dead] == [ids[3]]
        assert dead[0]["body"].startswith("could not connect")
    figures["seconds"] = round(time.monotonic() - started, 2)
    print("rl cycle figures:", figures)
