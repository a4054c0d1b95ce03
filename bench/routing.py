"""Routing benchmark: the same trace through the gateway and sglang-router, in front of the
same 4 stub engines with a prefix cache.

    python bench/routing.py                 # the full run: 4 seeds x 2 (~2-3 min on 2 cores)
    python bench/routing.py --smoke         # a short one (tests/test_routing_bench.py)

Engines: `python -m gateway.testing.stub` with a prefix cache bounded as a real engine's KV
memory bounds its radix cache: each holds `--cache-ratio` (1/16) of the mixed trace's working
set, so the 4 engines hold a quarter of it, and the live sessions only if the router
partitions them (where a conversation goes decides whether it stays cached). At 1/8 and
more, round robin reaches over half the trace's ceiling, so no router can be at twice its
hit rate there (docs/bench.md, "Against the cache size"). Prefill takes time per uncached token,
so a lost cache, or a pile-up, shows in latency. Between runs every engine flushes its
cache; each seed gets fresh engines sized to its trace, the same for every router.
Routers: the gateway with `cache_aware` and `least_inflight`,
sglang-router 0.3+ with `cache_aware` and `round_robin` (skipped when bench/.venv-router or
$BENCH_ROUTER_PYTHON has none). Per run: hit rate (sum of cached_tokens over sum of prompt
tokens, from the engines' counters), load imbalance (max over mean per engine, of requests
and of uncached tokens), p50/p99 latency, and the router's CPU time per request.
Results: bench/results/routing-*.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, routing_trace
from bench.procs import ROUTER_VENV

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ENGINES = 4
_METRIC = re.compile(rb"^(sglang:[a-z_]+)\{[^}]*\} ([0-9.e+]+)$", re.M)


@dataclass
class Run:
    router: str
    policy: str
    workload: str
    requests: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    per_engine: list[dict[str, float]] = field(default_factory=list)
    # Per job shape (routing_trace.shape_of): [cached, prompt] tokens, from the responses.
    shapes: dict[str, list[int]] = field(default_factory=dict)
    decisions: dict[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    status: str = "ok"

    def summary(self) -> dict[str, Any]:
        if self.status != "ok":
            return {"router": self.router, "policy": self.policy, "status": self.status}
        reqs = [e["requests"] for e in self.per_engine]
        prompt = sum(e["prompt_tokens"] for e in self.per_engine)
        cached = sum(e["cached_tokens"] for e in self.per_engine)
        uncached = [e["prompt_tokens"] - e["cached_tokens"] for e in self.per_engine]
        lat = sorted(self.latencies)

        def imbalance(values: list[float]) -> float:
            mean = statistics.fmean(values)
            return max(values) / mean if mean else 0.0

        return {
            "router": self.router,
            "policy": self.policy,
            "workload": self.workload,
            "status": self.status,
            "requests": self.requests,
            "errors": self.errors,
            "hit_rate": cached / prompt if prompt else 0.0,
            "imbalance_requests": imbalance(reqs),
            "imbalance_uncached": imbalance(uncached),
            "requests_per_engine": reqs,
            "decisions": self.decisions,
            "hit_rate_by_shape": {k: c / p if p else 0.0 for k, (c, p) in self.shapes.items()},
            "p50_ms": 1000 * lat[len(lat) // 2] if lat else 0.0,
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
            "router_cpu_us_per_request": 1e6 * self.cpu_s / self.requests if self.requests else 0,
            "wall_s": self.wall_s,
        }


def router_python() -> Path | None:
    env = os.environ.get("BENCH_ROUTER_PYTHON")
    py = Path(env) if env else ROUTER_VENV / "bin" / "python"
    return py if py.exists() else None


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def engine_counters(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        found = {m[0].decode(): float(m[1]) for m in _METRIC.findall(await r.read())}
    return {
        "requests": found.get("sglang:num_requests_total", 0.0),
        "prompt_tokens": found.get("sglang:prompt_tokens_total", 0.0),
        "cached_tokens": found.get("sglang:cached_tokens_total", 0.0),
    }


_DECISION = re.compile(
    rb'^sglang_gateway_cache_aware_decisions_total\{[^}]*decision="([a-z_]+)"[^}]*\} ([0-9.e+]+)$',
    re.M,
)


async def gateway_decisions(session: aiohttp.ClientSession, admin: int) -> dict[str, float]:
    """cache_aware's decisions over the run (the gateway's own counters, summed over backends)."""
    async with session.get(f"http://127.0.0.1:{admin}/metrics") as r:
        raw = await r.read()
    out: dict[str, float] = {}
    for decision, value in _DECISION.findall(raw):
        out[decision.decode()] = out.get(decision.decode(), 0.0) + float(value)
    return out


async def replay(
    session: aiohttp.ClientSession, port: int, jobs: list[routing_trace.Job], clients: int, run: Run
) -> None:
    queue = list(reversed(jobs))
    url = f"http://127.0.0.1:{port}/generate"

    async def one(prompt: str, shape: str) -> None:
        body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": 8}})
        t = time.perf_counter()
        cached = 0
        try:
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as r:
                raw = await r.read()
                ok = r.status == 200
            if ok:
                cached = int(json.loads(raw)["meta_info"].get("cached_tokens", 0))
        except (aiohttp.ClientError, ValueError, KeyError, TypeError):
            ok = False
        tally = run.shapes.setdefault(shape, [0, 0])
        tally[0] += cached
        tally[1] += len(prompt.split())
        run.latencies.append(time.perf_counter() - t)
        run.requests += 1
        run.errors += not ok

    async def client() -> None:
        while queue:
            job = queue.pop()
            shape = routing_trace.shape_of(job)
            for step in job:
                await asyncio.gather(*(one(p, shape) for p in step))

    await asyncio.gather(*(client() for _ in range(clients)))


async def wait_ready(session: aiohttp.ClientSession, port: int, wait_s: float = 30) -> bool:
    """Ready once a generation goes through (sglang-router answers 503 until it has workers)."""
    deadline = time.monotonic() + wait_s
    body = json.dumps({"text": "warm up", "sampling_params": {"max_new_tokens": 1}})
    while time.monotonic() < deadline:
        try:
            async with session.post(
                f"http://127.0.0.1:{port}/generate",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as r:
                await r.read()
                if r.status == 200:
                    return True
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    return False


def gateway_argv(
    tmp: Path, engines: list[int], policy: str, port: int, *, admin: int, settings: list[str]
) -> list[str]:
    backends: dict[str, Any] = {
        "balancer": policy,
        "static": [f"http://127.0.0.1:{p}" for p in engines],
    }
    for item in settings:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        at = backends
        for part in parents:
            at = at.setdefault(part, {})
        at[leaf] = json.loads(value) if value[:1].isdigit() or value[:1] in "-[{" else value
    cfg = tmp / f"gateway-{policy}.yaml"
    # JSON is YAML.
    cfg.write_text(
        json.dumps(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "admin": {"host": "127.0.0.1", "port": admin},
                "backends": backends,
                "logging": {"access_log": False},
            }
        )
    )
    return [sys.executable, "-m", "gateway", "--config", str(cfg)]


def router_argv(py: Path, engines: list[int], policy: str, port: int) -> list[str]:
    return [
        str(py),
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *(f"http://127.0.0.1:{p}" for p in engines),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(common.free_port()),
        "--log-level",
        "warn",
    ]


async def one_run(
    tmp: Path,
    engines: list[int],
    *,
    router: str,
    policy: str,
    workload: str,
    jobs: list[routing_trace.Job],
    clients: int,
    settings: list[str],
) -> Run:
    run = Run(router, policy, workload)
    port = common.free_port()
    admin = common.free_port()
    if router == "gateway":
        argv = gateway_argv(tmp, engines, policy, port, admin=admin, settings=settings)
    else:
        py = router_python()
        if py is None:
            run.status = "skipped: sglang-router not installed (bench/.venv-router)"
            return run
        argv = router_argv(py, engines, policy, port)
    proc = start(argv, tmp / f"{router}-{policy}-{workload}.log")
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            if not await wait_ready(session, port):
                run.status = f"failed: {router} did not start"
                return run
            for p in engines:
                async with session.post(f"http://127.0.0.1:{p}/flush_cache") as r:
                    await r.read()
            before = [await engine_counters(session, p) for p in engines]
            cpu0 = common.cpu_seconds(common.tree([proc.pid]))
            t0 = time.perf_counter()
            await replay(session, port, jobs, clients, run)
            run.wall_s = time.perf_counter() - t0
            run.cpu_s = common.cpu_seconds(common.tree([proc.pid])) - cpu0
            after = [await engine_counters(session, p) for p in engines]
            if router == "gateway" and policy == "cache_aware":
                run.decisions = await gateway_decisions(session, admin)
            run.per_engine = [
                {k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)
            ]
    finally:
        stop(proc)
    return run


RUNS = (
    ("gateway", "cache_aware", "mix"),
    ("gateway", "least_inflight", "mix"),
    ("sglang-router", "cache_aware", "mix"),
    ("sglang-router", "round_robin", "mix"),
    ("gateway", "cache_aware", "shared"),
    ("sglang-router", "cache_aware", "shared"),
)
METRICS = (
    "hit_rate",
    "imbalance_requests",
    "imbalance_uncached",
    "p50_ms",
    "p99_ms",
    "router_cpu_us_per_request",
)


def engine_cache_tokens(mix: list[routing_trace.Job], ratio: float) -> int:
    """Each engine's cache: `ratio` of the mixed trace's working set (its distinct prompt
    tokens), so that the fleet can hold the trace only if the router partitions it."""
    return max(2048, int(ratio * routing_trace.working_set(mix)))


def start_engines(
    tmp: Path, args: argparse.Namespace, capacity: int
) -> tuple[list[int], list[subprocess.Popen[bytes]]]:
    ports = [common.free_port() for _ in range(ENGINES)]
    procs = [
        start(
            [
                sys.executable,
                "-m",
                "gateway.testing.stub",
                "--port",
                str(p),
                "--keep",
                "10",
                "--delay-ms",
                str(args.decode_ms),
                "--prefix-cache-tokens",
                str(capacity),
                "--prefill-us-per-token",
                str(args.prefill_us),
            ],
            tmp / f"stub-{p}.log",
        )
        for p in ports
    ]
    for p in ports:
        if not common.wait_port(p, 20):
            for proc in procs:
                stop(proc)
            raise SystemExit(f"stub on {p} did not start")
    return ports, procs


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    shape = routing_trace.Shape()
    if args.smoke:
        shape = routing_trace.Shape(sessions=6, turns=4, groups=6, shared_clients=40)
    plan = list(RUNS)
    if args.only:
        plan = [x for x in plan if f"{x[0]}:{x[1]}" in args.only.split(",")]
    runs: list[dict[str, Any]] = []
    per_seed: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmpdir:
        tmp = Path(tmpdir)
        for k, seed in enumerate(args.seeds):
            traces = {w: routing_trace.make(w, seed, shape) for w in ("mix", "shared")}
            capacity = engine_cache_tokens(traces["mix"], args.cache_ratio)
            per_seed[seed] = {
                "working_set_tokens": routing_trace.working_set(traces["mix"]),
                "ceiling": {w: routing_trace.ceiling(t) for w, t in traces.items()},
                "engine_cache_tokens": capacity,
                "requests": {w: routing_trace.requests_in(t) for w, t in traces.items()},
            }
            # Fresh engines per seed (their cache is sized to its trace); the routers take
            # turns first, so a drift in the machine's load is not always charged to one.
            engines, stubs = start_engines(tmp, args, capacity)
            settings = list(args.gateway_settings)
            if args.tell_cache:
                # The operator's figures: the engines' size, and a prompt token's bytes.
                settings += [
                    f"cache_aware.engine_cache_tokens={capacity}",
                    f"cache_aware.bytes_per_token={args.tell_cache}",
                ]
            try:
                for repeat in range(args.repeats):
                    turn = (k * args.repeats + repeat) % len(plan)
                    for router, policy, workload in plan[turn:] + plan[:turn]:
                        run = await one_run(
                            tmp,
                            engines,
                            router=router,
                            policy=policy,
                            workload=workload,
                            jobs=traces[workload],
                            clients=args.clients,
                            settings=settings,
                        )
                        runs.append({"seed": seed, "repeat": repeat, **run.summary()})
                        print(json.dumps(runs[-1]), flush=True)
            finally:
                for proc in stubs:
                    stop(proc)
    return {
        "meta": {
            "mode": "smoke" if args.smoke else "full",
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "seeds": args.seeds,
            "repeats": args.repeats,
            "engines": ENGINES,
            "clients": args.clients,
            "cache_ratio": args.cache_ratio,
            "per_seed": per_seed,
            "prefill_us_per_token": args.prefill_us,
            "decode_ms": args.decode_ms,
            "gateway_settings": args.gateway_settings,
            "tell_cache_bytes_per_token": args.tell_cache,
            "cpus": os.cpu_count(),
        },
        "runs": runs,
        "summary": summarise(runs),
        "checks": checks(runs),
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trace, router and policy: each metric's mean, min and max over the seeds."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r["status"] == "ok":
            groups.setdefault((r["workload"], r["router"], r["policy"]), []).append(r)
    out = []
    for (workload, router, policy), rs in groups.items():
        row: dict[str, Any] = {
            "workload": workload,
            "router": router,
            "policy": policy,
            "runs": len(rs),
            "errors": sum(r["errors"] for r in rs),
            "engines_used_min": min(sum(1 for x in r["requests_per_engine"] if x) for r in rs),
        }
        shapes = sorted({k for r in rs for k in r.get("hit_rate_by_shape", {})})
        row["hit_rate_by_shape"] = {
            k: statistics.fmean(r["hit_rate_by_shape"].get(k, 0.0) for r in rs) for k in shapes
        }
        for m in METRICS:
            values = [r[m] for r in rs]
            row[m] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
        out.append(row)
    return out


def checks(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The routing bar, asked of every run (seed and repeat; not of the means): how many pass."""

    def by(run: tuple[int, int], workload: str, router: str, policy: str) -> dict[str, Any] | None:
        for r in runs:
            if ((r["seed"], r["repeat"]), r.get("workload"), r["router"], r["policy"]) == (
                run,
                workload,
                router,
                policy,
            ) and r["status"] == "ok":
                return r
        return None

    out: dict[str, list[bool]] = {
        "hit_rate >= sglang-router cache_aware": [],
        "hit_rate >= 2x round robin": [],
        "imbalance (requests) <= sglang-router cache_aware": [],
        "imbalance (uncached) <= sglang-router cache_aware": [],
        "shared trace on >= 2 engines": [],
    }
    for seed in sorted({(r["seed"], r["repeat"]) for r in runs}):
        gw = by(seed, "mix", "gateway", "cache_aware")
        sg = by(seed, "mix", "sglang-router", "cache_aware")
        rr = by(seed, "mix", "sglang-router", "round_robin")
        shared = by(seed, "shared", "gateway", "cache_aware")
        if gw and sg:
            out["hit_rate >= sglang-router cache_aware"].append(gw["hit_rate"] >= sg["hit_rate"])
            out["imbalance (requests) <= sglang-router cache_aware"].append(
                gw["imbalance_requests"] <= sg["imbalance_requests"]
            )
            out["imbalance (uncached) <= sglang-router cache_aware"].append(
                gw["imbalance_uncached"] <= sg["imbalance_uncached"]
            )
        if gw and rr:
            out["hit_rate >= 2x round robin"].append(gw["hit_rate"] >= 2 * rr["hit_rate"])
        if shared:
            out["shared trace on >= 2 engines"].append(
                sum(1 for x in shared["requests_per_engine"] if x) >= 2
            )
    return {k: {"passed": sum(v), "of": len(v)} for k, v in out.items() if v}


def _spread(cell: dict[str, float], fmt: str) -> str:
    mean, lo, hi = (format(cell[k], fmt) for k in ("mean", "min", "max"))
    return mean if lo == hi else f"{mean} ({lo}-{hi})"


def table(result: dict[str, Any]) -> str:
    m = result["meta"]
    seeds = m["seeds"]
    first = m["per_seed"][seeds[0]] if seeds[0] in m["per_seed"] else m["per_seed"][str(seeds[0])]
    sets = [v["working_set_tokens"] for v in m["per_seed"].values()]
    caches = [v["engine_cache_tokens"] for v in m["per_seed"].values()]
    lines = [
        f"# Routing benchmark ({m['mode']}, {m['when']})",
        "",
        f"Trace seeds {', '.join(map(str, seeds))}: mix = {first['requests']['mix']} requests "
        f"(agent sessions, GRPO groups of 8, shared system prompt), shared = "
        f"{first['requests']['shared']}; {m['clients']} clients; {m['engines']} stub engines. "
        f"The mixed trace's working set is {min(sets)}-{max(sets)} distinct prompt tokens; "
        f"each engine caches {m['cache_ratio']:g} of it ({min(caches)}-{max(caches)} tokens), "
        f"prefill {m['prefill_us_per_token']} us per uncached token (queued per engine), "
        f"decode {m['decode_ms']} ms; {m['cpus']} CPUs."
        + (f" Gateway settings: {m['gateway_settings']}." if m["gateway_settings"] else "")
        + (
            " The gateway is told the engines' cache size, at "
            f"{m['tell_cache_bytes_per_token']} request bytes per token."
            if m.get("tell_cache_bytes_per_token")
            else " The gateway reads each engine's cache size from its /server_info "
            "(max_total_num_tokens) and learns the bytes a token takes (the defaults)."
        ),
        "",
        f"Mean over {len(seeds)} seed(s) x {m['repeats']} run(s), (min-max):",
        "",
        "| trace | router | policy | hit rate | imbalance req | imbalance uncached "
        "| p50 ms | p99 ms | router CPU us/req | fewest engines used |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {r['workload']} | {r['router']} | {r['policy']} "
        f"| {_spread(r['hit_rate'], '.3f')} "
        f"| {_spread(r['imbalance_requests'], '.2f')} "
        f"| {_spread(r['imbalance_uncached'], '.2f')} "
        f"| {_spread(r['p50_ms'], '.1f')} | {_spread(r['p99_ms'], '.1f')} "
        f"| {_spread(r['router_cpu_us_per_request'], '.0f')} | {r['engines_used_min']} |"
        for r in result["summary"]
    )
    mixed = [r for r in result["summary"] if r["workload"] == "mix"]
    if mixed:
        lines += [
            "",
            "Mixed trace, hit rate per job shape (mean over the seeds, from the responses' "
            "`meta_info.cached_tokens`):",
            "",
            "| router | policy | agents | grpo | shared |",
            "|---|---|---:|---:|---:|",
        ]
        lines.extend(
            f"| {r['router']} | {r['policy']} | "
            + " | ".join(
                f"{r['hit_rate_by_shape'].get(k, 0.0):.3f}" for k in ("agents", "grpo", "shared")
            )
            + " |"
            for r in mixed
        )
    skipped = {(r["router"], r["policy"], r["status"]) for r in result["runs"]}
    for router, policy, status in sorted(skipped):
        if status != "ok":
            lines.append(f"| | {router} | {policy} | {status} |||||||")
    ceilings = {
        w: statistics.fmean(v["ceiling"][w] for v in m["per_seed"].values())
        for w in ("mix", "shared")
    }
    lines += [
        "",
        f"Ceiling (one engine, unbounded cache, the trace served job by job): mix "
        f"{ceilings['mix']:.3f}, shared {ceilings['shared']:.3f}.",
    ]
    if result["checks"]:
        lines += [
            "",
            "The routing bar, per run (seed and repeat; gateway cache_aware, same run):",
            "",
        ]
        lines += [f"- {k}: {v['passed']} of {v['of']}" for k, v in result["checks"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="comma list of trace seeds (default 22-25; --smoke: 22)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of each seed (default 2; --smoke: 1)"
    )
    parser.add_argument(
        "--cache-ratio",
        type=float,
        default=0.0625,
        help="each engine's prefix cache as a fraction of the mixed trace's working set",
    )
    parser.add_argument(
        "--set",
        dest="gateway_settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a gateway backends setting for its runs, e.g. balance_abs_threshold=16 or "
        "cache_aware.cache_threshold=0.5",
    )
    parser.add_argument(
        "--tell-cache",
        type=float,
        default=None,
        metavar="BYTES_PER_TOKEN",
        help="give the gateway the engines' cache size (cache_aware.engine_cache_tokens) "
        "and this many request bytes per prompt token (cache_aware.bytes_per_token) instead "
        "of what it reads and learns",
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prefill-us", type=float, default=20.0)
    parser.add_argument("--decode-ms", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", help="comma list of router:policy runs, e.g. gateway:cache_aware")
    args = parser.parse_args()
    if args.seeds is None:
        args.seeds = [22] if args.smoke else [22, 23, 24, 25]
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 2
    result = asyncio.run(main_async(args))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = result["meta"]["when"].replace(":", "").replace("+0000", "")
    base = args.out / f"routing-{stamp}-{result['meta']['mode']}"
    base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    base.with_suffix(".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
