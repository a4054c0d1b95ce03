"""Small process, port and /proc helpers shared by the orchestrator and the drivers."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    """A port the kernel considers free right now (bound and released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        time.sleep(0.05)
    return False


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after its closing one.
    return raw[raw.rindex(")") + 2 :].split()


def children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None:
            continue
        out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def tree(pids: Iterable[int]) -> list[int]:
    """The given processes and all their descendants that are alive now."""
    kids = children_map()
    seen: list[int] = []
    stack = list(pids)
    while stack:
        pid = stack.pop()
        if pid in seen or not Path(f"/proc/{pid}").exists():
            continue
        seen.append(pid)
        stack.extend(kids.get(pid, ()))
    return seen


def cpu_seconds(pids: Iterable[int]) -> float:
    """user + system CPU of the processes (all their threads), in seconds."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            # fields[0] is field 3 (state): utime is field 14, stime field 15.
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


def rss_bytes(pids: Iterable[int]) -> int:
    """Resident set size summed over the processes (shared pages counted once each)."""
    total = 0
    for pid in pids:
        try:
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        total += pages * PAGE
    return total


def hwm_bytes(pids: Iterable[int]) -> int:
    """Peak RSS (VmHWM) summed over the processes."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total


def raise_nofile(want: int = 65536) -> int:
    """Raise the soft open-files limit as far as the hard limit allows; children inherit it."""
    import resource  # noqa: PLC0415 - POSIX only, used by the orchestrator and drivers

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds over all CPUs since boot, steal seconds) from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


def children_cpu() -> float:
    """CPU seconds of this process's finished (waited-for) children."""
    import resource  # noqa: PLC0415

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class Interference:
    """CPU used on the machine by anything but the benchmark's own processes.

    The machine may be shared (other test suites, builds): a run during which others used
    a noticeable share of a core is flagged, and may be retried.
    """

    def __init__(self, ours: Iterable[int]) -> None:
        self.ours = list(ours)
        self.t0 = time.perf_counter()
        self.busy0, self.steal0 = machine_busy()
        self.own0 = cpu_seconds(tree(self.ours)) + children_cpu()

    def result(self, extra_own: float = 0.0) -> tuple[float, float]:
        """(other processes' CPU in cores, steal in cores) since construction."""
        wall = max(1e-6, time.perf_counter() - self.t0)
        busy, steal = machine_busy()
        own = cpu_seconds(tree(self.ours)) + children_cpu() - self.own0 + extra_own
        other = max(0.0, busy - self.busy0 - own)
        return other / wall, (steal - self.steal0) / wall


def wait_quiet(ours: Iterable[int], max_wait: float, threshold: float) -> tuple[float, float]:
    """Wait (at most `max_wait` s) until others use under `threshold` cores; (waited, load)."""
    ours = list(ours)
    t0 = time.perf_counter()
    while True:
        probe = Interference(ours)
        time.sleep(0.5)
        other, _ = probe.result()
        waited = time.perf_counter() - t0
        if other < threshold or waited >= max_wait:
            return waited, other
