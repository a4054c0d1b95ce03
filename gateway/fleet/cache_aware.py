"""cache_aware: send a request where its prompt prefix is cached, unless that backend is
overloaded.

The rule of sglang-router's policy of that name, with two differences that keep a shared
prefix from collapsing the fleet onto one engine:
- the balance rule is asked of the backend the match picked, against the least loaded
  candidate (sglang-router asks it of the fleet's max and min, so a hot backend keeps
  winning while some other pair is even);
- among backends that hold the same longest prefix the least loaded wins, so once a shared
  system prompt has spilled onto a second backend, both share its traffic.
A match shorter than `cache_threshold` of the prompt is no reason to go anywhere: the
request goes to the least loaded backend (sglang-router: the one with the smallest tree).
The default is half: a request that would reuse less than it brings new is mostly new work,
and where it lands is where its conversation will live, so load decides. With sglang-router's
0.3, a short system prompt shared by many agents (100 words before a 60-120-word first
message) pulled every new conversation onto its one holder until the balance rule tripped,
and with KV-bounded caches that engine evicted: in bench/routing.py (docs/bench.md) 0.5 kept
the mixed trace's worst seed at 0.80 where 0.3 fell to 0.77.
Either way the prompt is recorded as served by the chosen backend (gateway/fleet/prefix_index.py).

Requests whose prompt the gateway did not locate (routes that are not inspected, a body
without its prompt key near the start) go to the least loaded backend, at no other cost.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from gateway.fleet.balancers import BalanceRule, C, least_loaded
from gateway.fleet.prefix_index import PrefixIndex, Prompt

MATCHED: Final = "matched"  # the longest match won
BALANCED: Final = "balanced"  # it had a match, but its load was over the balance rule
UNMATCHED: Final = "unmatched"  # no backend held enough of the prompt: least loaded
NO_PROMPT: Final = "no_prompt"  # nothing to match: least loaded
DECISIONS: Final = (MATCHED, BALANCED, UNMATCHED, NO_PROMPT)


@dataclass(frozen=True, slots=True)
class CacheAwareRules:
    balance: BalanceRule = field(default_factory=BalanceRule)
    cache_threshold: float = 0.5  # sglang-router's is 0.3: see the module's docstring
    max_blocks_per_backend: int = 32768
    max_prompt_bytes: int = 256 << 10
    # What one engine's prefix cache holds, in request bytes (config: engine_cache_tokens
    # times bytes_per_token); None: bounded by blocks only.
    backend_cache_bytes: int | None = None


class RouteStats:
    """Per backend: decisions that chose it, and the prompt bytes it was sent and held."""

    __slots__ = ("decisions", "matched_bytes", "prompt_bytes")

    def __init__(self) -> None:
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self.matched_bytes = 0
        self.prompt_bytes = 0


class CacheAware:
    """The balancer (gateway/fleet/balancers.py's protocol), plus `choose_prompt`."""

    __slots__ = ("_counter", "_index", "rules", "stats")

    def __init__(self, rules: CacheAwareRules = CacheAwareRules(), seed: int | None = None) -> None:
        self.rules = rules
        self._index = PrefixIndex(rules.max_blocks_per_backend, rules.backend_cache_bytes)
        self._counter = itertools.count(seed or 0)
        self.stats: dict[str, RouteStats] = {}

    def inherit(self, previous: CacheAware) -> None:
        """Take over what a balancer this one replaces (a reload) learnt: the engines' caches
        did not change, and counters must not go back."""
        self._index = previous._index
        self._index.resize(self.rules.max_blocks_per_backend, self.rules.backend_cache_bytes)
        self.stats = previous.stats

    def set_members(self, urls: Sequence[str]) -> None:
        self._index.keep_only(urls)
        keep = set(urls)
        for url in [u for u in self.stats if u not in keep]:
            del self.stats[url]

    def forget(self, url: str) -> None:
        """The backend restarted: its cache is empty."""
        self._index.forget(url)

    def held_blocks(self, url: str) -> int:
        return self._index.blocks(url)

    def _least_loaded(self, candidates: Sequence[C]) -> C:
        return least_loaded(candidates, self._counter)

    def _count(self, url: str, decision: str, matched: int, prompt: int) -> None:
        stats = self.stats.get(url)
        if stats is None:
            stats = self.stats[url] = RouteStats()
        stats.decisions[decision] += 1
        stats.matched_bytes += matched
        stats.prompt_bytes += prompt

    def choose(self, candidates: Sequence[C], key: str | None) -> C:
        chosen = self._least_loaded(candidates)
        self._count(chosen.url, NO_PROMPT, 0, 0)
        return chosen

    def choose_prompt(self, candidates: Sequence[C], body: bytes, start: int) -> C:
        """The backend for a request whose prompt is `body[start:]` (its tail past the
        prompt only costs a block or two of match)."""
        return self.choose_for(candidates, Prompt(body, start))

    def choose_for(self, candidates: Sequence[C], prompt: Prompt) -> C:
        """choose_prompt for a request's Prompt, whose block names are cut once for all
        of its picks."""
        rules = self.rules
        body, start = prompt.body, prompt.start
        names, ends = prompt.blocks(rules.max_prompt_bytes)
        least = self._least_loaded(candidates)
        if not names:
            self._count(least.url, NO_PROMPT, 0, 0)
            return least
        index = self._index
        best = least
        best_blocks = index.matched(least.url, names)
        for c in candidates:
            m = index.matched(c.url, names)
            if m > best_blocks or (m == best_blocks and c.inflight < best.inflight):
                best, best_blocks = c, m
        considered = min(len(body) - start, rules.max_prompt_bytes)
        matched = ends[best_blocks - 1] if best_blocks else 0
        if not best_blocks or matched < rules.cache_threshold * considered:
            chosen, decision = least, UNMATCHED
            matched = index.matched(least.url, names)
            matched = ends[matched - 1] if matched else 0
        elif best is not least and rules.balance.overloaded(best.inflight, least.inflight):
            chosen, decision = least, BALANCED
            held = index.matched(least.url, names)
            matched = ends[held - 1] if held else 0
        else:
            chosen, decision = best, MATCHED
        index.record(chosen.url, names, ends)
        self._count(chosen.url, decision, matched, considered)
        return chosen
