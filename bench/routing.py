"""Routing benchmark: the same trace through the gateway and sglang-router, in front of the
same 4 stub engines with a prefix cache (issue 22).

    python bench/routing.py                 # the full run (~1-2 min on 2 cores)
    python bench/routing.py --smoke         # a short one (tests/test_bench_smoke.py)

Engines: `python -m gateway.testing.stub` with a prefix cache that holds a quarter of the
trace's working set each (so where a conversation goes matters) and prefill time per
uncached token (so a lost cache, or a pile-up, shows in latency). Between runs every engine
flushes its cache. Routers: the gateway with `cache_aware` and `least_inflight`,
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


async def replay(
    session: aiohttp.ClientSession, port: int, jobs: list[routing_trace.Job], clients: int, run: Run
) -> None:
    queue = list(reversed(jobs))
    url = f"http://127.0.0.1:{port}/generate"

    async def one(prompt: str) -> None:
        body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": 8}})
        t = time.perf_counter()
        try:
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                ok = r.status == 200
        except aiohttp.ClientError:
            ok = False
        run.latencies.append(time.perf_counter() - t)
        run.requests += 1
        run.errors += not ok

    async def client() -> None:
        while queue:
            for step in queue.pop():
                await asyncio.gather(*(one(p) for p in step))

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


def gateway_argv(tmp: Path, engines: list[int], policy: str, port: int) -> list[str]:
    cfg = tmp / f"gateway-{policy}.yaml"
    static = "".join(f"    - http://127.0.0.1:{p}\n" for p in engines)
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"admin: {{host: 127.0.0.1, port: {common.free_port()}}}\n"
        f"backends:\n  balancer: {policy}\n  static:\n{static}"
        "logging: {access_log: false}\n"
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
) -> Run:
    run = Run(router, policy, workload)
    port = common.free_port()
    if router == "gateway":
        argv = gateway_argv(tmp, engines, policy, port)
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
            run.per_engine = [
                {k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)
            ]
    finally:
        stop(proc)
    return run


RUNS = (
    ("gateway", "cache_aware"),
    ("gateway", "least_inflight"),
    ("sglang-router", "cache_aware"),
    ("sglang-router", "round_robin"),
)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    shape = routing_trace.Shape()
    if args.smoke:
        shape = routing_trace.Shape(sessions=6, turns=4, groups=6, shared_clients=40)
    traces = {w: routing_trace.make(w, args.seed, shape) for w in ("mix", "shared")}
    working_set = sum(len(job[-1][0].split()) for job in traces["mix"] if len(job) > 1)
    capacity = max(2048, working_set // ENGINES)
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmpdir:
        tmp = Path(tmpdir)
        engine_ports = [common.free_port() for _ in range(ENGINES)]
        stubs = [
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
            for p in engine_ports
        ]
        try:
            for p in engine_ports:
                if not common.wait_port(p, 20):
                    raise SystemExit(f"stub on {p} did not start")
            runs = []
            plan = [(r, p, "mix") for r, p in RUNS] + [
                (r, "cache_aware", "shared") for r in ("gateway", "sglang-router")
            ]
            if args.only:
                plan = [x for x in plan if f"{x[0]}:{x[1]}" in args.only.split(",")]
            for router, policy, workload in plan:
                run = await one_run(
                    tmp,
                    engine_ports,
                    router=router,
                    policy=policy,
                    workload=workload,
                    jobs=traces[workload],
                    clients=args.clients,
                )
                runs.append(run.summary())
                print(json.dumps(runs[-1]), flush=True)
        finally:
            for s in stubs:
                stop(s)
    return {
        "meta": {
            "mode": "smoke" if args.smoke else "full",
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "seed": args.seed,
            "engines": ENGINES,
            "clients": args.clients,
            "engine_cache_tokens": capacity,
            "prefill_us_per_token": args.prefill_us,
            "decode_ms": args.decode_ms,
            "requests": {w: routing_trace.requests_in(t) for w, t in traces.items()},
            "cpus": os.cpu_count(),
        },
        "runs": runs,
    }


def table(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"# Routing benchmark ({m['mode']}, {m['when']})",
        "",
        f"Trace seed {m['seed']}: mix = {m['requests']['mix']} requests (agent sessions, "
        f"GRPO groups of 8, shared system prompt), shared = {m['requests']['shared']}; "
        f"{m['clients']} clients; {m['engines']} stub engines, each caching "
        f"{m['engine_cache_tokens']} tokens, prefill {m['prefill_us_per_token']} us per "
        f"uncached token (queued per engine), decode {m['decode_ms']} ms; {m['cpus']} CPUs.",
        "",
        "| trace | router | policy | hit rate | imbalance req | imbalance uncached "
        "| p50 ms | p99 ms | router CPU us/req | requests per engine |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["runs"]:
        if r["status"] != "ok":
            lines.append(f"| | {r['router']} | {r['policy']} | {r['status']} |||||||")
            continue
        lines.append(
            f"| {r['workload']} | {r['router']} | {r['policy']} | {r['hit_rate']:.3f} "
            f"| {r['imbalance_requests']:.2f} | {r['imbalance_uncached']:.2f} "
            f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['router_cpu_us_per_request']:.0f} "
            f"| {' / '.join(str(int(x)) for x in r['requests_per_engine'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prefill-us", type=float, default=20.0)
    parser.add_argument("--decode-ms", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", help="comma list of router:policy runs, e.g. gateway:cache_aware")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = result["meta"]["when"].replace(":", "").replace("+0000", "")
    base = args.out / f"routing-{stamp}-{result['meta']['mode']}"
    base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    base.with_suffix(".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
