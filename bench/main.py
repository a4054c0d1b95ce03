"""The benchmark orchestrator: `python3 bench/run.py [--smoke]` (see docs/bench.md).

For each upstream kind it starts the proxies under test in front of that upstream port,
checks each answers the workload with a 200, then drives load in interleaved rounds
(direct, nginx, sglang-router, gateway, rotated every round) and keeps the medians.
Ratios to a direct connection are the headline; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bodies, common, report, servers
from bench.procs import (
    Proc,
    gateway_build,
    gateway_supports_workers,
    http_get,
    http_post,
    nginx_version,
    pinned,
    router_version,
    wait_until,
    wrk_version,
)
from bench.workloads import BY_NAME, SCALING_WORKLOADS, WORKLOADS, Workload

TARGETS = ("direct", "nginx", "sglang-router", "gateway", "gateway-nolog", "gateway-rl")
# The variants, each one setting away from the default config, run only where they tell
# something: the access log's cost on small requests, the RL filter's setting on big bodies.
VARIANT_WORKLOADS = {
    "gateway-nolog": frozenset({"small", "small-c1"}),
    "gateway-rl": frozenset({"ids-100k", "ids-100k-mask"}),
}
LUA = common.BENCH / "wrk" / "post.lua"
INSTALL = common.BENCH / "install-anchors.sh"
RESULTS = common.BENCH / "results"
MEDIAN_KEYS = (
    *("rps", "mb_s", "p50_us", "p90_us", "p99_us"),
    *("cpu_us_per_req", "cpu_util", "rss", "other_load", "steal"),
)
ERROR_KEYS = ("err_connect", "err_read", "err_write", "err_status", "err_timeout")

Json = dict[str, Any]
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


@dataclass
class Run:
    args: argparse.Namespace
    tmp: Path
    files: bodies.Files
    proxy_cpus: str | None
    load_cpus: str | None
    have_wrk: bool
    have_nginx: bool
    have_router: bool
    gateway_workers: int
    duration: int
    rounds: int
    upstream: servers.Upstream | None = None
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(text)
        log(f"note: {text}")


# -- set-up ----------------------------------------------------------------------------------


def _cpu_layout(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """(proxy cpus, load cpus, note): the proxy alone on one core, everything else elsewhere."""
    if args.proxy_cpus or args.load_cpus:
        return args.proxy_cpus, args.load_cpus, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None, "only one CPU: nothing is pinned, proxy and load share it"
    return str(cpus[0]), ",".join(str(c) for c in cpus[1:]), None


def _detect(run_install: bool, without: set[str], notes: list[str]) -> tuple[bool, bool, bool]:
    def state() -> tuple[bool, bool, bool]:
        return (
            "wrk" not in without and shutil.which("wrk") is not None,
            "nginx" not in without and shutil.which("nginx") is not None,
            "sglang-router" not in without and router_version() is not None,
        )

    have = state()
    if not all(have) and run_install:
        log("== some anchors are missing: running bench/install-anchors.sh")
        try:
            proc = subprocess.run(["bash", str(INSTALL)], check=False, timeout=900)
            if proc.returncode != 0:
                notes.append(f"bench/install-anchors.sh exited {proc.returncode}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            notes.append(f"bench/install-anchors.sh failed: {exc}")
        have = state()
    wrk, nginx, router = have
    if not wrk:
        notes.append(
            "skipped: wrk not installed - throughput workloads use the Python fallback load "
            "generator (its numbers are not comparable; install wrk for real figures)"
        )
    if not nginx:
        notes.append(
            "skipped: nginx not installed - no nginx anchor, and the upstream is the Python "
            "fallback (too slow for meaningful ratios; install nginx for real figures)"
        )
    if not router:
        notes.append(
            "skipped: sglang-router not installed in bench/.venv-router - no sglang-router "
            "anchor (bench/install-anchors.sh installs it from PyPI)"
        )
    return wrk, nginx, router


# -- proxies ------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    port: int
    proc: Proc | None = None  # None: direct to the upstream
    status: str = "ok"

    def root_pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None and self.proc.alive() else []

    def pids(self) -> list[int]:
        return self.proc.pids() if self.proc is not None else []


def _start_targets(run: Run, kind: str, names: tuple[str, ...]) -> dict[str, Target]:
    assert run.upstream is not None
    up_port = run.upstream.ports[kind]
    out: dict[str, Target] = {}
    t0 = time.perf_counter()
    for name in names:
        if name == "direct":
            out[name] = Target(name, up_port)
        elif name == "nginx":
            if not run.have_nginx:
                out[name] = Target(name, 0, status="skipped: nginx not installed")
                continue
            buf = run.args.nginx_body_buffer
            proc = servers.nginx_proxy(run.tmp, kind, up_port, run.proxy_cpus, buf).start()
            out[name] = Target(name, proc.port, proc)
        elif name == "sglang-router":
            if not run.have_router:
                out[name] = Target(name, 0, status="skipped: sglang-router not installed")
                continue
            proc = servers.router_proxy(run.tmp, kind, up_port, run.proxy_cpus).start()
            out[name] = Target(name, proc.port, proc)
        elif name.startswith("gateway"):
            workers = run.gateway_workers
            scaling = name.startswith("gateway-x")  # gateway-xN: the scaling runs
            if scaling:
                workers = int(name.rsplit("x", 1)[1])
            cpus = run.args.scaling_cpus or run.proxy_cpus if scaling else run.proxy_cpus
            proc = servers.gateway_proxy(
                run.tmp,
                kind,
                up_port,
                cpus,
                workers=workers,
                label=name,
                skip_parse=run.args.gateway_skip_parse or name == "gateway-rl",
                access_log=name != "gateway-nolog",
            ).start()
            out[name] = Target(name, proc.port, proc)
    for t in out.values():
        if t.proc is not None:
            _wait_ready(t)
    log(f"== {kind}: proxies up in {time.perf_counter() - t0:.1f}s")
    return out


def _wait_ready(t: Target) -> None:
    proc = t.proc
    assert proc is not None
    admin = proc.extra.get("admin_port")
    if isinstance(admin, int):
        ok = wait_until(lambda: http_get(admin, "/readyz") == 200, 30)
    else:
        ok = common.wait_port(proc.port, 30)
    if not ok or not proc.alive():
        tail = proc.log_tail(5).replace("\n", " | ")
        t.status = f"failed: did not start ({tail[-300:]})"
        proc.stop()


def _stop_targets(targets: dict[str, Target]) -> None:
    procs = [t.proc for t in targets.values() if t.proc is not None]
    for p in procs:
        p.terminate()
    for p in procs:
        p.stop()


def _validate(run: Run, w: Workload, t: Target) -> Json:
    """One request through the target: it must answer 200.

    503 and refused connections are retried for a while: sglang-router answers 503 until
    it has registered its worker.
    """
    body = getattr(run.files, w.body).read_bytes()
    last: Json = {}
    deadline = time.monotonic() + 30
    failures = 0
    while time.monotonic() < deadline and failures < 3:
        try:
            status, size = http_post(t.port, w.path, body)
            last = {"status": status, "response_bytes": size}
            if status != 503:
                return last
        except OSError as exc:
            last = {"status": 0, "error": type(exc).__name__}
            failures += 1
        time.sleep(0.2)
    return last


# -- one measurement ------------------------------------------------------------------------


def _load_argv(run: Run, w: Workload, port: int, duration: int) -> tuple[list[str], dict[str, str]]:
    url = f"http://127.0.0.1:{port}{w.path}"
    body = str(getattr(run.files, w.body))
    env = dict(os.environ, BENCH_BODY=body, PYTHONPATH=str(common.ROOT))
    if run.have_wrk:
        argv = ["wrk", "-t1", f"-c{w.conns}", f"-d{duration}s", "--timeout", "10s"]
        argv += ["-s", str(LUA), url]
    else:
        argv = [sys.executable, "-m", "bench.drivers", "load", "--url", url, "--body", body]
        argv += ["--conns", str(w.conns), "--duration", str(duration)]
    return pinned(run.load_cpus, argv), env


def _parse_line(stdout: str) -> Json | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("BENCH_JSON "):
            parsed: Json = json.loads(line.removeprefix("BENCH_JSON "))
            return parsed
    return None


def _disturbed(res: Json) -> float:
    """Cores others took during the run: processes outside the benchmark (common.Interference:
    on the proxy's CPUs and the rest), and the hypervisor (steal time, summed over the VM's
    CPUs, as the rest is). On a shared VM steal is the larger: rounds with half a core stolen
    showed twice the proxy CPU per request of the quiet ones, for every proxy."""
    return float(res.get("other_load", 0.0)) + float(res.get("steal", 0.0))


def measure(run: Run, w: Workload, t: Target, duration: int) -> Json:
    """One load run, retried once (the quieter kept) if others took CPU during it."""
    res = _measure_once(run, w, t, duration)
    if run.args.retry_noisy and "error" not in res and _disturbed(res) > run.args.noisy:
        again = _measure_once(run, w, t, duration)
        if "error" not in again and _disturbed(again) < _disturbed(res):
            again["retried_noisy"] = _disturbed(res)
            res = again
    return res


def _quiet(run: Run) -> float:
    if run.args.quiet_wait <= 0:
        return 0.0
    waited, _ = common.wait_quiet([os.getpid()], run.args.quiet_wait, run.args.quiet)
    return waited


def _probe(run: Run, t: Target) -> common.Interference:
    cpus = set(_expand(run.proxy_cpus)) if run.proxy_cpus else set()
    return common.Interference([os.getpid()], t.root_pids(), cpus)


def _others(t: Target, probe: common.Interference) -> tuple[float, float]:
    """Others' CPU on the cores this target's path uses (direct: only the load side)."""
    on_proxy, on_rest, steal = probe.result()
    return (on_rest if t.proc is None else on_proxy + on_rest), steal


def _measure_once(run: Run, w: Workload, t: Target, duration: int, *, quiet: bool = True) -> Json:
    argv, env = _load_argv(run, w, t.port, duration)
    waited = _quiet(run) if quiet else 0.0
    pids = t.pids()
    probe = _probe(run, t)
    cpu0 = common.cpu_seconds(pids)
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=env,
        cwd=common.ROOT,
        timeout=duration + 90,
        check=False,
    )
    cpu = common.cpu_seconds(t.pids()) - cpu0
    other, steal = _others(t, probe)
    res = _parse_line(proc.stdout)
    if res is None:
        return {"error": (proc.stderr or proc.stdout).strip()[-300:] or f"rc {proc.returncode}"}
    res |= {"other_load": other, "steal": steal, "quiet_wait_s": waited}
    seconds = res["duration_us"] / 1e6 or 1.0
    n = res["requests"]
    res["rps"] = n / seconds
    res["mb_s"] = res["bytes"] / seconds / 1e6
    if pids:
        res["cpu_s"] = cpu
        res["cpu_util"] = cpu / seconds
        res["cpu_us_per_req"] = cpu / n * 1e6 if n else None
        res["rss"] = common.rss_bytes(t.pids())
    return res


def _summarise(runs: list[Json]) -> Json:
    good = [r for r in runs if "error" not in r]
    out: Json = {"rounds": len(good)}
    for key in MEDIAN_KEYS:
        vals = [r[key] for r in good if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    out["errors"] = sum(int(r.get(k, 0)) for r in good for k in ERROR_KEYS)
    out["max_other_load"] = max((r.get("other_load", 0) for r in good), default=None)
    out["max_steal"] = max((r.get("steal", 0) for r in good), default=None)
    out["requests"] = sum(int(r["requests"]) for r in good)
    return out


# -- workloads ----------------------------------------------------------------------------


def run_throughput(run: Run, w: Workload, targets: dict[str, Target]) -> Json:
    log(f"== {w.name}: {w.title}")
    body_bytes = getattr(run.files, w.body).stat().st_size
    entry: Json = {"title": w.title, "driver": "wrk" if run.have_wrk else "python-load"}
    entry |= {"conns": w.conns, "path": w.path, "body_bytes": body_bytes, "targets": {}}
    active: list[Target] = []
    for name, t in targets.items():
        if name in VARIANT_WORKLOADS and w.name not in VARIANT_WORKLOADS[name]:
            continue
        rec: Json = {"status": t.status}
        entry["targets"][name] = rec
        if t.status != "ok":
            continue
        check = _validate(run, w, t)
        rec["check"] = check
        if check.get("status") != 200:
            rec["status"] = f"failed: answered {check} instead of 200"
            log(f"   {name}: {rec['status']}")
            continue
        active.append(t)
    sizes = {t.name: entry["targets"][t.name]["check"].get("response_bytes") for t in active}
    if "direct" in sizes:
        for name, size in sizes.items():
            if size != sizes["direct"]:
                run.note(f"{w.name}: {name} answered {size} bytes, direct {sizes['direct']}")
    if not run.args.smoke:
        for t in active:  # warm-up: connection pools, allocator; not waited on, not kept
            _measure_once(run, w, t, 1, quiet=False)
    runs: dict[str, list[Json]] = {t.name: [] for t in active}
    for r in range(run.rounds):
        shift = r % max(1, len(active))
        for t in active[shift:] + active[:shift]:
            res = measure(run, w, t, run.duration)
            runs[t.name].append(res)
            shown = f"{res['rps']:,.0f} req/s" if "rps" in res else res.get("error")
            log(f"   round {r + 1} {t.name}: {shown}")
            time.sleep(0.2)
    for name, rs in runs.items():
        entry["targets"][name]["runs"] = rs
        entry["targets"][name]["median"] = _summarise(rs)
    return entry


def run_memory(run: Run, w: Workload, targets: dict[str, Target]) -> Json:
    log(f"== {w.name}: {w.title}")
    files = run.files
    if w.driver == "sse":
        title = f"{run.args.sse_streams:,} slow SSE streams ({files.sse_slow_lines} events each)"
    else:
        title = f"{run.args.big_mb} MB response to one slow reader"
    entry: Json = {"title": title, "driver": w.driver, "path": w.path, "targets": {}}
    for name, t in targets.items():
        if name in VARIANT_WORKLOADS:
            continue
        rec: Json = {"status": t.status}
        entry["targets"][name] = rec
        if name == "direct" and run.args.smoke:
            rec["status"] = "skipped: smoke run (direct has no proxy memory to measure)"
            continue
        if t.status != "ok":
            continue
        url = f"http://127.0.0.1:{t.port}{w.path}"
        body = str(getattr(files, w.body))
        pids = ",".join(str(p) for p in t.root_pids())
        argv = [sys.executable, "-m", "bench.drivers", w.driver, "--url", url, "--body", body]
        argv += ["--pids", pids]
        if w.driver == "sse":
            argv += ["--streams", str(run.args.sse_streams)]
            argv += ["--expect-events", str(files.sse_slow_lines)]
            argv += ["--settle", "0.3" if run.args.smoke else "1"]
            limit = run.args.sse_slow_s * 3 + 150
        else:
            rate = run.args.slow_rate_mb * (1 << 20)
            argv += ["--rate", str(rate), "--expect-bytes", str(files.resp_64m.stat().st_size)]
            limit = files.resp_64m.stat().st_size / rate * 3 + 90
        env = dict(os.environ, PYTHONPATH=str(common.ROOT))
        waited = _quiet(run)
        probe = _probe(run, t)
        cpu0 = common.cpu_seconds(t.pids())
        try:
            proc = subprocess.run(
                pinned(run.load_cpus, argv),
                check=False,
                capture_output=True,
                text=True,
                env=env,
                cwd=common.ROOT,
                timeout=limit,
            )
        except subprocess.TimeoutExpired:
            rec["status"] = f"failed: driver timed out after {limit:.0f}s"
            continue
        res = _parse_line(proc.stdout)
        if res is None:
            rec["status"] = "failed: " + (proc.stderr or proc.stdout).strip()[-300:]
            log(f"   {name}: {rec['status']}")
            continue
        other, steal = _others(t, probe)
        res |= {"other_load": other, "steal": steal, "quiet_wait_s": waited}
        if t.proc is not None:
            res["cpu_s"] = common.cpu_seconds(t.pids()) - cpu0
        else:  # direct: nothing in between to measure
            for key in [k for k in res if k.startswith("rss") or k.startswith("per_")]:
                res[key] = None
            res["peak_over_baseline"] = None
        rec["result"] = res
        log(f"   {name}: {report.memory_line(w.driver, res)}")
        time.sleep(0.1 if run.args.smoke else 0.5)
    return entry


def run_groups(run: Run, selected: list[Workload], results: Json) -> None:
    names = tuple(t for t in TARGETS if t in run.args.targets.split(","))
    for kind in servers.KINDS:
        group = [w for w in selected if w.kind == kind]
        if not group:
            continue
        wanted = {w.name for w in group}
        kind_names = tuple(
            n for n in names if n not in VARIANT_WORKLOADS or VARIANT_WORKLOADS[n] & wanted
        )
        targets = _start_targets(run, kind, kind_names)
        try:
            for w in group:
                try:
                    if w.driver == "wrk":
                        results["workloads"][w.name] = run_throughput(run, w, targets)
                    else:
                        results["workloads"][w.name] = run_memory(run, w, targets)
                except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
                    run.note(f"{w.name}: aborted: {type(exc).__name__}: {exc}")
        finally:
            _stop_targets(targets)


def run_floor(run: Run, results: Json) -> None:
    """The parse floor of the 100k-id bodies (bench/floor.py), on the proxy's CPU."""
    files = {"ids-100k": run.files.ids_100k, "ids-100k-mask": run.files.ids_100k_mask}
    names = [n for n in files if n in results["workloads"]]
    if not names:
        return
    argv = [sys.executable, "-m", "bench.floor", *(str(files[n]) for n in names)]
    try:
        done = subprocess.run(
            pinned(run.proxy_cpus, argv),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            cwd=common.BENCH.parent,
        )
        measured = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        run.note(f"parse floor: not measured: {type(exc).__name__}: {exc}")
        return
    results["parse_floor"] = {n: measured[files[n].name] for n in names}


def run_scaling(run: Run, results: Json) -> None:
    counts = [int(c) for c in run.args.scaling.split(",") if c]
    if len(counts) < 2:
        return
    if not gateway_supports_workers():
        results["scaling"] = {
            "skipped": "sglang-gateway does not accept --workers yet (checked its --help)"
        }
        run.note("skipped: gateway scaling " + "->".join(map(str, counts)) + ": no --workers flag")
        return
    cpus = run.args.scaling_cpus or run.proxy_cpus
    ncpu = len(_expand(cpus)) if cpus else os.cpu_count() or 1
    if ncpu < max(counts):
        run.note(
            f"scaling: the gateway's CPU set ({cpus}) has {ncpu} core(s), fewer than "
            f"{max(counts)} workers: this measures the cost of more workers on the same "
            "core, not scaling (pass --scaling-cpus with more cores on a bigger machine)"
        )
    names = tuple(f"gateway-x{c}" for c in counts)
    entry: Json = {"cpus": cpus, "workers": counts, "workloads": {}}
    targets = _start_targets(run, "canned", names)
    try:
        for wname in SCALING_WORKLOADS:
            w = BY_NAME[wname]
            entry["workloads"][wname] = run_throughput(run, w, targets)
    finally:
        _stop_targets(targets)
    results["scaling"] = entry


def _expand(cpus: str) -> list[int]:
    out: list[int] = []
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


# -- profile mode ----------------------------------------------------------------------------


def run_profile(run: Run, selected: list[Workload], results: Json) -> None:
    """py-spy on the gateway while wrk drives each workload; top frames as text."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        run.note("skipped: profile: py-spy not installed (.venv/bin/pip install py-spy)")
        return
    out_dir = Path(run.args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prof: Json = {}
    for kind in servers.KINDS:
        group = [w for w in selected if w.kind == kind and w.driver == "wrk"]
        if not group:
            continue
        targets = _start_targets(run, kind, ("gateway",))
        t = targets["gateway"]
        try:
            if t.status != "ok":
                run.note(f"profile: gateway {t.status}")
                continue
            for w in group:
                log(f"== profile {w.name}")
                _measure_once(run, w, t, 1, quiet=False)  # warm-up
                raw = out_dir / f"profile-{w.name}.txt"
                spy_argv = [spy, "record", "--pid", str(t.pids()[0]), "--duration"]
                spy_argv += [str(run.duration), "--rate", "250", "--format", "raw"]
                if not run.args.profile_lines:
                    spy_argv.append("--function")  # one row per function, not per line
                spy_argv += ["--nonblocking", "-o", str(raw)]
                if run.gateway_workers > 1:
                    spy_argv.append("--subprocesses")
                sampler = subprocess.Popen(
                    pinned(run.load_cpus, spy_argv),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                time.sleep(0.5)
                res = measure(run, w, t, run.duration)
                _, err = sampler.communicate(timeout=run.duration + 60)
                if not raw.exists():
                    run.note(f"profile {w.name}: py-spy failed: {err.strip()[-300:]}")
                    continue
                prof[w.name] = report.collapse(raw.read_text(), top=run.args.profile_top)
                prof[w.name]["rps"] = res.get("rps")
                prof[w.name]["raw"] = str(raw)
        finally:
            _stop_targets(targets)
    results["profile"] = prof


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run.py",
        description="Benchmark the gateway against a direct connection, nginx and "
        "sglang-router on loopback (see docs/bench.md).",
    )
    p.add_argument("--smoke", action="store_true", help="seconds-long run, a subset, CI")
    p.add_argument("--rounds", type=int, help="interleaved rounds (full 3, smoke 1)")
    p.add_argument("--duration", type=int, help="seconds per wrk run (full 5, smoke 1)")
    p.add_argument("--workloads", help="comma list (default: all; smoke: its subset)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma list of " + str(TARGETS))
    p.add_argument("--gateway-workers", type=int, default=1, help="run the gateway with N")
    p.add_argument("--scaling", help="gateway worker counts to compare (full: 1,2; smoke: off)")
    p.add_argument("--scaling-cpus", help="CPU list for the scaling runs (default: proxy cpus)")
    p.add_argument("--proxy-cpus", help="CPU list for the proxy under test (default: 0)")
    p.add_argument("--load-cpus", help="CPU list for wrk and the upstream (default: the rest)")
    p.add_argument("--sse-streams", type=int, help="concurrent slow SSE streams (full 1000)")
    p.add_argument("--sse-slow-s", type=float, help="seconds each slow stream lasts (full 12)")
    p.add_argument("--big-mb", type=int, help="size of the slow reader's response (full 64)")
    p.add_argument("--slow-rate-mb", type=float, help="slow reader speed, MiB/s (full 8)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        help="before each run, wait up to this many seconds for other processes on the "
        "machine to go quiet (full 5, smoke 0)",
    )
    p.add_argument(
        "--quiet", type=float, default=0.15, help="'quiet': others use < this many cores"
    )
    p.add_argument(
        "--noisy",
        type=float,
        default=0.25,
        help="flag runs where others (processes and steal) took more cores",
    )
    p.add_argument(
        "--retry-noisy",
        action=argparse.BooleanOptionalAction,
        help="re-run a flagged run once, keep the quieter (full: on, smoke: off)",
    )
    p.add_argument("--no-install", action="store_true", help="never run install-anchors.sh")
    p.add_argument(
        "--without",
        default="",
        help="act as if these were not installed: comma list of wrk, nginx, sglang-router "
        "(exercises the fallbacks)",
    )
    p.add_argument("--install", action="store_true", help="run install-anchors.sh in smoke")
    p.add_argument("--profile", action="store_true", help="py-spy the gateway instead")
    p.add_argument("--profile-top", type=int, default=25, help="rows per profile table")
    p.add_argument("--profile-lines", action="store_true", help="profile rows per source line")
    p.add_argument("--out", default=str(RESULTS), help="results directory")
    p.add_argument(
        "--gateway-skip-parse",
        action="store_true",
        help="run the gateway with policy.skip_parse_without_mask_key (the RL filter's setting)",
    )
    p.add_argument(
        "--nginx-body-buffer",
        default="2m",
        help="the nginx anchor's client_body_buffer_size (nginx's own default: 16k, which "
        "spools large bodies to temp files)",
    )
    p.add_argument("--keep-tmp", action="store_true", help="keep configs, bodies and logs")
    p.add_argument("--render", metavar="JSON", help="only re-render a results JSON as Markdown")
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = {
        "rounds": 1 if smoke else 3,
        "duration": 1 if smoke else 5,
        "scaling": "" if smoke or args.profile else "1,2",
        "sse_streams": 50 if smoke else 1000,
        "sse_slow_s": 2.0 if smoke else 12.0,
        "big_mb": 16 if smoke else 64,
        "slow_rate_mb": 32.0 if smoke else 8.0,
        "quiet_wait": 0.0 if smoke else 5.0,
        "retry_noisy": not smoke,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _select(args: argparse.Namespace) -> list[Workload]:
    if args.workloads:
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise SystemExit(f"unknown workloads: {unknown}; known: {list(BY_NAME)}")
        return [BY_NAME[n] for n in names]
    if args.profile:
        return [BY_NAME["small"], BY_NAME["ids-100k"], BY_NAME["ids-100k-mask"]]
    return [w for w in WORKLOADS if w.smoke or not args.smoke]


def _git_rev() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "-C", str(common.ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        )
        dirty = subprocess.run(
            ["git", "-C", str(common.ROOT), "status", "--porcelain", "--", "gateway"],
            capture_output=True,
            text=True,
            check=False,
        )
        return out.stdout.strip() + ("+dirty(gateway)" if dirty.stdout.strip() else "")
    return "unknown"


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def render(path: Path) -> int:
    """Re-render a results JSON as Markdown (next to it), e.g. after a report change."""
    md = report.markdown(json.loads(path.read_text()))
    path.with_suffix(".md").write_text(md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    # SIGTERM, and SIGINT even where a shell started us with it ignored, unwind through the
    # finally blocks that stop every process the run started.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    args = parse_args(argv)
    if args.render:
        return render(Path(args.render))
    selected = _select(args)
    started = time.time()
    nofile = common.raise_nofile()
    notes: list[str] = []
    without = {x.strip() for x in args.without.split(",") if x.strip()}
    have = _detect((not args.smoke and not args.no_install) or args.install, without, notes)
    proxy_cpus, load_cpus, cpu_note = _cpu_layout(args)
    if cpu_note:
        notes.append(cpu_note)
    workers = args.gateway_workers
    if workers > 1 and not gateway_supports_workers():
        notes.append(
            f"skipped: --gateway-workers {workers}: sglang-gateway has no --workers yet; "
            "the gateway runs with one worker"
        )
        workers = 1
    if args.sse_streams > nofile // 3:
        notes.append(f"open-files limit {nofile}: slow SSE streams capped at {nofile // 3}")
        args.sse_streams = nofile // 3
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    tmp.chmod(0o755)  # nginx workers run as an unprivileged user and serve files from here
    log(f"== bodies and responses in {tmp}")
    files = bodies.make_all(tmp / "files", big_response_bytes=args.big_mb << 20)
    run = Run(
        args=args,
        tmp=tmp,
        files=files,
        proxy_cpus=proxy_cpus,
        load_cpus=load_cpus,
        have_wrk=have[0],
        have_nginx=have[1],
        have_router=have[2],
        gateway_workers=workers,
        duration=args.duration,
        rounds=args.rounds,
        notes=notes,
    )
    for n in notes:
        log(f"note: {n}")
    results: Json = {
        "meta": {
            "started": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
            "mode": "profile" if args.profile else "smoke" if args.smoke else "full",
            "command": " ".join(["bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
            "host": {
                "cpus": os.cpu_count(),
                "cpu_model": _cpu_model(),
                "kernel": platform.release(),
                "python": platform.python_version(),
            },
            "versions": {
                "gateway_commit": _git_rev(),
                "gateway_build": gateway_build(),
                "nginx": nginx_version() if run.have_nginx else None,
                "wrk": wrk_version() if run.have_wrk else None,
                "sglang_router": router_version() if run.have_router else None,
                "aiohttp": _pkg_version("aiohttp"),
                "orjson": _pkg_version("orjson"),
                "uvloop": _pkg_version("uvloop"),
            },
            "pinning": {"proxy": proxy_cpus, "load_and_upstream": load_cpus},
            "rounds": run.rounds,
            "duration_s": run.duration,
            "gateway_workers": workers,
            "nginx_body_buffer": args.nginx_body_buffer,
            "gateway_skip_parse": args.gateway_skip_parse,
            "sse_streams": args.sse_streams,
            "sse_slow_s": args.sse_slow_s,
            "big_response_mb": args.big_mb,
            "slow_reader_mib_s": args.slow_rate_mb,
        },
        "notes": notes,
        "workloads": {},
    }
    status = 0
    try:
        run.upstream = servers.start_upstream(
            tmp, files, load_cpus, args.sse_slow_s, use_nginx=run.have_nginx
        )
        results["meta"]["upstream"] = run.upstream.impl
        if args.profile:
            run_profile(run, selected, results)
        else:
            run_groups(run, selected, results)
            run_floor(run, results)
            run_scaling(run, results)
    except KeyboardInterrupt as exc:
        run.note(f"interrupted ({exc}): only the workloads that finished are reported")
        results["meta"]["interrupted"] = True
        status = 130
    finally:
        if run.upstream is not None:
            run.upstream.proc.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    results["meta"]["elapsed_s"] = round(time.time() - started, 1)
    write_results(args, results)
    return status


def write_results(args: argparse.Namespace, results: Json) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    mode = results["meta"]["mode"]
    base = out / f"{stamp}-{mode}"
    noisy = _noisy_runs(results, args.noisy)
    if noisy:
        results["notes"].append(noisy)
    md = report.markdown(results)
    base.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    base.with_suffix(".md").write_text(md)
    print("\n" + md, flush=True)
    log(f"== results: {base}.json, {base}.md")
    complete = not results["meta"].get("interrupted")
    if mode == "full" and complete and out.resolve() == RESULTS.resolve() and not args.workloads:
        (out / "latest.md").write_text(md)
        log(f"== updated {out / 'latest.md'}")


def _noisy_runs(results: Json, bar: float) -> str | None:
    loads: list[float] = []
    sections = [results["workloads"], results.get("scaling", {}).get("workloads", {})]
    for section in sections:
        for entry in section.values():
            for t in entry["targets"].values():
                loads += [_disturbed(r) for r in t.get("runs", []) if "rps" in r]
                if "result" in t:
                    loads.append(_disturbed(t["result"]))
    flagged = [x for x in loads if x > bar]
    if not flagged:
        return None
    return (
        f"interference: in {len(flagged)} of {len(loads)} runs, processes outside the "
        f"benchmark or the hypervisor (steal) took more than {bar} cores (up to "
        f"{max(flagged):.2f}); those figures are less reliable (see the 'others' and 'steal' "
        "columns)"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _pkg_version(name: str) -> str | None:
    import importlib.metadata as md  # noqa: PLC0415

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
