"""The processes a run starts: the upstream, the proxies under test, and how to stop them.

Every process is started in its own session (process group) and pinned with `taskset`;
stopping sends SIGTERM to that group, then SIGKILL after a grace period. Nothing else on
the machine is ever signalled.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import common

ROUTER_VENV = common.BENCH / ".venv-router"


def pinned(cpus: str | None, argv: list[str]) -> list[str]:
    if cpus and shutil.which("taskset"):
        return ["taskset", "-c", cpus, *argv]
    return argv


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    port: int = 0
    popen: subprocess.Popen[bytes] | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def start(self, env: dict[str, str] | None = None) -> Proc:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def pids(self) -> list[int]:
        """This process and its descendants (nginx workers, gateway workers, ...)."""
        return common.tree([self.pid]) if self.alive() else []

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def terminate(self) -> None:
        """SIGTERM the process group without waiting (stop() then waits)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)

    def stop(self, grace: float = 5.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        pgid = self.popen.pid  # start_new_session: the group id is our child's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.popen.wait(5)
        # Workers that outlived their parent are still in the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def http_get(port: int, path: str, timeout: float = 2.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def http_post(port: int, path: str, body: bytes, timeout: float = 30.0) -> tuple[int, int]:
    """One POST; returns (status, response body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, len(resp.read())
    finally:
        conn.close()


# -- versions ----------------------------------------------------------------------------


def nginx_version() -> str | None:
    exe = shutil.which("nginx")
    if exe is None:
        return None
    out = subprocess.run([exe, "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().split("/")[-1] or "unknown"


def wrk_version() -> str | None:
    exe = shutil.which("wrk")
    if exe is None:
        return None
    out = subprocess.run([exe, "-v"], capture_output=True, text=True, check=False)
    first = (out.stdout or out.stderr).strip().splitlines()
    return first[0].split(" [")[0].removeprefix("wrk ") if first else "unknown"


def router_python() -> Path | None:
    py = ROUTER_VENV / "bin" / "python"
    return py if py.exists() else None


def router_version() -> str | None:
    py = router_python()
    if py is None:
        return None
    code = "import importlib.metadata as m, sglang_router; print(m.version('sglang-router'))"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def gateway_argv() -> list[str]:
    """How to start the gateway: $BENCH_GATEWAY_CMD (e.g. another checkout's), else this one."""
    if os.environ.get("BENCH_GATEWAY_CMD"):
        return shlex.split(os.environ["BENCH_GATEWAY_CMD"])
    exe = Path(sys.executable).parent / "sglang-gateway"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gateway"]


def gateway_build() -> str:
    """ "compiled" or "pure", as the gateway's own --version says; "unknown" if it says neither."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [*gateway_argv(), "--version"], capture_output=True, text=True, check=False, timeout=30
        )
        for build in ("compiled", "pure"):
            if f"{build} build" in out.stdout:
                return build
    return "unknown"


def gateway_supports_workers() -> bool:
    out = subprocess.run(
        [*gateway_argv(), "--help"], capture_output=True, text=True, check=False, timeout=30
    )
    return "--workers" in out.stdout


def wait_until(check: object, timeout: float, interval: float = 0.1) -> bool:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, http.client.HTTPException):
            if check():
                return True
        time.sleep(interval)
    return False
