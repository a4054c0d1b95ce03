"""A real etcd for tests: Debian's etcd-server on loopback ephemeral ports, a temporary data
directory, stopped (and restartable, for the fault tests) by the test that started it.

Without the binary a test that needs it skips locally and fails under CI (.ci/run installs
etcd-server as it installs Prometheus)."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import free_port


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed; CI must run these tests (.ci/run)")
        pytest.skip("etcd is not installed here (apt-get install etcd-server)")
    return path


class EtcdServer:
    """One single-member etcd; `stop` and `start` again keep its data (a restart)."""

    def __init__(self, binary: str, data_dir: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.log = data_dir.parent / "etcd.log"

    async def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                "--name=test",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.url}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--initial-cluster-state=new",
                # Quick elections: a restarted single member leads within a second.
                "--heartbeat-interval=50",
                "--election-timeout=500",
                stdout=out,
                stderr=out,
            )
        async with aiohttp.ClientSession() as s, asyncio.timeout(20):
            while True:
                assert self.proc.returncode is None, self.log.read_text()[-2000:]
                try:
                    async with s.get(self.url + "/health") as r:
                        if (
                            r.status == 200
                            and (await r.json(content_type=None)).get("health") == "true"
                        ):
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.post(self.url + path, json=body) as r:
            data: dict[str, Any] = await r.json(content_type=None)
            assert r.status == 200, data
            return data

    async def revision(self) -> int:
        head = await self.call("/v3/kv/range", {"key": b64(b"\0")})
        return int(head["header"]["revision"])

    async def compact(self) -> int:
        """Compact the whole history up to now; the revision compacted at."""
        revision = await self.revision()
        await self.call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    async def get(self, key: str) -> bytes | None:
        found = await self.call("/v3/kv/range", {"key": b64(key.encode())})
        kvs = found.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    server = EtcdServer(etcd_binary(), tmp_path / "etcd-data")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
