"""The fleet's answers to an engine's read routes, shaped like one engine's answer.

A client written against one SGLang engine reads the fleet through the gateway unchanged:

- `GET /v1/loads`, `/get_loads` go to every engine (gateway/edge/fleet_control.py); the
  reply is SGLang's `/v1/loads` answer for the whole fleet: `loads` holds every engine's
  entries (one per DP rank, as each engine sent them) each tagged with `worker_id` and
  `worker_url`, `dp_rank_count` counts them, `aggregate` sums them as SGLang does, and
  `results` lists each engine's status and the rest of its answer (its `loads` moved up).
  So slime's `num_requests_from_load` (the sum of `num_running_reqs` + `num_waiting_reqs`
  over `loads`) and a reader of `aggregate.total_reqs` count the fleet. An engine that
  failed, or answered without a `loads` list, makes it a 502 that names it (`detail`, and
  its entry in `results`): a fleet read short of an engine must never pass for idle.
- `GET /get_weight_version` is answered from what the gateway knows of each engine's
  weights (each engine's own report, read on every health probe, and every update through
  the gateway), with no call to the engines: SGLang's `{"weight_version"}`, the version
  every available engine serves, or null while they disagree (mid-update) or none is known,
  so a framework polling it after an update waits for the whole fleet rather than taking
  the first engine's word; `latest` (what routing.weight_version: latest routes to) and
  each worker's version beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

import orjson

from gateway.edge.control import BackendResult
from gateway.fleet.pool import BackendPool, worker_id

LOADS_PATHS: Final = frozenset({"/v1/loads", "/get_loads"})

# The per-rank counts SGLang's aggregate sums, and the averages it takes (field, digits).
_TOTALS: Final = (
    ("total_running_reqs", "num_running_reqs"),
    ("total_waiting_reqs", "num_waiting_reqs"),
    ("total_used_tokens", "num_used_tokens"),
    ("total_tokens", "num_total_tokens"),
)
_AVERAGES: Final = (
    ("avg_token_usage", "token_usage", 4),
    ("avg_throughput", "gen_throughput", 2),
    ("avg_utilization", "utilization", 4),
)


def _number(entry: dict[str, Any], key: str) -> int | float:
    value = entry.get(key)
    # bool is an int to Python, never a count to SGLang.
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


def aggregate(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's `aggregate` over `entries` (its _compute_aggregate), a field an entry lacks
    (an older release, `include=` leaving it out) counted as 0."""
    n = len(entries)
    out: dict[str, Any] = {total: sum(_number(e, key) for e in entries) for total, key in _TOTALS}
    out["total_reqs"] = out["total_running_reqs"] + out["total_waiting_reqs"]
    for avg, key, digits in _AVERAGES:
        out[avg] = round(sum(_number(e, key) for e in entries) / n, digits) if n else 0.0
    return out


def merged_loads(results: Sequence[BackendResult]) -> tuple[bool, bytes]:
    """(every engine answered with its loads, the fleet's /v1/loads answer)."""
    entries: list[dict[str, Any]] = []
    per_engine: list[dict[str, Any]] = []
    failed: list[str] = []
    for r in results:
        body = r.body
        loads = body.get("loads") if isinstance(body, dict) else None
        answer = r.as_json()
        if (
            r.ok
            and isinstance(body, dict)
            and isinstance(loads, list)
            and all(isinstance(e, dict) for e in loads)
        ):
            wid = worker_id(r.url)
            entries.extend({**e, "worker_id": wid, "worker_url": r.url} for e in loads)
            answer["body"] = {k: v for k, v in body.items() if k != "loads"}
            per_engine.append(answer)
            continue
        failed.append(f"{worker_id(r.url)} ({r.url}): {_why(r)}")
        per_engine.append(answer)
    reply: dict[str, Any] = {
        "success": not failed,
        "timestamp": datetime.now(UTC).isoformat(),
        "dp_rank_count": len(entries),
        "loads": entries,
        "aggregate": aggregate(entries),
        "results": per_engine,
    }
    if failed:
        reply["detail"] = "The fleet's load is incomplete: no loads from " + "; ".join(failed) + "."
    return not failed, orjson.dumps(reply)


def _why(r: BackendResult) -> str:
    if r.status == 0:
        return str(r.body)  # the gateway's own words: could not connect, no answer in time
    if not r.ok:
        return f"status {r.status}"
    return "answered without a loads list"


def weight_version(pool: BackendPool) -> bytes:
    """The fleet's /get_weight_version answer, from the gateway's view of each engine."""
    now = pool.now()
    workers = [
        {"id": b.id, "url": b.url, "weight_version": b.weight_version} for b in pool.backends
    ]
    # Engines out of service (failed probes, ejected) serve nothing meanwhile, and one that
    # does not say its weights (not read yet, a release without weight_version) has no vote.
    served = {
        b.weight_version
        for b in pool.backends
        if b.weight_version is not None and pool.available(b, now)
    }
    fleet = served.pop() if len(served) == 1 else None
    return orjson.dumps(
        {"weight_version": fleet, "latest": pool.latest_version, "workers": workers}
    )
