"""`sglang-gateway launch-router`: the gateway started with sglang-router's launch flags, as
a framework's script starts the router (real processes: the gateway and stub engines)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import yaml

from tests.conftest import free_port, spawn, start_stub_process


async def run(*args: str) -> tuple[int, str, str]:
    proc = await spawn(
        "gateway",
        "launch-router",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ},
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@contextlib.asynccontextmanager
async def engines(n: int) -> AsyncIterator[list[str]]:
    procs: list[asyncio.subprocess.Process] = []
    urls: list[str] = []
    try:
        for _ in range(n):
            proc, url = await start_stub_process()
            procs.append(proc)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


@pytest.mark.heavy
async def test_a_router_command_line_starts_a_gateway_that_serves() -> None:
    port, prometheus = free_port(), free_port()
    async with engines(2) as urls:
        proc = await spawn(
            "gateway",
            "launch-router",
            "--worker-urls",
            *urls,
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(prometheus),
            "--request-timeout-secs",
            "600",
            "--health-check-interval-secs",
            "1",
            "--log-level",
            "warn",
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as s:
                for _ in range(100):  # up within a few seconds, ready once probed
                    with contextlib.suppress(aiohttp.ClientError):
                        async with s.get(base + "/readiness") as r:
                            if r.status == 200:
                                ready = await r.json()
                                break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("the gateway never turned ready")
                assert ready["total_workers"] == 2
                body = orjson.dumps({"text": "hi", "sampling_params": {"top_k": 2}})
                for _ in range(4):
                    async with s.post(
                        base + "/generate", data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        assert r.status == 200
                        assert "text" in await r.json()
                async with s.get(base + "/workers") as r:
                    listing = await r.json()
                served = {w["url"] for w in listing["workers"]}
                assert served == set(urls) and listing["total"] == 2
                # The registry: an engine that comes later registers itself, as with SMG.
                async with (
                    engines(1) as (late,),
                    s.post(base + "/workers", json={"url": late}) as r,
                ):
                    assert r.status == 200
                # --prometheus-port is the admin listener: the gateway's own metrics.
                async with s.get(f"http://127.0.0.1:{prometheus}/metrics") as r:
                    assert r.status == 200 and "sglang_gateway_" in await r.text()
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 30) == 0


@pytest.mark.heavy
async def test_the_flags_become_the_config() -> None:
    code, out, err = await run(
        "--worker-urls",
        "http://10.0.0.1:30000",
        "http://10.0.0.2:30000",
        "--policy",
        "consistent_hashing",
        "--request-timeout-secs",
        "14400",
        "--max-payload-size",
        "1048576",
        "--prometheus-host",
        "0.0.0.0",
        "--disable-health-check",
        "--log-level",
        "warn",
        "--check-config",
    )
    assert code == 0, err
    cfg = yaml.safe_load(out)
    b = cfg["backends"]
    assert b["discovery"] == "registry"
    assert b["static"] == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert (b["balancer"], b["hash_header"]) == ("consistent_hash", "X-SMG-Routing-Key")
    assert b["health"]["enabled"] is False
    assert cfg["listen"]["port"] == 30000 and cfg["admin"] == {"host": "0.0.0.0", "port": 29000}
    t = cfg["timeouts"]
    assert t["total_s"] == t["ttfb_s"] == t["idle_s"] == 14400
    assert cfg["limits"]["max_body_bytes"] == 1048576
    assert cfg["logging"]["level"] == "warning"
    # With no worker at all: engines register themselves later; SMG's default policy, and
    # its cache-aware thresholds by their flags.
    code, out, _ = await run(
        "--check-config", "--cache-threshold", "0.5", "--balance-abs-threshold", "16"
    )
    b = yaml.safe_load(out)["backends"]
    assert code == 0 and b["static"] == [] and b["balancer"] == "cache_aware"
    assert b["cache_aware"]["cache_threshold"] == 0.5 and b["balance_abs_threshold"] == 16


async def test_pd_disaggregation_takes_the_routers_prefill_and_decode_flags() -> None:
    code, out, err = await run(
        "--check-config",
        "--pd-disaggregation",
        "--prefill",
        "http://10.0.0.1:30000",
        "8998",
        "--prefill",
        "http://10.0.0.2:30000",
        "none",
        "--prefill",
        "http://10.0.0.3:30000",
        "--decode",
        "http://10.0.0.4:30000",
        "--prefill-policy",
        "cache_aware",
        "--decode-policy",
        "round_robin",
    )
    assert code == 0, err
    b = yaml.safe_load(out)["backends"]
    assert b["mode"] == "pd" and b["discovery"] == "registry"
    assert b["prefill"] == [
        {"url": "http://10.0.0.1:30000", "bootstrap_port": 8998},
        {"url": "http://10.0.0.2:30000", "bootstrap_port": None},
        {"url": "http://10.0.0.3:30000", "bootstrap_port": None},
    ]
    assert b["decode"] == ["http://10.0.0.4:30000"]
    assert b["prefill_balancer"] == "cache_aware" and b["decode_balancer"] == "round_robin"


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-tree-size", "1000"], "not supported: --max-tree-size"),
        (["--pol", "random"], "not supported: --pol"),
        (["--prefill", "http://p:1", "9000"], "--prefill needs --pd-disaggregation"),
        (["--epd-disaggregation"], "--epd-disaggregation is not supported"),
        (
            ["--pd-disaggregation", "--prefill", "http://p:1", "port"],
            "the bootstrap port must be a number or none",
        ),
        (
            ["--pd-disaggregation", "--prefill-policy", "bucket"],
            "--prefill-policy bucket: SMG's bucket",
        ),
        (["--api-key=secret"], "--api-key is not supported"),
        (["--policy", "prefix_hash"], "--policy prefix_hash: SMG's prefix_hash"),
        (["--policy", "fastest"], "--policy fastest: not a policy"),
        (["--port", "x"], "invalid int value"),
    ],
)
async def test_a_flag_it_cannot_honour_exits_2_listing_what_it_takes(
    args: list[str], needle: str
) -> None:
    code, out, err = await run(*args, "--check-config")
    assert code == 2
    assert needle in err
    assert "Supported flags: --worker-urls, --host, --port, --policy" in err
    assert "secret" not in err  # a refused credential is not echoed
    assert out == ""


async def test_a_bad_value_is_a_config_error_naming_its_key() -> None:
    code, _, err = await run("--request-timeout-secs", "0", "--check-config")
    assert code == 2
    assert "timeouts" in err and "greater than 0" in err


async def test_it_runs_as_a_module_like_sglang_routers_launcher() -> None:
    proc = await spawn(
        "gateway.launch_router",
        "--worker-urls",
        "http://10.0.0.1:30000",
        "--check-config",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
    assert yaml.safe_load(out)["backends"]["static"] == ["http://10.0.0.1:30000"]


async def test_help_lists_each_flag_with_its_config_key() -> None:
    code, out, _ = await run("--help")
    assert code == 0
    assert "--worker-urls" in out and "backends.static" in out
    assert "--prometheus-port" in out and "admin.port" in out
