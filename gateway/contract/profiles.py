"""Each SGLang release's own sampling-mask admission (docs/sglang-contract.md section 3).

The rule changed by release: 0.5.18 allowed a top-p-only mask, 0.5.16-0.5.17 and 0.5.19
require a finite `top_k`, 0.5.20 and later also cap it (`--sampling-mask-max-tokens`), and
every release refuses the mask under speculative decoding and on the ascend sampling
backend. A fleet mixes releases and settings, so the gateway keeps one profile per backend
(learnt from its `/server_info`) and applies exactly that backend's rule.

Parsing, lax readings, greedy forcing and batch pairing are shared (gateway/contract/
policy.py): a body becomes a MaskDemand, the mask items in the order SGLang checks them,
and each profile judges those items alone. Pure functions, no I/O.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.contract.lax import TOP_K_ALL

# The exact texts of each release (clients and SGLang's own tests look for them).
FINITE_TOP_K_MESSAGE: Final = (
    "return_sampling_mask requires finite top_k; top_p-only sampling is valid but can "
    "return huge masks in the tail, blowing up metadata, so we need a safety cap."
)
TOP_P_MESSAGE: Final = (
    "return_sampling_mask cannot return the full vocabulary; set top_p < 1 or a finite top_k."
)
CAP_MESSAGE: Final = (
    "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= {cap}; "
    "got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens."
)
SPECULATIVE_MESSAGE: Final = "return_sampling_mask is not supported with speculative decoding."
ASCEND_MESSAGE: Final = "return_sampling_mask is not supported with the ascend sampling backend."

DEFAULT_CAP: Final = 4096  # --sampling-mask-max-tokens' default (0.5.20 and later)


class MaskRule(enum.Enum):
    FINITE_TOP_K = "finite_top_k"  # 0.5.16-0.5.17, 0.5.19
    TOP_P_OR_TOP_K = "top_p_or_top_k"  # 0.5.18
    CAPPED = "capped"  # 0.5.20-0.5.23
    STRICT = "strict"  # release unknown: every rule of every known release at once


@dataclass(frozen=True, slots=True)
class MaskItem:
    """One item that asks for a mask, as SGLang sees it after normalisation."""

    top_k: int  # TOP_K_ALL (or above) when unbounded; 1 for a greedy item
    top_p_below_one: bool  # a real number below 1 (anything else counts as 1: stricter)
    # top_k as SGLang holds it, for messages that print it: /generate keeps a float as sent
    # (1024.0), where the gateway reads 1024.
    shown: int | float | None = field(default=None, compare=False)

    @property
    def unbounded(self) -> bool:
        # Omitted, null and -1 normalise to TOP_K_ALL in SGLang; anything above it counts as
        # unbounded too, though SGLang would take 2**30 + 1 as finite.
        return self.top_k >= TOP_K_ALL


@dataclass(frozen=True, slots=True)
class MaskProfile:
    """One backend's admission of mask items."""

    rule: MaskRule
    cap: int | None = None  # CAPPED and STRICT: the largest top_k admitted
    speculative: bool = False
    ascend: bool = False

    @property
    def name(self) -> str:
        """A short fixed label (metrics, logs, /workers): rule, cap, and settings."""
        name = self.rule.value
        if self.cap is not None:
            name += f":{self.cap}"
        if self.speculative:
            name += "+speculative"
        if self.ascend:
            name += "+ascend"
        return name

    def refusal(self, item: MaskItem) -> tuple[str, str] | None:
        """(reason, message) this backend refuses `item` with, or None when it serves it.
        The top_k rule comes first, then the settings, as SGLang checks them."""
        k = item.top_k
        cap = self.cap if self.cap is not None else DEFAULT_CAP
        match self.rule:
            case MaskRule.FINITE_TOP_K:
                if item.unbounded:
                    return "unbounded_top_k", FINITE_TOP_K_MESSAGE
            case MaskRule.TOP_P_OR_TOP_K:
                if item.unbounded and not item.top_p_below_one:
                    return "unbounded_top_k_and_top_p", TOP_P_MESSAGE
            case MaskRule.CAPPED:
                if not (k == 1 or 1 < k <= cap):
                    reason = "unbounded_top_k" if item.unbounded else "top_k_above_cap"
                    shown = k if item.shown is None else item.shown
                    return reason, CAP_MESSAGE.format(cap=cap, top_k=shown)
            case MaskRule.STRICT:
                if item.unbounded:
                    return "unbounded_top_k", FINITE_TOP_K_MESSAGE
                if k > cap:
                    return "top_k_above_cap", FINITE_TOP_K_MESSAGE
        if self.speculative:
            return "speculative_decoding", SPECULATIVE_MESSAGE
        if self.ascend:
            return "ascend_backend", ASCEND_MESSAGE
        return None

    def reasons(self) -> tuple[str, ...]:
        """Every reason `refusal` can give (their metric series exist at 0 before the first
        refusal), in the order it checks them."""
        match self.rule:
            case MaskRule.FINITE_TOP_K:
                top_k: tuple[str, ...] = ("unbounded_top_k",)
            case MaskRule.TOP_P_OR_TOP_K:
                top_k = ("unbounded_top_k_and_top_p",)
            case MaskRule.CAPPED | MaskRule.STRICT:
                top_k = ("unbounded_top_k", "top_k_above_cap")
        if self.speculative:  # checked first: a speculative ascend backend never says ascend
            return (*top_k, "speculative_decoding")
        return (*top_k, "ascend_backend") if self.ascend else top_k

    def closeness(self) -> tuple[int, int, int]:
        """Orders refusing profiles by how near a client is to being served by one: a limit
        on top_k the client can meet beats a setting it cannot change, a larger cap beats a
        smaller one, and a known release's own words beat the strict profile's."""
        setting = self.speculative or self.ascend
        cap = TOP_K_ALL if self.rule in (MaskRule.FINITE_TOP_K, MaskRule.TOP_P_OR_TOP_K) else 0
        known = self.rule is not MaskRule.STRICT
        return (0 if setting else 1, self.cap if self.cap is not None else cap, int(known))


# 0.5.19's rule: what the gateway applied to every backend before profiles, and still the
# rule of a backend whose release is pinned to 0.5.19 or not known to differ.
LEGACY: Final = MaskProfile(MaskRule.FINITE_TOP_K)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a backend's /server_info says about its admission."""

    version: str | None = None
    sampling_mask_max_tokens: int | None = None
    speculative_algorithm: str | None = None
    sampling_backend: str | None = None
    disaggregation_mode: str | None = None
    # Tokens its prefix cache can hold (gateway/fleet/cache_aware.py), None where unknown.
    cache_tokens: int | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerInfo:
        def text(key: str) -> str | None:
            value = data.get(key)
            return value if isinstance(value, str) else None

        speculative = text("speculative_algorithm")
        return cls(
            version=text("version"),
            # JSON true is no cap: read as 1, it would refuse every top_k over 1.
            sampling_mask_max_tokens=_positive(data.get("sampling_mask_max_tokens")),
            # SGLang reports "NONE" or null when it is off, depending on the release.
            speculative_algorithm=None if speculative in (None, "", "NONE") else speculative,
            sampling_backend=text("sampling_backend"),
            disaggregation_mode=text("disaggregation_mode"),
            cache_tokens=_cache_tokens(data),
        )


def _cache_tokens(data: Mapping[str, Any]) -> int | None:
    """The radix cache lives in the KV pool (max_total_num_tokens, per data-parallel rank,
    each rank with a cache of its own). A hierarchical cache keeps more in host memory, so
    its pool says too little: unknown; without a radix cache there is nothing to bound."""
    pool, ranks = _positive(data.get("max_total_num_tokens")), _positive(data.get("dp_size"))
    if pool is None:
        return None
    if data.get("enable_hierarchical_cache") is True or data.get("disable_radix_cache") is True:
        return None
    return pool * (ranks or 1)


def _positive(value: object) -> int | None:
    """A count as JSON carries it: an int above 0 (JSON's true is no count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_RELEASE: Final = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
NEWEST_KNOWN: Final = (0, 5, 23)  # releases read for docs/sglang-contract.md


def release(version: str | None) -> tuple[int, int, int] | None:
    """`0.5.19`, `0.5.20.post1`, `0.5.21rc0` -> (0, 5, 19), ...; None when unreadable."""
    m = _RELEASE.match(version or "")
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def rule_of(version: str | None) -> MaskRule:
    """The admission rule of a release; STRICT for one whose rule the gateway does not
    know (before the mask existed, after the newest release read, or unreadable)."""
    r = release(version)
    if r is None or r < (0, 5, 16) or r > NEWEST_KNOWN:
        return MaskRule.STRICT
    if r == (0, 5, 18):
        return MaskRule.TOP_P_OR_TOP_K
    if r >= (0, 5, 20):
        return MaskRule.CAPPED
    return MaskRule.FINITE_TOP_K


def profile_of(info: ServerInfo | None, *, strict_cap: int = DEFAULT_CAP) -> MaskProfile:
    """A backend's profile from what it says about itself; the strictest when it said
    nothing. `strict_cap`: the smallest cap in the fleet, which an unknown backend gets."""
    if info is None:
        return MaskProfile(MaskRule.STRICT, strict_cap)
    rule = rule_of(info.version)
    cap: int | None = None
    if rule is MaskRule.CAPPED:
        cap = info.sampling_mask_max_tokens or DEFAULT_CAP
    elif rule is MaskRule.STRICT:
        cap = min(strict_cap, info.sampling_mask_max_tokens or strict_cap)
    return MaskProfile(
        rule,
        cap,
        speculative=info.speculative_algorithm is not None,
        ascend=info.sampling_backend == "ascend",
    )


def pinned(version: str, cap: int = DEFAULT_CAP) -> MaskProfile:
    """The profile `policy.sampling_mask.profile: "<release>"` pins every backend to."""
    rule = rule_of(version)
    if rule is MaskRule.STRICT:
        raise ValueError(
            f"unknown SGLang release {version!r}: pin one from 0.5.16 to "
            f"{'.'.join(map(str, NEWEST_KNOWN))}, or use auto"
        )
    return MaskProfile(rule, cap if rule is MaskRule.CAPPED else None)
