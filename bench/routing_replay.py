"""The routing trace replayed in virtual time: the gateway's balancer and the stub's prefix
cache in one process, no sockets, ~0.3 s a run, so a decision rule can be judged over many
seeds before the real benchmark (bench/routing.py) checks it.

    python bench/routing_replay.py --seeds 16 --cache-ratio 0.0625 \\
        --set cache_threshold=0.3 --set balance_abs_threshold=12

Each engine is a `PrefixCache` whose prefill queues (one at a time, per uncached token) and
whose decode takes a fixed time in parallel, as the stub's; 16 clients replay the trace as
bench/routing.py does, a request counted in flight on its engine until it finishes. It
leaves out the network, the processes and the machine's noise: cache_aware's and round
robin's hit rates agree with the real benchmark's within about 0.01 (least_inflight's, which
hangs on timing, does not: 0.60 against 0.54), its latencies are only relative.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import routing_trace
from bench.routing import ENGINES, engine_cache_tokens
from gateway.contract.prompt import prompt_start
from gateway.contract.routes import Kind
from gateway.fleet.balancers import BalanceRule, LeastInflight, RoundRobin
from gateway.fleet.cache_aware import CacheAware, CacheAwareRules
from gateway.testing.stub.cache import PrefixCache


class Engine:
    __slots__ = ("busy_until", "cache", "inflight", "requests", "uncached", "url")

    def __init__(self, url: str, capacity: int) -> None:
        self.url = url
        self.inflight = 0
        self.cache = PrefixCache(capacity)
        self.busy_until = 0.0
        self.requests = 0
        self.uncached = 0


def replay(
    balancer: Any,
    jobs: list[routing_trace.Job],
    capacity: int,
    *,
    clients: int = 16,
    prefill_s: float = 20e-6,
    decode_s: float = 0.010,
) -> dict[str, Any]:
    engines = [Engine(f"http://engine-{i}", capacity) for i in range(ENGINES)]
    balancer.set_members([e.url for e in engines])
    if isinstance(balancer, CacheAware):
        for e in engines:  # as the stub's /server_info says (max_total_num_tokens)
            balancer.report(e.url, capacity)
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = itertools.count()
    queue = list(reversed(jobs))
    latencies: list[float] = []
    shapes: dict[str, list[int]] = {}

    def at(t: float, f: Callable[[float], None]) -> None:
        heapq.heappush(events, (t, next(order), f))

    def send(t: float, prompt: str, shape: str, done: Callable[[float], None]) -> None:
        body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": 8}}).encode()
        start = prompt_start(Kind.GENERATE, body)
        if isinstance(balancer, CacheAware) and start is not None:
            e = balancer.choose_prompt(engines, body, start)
        else:
            e = balancer.choose(engines, None)
        e.inflight += 1
        e.requests += 1
        tokens = prompt.split()
        hit = e.cache.admit(tokens)
        e.uncached += len(tokens) - hit
        tally = shapes.setdefault(shape, [0, 0])
        tally[0] += hit
        tally[1] += len(tokens)
        e.busy_until = max(t, e.busy_until) + (len(tokens) - hit) * prefill_s

        def finish(t2: float) -> None:
            e.inflight -= 1
            latencies.append(t2 - t)
            done(t2)

        at(e.busy_until + decode_s, finish)

    def client(t: float) -> None:
        if not queue:
            return
        job = queue.pop()
        shape = routing_trace.shape_of(job)
        steps = iter(job)

        def step(t: float) -> None:
            prompts = next(steps, None)
            if prompts is None:
                client(t)
                return
            left = [len(prompts)]

            def done(t2: float) -> None:
                left[0] -= 1
                if not left[0]:
                    step(t2)

            for p in prompts:
                send(t, p, shape, done)

        step(t)

    for _ in range(clients):
        at(0.0, client)
    while events:
        t, _, f = heapq.heappop(events)
        f(t)
    cached = sum(c for c, _ in shapes.values())
    prompt = sum(p for _, p in shapes.values())
    latencies.sort()
    reqs = [e.requests for e in engines]
    uncached = [e.uncached for e in engines]
    return {
        "hit_rate": cached / prompt,
        "imbalance_requests": max(reqs) / statistics.fmean(reqs),
        "imbalance_uncached": max(uncached) / statistics.fmean(uncached),
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        "engines_used": sum(1 for r in reqs if r),
        "hit_rate_by_shape": {k: c / p for k, (c, p) in shapes.items()},
    }


def cache_aware(settings: dict[str, float]) -> CacheAware:
    default, rules = BalanceRule(), CacheAwareRules()
    rule = BalanceRule(
        int(settings.get("balance_abs_threshold", default.abs_threshold)),
        settings.get("balance_rel_threshold", default.rel_threshold),
    )
    threshold = settings.get("cache_threshold", rules.cache_threshold)
    tokens, per_token = settings.get("engine_cache_tokens"), settings.get("bytes_per_token")
    return CacheAware(
        CacheAwareRules(
            balance=rule,
            cache_threshold=threshold,
            engine_cache_tokens=None if tokens is None else int(tokens),
            reported=bool(settings.get("reported", 1)),
            bytes_per_token=per_token,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16, help="seeds 22, 23, ... (16)")
    parser.add_argument("--cache-ratio", type=float, default=0.0625)  # as bench/routing.py
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="cache_threshold, balance_abs_threshold, balance_rel_threshold, "
        "engine_cache_tokens, bytes_per_token, or reported=0 (engines' sizes unheard)",
    )
    args = parser.parse_args()
    settings = {k: float(v) for k, _, v in (item.partition("=") for item in args.set)}
    routers: dict[str, Callable[[], Any]] = {
        "cache_aware": lambda: cache_aware(settings),
        "least_inflight": LeastInflight,
        "round_robin": RoundRobin,
    }
    for name, make in routers.items():
        for workload in ("mix", "shared"):
            runs = []
            for seed in range(22, 22 + args.seeds):
                mix = routing_trace.make("mix", seed)
                jobs = mix if workload == "mix" else routing_trace.make(workload, seed)
                runs.append(replay(make(), jobs, engine_cache_tokens(mix, args.cache_ratio)))
            hits = [r["hit_rate"] for r in runs]
            print(
                f"{workload:6} {name:14} hit rate {statistics.fmean(hits):.3f} "
                f"({min(hits):.3f}-{max(hits):.3f}) imbalance req "
                f"{statistics.fmean(r['imbalance_requests'] for r in runs):.2f} uncached "
                f"{statistics.fmean(r['imbalance_uncached'] for r in runs):.2f} "
                f"fewest engines {min(r['engines_used'] for r in runs)}"
            )


if __name__ == "__main__":
    main()
