"""Hardening II, item 5: `--workers N` stays one gateway, with one set of rules.

A real supervisor with two workers, in front of a real stub. Workers must run the config
the supervisor last accepted (never a file a reload refused, nor edits nobody reloaded),
must not outlive their supervisor, and a worker that cannot start must show in /readyz and
in a metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.testing.stub import StubBackend
from tests.conftest import free_port, spawn

pytestmark = pytest.mark.heavy

MASK = orjson.dumps({"text": "x", "sampling_params": {"top_p": 0.9}, "return_sampling_mask": True})
ENFORCE = "enforce"
LOG_ONLY = "log_only"


def config_text(stub: StubBackend, port: int, admin: int, mode: str) -> str:
    return (
        f"listen: {{host: 127.0.0.1, port: {port}, workers: 2}}\n"
        f"admin: {{host: 127.0.0.1, port: {admin}}}\n"
        f"backends: {{static: ['{stub.url}'], health: {{interval_s: 0.2}}}}\n"
        f"policy: {{sampling_mask: {{mode: {mode}}}}}\n"
        "timeouts: {shutdown_grace_s: 1}\nlogging: {access_log: false}\n"
    )


@dataclass
class Supervised:
    proc: asyncio.subprocess.Process
    port: int
    admin: int
    lines: list[str] = field(default_factory=list)
    pids: dict[int, int] = field(default_factory=dict)  # worker index -> latest pid

    async def pump(self) -> None:
        assert self.proc.stderr is not None
        while line := (await self.proc.stderr.readline()).decode():
            self.lines.append(line)
            if m := re.search(r"worker (\d+) \(pid (\d+)\) ready", line):
                self.pids[int(m.group(1))] = int(m.group(2))

    async def wait_line(self, pattern: str, after: int = 0, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while not any(re.search(pattern, line) for line in self.lines[after:]):
                await asyncio.sleep(0.05)

    async def readyz(self) -> tuple[int, str]:
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"http://127.0.0.1:{self.admin}/readyz") as r,
            ):
                return r.status, (await r.json())["reason"]
        except aiohttp.ClientError:
            return 0, ""

    async def wait_ready(self, reason: str = "2/2 workers ready") -> None:
        async with asyncio.timeout(30):
            while await self.readyz() != (200, reason):
                await asyncio.sleep(0.1)

    async def metrics(self) -> str:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{self.admin}/metrics") as r,
        ):
            return await r.text()

    async def masks_forwarded(self, stub: StubBackend, n: int = 30) -> int:
        """Unbounded mask requests, each on a fresh connection so both workers are asked:
        how many the gateway let through to the backend (enforce: none; log_only: all)."""
        before = sum(1 for r in stub.received if r.path == "/generate")
        await self.mask_statuses(n)
        return sum(1 for r in stub.received if r.path == "/generate") - before

    async def mask_statuses(self, n: int = 30) -> list[int]:
        out = []
        for _ in range(n):
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    f"http://127.0.0.1:{self.port}/generate",
                    data=MASK,
                    headers={"Content-Type": "application/json"},
                ) as r,
            ):
                out.append(r.status)
        return out

    async def restart_worker(self, index: int) -> None:
        old = self.pids[index]
        os.kill(old, signal.SIGKILL)
        async with asyncio.timeout(20):
            while self.pids.get(index) == old:
                await asyncio.sleep(0.05)
        await self.wait_ready()


@pytest.fixture
async def supervised(stub: StubBackend, tmp_path: Path) -> AsyncIterator[tuple[Supervised, Path]]:
    port, admin = free_port(), free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(stub, port, admin, ENFORCE))
    proc = await spawn(
        "gateway",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    sup = Supervised(proc, port, admin)
    pump = asyncio.create_task(sup.pump())
    try:
        await sup.wait_ready()
        yield sup, cfg
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 20)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in sup.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pump.cancel()


async def test_a_worker_restarted_after_a_refused_reload_runs_the_accepted_config(
    supervised: tuple[Supervised, Path], stub: StubBackend
) -> None:
    sup, cfg = supervised
    assert await sup.masks_forwarded(stub) == 0
    cfg.write_text("listen: {prot: 1\n")  # not even YAML
    mark = len(sup.lines)
    sup.proc.send_signal(signal.SIGHUP)
    await sup.wait_line("reload refused", after=mark)
    await sup.restart_worker(0)
    await sup.restart_worker(1)
    # Both restarted workers run the config the supervisor accepted: no crash loop, ready.
    assert await sup.readyz() == (200, "2/2 workers ready")
    assert await sup.masks_forwarded(stub) == 0
    assert not any("Traceback" in line for line in sup.lines)


async def test_a_restarted_worker_never_reads_edits_nobody_reloaded(
    supervised: tuple[Supervised, Path], stub: StubBackend
) -> None:
    sup, cfg = supervised
    cfg.write_text(config_text(stub, sup.port, sup.admin, LOG_ONLY))  # valid, not reloaded
    await sup.restart_worker(1)
    # Before the fix the restarted worker ran log_only and let these through.
    assert await sup.masks_forwarded(stub) == 0
    mark = len(sup.lines)
    sup.proc.send_signal(signal.SIGHUP)
    await sup.wait_line("config accepted", after=mark)
    await asyncio.sleep(0.5)  # the workers reload on the supervisor's signal
    assert await sup.masks_forwarded(stub) == 30  # log_only everywhere now
    await sup.restart_worker(0)
    assert await sup.masks_forwarded(stub) == 30
    text = await sup.metrics()
    assert 'sglang_gateway_worker_restarts_total{worker="0"} 1.0' in text
    assert 'sglang_gateway_supervisor_config_reloads_total{result="ok"} 1.0' in text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"  # a zombie has exited
    return True


async def test_workers_exit_when_the_supervisor_is_killed(
    supervised: tuple[Supervised, Path],
) -> None:
    sup, _ = supervised
    workers = list(sup.pids.values())
    assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    sup.proc.kill()
    await sup.proc.wait()
    async with asyncio.timeout(10):  # they drain (grace 1 s) and exit
        while any(_alive(pid) for pid in workers):
            await asyncio.sleep(0.05)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", sup.port), timeout=1):
        pass


async def test_a_worker_that_cannot_start_is_reported(
    supervised: tuple[Supervised, Path],
) -> None:
    sup, _ = supervised
    for pid in sup.pids.values():
        os.kill(pid, signal.SIGKILL)
    # Someone else takes the port (without SO_REUSEPORT): no worker can bind it again.
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        async with asyncio.timeout(5):
            while True:
                try:
                    squatter.bind(("127.0.0.1", sup.port))
                    break
                except OSError:
                    await asyncio.sleep(0.01)
        squatter.listen()
        async with asyncio.timeout(30):
            while True:
                status, reason = await sup.readyz()
                if "failing to start: worker 0, worker 1" in reason:
                    break
                await asyncio.sleep(0.1)
        assert status == 503
        text = await sup.metrics()
        assert 'sglang_gateway_worker_failing{worker="0"} 1.0' in text
        assert 'sglang_gateway_worker_up{worker="1"} 0.0' in text
        restarts = re.search(r'sglang_gateway_worker_restarts_total\{worker="0"\} (\S+)', text)
        assert restarts is not None and float(restarts.group(1)) >= 3
