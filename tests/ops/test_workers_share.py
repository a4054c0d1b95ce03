"""--workers N stays one gateway: what operators change through one worker holds in all.

Registry membership, paused engines and weight versions are shared through the supervisor's
document (gateway/fleet/shared.py); the worker that takes a change answers only once every
sibling adopted it. Each check below therefore runs at once after the call, on fresh
connections, which the kernel spreads over both workers.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.pool import worker_id
from gateway.testing.stub import StubBackend
from tests.conftest import free_port, spawn

pytestmark = pytest.mark.heavy

FRESH = 24  # fresh connections per check: both workers take some (checked on the metrics)
GEN = orjson.dumps({"text": "x", "sampling_params": {"max_new_tokens": 2}})
JSON = {"Content-Type": "application/json"}


class Fleet2:
    def __init__(self, port: int, admin: int, proc: asyncio.subprocess.Process) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin}"
        self.proc = proc

    async def once(self, method: str, path: str, **kw: Any) -> tuple[int, Any, Any]:
        """One call on a new connection: (status, JSON body, headers)."""
        async with aiohttp.ClientSession() as s, s.request(method, self.url + path, **kw) as r:
            data = await r.read()
            return r.status, orjson.loads(data) if data else None, r.headers

    async def each(self, method: str, path: str, **kw: Any) -> list[tuple[int, Any, Any]]:
        """The same call on FRESH new connections, one after another."""
        return [await self.once(method, path, **kw) for _ in range(FRESH)]

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        status, body, _ = await self.once(method, path, **kw)
        return status, body

    async def metric(self, name: str) -> list[dict[str, str]]:
        """The labels of each sample of `name` whose value is 1, every worker's."""
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/metrics") as r:
            text = await r.text()
        return [
            sample.labels
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and sample.value == 1.0
        ]

    async def served_by_both(self) -> None:
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/metrics") as r:
            text = await r.text()
        workers = {
            sample.labels["worker"]
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "sglang_gateway_requests_total" and sample.value > 0
        }
        assert workers == {"0", "1"}


@pytest.fixture
async def fleet2(stubs: list[StubBackend], tmp_path: Path) -> AsyncIterator[Fleet2]:
    port, admin = free_port(), free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}, workers: 2}}\n"
        f"admin: {{host: 127.0.0.1, port: {admin}}}\n"
        "backends:\n"
        "  discovery: registry\n"
        f"  static: ['{stubs[0].url}']\n"
        "  queue_timeout_s: 0.3\n"
        "  pause_hold_s: 0.3\n"
        "  health: {interval_s: 0.1}\n"
        "logging: {access_log: false}\n"
    )
    proc = await spawn(
        "gateway",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    gw = Fleet2(port, admin, proc)
    try:
        async with aiohttp.ClientSession() as s, asyncio.timeout(30):
            while True:
                try:
                    async with s.get(gw.admin + "/readyz") as r:
                        if r.status == 200 and (await r.json())["reason"] == "2/2 workers ready":
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        yield gw
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=20) == 0


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


async def test_two_workers_share_registry_pause_and_weights(
    fleet2: Fleet2, stubs: list[StubBackend]
) -> None:
    first, second = stubs[0], stubs[1]

    # Registered through one worker: every worker lists it and routes to it.
    status, worker = await fleet2.call("POST", "/workers", json={"url": second.url})
    assert status == 200 and worker["url"] == second.url
    for status, listed, _ in await fleet2.each("GET", "/workers"):
        assert status == 200
        assert {w["url"] for w in listed["workers"]} == {first.url, second.url}
    await fleet2.served_by_both()

    # Paused through one worker: no worker sends a generation to either engine.
    status, reply = await fleet2.call("POST", "/pause_generation", json={"mode": "retract"})
    assert status == 200 and reply["success"] and len(reply["results"]) == 2
    before = first.generations_seen + second.generations_seen
    for status, _, headers in await fleet2.each("POST", "/generate", data=GEN, headers=JSON):
        assert status == 503 and "Retry-After" in headers
    assert first.generations_seen + second.generations_seen == before
    paused = await fleet2.metric("sglang_gateway_backend_state")
    assert {(m["worker"], m["backend"]) for m in paused if m["state"] == "paused"} == {
        (w, u) for w in ("0", "1") for u in (first.url, second.url)
    }

    # New weights through one worker; continue through another connection.
    update = {"model_path": "/ckpt/step-2", "weight_version": "step-2"}
    status, reply = await fleet2.call("POST", "/update_weights_from_disk", json=update)
    assert status == 200 and reply["success"]
    status, _ = await fleet2.call("POST", "/continue_generation", json={})
    assert status == 200
    for status, out, headers in await fleet2.each("POST", "/generate", data=GEN, headers=JSON):
        assert status == 200
        assert out["meta_info"]["weight_version"] == "step-2"
        assert headers["X-Weight-Version"] == "step-2"
    versions = await fleet2.metric("sglang_gateway_backend_weight_version")
    assert {(m["worker"], m["backend"], m["version"]) for m in versions} == {
        (w, u, "step-2") for w in ("0", "1") for u in (first.url, second.url)
    }

    # A worker restarted by the supervisor knows what its siblings know.
    children = _children(fleet2.proc.pid)
    assert len(children) == 2
    os.kill(children[0], signal.SIGKILL)
    async with aiohttp.ClientSession() as s, asyncio.timeout(20):
        while True:
            async with s.get(fleet2.admin + "/readyz") as r:
                ready = r.status == 200 and (await r.json())["reason"] == "2/2 workers ready"
                if ready and set(_children(fleet2.proc.pid)) - set(children):
                    break
            await asyncio.sleep(0.1)
    for status, listed, _ in await fleet2.each("GET", "/workers"):
        assert status == 200
        assert {w["url"] for w in listed["workers"]} == {first.url, second.url}
        assert {w["weight_version"] for w in listed["workers"]} == {"step-2"}

    await fleet2.served_by_both()  # the restarted worker answered some of those

    # Removed through one worker: gone from every worker.
    status, _ = await fleet2.call("DELETE", f"/workers/{worker['id']}")
    assert status == 200
    for status, listed, _ in await fleet2.each("GET", "/workers"):
        assert status == 200
        assert [w["url"] for w in listed["workers"]] == [first.url]


async def test_an_abort_reaches_a_rid_routed_by_the_other_worker(
    fleet2: Fleet2, stubs: list[StubBackend]
) -> None:
    for stub in stubs[1:]:
        status, _ = await fleet2.call("POST", "/workers", json={"url": stub.url})
        assert status == 200
    slow = {**JSON, "X-Stub-Delay-Ms": "20000"}
    body = orjson.dumps({"text": "x", "rid": "rollout-7"})
    seen = sum(s.generations_seen for s in stubs)
    running = asyncio.ensure_future(fleet2.once("POST", "/generate", data=body, headers=slow))
    async with asyncio.timeout(10):
        while sum(s.generations_seen for s in stubs) == seen:  # it reached its engine
            await asyncio.sleep(0.01)
    # Aborts on fresh connections: whichever worker takes one, the owner gets it.
    for status, reply, _ in (
        await fleet2.each("POST", "/abort_request", json={"rid": "rollout-7"})
    )[:4]:
        assert status == 200 and reply["success"]
    status, out, _ = await asyncio.wait_for(running, 5)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert sum(s.aborted for s in stubs) == 1


async def test_a_patched_registration_reaches_every_worker(
    fleet2: Fleet2, stubs: list[StubBackend]
) -> None:
    wid = worker_id(stubs[0].url)
    status, worker = await fleet2.call("PATCH", f"/workers/{wid}", json={"priority": 9})
    assert status == 200 and worker["priority"] == 9
    for status, listed, _ in await fleet2.each("GET", "/workers"):
        assert status == 200
        assert [w.get("priority") for w in listed["workers"]] == [9]
