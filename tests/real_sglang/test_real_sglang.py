"""The gateway's admission against SGLang's own code, release by release.

Every generated `/generate` and chat body is judged twice: by the gateway (inspect_body, then the
release's profile) and by the released SGLang itself (tests/real_sglang/judge.py: the wheel's
request models, batch split, SamplingParams and the scheduler's mask admission, in a process
of its own). Counted per release:

- bypass: the gateway forwards a body that the release would run with a mask whose top_k is
  unbounded (>= TOP_K_ALL) or above the release's cap. Must be 0.
- looser: the gateway forwards a body that the release's mask admission refuses. Must be 0
  (SGLang would refuse it anyway, but the gateway is never looser than its backend).
- unjustified refusal: the gateway refuses a body the release serves. Allowed only for the
  deliberate, documented reasons in FAIL_CLOSED (docs/sglang-contract.md s.10).

The wheels come from PyPI (`pip download --no-deps`); without a network the test skips
locally and fails under CI.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings

from gateway.contract.inspection import inspect_body
from gateway.contract.lax import TOP_K_ALL
from gateway.contract.policy import BodyRules, resolve
from gateway.contract.profiles import MaskProfile, MaskRule
from gateway.contract.routes import Kind
from tests.hardening.bodies import requests
from tests.property_scale import examples
from tests.real_sglang.wheels import Unavailable, unpacked

pytestmark = [pytest.mark.heavy, pytest.mark.property]

JUDGE = Path(__file__).with_name("judge.py")
BODIES = examples(3000)  # about half are /generate bodies

# (release, --sampling-mask-max-tokens, the gateway profile for that backend)
RELEASES = [
    ("0.5.18", None, MaskProfile(MaskRule.TOP_P_OR_TOP_K)),
    ("0.5.19", None, MaskProfile(MaskRule.FINITE_TOP_K)),
    ("0.5.23", 4096, MaskProfile(MaskRule.CAPPED, 4096)),
    ("0.5.23", 64, MaskProfile(MaskRule.CAPPED, 64)),
]

# Refusals of bodies SGLang serves, each deliberate (docs/sglang-contract.md: s.10, the rules),
# with what must hold of the masks SGLang would have run for the refusal to be that one:
FAIL_CLOSED: dict[str, Any] = {
    # top_k above 2**30 (2**31, 1e300, ...): SGLang 0.5.19 compares `== TOP_K_ALL` and runs
    # it, with a mask of up to the whole vocabulary; the gateway takes it as unbounded.
    "unbounded_top_k": lambda masks: any(k >= TOP_K_ALL for k in masks),
    # The same for 0.5.18, whose own test is `top_k != TOP_K_ALL or top_p < 1`.
    "unbounded_top_k_and_top_p": lambda masks: any(k >= TOP_K_ALL for k in masks),
    # A top_k SGLang does not read as an integer (5.5: SamplingParams keeps the float and
    # the sampler would fail on it): the gateway's plain reading refuses it.
    "invalid_field": lambda masks: any(isinstance(k, float) and not k.is_integer() for k in masks),
    # n above policy.max_parallel_samples: SGLang allocates batch x n state up front.
    "n_too_large": lambda masks: True,
}


_KINDS = {
    "/generate": Kind.GENERATE,
    "/%67enerate": Kind.GENERATE,
    "/generate/": Kind.GENERATE,
    "/v1/chat/completions": Kind.CHAT,
    "/invocations": Kind.CHAT,
}


def _bodies() -> list[tuple[Kind, bytes]]:
    found: list[tuple[Kind, bytes]] = []

    @settings(
        max_examples=BODIES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    @seed(20261201)  # the same bodies on every checkout
    def collect(case: tuple[str, bytes]) -> None:
        path, body = case
        if path in _KINDS:
            found.append((_KINDS[path], body))

    collect()
    return found


@pytest.fixture(scope="module")
def bodies() -> list[tuple[Kind, bytes]]:
    return _bodies()


def _judge(
    root: Path, cap: int | None, bodies: list[tuple[Kind, bytes]]
) -> Iterator[dict[str, Any]]:
    lines = "".join(
        json.dumps({"body": base64.b64encode(b).decode(), "chat": kind is Kind.CHAT}) + "\n"
        for kind, b in bodies
    )
    args = [sys.executable, str(JUDGE), str(root)] + ([str(cap)] if cap else [])
    done = subprocess.run(
        args, input=lines, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(verdicts) == len(bodies)
    yield from verdicts


def _release(version: str) -> Path:
    try:
        return unpacked(version)
    except Unavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SGLang's wheel is not reachable here: {exc}")


@pytest.mark.parametrize(("version", "cap", "profile"), RELEASES, ids=str)
def test_the_gateway_admits_exactly_what_the_release_serves(
    bodies: list[tuple[Kind, bytes]], version: str, cap: int | None, profile: MaskProfile
) -> None:
    root = _release(version)
    rules = BodyRules()
    counts: Counter[str] = Counter()
    unjustified: Counter[str] = Counter()
    examples: dict[str, bytes] = {}
    for (kind, body), real in zip(bodies, _judge(root, cap, bodies), strict=True):
        counts["bodies"] += 1
        counts[f"{kind.name.lower()} {real['verdict']}"] += 1
        counts[real["verdict"]] += 1
        mine = resolve(inspect_body(kind, body, rules), profile)
        if real["verdict"] == "served":
            masks = real["masks"]
            counts["served with a mask"] += bool(masks)
            # 0.5.18 runs top-p-only masks by design (its rule reads top_p): only a cap or,
            # for the other releases, an unbounded top_k makes a mask too wide.
            unbounded_ok = profile.rule is MaskRule.TOP_P_OR_TOP_K
            too_wide = [
                k
                for k in masks
                if (k >= TOP_K_ALL and not unbounded_ok) or (cap is not None and k > cap)
            ]
            if mine is None and too_wide:
                counts["bypass"] += 1
                examples.setdefault("bypass", body)
            if mine is not None:
                reason = mine.reason
                if reason not in FAIL_CLOSED or not FAIL_CLOSED[reason](masks):
                    reason = f"unexplained {reason}"
                unjustified[reason] += 1
                examples.setdefault(reason, body)
        elif real["verdict"] == "refused" and mine is None:
            counts["looser"] += 1
            examples.setdefault("looser", body)
        elif real["verdict"] == "refused" and mine is not None and mine.rule == "sampling_mask":
            # Both refuse the mask: in the release's own words.
            same = mine.message == real["why"]
            counts["same message" if same else "other message"] += 1
            if not same:
                examples.setdefault("other message", body)
    counts["unjustified refusals"] = sum(unjustified.values())
    print(f"real SGLang {version} cap {cap}: {dict(counts)}; refused for {dict(unjustified)}")
    assert counts["bypass"] == 0, examples.get("bypass")
    assert counts["looser"] == 0, examples.get("looser")
    assert counts["other message"] == 0, examples.get("other message")
    unexplained = [r for r in unjustified if r.startswith("unexplained")]
    assert not unexplained, {r: examples[r] for r in unexplained}
    assert counts["served with a mask"] > 50 and counts["refused"] > 50  # the bodies probe both
