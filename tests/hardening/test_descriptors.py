"""Hardening II, item 4: running out of descriptors is the gateway's fault, not a backend's.

A real gateway process under a small RLIMIT_NOFILE is given more idle client connections
than it has descriptors. With the default connection limit it refuses the excess at once and
keeps serving; with the limit lifted it runs out, and its failed upstream connects (EMFILE)
must not eject the healthy backend. /readyz and /metrics stay reachable throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.testing.stub import StubBackend
from tests.conftest import gateway_process, process_config

pytestmark = pytest.mark.heavy

NOFILE = 256
OK = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@contextlib.asynccontextmanager
async def gateway(stub: StubBackend, tmp_path: Path, limits: str) -> AsyncIterator[tuple[int, int]]:
    config = process_config(stub.url, f"limits: {{{limits}}}\nlogging: {{access_log: false}}\n")
    config = config.replace("health: {enabled: false}", "health: {interval_s: 0.2}")
    async with gateway_process(config, tmp_path, preexec_fn=_limit_fds) as gw:
        yield gw.port, gw.admin


async def _metrics(admin: int) -> dict[str, float]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{admin}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r,
    ):
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{v}" for v in sample.labels.values())
            out[key] = sample.value
    return out


async def _ready(admin: int) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{admin}/readyz", timeout=aiohttp.ClientTimeout(total=5)) as r,
    ):
        return r.status


async def _hold(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    held = []
    for _ in range(n):
        with contextlib.suppress(OSError):
            held.append(await asyncio.open_connection("127.0.0.1", port))
    return held


async def _first_bytes(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(200), 0.5)
    except TimeoutError:
        return b""


async def _generate(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> int:
    reader, writer = conn
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(OK), OK)
    )
    async with asyncio.timeout(10):
        line = await reader.readline()
    return int(line.split()[1]) if line else 0


async def test_default_limit_refuses_excess_connections_and_keeps_serving(
    stub: StubBackend, tmp_path: Path
) -> None:
    async with gateway(stub, tmp_path, "") as (port, admin):
        limit = (await _metrics(admin))["sglang_gateway_client_connections_limit"]
        assert limit == (NOFILE - 64) // 2
        held = await _hold(port, NOFILE + 50)
        try:
            await asyncio.sleep(0.3)
            # The excess was answered 503 and closed; the rest are held open, silent.
            firsts = await asyncio.gather(*(_first_bytes(reader) for reader, _ in held))
            refused = [f for f in firsts if f.startswith(b"HTTP/1.1 503 ")]
            assert len(refused) == len(held) - limit
            assert firsts.count(b"") == limit
            live = [c for c, f in zip(held, firsts, strict=True) if not f]
            # Held connections still get their requests served: descriptors were kept for
            # the upstream connects.
            statuses = await asyncio.gather(*(_generate(c) for c in live[:20]))
            assert statuses == [200] * 20
            assert await _ready(admin) == 200
            m = await _metrics(admin)
            assert m["sglang_gateway_client_connections_refused_total"] >= len(held) - limit
            assert m["sglang_gateway_upstream_local_errors_total"] == 0
            assert m[f"sglang_gateway_backend_ejected,{stub.url}"] == 0
        finally:
            for _, writer in held:
                writer.transport.abort()


async def test_out_of_descriptors_never_ejects_a_backend(stub: StubBackend, tmp_path: Path) -> None:
    async with gateway(stub, tmp_path, "max_client_connections: 100000") as (port, admin):
        held = await _hold(port, NOFILE + 50)
        try:
            await asyncio.sleep(0.5)  # the gateway accepts until it has no descriptor left
            statuses = await asyncio.gather(*(_generate(c) for c in held[:10]))
            # No descriptor for an upstream connect: 503, the gateway's own fault.
            assert 503 in statuses, statuses
            await asyncio.sleep(0.6)  # probes fail with EMFILE too, and must not count
        finally:
            for _, writer in held:
                writer.transport.abort()
        await asyncio.sleep(0.5)
        m = await _metrics(admin)
        assert m.get(f"sglang_gateway_upstream_errors_total,{stub.url},connect_failed", 0) == 0
        assert m[f"sglang_gateway_backend_ejected,{stub.url}"] == 0
        assert m[f"sglang_gateway_backend_healthy,{stub.url}"] == 1
        assert m["sglang_gateway_upstream_local_errors_total"] >= 1
        assert await _ready(admin) == 200


@pytest.fixture(autouse=True)
def _enough_fds_here() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft >= 4 * NOFILE, "the test process needs more descriptors than the gateway"
