"""Hardening II, item 2: inspecting large bodies takes bounded memory and a bounded stall.

Measured on a real gateway process with the shipped limits (64 MiB bodies, 256 MiB of
inspection budget) and a stub backend in a process of its own: dense one-digit token-id
bodies of 64 MiB, one and two at once. Before gateway/contract/skim.py one such body took the
gateway from 54 MiB to a 950 MiB peak and two passed 1 GiB, the sidecar manifest's limit.
The formula (docs/hardening.md, "Memory per request"): about 2 x the body while it is read
and forwarded, plus the parse of what is left after the skim, charged to the budget.

Hardening III: the loop's longest turn while two such bodies are inspected at
once, in CPU time of the loop's thread (tests/hardening/loop_probe.py), and the listener's
reads of a fast upload, a MiB per turn.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
from pathlib import Path

import aiohttp
import pytest

from gateway import config as config_mod
from gateway import runtime
from gateway.app import Gateway
from gateway.edge import server
from gateway.edge.budget import InspectionBudget, TooCostly, parse_cost
from tests.conftest import (
    GatewayFactory,
    gateway_process,
    gw_url,
    process_config,
    spawn,
    start_stub_process,
)
from tests.hardening.checks import LoopTurns
from tests.hardening.loop_probe import dense_body

MIB = 1 << 20
SIDECAR_LIMIT = 1024 * MIB  # deploy/kubernetes/overlays/sidecar/deployment-patch.yaml


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


async def _post(port: int, body: bytes) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{port}/generate",
            data=io.BytesIO(body),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=120),
        ) as r,
    ):
        await r.read()
        return r.status


@pytest.mark.heavy
@pytest.mark.parametrize("concurrent", [1, 2])
async def test_peak_memory_of_64_mib_token_bodies_with_the_shipped_limits(
    tmp_path: Path, concurrent: int
) -> None:
    stub, stub_url = await start_stub_process()
    try:
        async with gateway_process(process_config(stub_url), tmp_path) as gw:
            body = dense_body(64 * MIB - 4096)  # under limits.max_body_bytes (64 MiB)
            warm = b'{"text": "warm", "sampling_params": {"top_k": 2}}'
            assert await _post(gw.port, warm) == 200
            base = _status_kib(gw.proc.pid, "VmRSS") * 1024
            statuses = await asyncio.gather(*(_post(gw.port, body) for _ in range(concurrent)))
            peak = _status_kib(gw.proc.pid, "VmHWM") * 1024
    finally:
        stub.kill()
        await stub.wait()
    assert statuses == [200] * concurrent
    grew = peak - base
    # About two copies of each body (read, then joined; forwarded as is) and little else.
    assert grew <= concurrent * 2.5 * len(body), f"{grew / MIB:.0f} MiB"
    assert peak < SIDECAR_LIMIT


@pytest.mark.heavy
async def test_two_64_mib_bodies_at_once_never_stall_the_loop_for_long() -> None:
    """The loop keeps turning while two large bodies are read, joined, skimmed, parsed and
    forwarded at once (a Hardening III finding: one turn took 240 ms of them).

    Measured in CPU time of the loop's thread, in a gateway process of its own
    (tests/hardening/loop_probe.py): on a loaded machine the wall clock also counts the time
    the thread waited for a core (a loaded run: 860 ms against a 500 ms bound, with nothing
    slower in the gateway)."""
    # Each read, scan and copy of a body is sliced with the loop turning between slices,
    # and the join runs in a thread: 5-14 ms in the worst tick of a run on the 2-core VM
    # (docs/hardening.md, "Loop stall with large bodies"). The join on the loop alone
    # takes 50 ms, the skim without its pauses 500.
    #
    # The best of three runs is held to 40 ms: a step that runs long does so in every
    # run, while turns the loaded machine took from the test vary. Fresh-clone CI runs of
    # the whole suite read 52.5 ms in one run (the next one passed), and 30.0 and 53.6 ms
    # in two runs of another, where the probe stays under 15 ms alone and beside two busy
    # loops. 40 ms still fails the join moved back onto the loop (50 ms in every run) and
    # the skim without its pauses (500).
    runs: list[LoopTurns] = []
    for _ in range(3):
        probe = await spawn("tests.hardening.loop_probe", stdout=asyncio.subprocess.PIPE)
        out, _ = await probe.communicate()
        assert probe.returncode == 0
        runs.append(LoopTurns(**json.loads(out)))
        if runs[-1].worst_cpu < 0.025:
            break
    assert min(run.worst_cpu for run in runs) < 0.040, "; ".join(map(str, runs))


@pytest.mark.heavy
def test_a_fast_upload_is_read_a_mebibyte_a_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """libuv reads up to 32 times 256 KiB in a row from a client that keeps sending, each
    read copied three times on its way into the body; the listener lets the loop turn
    after each MiB (gateway/edge/server.py, _READ_PER_TURN). On uvloop, the loop the
    gateway runs on: asyncio's own reads once per turn."""
    per_turn = [0]
    most = [0]
    received = server._Connection.data_received

    def counting(self: server._Connection, data: bytes) -> None:
        per_turn[0] += len(data)
        received(self, data)

    monkeypatch.setattr(server._Connection, "data_received", counting)

    async def upload() -> None:
        stub, stub_url = await start_stub_process()
        gw = Gateway(
            config_mod.build(
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "admin": {"host": "127.0.0.1", "port": 0},
                    "backends": {"static": [stub_url], "health": {"enabled": False}},
                }
            )
        )
        try:
            await gw.start()
            body = dense_body(16 * MIB)
            head = (
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            reply: list[bytes] = []

            def client() -> None:
                with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
                    sock.sendall(head + body)
                    while chunk := sock.recv(65536):
                        reply.append(chunk)

            thread = threading.Thread(target=client)
            thread.start()
            while thread.is_alive():
                most[0] = max(most[0], per_turn[0])
                per_turn[0] = 0
                await asyncio.sleep(0)
            thread.join()
            assert b"".join(reply).startswith(b"HTTP/1.1 200 ")
        finally:
            await gw.stop()
            stub.kill()
            await stub.wait()

    runtime.run(upload())
    # The limit, plus the read that crossed it.
    assert most[0] <= MIB + (256 << 10), f"{most[0] / MIB:.2f} MiB read in one turn"


async def test_a_body_too_costly_to_inspect_is_413_and_a_busy_budget_503(
    make_gateway: GatewayFactory,
) -> None:
    stub, stub_url = await start_stub_process()
    try:
        gw = await make_gateway(
            stub_url,
            backends={"health": {"enabled": False}, "queue_timeout_s": 0.05},
            limits={"max_inspecting_bytes": 16 * MIB},
        )
        # A batch of 600k one-letter prompts: no integer run to skim; its parse alone would
        # cost about 2 x 3.6 MiB + 24 x 600k values, past the 16 MiB budget.
        texts = b'{"text": [' + b'"a",' * 600_000 + b'"a"], "sampling_params": {"top_k": 2}}'
        assert parse_cost(texts) > 16 * MIB
        async with aiohttp.ClientSession() as s:
            json = {"Content-Type": "application/json"}
            async with s.post(gw_url(gw, "/generate"), data=io.BytesIO(texts), headers=json) as r:
                assert r.status == 413
                assert "max_inspecting_bytes" in (await r.json())["error"]["message"]
            # While the budget is held, another inspection waits queue_timeout_s, then 503.
            assert gw.proxy is not None
            budget = gw.proxy.budget
            assert budget.try_acquire(budget.limit)
            try:
                small = b'{"text": "x", "sampling_params": {"top_k": 2}}'
                async with s.post(gw_url(gw, "/generate"), data=small, headers=json) as r:
                    assert r.status == 503
                    assert r.headers["Retry-After"] == "1"
            finally:
                budget.release(budget.limit)
            async with s.post(gw_url(gw, "/generate"), data=small, headers=json) as r:
                assert r.status == 200
        assert budget.used == 0 and budget.refused == 1
    finally:
        stub.kill()
        await stub.wait()


async def test_budget_grants_in_order_and_hands_on_what_a_leaver_was_given() -> None:
    budget = InspectionBudget(100)
    assert budget.try_acquire(60)
    with pytest.raises(TooCostly):
        budget.try_acquire(101)
    order: list[str] = []

    async def take(name: str, cost: int, timeout: float = 2) -> bool:
        ok = await budget.acquire(cost, timeout)
        order.append(name if ok else f"{name}:timeout")
        return ok

    big = asyncio.create_task(take("big", 80))
    small = asyncio.create_task(take("small", 10))  # fits now, but waits behind big
    gone = asyncio.create_task(take("gone", 5, timeout=0.05))
    assert await gone is False
    assert order == ["gone:timeout"]
    budget.release(60)
    await asyncio.gather(big, small)
    assert order == ["gone:timeout", "big", "small"]
    assert budget.used == 90
    # A waiter cancelled as it was granted hands its share on.
    waiter = asyncio.create_task(budget.acquire(50, 2))
    await asyncio.sleep(0)
    budget.release(90)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.used == 0
