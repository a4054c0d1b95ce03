"""--workers N: processes sharing one port, one supervisor, merged metrics."""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.openmetrics.parser import text_fd_to_metric_families

from gateway.ops.supervisor import merge_metrics
from gateway.testing.stub import StubBackend
from tests.conftest import free_port, spawn
from tests.fleet.kubeapi import FakeKubernetesApi

pytestmark = pytest.mark.heavy

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def test_merge_labels_each_worker() -> None:
    a = '# TYPE x_total counter\nx_total{route="/generate"} 3.0\n'
    b = '# TYPE x_total counter\nx_total{route="/generate"} 4.0\n'
    text = merge_metrics([(0, a), (1, b)])[0].decode()
    assert 'x_total{route="/generate",worker="0"} 3.0' in text
    assert 'x_total{route="/generate",worker="1"} 4.0' in text
    assert text.count("# TYPE x_total counter") == 1


async def test_two_workers_share_the_port(stub: StubBackend) -> None:
    port, admin = free_port(), free_port()
    proc = await spawn(
        "gateway",
        "--backend",
        stub.url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        "--workers",
        "2",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    body = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
    try:
        async with aiohttp.ClientSession() as s:
            async with asyncio.timeout(30):
                while True:
                    try:
                        async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
                            if (
                                r.status == 200
                                and (await r.json())["reason"] == "2/2 workers ready"
                            ):
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
            # Fresh connections each time, so the kernel spreads them over both workers.
            for _ in range(40):
                async with (
                    aiohttp.ClientSession() as one,
                    one.post(
                        f"http://127.0.0.1:{port}/generate",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    ) as r,
                ):
                    assert r.status == 200
            async with s.get(f"http://127.0.0.1:{admin}/metrics") as r:
                text = await r.text()
            # The merged exposition in OpenMetrics too, when the scraper asks for it.
            async with s.get(
                f"http://127.0.0.1:{admin}/metrics", headers={"Accept": OPENMETRICS}
            ) as r:
                assert r.headers["Content-Type"].startswith("application/openmetrics-text")
                om = {f.name: f for f in text_fd_to_metric_families(io.StringIO(await r.text()))}
        om_requests = [
            s.labels["worker"]
            for s in om["sglang_gateway_requests"].samples
            if s.labels.get("route") == "/generate" and s.name.endswith("_total")
        ]
        assert set(om_requests) == {"0", "1"}
        per_worker = {}
        for line in text.splitlines():
            if line.startswith("sglang_gateway_requests_total{") and 'route="/generate"' in line:
                worker = line.split('worker="')[1].split('"')[0]
                per_worker[worker] = float(line.rsplit(" ", 1)[1])
        assert sum(per_worker.values()) == 40
        assert set(per_worker) == {"0", "1"}  # both workers took connections
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=20) == 0


async def test_workers_that_cannot_start_say_why(stub: StubBackend) -> None:
    """The admin port taken: exit 1 with the reason in a JSON line, nothing left open."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        admin = taken.getsockname()[1]
        proc = await spawn(
            "gateway",
            "--backend",
            stub.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--admin-port",
            str(admin),
            "--workers",
            "2",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 1
    lines = [orjson.loads(line) for line in err.decode().splitlines()]
    (failure,) = [line for line in lines if "cannot start" in line["message"]]
    assert failure["level"] == "error"
    assert "address already in use" in failure["message"].lower()
    assert not [line for line in lines if "Unclosed" in line["message"]]


async def test_the_supervisors_readyz_says_why_its_workers_are_not_ready(
    tmp_path: Path,
) -> None:
    """Discovery refused by RBAC in every worker: the supervisor's /readyz names the cause
    once, for all the workers it applies to."""
    api = FakeKubernetesApi()
    api.granted = set()
    await api.start()
    port, admin = free_port(), free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}, workers: 2}}\n"
        f"admin: {{host: 127.0.0.1, port: {admin}}}\n"
        "backends:\n  discovery: kubernetes\n  kubernetes:\n"
        f"    {{namespace: llm, service: sglang, port: 30000, api_server: '{api.url}',\n"
        "     token_file: null, ca_file: null}\n"
        "logging: {access_log: false}\n"
    )
    proc = await spawn(
        "gateway",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    reason = ""
    try:
        async with aiohttp.ClientSession() as s, asyncio.timeout(30):
            # Each worker says it once its first list is refused.
            while "worker 0, 1: " not in reason:
                await asyncio.sleep(0.1)
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
                        if r.status == 503:
                            reason = (await r.json())["reason"]
        assert reason == (
            "0/2 workers ready; worker 0, 1: no healthy backend; kubernetes discovery "
            "failing: forbidden (HTTP 403 on list endpointslices)"
        ), reason
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=20) == 0
        await api.stop()
