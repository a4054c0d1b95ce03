"""The stub's admin listener, as the image runs it: a real process, probed over sockets, and
the image's own HEALTHCHECK command run against it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys

import aiohttp

from gateway.testing.stub import StubBackend
from gateway.testing.stub.admin import start_admin
from tests.conftest import ROOT, free_port, read_match, spawn


def healthcheck_command() -> list[str]:
    """docker/Dockerfile's HEALTHCHECK CMD, with this interpreter for `python`."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    m = re.search(r"^HEALTHCHECK\b.*?\bCMD\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert m, "docker/Dockerfile has no exec-form HEALTHCHECK"
    cmd: list[str] = json.loads(m.group(1))
    assert cmd[0] == "python"
    return [sys.executable, *cmd[1:]]


def env_without_admin(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_ADMIN_PORT"}
    return {**env, **extra}


async def start(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await spawn(
        "gateway",
        "stub",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )


async def stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), timeout=20)


async def healthcheck(admin_port: int) -> int:
    proc = await asyncio.create_subprocess_exec(
        *healthcheck_command(),
        env=env_without_admin(GATEWAY_ADMIN_PORT=str(admin_port)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(proc.wait(), timeout=20)


async def test_admin_port_serves_livez_and_readyz_beside_sglang_routes() -> None:
    proc = await start("--admin-port", "0", env=env_without_admin())
    try:
        admin = (await read_match(proc.stdout, r"stub admin on (http://\S+)")).group(1)
        main = (await read_match(proc.stdout, r"stub listening on (http://\S+)")).group(1)
        assert admin != main
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{admin}/livez") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok"})
            async with s.get(f"{admin}/readyz") as r:
                assert r.status == 200
                assert (await r.json())["status"] == "ready"
            async with s.get(f"{main}/health") as r:
                assert r.status == 200
            # The SGLang surface gains nothing: the probes live on the admin port only.
            async with s.get(f"{main}/livez") as r:
                assert r.status == 404
            async with s.get(f"{admin}/generate") as r:
                assert r.status == 404
    finally:
        assert await stop(proc) == 0


async def test_image_healthcheck_passes_on_the_stub_run_as_documented() -> None:
    # The image sets GATEWAY_ADMIN_PORT and the documented command passes no admin flag.
    port = free_port()
    proc = await start(env=env_without_admin(GATEWAY_ADMIN_PORT=str(port)))
    try:
        await read_match(proc.stdout, rf"stub admin on http://127\.0\.0\.1:{port} ")
        await read_match(proc.stdout, r"stub listening on ")
        assert await healthcheck(port) == 0
    finally:
        assert await stop(proc) == 0
    # Gone with the process: the same check now fails, so it does check something.
    assert await healthcheck(port) != 0


async def test_no_admin_listener_unless_asked() -> None:
    proc = await start(env=env_without_admin())
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=20)).decode()
        assert line.startswith("stub listening on "), line
    finally:
        assert await stop(proc) == 0


async def test_bad_admin_port_variable_fails_like_a_bad_flag() -> None:
    proc = await spawn(
        "gateway",
        "stub",
        env=env_without_admin(GATEWAY_ADMIN_PORT="eighty"),
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 2
    assert b"--admin-port: invalid int value: 'eighty'" in err


async def test_readyz_follows_what_health_would_answer() -> None:
    stub = StubBackend(health_status=503)
    await stub.start()
    admin, port = await start_admin(stub, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:

            async def readyz() -> tuple[int, str]:
                async with s.get(f"http://127.0.0.1:{port}/readyz") as r:
                    return r.status, (await r.json())["reason"]

            assert await readyz() == (503, "/health answers 503")
            stub.health_status = 200
            assert await readyz() == (200, "")
            await stub.stop()
            assert await readyz() == (503, "not serving")
    finally:
        await admin.cleanup()
        await stub.stop()
