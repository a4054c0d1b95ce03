"""Hit rate against the engines' cache size: bench/routing.py's mixed trace, 4 engines, with
each engine's prefix cache at 1/32, 1/16, 1/8 and 1/4 of the trace's working set.

    python bench/routing_sweep.py           # seeds 22, 23; one run each (~2 min on 2 cores)

Per cache size and seed: the hit rate of the gateway's cache_aware, sglang-router's
cache_aware and round robin (sglang-router's), and the ceiling (one engine with an unbounded
cache serving the trace job by job, bench/routing_trace.py). Where round robin's hit rate is
more than half the ceiling, twice it is out of reach for any router; the table says, per
size, whether the gateway reached 2x round robin and what share of the ceiling it reached.
Results: bench/results/routing-sweep.md (and a .json beside it, not kept in git).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.routing import ENGINES, RESULTS, ROOT, main_async

RATIOS = ((1, 32), (1, 16), (1, 8), (1, 4))
ROUTERS = (
    ("gateway", "cache_aware"),
    ("sglang-router", "cache_aware"),
    ("sglang-router", "round_robin"),
)


def _args(ratio: float, seeds: list[int]) -> argparse.Namespace:
    return argparse.Namespace(
        smoke=False,
        seeds=seeds,
        repeats=1,
        cache_ratio=ratio,
        gateway_settings=[],
        tell_cache=None,
        clients=16,
        prefill_us=20.0,
        decode_ms=10,
        only=",".join(f"{r}:{p}" for r, p in ROUTERS),
    )


async def sweep(seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for num, den in RATIOS:
        result = await main_async(_args(num / den, seeds))
        per_seed = result["meta"]["per_seed"]
        for seed in seeds:
            row: dict[str, Any] = {
                "cache": f"{num}/{den}",
                "seed": seed,
                "ceiling": per_seed[seed]["ceiling"]["mix"],
                "engine_cache_tokens": per_seed[seed]["engine_cache_tokens"],
                "working_set_tokens": per_seed[seed]["working_set_tokens"],
            }
            for r in result["runs"]:
                if r["seed"] == seed and r["workload"] == "mix" and r["status"] == "ok":
                    row[f"{r['router']} {r['policy']}"] = r["hit_rate"]
            rows.append(row)
    return rows


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    gw, sg, rr = (f"{r} {p}" for r, p in ROUTERS)
    lines = [
        f"Cache-size sweep, mixed trace, {ENGINES} engines, seeds "
        f"{', '.join(str(s) for s in meta['seeds'])}, one run each; {meta['when']}, commit "
        f"{meta['commit']}, {meta['machine']}.",
        "",
        "| engine cache (of the working set) | seed | gateway cache_aware | sglang-router "
        "cache_aware | round robin | ceiling | gateway / round robin | 2x round robin | "
        "gateway / ceiling |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        g, s, r, c = row.get(gw), row.get(sg), row.get(rr), row["ceiling"]
        if g is None or r is None:
            lines.append(f"| {row['cache']} | {row['seed']} | run failed or skipped | | | | | | |")
            continue
        reach = "out of reach" if 2 * r > c else ("holds" if g >= 2 * r else "misses")
        lines.append(
            f"| {row['cache']} | {row['seed']} | {g:.3f} | "
            f"{'-' if s is None else f'{s:.3f}'} | {r:.3f} | {c:.3f} | {g / r:.2f}x | "
            f"{reach} | {g / c:.0%} |"
        )
    by_size: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault(row["cache"], []).append(row)
    lines.append("")
    for size, rs in by_size.items():
        ok = [x for x in rs if gw in x and rr in x]
        if ok:
            ratio = statistics.fmean(x[gw] / x[rr] for x in ok)
            lines.append(f"- {size}: gateway at {ratio:.2f}x round robin on average.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[22, 23])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = asyncio.run(sweep(args.seeds))
    meta = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}",
        "seeds": args.seeds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing-sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = table(rows, meta)
    (args.out / "routing-sweep.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
