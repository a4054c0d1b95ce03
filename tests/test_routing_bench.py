"""The routing benchmark's smoke run works end to end (no figure is asserted, only that
every run completes and writes its table); sglang-router's runs are skipped where it is
not installed."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import routing_replay, routing_trace

ROOT = Path(__file__).resolve().parent.parent


def test_the_trace_is_replayable_and_has_every_shape() -> None:
    assert routing_trace.make("mix", 5) == routing_trace.make("mix", 5)
    assert routing_trace.make("mix", 5) != routing_trace.make("mix", 6)
    jobs = routing_trace.make("mix", 5)
    sessions = [j for j in jobs if len(j) > 1]
    assert sessions and all(
        b[0].startswith(a[0]) for j in sessions for a, b in itertools.pairwise(j)
    )
    groups = [j for j in jobs if len(j[0]) > 1]
    assert groups and all(len(set(j[0])) == 1 for j in groups)


@pytest.mark.slow  # starts 4 stubs and the routers: run by scripts/check.sh --slow
def test_routing_bench_smoke_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "routing.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("routing-*-smoke.json")
    data = json.loads(result.read_text())
    runs = data["runs"]
    assert len(runs) == 6
    for run in runs:
        assert run["status"] == "ok" or run["status"].startswith("skipped"), run
        if run["status"] == "ok":
            assert run["errors"] == 0 and run["requests"] > 0
    # Each engine caches a set share of the trace's working set, and the tables summarise it.
    meta = data["meta"]["per_seed"]["22"]
    assert meta["engine_cache_tokens"] == max(
        2048, int(data["meta"]["cache_ratio"] * meta["working_set_tokens"])
    )
    assert {(r["workload"], r["router"], r["policy"]) for r in data["summary"]} >= {
        ("mix", "gateway", "cache_aware"),
        ("shared", "gateway", "cache_aware"),
    }
    assert "The routing bar" in next(tmp_path.glob("routing-*-smoke.md")).read_text() or not [
        r for r in runs if r["router"] == "sglang-router" and r["status"] == "ok"
    ]


def test_the_working_set_counts_a_shared_prefix_once() -> None:
    system = " ".join(f"s{i}" for i in range(64))
    jobs = [[[system + " a" * 16]], [[system + " b" * 16]]]
    assert routing_trace.working_set(jobs) == 64 + 16 + 16


def test_the_replay_runs_the_balancers_over_the_stub_cache() -> None:
    shape = routing_trace.Shape(sessions=6, turns=4, groups=6, shared_clients=40)
    jobs = routing_trace.make("mix", 22, shape)
    aware = routing_replay.replay(routing_replay.cache_aware({}), jobs, 4096)
    spread = routing_replay.replay(routing_replay.RoundRobin(), jobs, 4096)
    assert spread["imbalance_requests"] < 1.05
    assert aware["hit_rate"] > spread["hit_rate"] > 0
    assert set(aware["hit_rate_by_shape"]) == {"agents", "grpo", "shared"}
