"""Differential testing: the gateway's reading of a body against SGLang's own (tests/sglang_model).

Hypothesis writes bodies with random types and spellings at every field that decides the
sampling-mask rule, sends them through a running gateway over real sockets to a recording stub,
and checks two things per body:

1. Safety: nothing the stub receives would make SGLang (per the model) run an item with the
   mask on and top_k >= TOP_K_ALL.
2. Transparency: a body that SGLang would accept, and that the gateway has no documented
   reason to refuse (`refusal_reasons` below), arrives at the stub byte for byte.

"No reason to refuse" is defined here from the body alone, from the rules
docs/sglang-contract.md lists as deliberately stricter than SGLang, and nowhere else. A
gateway refusal of an accepted body that none of these reasons covers fails the test, so
over-blocking is caught as well as leaking.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, seed, settings
from pydantic import TypeAdapter, ValidationError

from tests import sglang_model as sglang
from tests.hardening.bodies import requests
from tests.hardening.live import LiveGateway, exchange
from tests.property_scale import examples

OPENAI_ROUTES = frozenset({"/v1/chat/completions", "/invocations", "/v1/completions"})
OPENAI_ROUTES |= {"/v1/responses"}
NO_MASK_FIELD_ROUTES = frozenset({"/v1/completions", "/v1/responses"})
_PYDANTIC_BOOL: TypeAdapter[bool] = TypeAdapter(bool)
_PLAIN_DECIMAL = re.compile(r"[+-]?[0-9]+\Z")


def _pydantic_bool(value: object) -> bool | None:
    try:
        return _PYDANTIC_BOOL.validate_python(value)
    except ValidationError:
        return None


def _finite(top_k: object) -> bool:
    if isinstance(top_k, bool):
        return top_k  # true is 1; false is 0, which SGLang refuses
    return isinstance(top_k, int | float) and 1 <= top_k < sglang.TOP_K_ALL


def _shape(path: str, obj: dict[str, Any]) -> tuple[bool, int, Any, Any]:
    """(single?, batch size, mask value, sampling_params value) the way SGLang lays them out."""
    if path == "/vertex_generate":
        instances = obj.get("instances")
        if not isinstance(instances, list) or not instances:
            return False, 0, None, None  # SGLang answers [] without running anything
        params = obj.get("parameters") or {}
        gen = dict(params) if isinstance(params, dict) else {}
        for key in ("text", "input_ids", "input_embeds"):
            if isinstance(instances[0], dict) and instances[0].get(key):
                gen.setdefault(
                    key, [i.get(key) if isinstance(i, dict) else None for i in instances]
                )
                break
        obj = gen
    text, ids, embeds = obj.get("text"), obj.get("input_ids"), obj.get("input_embeds")
    if text is not None:
        single = isinstance(text, str)
        size = 1 if single or not isinstance(text, list) else len(text)
    elif isinstance(ids, list) and ids:
        single = not isinstance(ids[0], list)
        size = 1 if single else len(ids)
    elif isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0]:
        single = not isinstance(embeds[0][0], list)
        size = 1 if single else len(embeds)
    else:
        single, size = True, 1
    return single, size, obj.get("return_sampling_mask"), obj.get("sampling_params")


def _n(params: object) -> object:
    return params.get("n", 1) if isinstance(params, dict) else 1


def refusal_reasons(path: str, obj: Any, reading: sglang.Reading) -> list[str]:
    """Why the gateway may refuse a body SGLang would accept: its documented strictness.

    - `mask on a route without the field`: /v1/completions and /v1/responses refuse an
      unbounded mask request though SGLang 0.5.19 ignores the key there (fail closed).
    - `non-integral top_k`: 5.5 is refused; SGLang runs it on /generate as "finite".
    - `top_k spelling`: on OpenAI routes only plain decimal strings are read as integers;
      pydantic also reads " 5 ", "5.0", "5_0".
    - `greedy by a non-numeric temperature`: a bool or string temperature is never taken as
      greedy, so an item whose top_k is finite (or valid) only through SGLang's greedy forcing
      is refused.
    - `batch lists disagree`, `empty batch`, `params list on a single request`: where list
      lengths disagree with the batch, a missing flag counts as on and missing params as {}.
    - `list mask with n > 1`: refused outright (SGLang refuses it too, except with beams).
    """
    reasons: list[str] = []
    if not isinstance(obj, dict):
        return reasons
    mask = obj.get("return_sampling_mask")
    if path in NO_MASK_FIELD_ROUTES and mask is not None and _pydantic_bool(mask) is not False:
        reasons.append("mask on a route without the field")
    openai = path in OPENAI_ROUTES
    sent = [obj] if openai else [item.sent for item in reading.items]
    for params in sent:
        if not isinstance(params, dict):
            continue
        top_k = params.get("top_k")
        if isinstance(top_k, float) and not top_k.is_integer():
            reasons.append("non-integral top_k")
        if openai and isinstance(top_k, str) and not _PLAIN_DECIMAL.match(top_k):
            reasons.append("top_k spelling")
        temperature = params.get("temperature")
        if isinstance(temperature, bool | str) and not _finite(top_k):
            reasons.append("greedy by a non-numeric temperature")
    if path in ("/generate", "/vertex_generate"):
        single, size, mask, params = _shape(path, obj)
        if not single and size == 0:
            reasons.append("empty batch")
        if not single and isinstance(mask, list) and len(mask) != size:
            reasons.append("batch lists disagree")
        if not single and isinstance(params, list) and len(params) != size:
            reasons.append("batch lists disagree")
        if single and isinstance(params, list):
            reasons.append("params list on a single request")
        all_params = params if isinstance(params, list) else [params]
        if isinstance(mask, list) and any(
            isinstance(_n(p), int | float) and not isinstance(_n(p), bool) and _n(p) > 1  # type: ignore[operator]
            for p in all_params
        ):
            reasons.append("list mask with n > 1")
    return reasons


@pytest.fixture(scope="module")
def live() -> Any:
    gw = LiveGateway().start()
    yield gw
    gw.stop()


def _canonical(path: str) -> str:
    return "/generate" if path in ("/%67enerate", "/generate/") else path


def run_differential(live: LiveGateway, max_examples: int, derandomize: bool) -> Counter[str]:
    stats: Counter[str] = Counter()
    conn = live.connection()

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests())
    # derandomize alone seeds from the function's digest, which differs between checkouts;
    # a fixed seed makes the bounded run the same everywhere.
    @seed(20261130 if derandomize else None)
    def check(case: tuple[str, bytes]) -> None:
        path, body = case
        reading = sglang.read("POST", path, body)
        rid = uuid.uuid4().hex
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        status, resp_headers, data = exchange(conn, "POST", path, body, headers)
        got = live.last_received()
        forwarded = got is not None and got.headers.get("X-Request-Id") == rid
        stats["bodies"] += 1
        # 1. Safety.
        assert not (forwarded and reading.runs_unbounded_mask), (
            f"BYPASS: SGLang would run an unbounded mask request: {path} {body!r} {reading}"
        )
        if forwarded:
            assert got is not None
            stats["forwarded"] += 1
            assert got.body == body
            assert got.headers["Content-Length"] == str(len(body))
            assert "Transfer-Encoding" not in got.headers
        else:
            stats["refused"] += 1
            assert status in (400, 415), (status, data)
            assert resp_headers.get("x-request-id") == rid
            orjson.loads(data)  # a JSON body in SGLang's shape
        # 2. Transparency.
        obj = orjson.loads(body)
        reasons = refusal_reasons(_canonical(path), obj, reading)
        if reading.accepted:
            stats["accepted"] += 1
            if not reasons:
                stats["accepted, no reason to refuse"] += 1
                assert forwarded, (
                    f"over-refusal: SGLang accepts and no documented reason applies: "
                    f"{path} {body!r} -> {status} {data!r}"
                )
        if reading.runs_unbounded_mask:
            stats["unbounded mask (must be refused)"] += 1

    try:
        check()
    finally:
        conn.close()
    return stats


def _report(stats: Counter[str]) -> None:
    print("differential:", dict(stats))  # shown with -s; figures for the hardening report


@pytest.mark.property
def test_differential_gateway_against_sglang_model(live: LiveGateway) -> None:
    stats = run_differential(live, max_examples=examples(1500), derandomize=True)
    _report(stats)
    assert stats["bodies"] >= examples(1000)
    # The property is only as good as what it exercises: most bodies must be forwarded
    # and checked byte for byte, and many must be unbounded mask requests.
    assert stats["forwarded"] >= 0.3 * stats["bodies"]
    assert stats["accepted, no reason to refuse"] >= 0.25 * stats["bodies"]
    assert stats["unbounded mask (must be refused)"] >= 0.1 * stats["bodies"]


@pytest.mark.property
@pytest.mark.slow
# 20,000 bodies through real sockets take about 2-4 minutes on a 2-core machine: more
# than the suite's 120 s default, which is meant for a test that hangs.
@pytest.mark.timeout(900)
def test_differential_long_random_run(live: LiveGateway) -> None:
    stats = run_differential(live, max_examples=examples(20_000), derandomize=False)
    _report(stats)
    assert stats["forwarded"] >= 0.3 * stats["bodies"]
