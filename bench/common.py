"""Small process, port and /proc helpers shared by the orchestrator and the drivers."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import timeit
from collections.abc import Callable, Iterable
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


def cpu_busy() -> dict[int, tuple[float, float]]:
    """Per CPU: (busy seconds since boot, steal seconds), from /proc/stat."""
    out: dict[int, tuple[float, float]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if not line.startswith("cpu") or line[3] == " ":
            continue
        name, *rest = line.split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            [int(x) for x in rest] + [0] * 8
        )[:8]
        out[int(name[3:])] = ((user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK)
    return out


def children_cpu() -> float:
    """CPU seconds of this process's finished (waited-for) children."""
    import resource  # noqa: PLC0415

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class Interference:
    """CPU used by anything but the benchmark's own processes, on each side of the pinning.

    The machine may be shared (other test suites, builds). `ours` is the benchmark's whole
    process tree (the orchestrator: upstream, proxies, wrk), `proxy` the proxy under test,
    pinned to `proxy_cpus`; everything else of ours runs on the other CPUs. Results, in cores:
    others on the proxy CPUs, others on the remaining CPUs, steal (VM) over all CPUs.
    """

    def __init__(self, ours: list[int], proxy: list[int], proxy_cpus: set[int]) -> None:
        self.ours, self.proxy, self.proxy_cpus = ours, proxy, proxy_cpus
        self.t0 = time.perf_counter()
        self.busy0 = cpu_busy()
        self.own0 = cpu_seconds(tree(ours)) + children_cpu()
        self.proxy0 = cpu_seconds(tree(proxy))

    def result(self) -> tuple[float, float, float]:
        wall = max(1e-6, time.perf_counter() - self.t0)
        busy = cpu_busy()
        own = cpu_seconds(tree(self.ours)) + children_cpu() - self.own0
        proxy = cpu_seconds(tree(self.proxy)) - self.proxy0 if self.proxy else 0.0
        side = {True: 0.0, False: 0.0}  # True: the proxy CPUs
        steal = 0.0
        for cpu, (b, s) in busy.items():
            b0, s0 = self.busy0.get(cpu, (b, s))
            side[cpu in self.proxy_cpus] += b - b0
            steal += s - s0
        if not self.proxy_cpus:  # nothing pinned: one pool
            return 0.0, max(0.0, side[False] - own) / wall, steal / wall
        on_proxy = max(0.0, side[True] - proxy)
        on_rest = max(0.0, side[False] - (own - proxy))
        return on_proxy / wall, on_rest / wall, steal / wall


def wait_quiet(ours: list[int], max_wait: float, threshold: float) -> tuple[float, float]:
    """Wait (at most `max_wait` s) until others use under `threshold` cores; (waited, load)."""
    t0 = time.perf_counter()
    while True:
        probe = Interference(ours, [], set())
        time.sleep(0.5)
        _, other, _ = probe.result()
        waited = time.perf_counter() - t0
        if other < threshold or waited >= max_wait:
            return waited, other


def best_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Microseconds per call of `fn`: the best of `repeat` runs of `number` calls (best, not
    mean: the machine may be shared, and the least a call costs is what is asked)."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6
