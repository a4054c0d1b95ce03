"""Inspection of a body of any size: the skim of long integer arrays, a share of the
inspection budget, then the contract's parse and policy.

The contract's reading (gateway/contract/inspection.py) is pure and synchronous; this adds
what a server needs around it for large bodies: yielding to the loop while they are scanned
(gateway/contract/skim.py, gateway/contract/scan.py) and waiting for memory
(gateway/edge/budget.py). What is left in one step is the parse itself (one call into
simdjson or orjson, which hold the GIL), of the reduced body where the skim shrank it.
"""

from __future__ import annotations

from typing import Final

from gateway.contract import scan
from gateway.contract.inspection import (
    ORJSON_SENSITIVE,
    judge,
    parse_object,
)
from gateway.contract.keyscan import keys_for, may_name_sliced
from gateway.contract.policy import (
    READS,
    SHAPE_ONLY,
    BodyRules,
    Rejection,
    Verdict,
)
from gateway.contract.rids import top_level_rids_sliced
from gateway.contract.routes import Kind
from gateway.contract.skim import skim
from gateway.edge.budget import InspectionBudget, TooCostly, parse_cost_sliced

INSPECTION_BUSY: Final = "The gateway is busy inspecting other large requests; retry later."


async def inspect_large(
    kind: Kind,
    body: bytes,
    rules: BodyRules,
    budget: InspectionBudget,
    *,
    wait_s: float,
    skip_parse_without_key: bool = False,
    rids: list[str] | None = None,
    adapters: list[str] | None = None,
) -> Verdict:
    """inspect_body for any size: long integer arrays in shape-only fields are validated
    without being parsed (gateway/contract/skim.py), and the parse waits for its share of the
    inspection budget (gateway/edge/budget.py)."""
    if skip_parse_without_key and not await may_name_sliced(
        body, keys_for(kind, adapters is not None)
    ):
        if rids is None:
            return None
        found = await top_level_rids_sliced(body)
        if found is not None:
            rids += found
            return None
    # orjson's own verdict is needed on bodies it may refuse (see ORJSON_SENSITIVE). A route
    # that reads no shape-only field (chat, completions) has nothing to skim: walking a
    # 1 MB chat body's strings cost ten times its parse.
    reads = READS[kind]
    skimmable = reads is None or not SHAPE_ONLY.isdisjoint(reads)
    # Matched past the leading blanks, found a slice at a time: the pattern's own match
    # would run over all of them (the same answer: what follows them must be `{`).
    sensitive = ORJSON_SENSITIVE.match(body, await scan.run_end(scan.BLANKS, body, 0))
    skimmed = await skim(body, SHAPE_ONLY) if skimmable and not sensitive else None
    cost = await parse_cost_sliced(skimmed.body if skimmed is not None else body)
    try:
        granted = await budget.acquire(cost, wait_s)
    except TooCostly:
        return Rejection(
            413,
            "request_body",
            "too_costly",
            "Request body needs more memory to inspect than limits.max_inspecting_bytes "
            f"({budget.limit} bytes) allows.",
            detail=f"estimated {cost} bytes",
        )
    if not granted:
        return Rejection(503, "request_body", "inspection_busy", INSPECTION_BUSY)
    try:
        return judge(kind, parse_object(body, kind, skimmed), rules, rids, adapters)
    finally:
        budget.release(cost)
