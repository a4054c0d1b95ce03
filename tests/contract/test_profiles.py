"""Each release's mask admission, as a truth table (docs/sglang-contract.md section 3)."""

from __future__ import annotations

import pytest

from gateway.contract.lax import TOP_K_ALL
from gateway.contract.policy import BodyRules, MaskDemand
from gateway.contract.profiles import (
    ASCEND_MESSAGE,
    CAP_MESSAGE,
    FINITE_TOP_K_MESSAGE,
    SPECULATIVE_MESSAGE,
    TOP_P_MESSAGE,
    MaskItem,
    MaskProfile,
    MaskRule,
    ServerInfo,
    pinned,
    profile_of,
    rule_of,
)
from gateway.contract.routes import Kind

V19 = MaskProfile(MaskRule.FINITE_TOP_K)
V18 = MaskProfile(MaskRule.TOP_P_OR_TOP_K)
V23 = MaskProfile(MaskRule.CAPPED, 4096)
V23_64 = MaskProfile(MaskRule.CAPPED, 64)
STRICT = MaskProfile(MaskRule.STRICT, 64)
SPEC = MaskProfile(MaskRule.CAPPED, 4096, speculative=True)
ASCEND = MaskProfile(MaskRule.FINITE_TOP_K, ascend=True)

ALL = TOP_K_ALL
# (top_k, top_p below one) -> the message of each profile (None: served)
TABLE = [
    ((1, False), [None, None, None, None, None, SPECULATIVE_MESSAGE, ASCEND_MESSAGE]),
    ((2, False), [None, None, None, None, None, SPECULATIVE_MESSAGE, ASCEND_MESSAGE]),
    ((64, False), [None, None, None, None, None, SPECULATIVE_MESSAGE, ASCEND_MESSAGE]),
    (
        (65, False),
        [
            None,
            None,
            None,
            CAP_MESSAGE.format(cap=64, top_k=65),
            FINITE_TOP_K_MESSAGE,
            SPECULATIVE_MESSAGE,
            ASCEND_MESSAGE,
        ],
    ),
    (
        (4096, True),
        [
            None,
            None,
            None,
            CAP_MESSAGE.format(cap=64, top_k=4096),
            FINITE_TOP_K_MESSAGE,
            SPECULATIVE_MESSAGE,
            ASCEND_MESSAGE,
        ],
    ),
    (
        (4097, False),
        [
            None,
            None,
            CAP_MESSAGE.format(cap=4096, top_k=4097),
            CAP_MESSAGE.format(cap=64, top_k=4097),
            FINITE_TOP_K_MESSAGE,
            CAP_MESSAGE.format(cap=4096, top_k=4097),
            ASCEND_MESSAGE,
        ],
    ),
    (
        (ALL, True),  # top-p-only: 0.5.18 served it
        [
            FINITE_TOP_K_MESSAGE,
            None,
            CAP_MESSAGE.format(cap=4096, top_k=ALL),
            CAP_MESSAGE.format(cap=64, top_k=ALL),
            FINITE_TOP_K_MESSAGE,
            CAP_MESSAGE.format(cap=4096, top_k=ALL),
            FINITE_TOP_K_MESSAGE,
        ],
    ),
    (
        (ALL, False),
        [
            FINITE_TOP_K_MESSAGE,
            TOP_P_MESSAGE,
            CAP_MESSAGE.format(cap=4096, top_k=ALL),
            CAP_MESSAGE.format(cap=64, top_k=ALL),
            FINITE_TOP_K_MESSAGE,
            CAP_MESSAGE.format(cap=4096, top_k=ALL),
            FINITE_TOP_K_MESSAGE,
        ],
    ),
]
PROFILES = [V19, V18, V23, V23_64, STRICT, SPEC, ASCEND]


@pytest.mark.parametrize(("item", "expected"), TABLE)
def test_truth_table(item: tuple[int, bool], expected: list[str | None]) -> None:
    got = [p.refusal(MaskItem(*item)) for p in PROFILES]
    assert [g[1] if g else None for g in got] == expected


def test_a_profile_names_every_reason_it_refuses_with() -> None:
    """reasons() is what the metrics export at 0 for a profile before its first refusal:
    exactly the reasons refusal() can give, every one of them."""
    spec_strict = MaskProfile(MaskRule.STRICT, 64, speculative=True, ascend=True)
    for profile in [*PROFILES, spec_strict]:
        given = set()
        for top_k in (1, 2, 64, 65, 4096, 4097, ALL):
            for below_one in (False, True):
                refused = profile.refusal(MaskItem(top_k, below_one))
                if refused is not None:
                    given.add(refused[0])
        # speculative / ascend are checked after top_k, so a served top_k shows them.
        assert given == set(profile.reasons()), profile.name
        assert len(profile.reasons()) == len(given), profile.name


def test_the_0_5_20_message_is_sglangs() -> None:
    refused = V23.refusal(MaskItem(4097, False))
    assert refused == (
        "top_k_above_cap",
        "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
        "4096; got top_k=4097. Lower top_k or increase --sampling-mask-max-tokens.",
    )


@pytest.mark.parametrize(
    ("version", "rule"),
    [
        ("0.5.15", MaskRule.STRICT),
        ("0.5.16", MaskRule.FINITE_TOP_K),
        ("0.5.17.post1", MaskRule.FINITE_TOP_K),
        ("0.5.18", MaskRule.TOP_P_OR_TOP_K),
        ("0.5.19", MaskRule.FINITE_TOP_K),
        ("0.5.20rc0", MaskRule.CAPPED),
        ("v0.5.23", MaskRule.CAPPED),
        ("0.5.24", MaskRule.STRICT),
        ("0.6.0", MaskRule.STRICT),
        ("", MaskRule.STRICT),
        (None, MaskRule.STRICT),
        ("main", MaskRule.STRICT),
    ],
)
def test_release_rules(version: str | None, rule: MaskRule) -> None:
    assert rule_of(version) is rule


@pytest.mark.parametrize(
    ("info", "tokens"),
    [
        # SGLang 0.5.23's /server_info: scheduler_info's max_total_num_tokens merged in at
        # the top (sglang/srt/utils/common.py, build_server_info), beside the server args.
        ({"max_total_num_tokens": 500_000, "dp_size": 1}, 500_000),
        ({"max_total_num_tokens": 500_000}, 500_000),
        # Each data-parallel rank has a pool and a radix cache of its own.
        ({"max_total_num_tokens": 500_000, "dp_size": 4}, 2_000_000),
        # A host tier holds more than the pool says; no radix cache, nothing to bound.
        ({"max_total_num_tokens": 500_000, "enable_hierarchical_cache": True}, None),
        ({"max_total_num_tokens": 500_000, "disable_radix_cache": True}, None),
        ({"max_total_num_tokens": 500_000, "enable_hierarchical_cache": False}, 500_000),
        ({}, None),
        ({"max_total_num_tokens": 0}, None),
        ({"max_total_num_tokens": "500000"}, None),
        ({"max_total_num_tokens": True}, None),
        ({"max_total_num_tokens": 1000, "dp_size": "2"}, 1000),
    ],
)
def test_the_cache_size_an_engine_reports(info: dict[str, object], tokens: int | None) -> None:
    assert ServerInfo.from_json({"version": "0.5.23", **info}).cache_tokens == tokens


def test_profiles_from_server_info() -> None:
    info = ServerInfo.from_json(
        {"version": "0.5.23", "sampling_mask_max_tokens": 64, "speculative_algorithm": "EAGLE"}
    )
    assert profile_of(info) == MaskProfile(MaskRule.CAPPED, 64, speculative=True)
    assert profile_of(info).name == "capped:64+speculative"
    off = ServerInfo.from_json({"version": "0.5.23", "speculative_algorithm": "NONE"})
    assert profile_of(off) == MaskProfile(MaskRule.CAPPED, 4096)
    assert profile_of(ServerInfo.from_json({"version": "0.5.19"})).name == "finite_top_k"
    ascend = ServerInfo.from_json({"version": "0.5.18", "sampling_backend": "ascend"})
    assert profile_of(ascend) == MaskProfile(MaskRule.TOP_P_OR_TOP_K, ascend=True)
    # Unknown: every rule at once, at most the smallest cap seen.
    assert profile_of(None, strict_cap=64) == MaskProfile(MaskRule.STRICT, 64)
    assert profile_of(ServerInfo.from_json({"version": "0.7.0"})) == MaskProfile(
        MaskRule.STRICT, 4096
    )
    assert ServerInfo.from_json({"sampling_mask_max_tokens": "64"}).sampling_mask_max_tokens is None
    # JSON's true is a bool, not a cap of 1 (which would refuse every top_k above 1).
    assert ServerInfo.from_json({"sampling_mask_max_tokens": True}).sampling_mask_max_tokens is None
    assert ServerInfo.from_json({"sampling_mask_max_tokens": 0}).sampling_mask_max_tokens is None


def test_pinned_profiles() -> None:
    assert pinned("0.5.19") == V19
    assert pinned("0.5.18") == V18
    assert pinned("0.5.21", 128) == MaskProfile(MaskRule.CAPPED, 128)
    with pytest.raises(ValueError, match="unknown SGLang release"):
        pinned("0.9.0")


def test_shared_reading_then_per_profile_admission() -> None:
    rules = BodyRules()
    # A batch: item 0 asks a mask with top_k 100, item 1 a top-p-only mask.
    body = {
        "text": ["a", "b"],
        "return_sampling_mask": True,
        "sampling_params": [{"top_k": 100}, {"top_p": 0.9}],
    }
    demand = rules.assess(Kind.GENERATE, body)
    assert isinstance(demand, MaskDemand)
    assert demand.items == (MaskItem(100, False), MaskItem(ALL, True))
    assert demand.verdict(V18) is None
    refused = demand.verdict(V23_64)
    assert refused is not None and refused.message == CAP_MESSAGE.format(cap=64, top_k=100)
    assert refused.profile == "capped:64"
    # Greedy is top_k 1 in every release, but speculative decoding still refuses it.
    greedy = rules.assess(
        Kind.CHAT,
        {"return_sampling_mask": True, "return_meta_info": True, "temperature": 0},
    )
    assert isinstance(greedy, MaskDemand) and greedy.items == (MaskItem(1, False),)
    assert greedy.verdict(V23_64) is None
    spec = greedy.verdict(SPEC)
    assert spec is not None and spec.message == SPECULATIVE_MESSAGE
    # A refusal every release makes comes first: SGLang checks every item's parameters
    # before its scheduler judges any mask.
    late = rules.assess(
        Kind.GENERATE,
        {
            "text": ["a", "b"],
            "return_sampling_mask": True,
            "sampling_params": [{"top_k": 5}, {"top_k": -7}],
        },
    )
    assert not isinstance(late, MaskDemand) and late is not None
    assert late.reason == "invalid_top_k"
    assert rules.assess(Kind.GENERATE, {"text": "a"}) is None
