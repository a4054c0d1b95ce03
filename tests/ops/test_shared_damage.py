"""--workers 2 when the state they share is damaged or cannot be written.

A real supervisor with two workers in front of real stubs. The document the workers share is
damaged from outside (truncated, emptied, `[]`, garbage, wrong field types, deleted) or made
unwritable (a file-size limit on the workers: EFBIG, the lock path a directory: EISDIR, a
full tmpfs: ENOSPC, root only). Whatever happens, a control call must not answer as if
every worker knew when they do not, the log must stay bounded, and once a change lands
every worker must hold the same view: GET /workers on 30 fresh connections (the kernel
spreads them over both workers) must show one view.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.shared import STATE_ENV, validate
from gateway.testing.stub import StubBackend
from tests.conftest import free_port, spawn

pytestmark = pytest.mark.heavy

VIEWS = 30
SHARED_LOGGER = "gateway.fleet.shared"


class Workers2:
    def __init__(self, port: int, admin: int, proc: asyncio.subprocess.Process) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin}"
        self.proc = proc
        # stderr through a pipe: a file would take the workers' file-size limit too.
        self.lines: list[str] = []

    async def pump(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line.decode(errors="replace"))

    async def call(
        self, method: str, path: str, session: aiohttp.ClientSession | None = None, **kw: Any
    ) -> tuple[int, Any]:
        """One call on a new connection, or on `session`'s (which stays with one worker)."""
        async with contextlib.AsyncExitStack() as stack:
            if session is None:
                session = await stack.enter_async_context(aiohttp.ClientSession())
            async with session.request(method, self.url + path, **kw) as r:
                data = await r.read()
                return r.status, orjson.loads(data) if data else None
        raise AssertionError("unreachable")

    async def views(self) -> list[tuple[tuple[str, bool], ...]]:
        """What the workers say of the fleet, one view per fresh connection."""
        out = []
        for _ in range(VIEWS):
            status, listed = await self.call("GET", "/workers")
            assert status == 200
            out.append(tuple(sorted((w["url"], w["paused"]) for w in listed["workers"])))
        return out

    async def metric(self, name: str, **labels: str) -> float:
        """The sum over both workers of the samples of `name` with these labels."""
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/metrics") as r:
            text = await r.text()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def workers(self) -> list[int]:
        return _children(self.proc.pid)

    def state_file(self) -> Path:
        environ = Path(f"/proc/{self.workers()[0]}/environ").read_bytes().split(b"\0")
        (entry,) = [e for e in environ if e.startswith(STATE_ENV.encode() + b"=")]
        return Path(entry.split(b"=", 1)[1].decode())

    def log_mark(self) -> int:
        return len(self.lines)

    def shared_lines(self, mark: int) -> list[str]:
        """What the workers logged about the shared state since `mark`."""
        return [ln for ln in self.lines[mark:] if f'"logger":"{SHARED_LOGGER}"' in ln]


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
    return sorted(found)


@contextlib.asynccontextmanager
async def workers2(
    stubs: list[StubBackend], tmp_path: Path, tmpdir: Path | None = None
) -> AsyncIterator[Workers2]:
    port, admin = free_port(), free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}, workers: 2}}\n"
        f"admin: {{host: 127.0.0.1, port: {admin}}}\n"
        "backends:\n"
        "  discovery: registry\n"
        f"  static: ['{stubs[0].url}', '{stubs[1].url}']\n"
        "  queue_timeout_s: 0.3\n"
        "  health: {interval_s: 0.1}\n"
        "timeouts: {shutdown_grace_s: 1}\n"
        "logging: {access_log: false, format: json}\n"
    )
    env = {**os.environ, "TMPDIR": str(tmpdir or tmp_path)}
    proc = await spawn(
        "gateway",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    gw = Workers2(port, admin, proc)
    pump = asyncio.create_task(gw.pump())
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
        await asyncio.wait_for(pump, timeout=5)


async def _pause_and_continue_agree(gw: Workers2, stubs: list[StubBackend]) -> None:
    """A pause and a continue, each answered 200 and then seen alike by every view."""
    engines = tuple(sorted((stubs[0].url, stubs[1].url)))
    status, reply = await gw.call("POST", "/pause_generation", json={"mode": "abort"})
    assert status == 200 and reply["success"], reply
    assert set(await gw.views()) == {tuple((u, True) for u in engines)}
    status, _ = await gw.call("POST", "/continue_generation", json={})
    assert status == 200
    assert set(await gw.views()) == {tuple((u, False) for u in engines)}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _write(text: bytes) -> Callable[[Path], object]:
    return lambda path: path.write_bytes(text)


def _paused_as_text(path: Path) -> None:
    doc = json.loads(path.read_bytes())
    for state in doc["backends"].values():
        state["paused"] = "no"
    path.write_text(json.dumps(doc))


DAMAGE: dict[str, Callable[[Path], object]] = {
    "truncated": _truncate,
    "emptied": _write(b""),
    "a list": _write(b"[]"),
    "garbage": _write(b"\x00\xff{not json"),
    "wrong types": _write(b'{"generation": "9", "members": [], "backends": 5}'),
    "a flag that is not a boolean": _paused_as_text,
    "deleted": lambda path: path.unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_a_damaged_state_file_is_logged_once_rebuilt_and_shared_again(
    stubs: list[StubBackend], tmp_path: Path, damage: str
) -> None:
    async with workers2(stubs, tmp_path) as gw:
        await _pause_and_continue_agree(gw, stubs)
        path = gw.state_file()
        generation = validate(json.loads(path.read_bytes()))["generation"]
        mark = gw.log_mark()
        DAMAGE[damage](path)
        await asyncio.sleep(2)
        # Rebuilt by a worker from its own view, counted above what any worker adopted.
        rebuilt = validate(json.loads(path.read_bytes()))
        assert rebuilt["generation"] > generation
        assert all(s == {} for s in rebuilt["backends"].values()) or all(
            s.get("paused") is False for s in rebuilt["backends"].values()
        )
        # Polled 20 times a second by each worker: logged once each at most (the damage
        # seen, the rebuild), not once per poll.
        lines = gw.shared_lines(mark)
        assert 1 <= len(lines) <= 4, lines
        assert await gw.metric("sglang_gateway_shared_state_errors_total", operation="read") >= 1
        assert await gw.metric("sglang_gateway_shared_state_repairs_total") >= 1
        await _pause_and_continue_agree(gw, stubs)


def _limit_file_size(gw: Workers2) -> Callable[[], None]:
    """EFBIG for any file the workers write past 64 bytes (the document, not the acks)."""
    pids = gw.workers()
    before = {pid: resource.prlimit(pid, resource.RLIMIT_FSIZE) for pid in pids}
    for pid, (_, hard) in before.items():
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (64, hard))

    def restore() -> None:
        for pid, limits in before.items():
            resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)

    return restore


def _lock_is_a_directory(gw: Workers2) -> Callable[[], None]:
    lock = gw.state_file().with_name(gw.state_file().name + ".lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()
    return lock.rmdir


def _fill_the_disk(gw: Workers2) -> Callable[[], None]:
    filler = gw.state_file().parent / "filler"
    with contextlib.suppress(OSError), filler.open("wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)
    return filler.unlink


UNWRITABLE: dict[str, Callable[[Workers2], Callable[[], None]]] = {
    "a file size limit (EFBIG)": _limit_file_size,
    "the lock path a directory (EISDIR)": _lock_is_a_directory,
    "a full disk (ENOSPC)": _fill_the_disk,
}


@contextlib.contextmanager
def _small_tmpfs(tmp_path: Path) -> Any:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip("a full disk needs a tmpfs, and mounting one needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("kind", list(UNWRITABLE))
async def test_a_change_that_cannot_be_shared_fails_says_so_and_the_workers_converge(
    stubs: list[StubBackend], tmp_path: Path, kind: str
) -> None:
    engines = tuple(sorted((stubs[0].url, stubs[1].url)))
    async with contextlib.AsyncExitStack() as stack:
        tmpdir = stack.enter_context(_small_tmpfs(tmp_path)) if "ENOSPC" in kind else None
        async with workers2(stubs, tmp_path, tmpdir) as gw:
            assert set(await gw.views()) == {tuple((u, False) for u in engines)}
            mark = gw.log_mark()
            restore = UNWRITABLE[kind](gw)
            for _ in range(10):
                status, reply = await gw.call("POST", "/pause_generation", json={"mode": "abort"})
                assert status == 503, reply
                assert reply["success"] is False and reply["shared"] is False
                assert "could not be shared" in reply["detail"]
                # The engines did pause: the reply lists what each said.
                assert sorted((r["url"], r["status"]) for r in reply["results"]) == [
                    (u, 200) for u in engines
                ]
            assert stubs[0].pause_mode == "abort" and stubs[1].pause_mode == "abort"
            # One connection, so one worker, for the registration and its retry below.
            same = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            )
            register = {"url": stubs[2].url}
            status, reply = await gw.call("POST", "/workers", same, json=register)
            assert status == 503 and reply["shared"] is False
            assert reply["result"]["url"] == stubs[2].url
            # A failed write leaves the last document whole, and nothing beside it.
            state = gw.state_file()
            assert validate(json.loads(state.read_bytes()))["members"].keys() == set(engines)
            assert [p.name for p in state.parent.iterdir() if p.name.endswith(".new")] == []
            # Eleven failures, each worker logging once at most.
            assert 1 <= len(gw.shared_lines(mark)) <= 2, gw.shared_lines(mark)
            assert (
                await gw.metric(
                    "sglang_gateway_control_requests_total",
                    route="/pause_generation",
                    result="unshared",
                )
                == 10
            )
            assert (
                await gw.metric(
                    "sglang_gateway_control_requests_total", route="/workers", result="unshared"
                )
                == 1
            )
            assert (
                await gw.metric("sglang_gateway_shared_state_errors_total", operation="write") == 11
            )
            restore()
            # The next change that lands (the registration again, through the worker that
            # holds it alone) is what every worker holds: the pause that was never shared
            # gives way in the worker that made it.
            status, _ = await gw.call("POST", "/workers", same, json=register)
            assert status == 200
            everyone = tuple(sorted((u, False) for u in (*engines, stubs[2].url)))
            assert set(await gw.views()) == {everyone}
            # Repeated, the pause lands everywhere.
            status, reply = await gw.call("POST", "/pause_generation", json={"mode": "abort"})
            assert status == 200 and reply["success"]
            assert set(await gw.views()) == {tuple((u, True) for u, _ in everyone)}
            status, _ = await gw.call("POST", "/continue_generation", json={})
            assert status == 200
            assert set(await gw.views()) == {everyone}
