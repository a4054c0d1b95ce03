"""Shared fixtures: real stub backends and real gateways on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway import build
from gateway import config as config_mod
from gateway.app import Gateway
from gateway.fleet.discovery import Resolver
from gateway.testing.stub import Received, StubBackend

GatewayFactory = Callable[..., Awaitable[Gateway]]

# scripts/check.sh says which build each of its runs is for; a run that imports the other
# one would pass while testing the wrong code. tests/test_build.py checks each module.
EXPECT_BUILD = os.environ.get("SGLANG_GATEWAY_EXPECT_BUILD")


def pytest_sessionstart(session: pytest.Session) -> None:
    if EXPECT_BUILD and build.BUILD != EXPECT_BUILD:
        pytest.exit(
            f"SGLANG_GATEWAY_EXPECT_BUILD={EXPECT_BUILD}, but this run imports the "
            f"{build.BUILD} build ({build.BUILD_WHY}) from {Path(build.__file__).parent}",
            returncode=3,
        )


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture
async def stub() -> AsyncIterator[StubBackend]:
    backend = StubBackend()
    await backend.start()
    yield backend
    await backend.stop()


@pytest.fixture
async def stubs() -> AsyncIterator[list[StubBackend]]:
    """Three stub backends on their own ephemeral ports (a small fleet)."""
    backends = [StubBackend() for _ in range(3)]
    for b in backends:
        await b.start()
    yield backends
    for b in backends:
        await b.stop()


@pytest.fixture
async def make_gateway() -> AsyncIterator[GatewayFactory]:
    """Start gateways in front of given backend URLs; all are stopped at teardown."""
    started: list[Gateway] = []

    async def factory(*urls: str, resolver: Resolver | None = None, **overrides: Any) -> Gateway:
        data = merge(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "admin": {"host": "127.0.0.1", "port": 0},
                "backends": {"static": list(urls), "health": {"interval_s": 0.2}},
                "timeouts": {"shutdown_grace_s": 2},
                "logging": {"access_log": True},
            },
            overrides,
        )
        gw = Gateway(config_mod.build(data), resolver=resolver)
        await gw.start()
        started.append(gw)
        return gw

    yield factory
    for gw in started:
        await gw.stop()


@pytest.fixture
async def gateway(stub: StubBackend, make_gateway: GatewayFactory) -> Gateway:
    return await make_gateway(stub.url)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def last_proxied(stub: StubBackend) -> Received:
    """The last request the gateway forwarded to `stub` (health probes excluded: the
    gateway's own probes carry no X-Forwarded-For)."""
    return next(r for r in reversed(stub.received) if "X-Forwarded-For" in r.headers)


def proxied(stub: StubBackend) -> list[Received]:
    """What the gateway forwarded to `stub` for its clients: its own calls (health probes,
    the /model_info read when a backend joins) carry no X-Forwarded-For."""
    return [r for r in stub.received if "X-Forwarded-For" in r.headers]


def gw_url(gw: Gateway, path: str = "") -> str:
    return f"http://127.0.0.1:{gw.port}{path}"


def admin_url(gw: Gateway, path: str = "") -> str:
    return f"http://127.0.0.1:{gw.admin_port}{path}"


ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port that was free a moment ago, for a process that must be told its port up front."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def spawn(module: str, *args: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """`python -m module args` from the repository root: a real process, real signals."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, cwd=ROOT, **kwargs
    )


async def read_match(
    stream: asyncio.StreamReader | None, pattern: str, timeout: float = 20
) -> re.Match[str]:
    """The first line of a process's output that matches `pattern`."""
    assert stream is not None
    async with asyncio.timeout(timeout):
        while True:
            line = (await stream.readline()).decode()
            assert line, f"the process ended before printing {pattern!r}"
            if m := re.search(pattern, line):
                return m


async def start_stub_process(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await spawn("gateway.testing.stub", "--port", "0", *args, stdout=asyncio.subprocess.PIPE)
    m = await read_match(proc.stdout, r"stub listening on (http://\S+)")
    return proc, m.group(1)


async def abandon_generate(gw: Gateway, *, stream: bool, headers: dict[str, str]) -> None:
    """A client that gives up on a slow /generate after 0.5 s: mid-stream when `stream`,
    else while the backend is still working on the answer."""
    body = orjson.dumps({"text": "x", "stream": stream, "sampling_params": {"top_k": 2}})
    hdrs = {"Content-Type": "application/json", **headers}
    if stream:
        hdrs.update({"X-Stub-Chunk-Delay-Ms": "200", "X-Stub-Events": "100"})
    else:
        hdrs["X-Stub-Delay-Ms"] = "10000"
    async with aiohttp.ClientSession() as s:
        with pytest.raises(TimeoutError):
            async with s.post(
                gw_url(gw, "/generate"),
                data=body,
                headers=hdrs,
                timeout=aiohttp.ClientTimeout(total=0.5),
            ) as r:
                await r.read()


async def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll a condition on the loop (readiness, counters), failing after `timeout`."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@dataclass
class GatewayProcess:
    proc: asyncio.subprocess.Process
    port: int
    admin: int


@contextlib.asynccontextmanager
async def gateway_process(
    config: str, tmp_path: Path, *, stdout: int = asyncio.subprocess.DEVNULL, **kwargs: Any
) -> AsyncIterator[GatewayProcess]:
    """`python -m gateway --config` on a config file with ephemeral ports (listen and admin
    port 0), until it says where it listens; killed on the way out unless it has exited.

    stderr is read until that line, then drained in the background so the pipe never fills.
    """
    cfg = tmp_path / "gateway-process.yaml"
    cfg.write_text(config)
    proc = await spawn(
        "gateway", "--config", str(cfg), stdout=stdout, stderr=asyncio.subprocess.PIPE, **kwargs
    )
    drain: asyncio.Task[bytes] | None = None
    try:
        m = await read_match(
            proc.stderr, r"listening on 127\.0\.0\.1:(\d+) \(admin 127\.0\.0\.1:(\d+)\)"
        )
        assert proc.stderr is not None
        if stdout != asyncio.subprocess.PIPE:
            drain = asyncio.create_task(proc.stderr.read())
        yield GatewayProcess(proc, int(m.group(1)), int(m.group(2)))
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        if drain is not None:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain


def process_config(backend_url: str, extra: str = "") -> str:
    """A minimal config for gateway_process: loopback, ephemeral ports, no health probes."""
    return (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        f"backends: {{static: ['{backend_url}'], health: {{enabled: false}}}}\n" + extra
    )


@contextlib.asynccontextmanager
async def cli_gateway(tmp_path: Path, *args: str) -> AsyncIterator[tuple[int, Path, Path]]:
    """The real entry point (`python -m gateway`) with its real log set-up; yields the
    client port and the files its stdout and stderr go to. SIGTERM and exit 0 at the end.
    Ports are picked up front: at log level warning the gateway does not print them."""
    port, admin = free_port(), free_port()
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = await spawn(
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--admin-port",
            str(admin),
            *args,
            stdout=out,
            stderr=err,
        )
    try:
        async with asyncio.timeout(20), aiohttp.ClientSession() as s:
            while True:
                assert proc.returncode is None, err_path.read_text()
                try:
                    async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
        yield port, out_path, err_path
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
