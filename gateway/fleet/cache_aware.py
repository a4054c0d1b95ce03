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
request goes to the least loaded backend (sglang-router: the one with the smallest tree),
or, where every cache near it in load has turned over lately, to the least pressed of
those (`_place`): new work evicts what it lands on.
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


# The least a backend's cache is taken to hold, in request bytes: about one prompt.
MIN_CACHE_BYTES: Final = 4096
# Until the first prompt is sampled: between English text in JSON (~4-6 bytes a token) and
# input_ids (~6-7).
_FIRST_GUESS_BYTES_PER_TOKEN: Final = 6.0
# One prompt in this many is counted for bytes_per_token, the first included.
_SAMPLE_EVERY: Final = 16
# Of a sampled prompt, the bytes counted: its kind of text shows in its start as well as in
# the whole, at ~10 us instead of ~150 for a prompt of 256 KB.
_SAMPLE_BYTES: Final = 16 << 10
# The learnt figure moves the limits only when it moved this much (each move re-trims).
_RELIMIT_STEP: Final = 0.02
# Cache pressure: the prompt bytes sent to a backend lately, over the bytes its cache holds.
# "Lately": each prompt's weight decays per prompt routed, by 1 - 1 / (this x members),
# so about the last this-many prompts of each backend count, whatever the fleet's size
# (0.98 per prompt with 4 backends, the setting measured).
_PRESSURE_PROMPTS: Final = 12.5
# Placed by pressure, a request may go to a backend this many in flight over the least
# loaded.
_PRESSURE_SLACK: Final = 3
# The pressures are kept scaled up instead of all decayed per request; rescaled past this.
_RESCALE_AT: Final = 1e12
# Sampled tokens past which both sums are halved, so the figure follows a change of traffic.
_SAMPLED_TOKENS_KEPT: Final = 1 << 24


def prompt_tokens(body: bytes, start: int, end: int) -> int:
    """About how many tokens `body[start:end]` of a prompt is, without a tokenizer, erring
    on the few side: words of text (its spaces; a real tokenizer cuts English into ~1.3
    tokens a word, a stub engine one), ids of an input_ids list (its commas, `[1,2]` and
    `[1, 2]` alike), and at least one per 16 bytes (text without spaces: ~3-6 bytes a
    token). Too few tokens makes the engine's cache seem larger than it is, which costs
    nothing (prefix_index.py: 1.5x the true size changed nothing, 0.6x lost hits)."""
    return max(body.count(b" ", start, end), body.count(b",", start, end), (end - start) >> 4, 1)


@dataclass(frozen=True, slots=True)
class CacheAwareRules:
    balance: BalanceRule = field(default_factory=BalanceRule)
    cache_threshold: float = 0.5  # sglang-router's is 0.3: see the module's docstring
    max_blocks_per_backend: int = 32768
    max_prompt_bytes: int = 256 << 10
    # Tokens one engine's prefix cache holds, the same figure for all; None: each engine's
    # own, as it reports it (`report`; SGLang's max_total_num_tokens), when `reported`.
    engine_cache_tokens: int | None = None
    reported: bool = True
    # Request bytes a prompt token takes; None: learnt from the prompts (`prompt_tokens`).
    bytes_per_token: float | None = None
    # New work placed away from caches that are turning over (`_place`).
    place_by_pressure: bool = True


class RouteStats:
    """Per backend: decisions that chose it, and the prompt bytes it was sent and held."""

    __slots__ = ("decisions", "matched_bytes", "prompt_bytes")

    def __init__(self) -> None:
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self.matched_bytes = 0
        self.prompt_bytes = 0


class CacheAware:
    """The balancer (gateway/fleet/balancers.py's protocol), plus `choose_prompt`.

    What it remembers of a backend is bounded by that engine's cache, in request bytes:
    its size in tokens (the rules' figure, or the one it reports) times the bytes a token
    takes in this traffic (the rules' figure, or learnt from one prompt in _SAMPLE_EVERY)."""

    __slots__ = (
        "_bytes_per_token",
        "_counter",
        "_decay",
        "_index",
        "_members",
        "_pressure",
        "_reported",
        "_sample",
        "_sampled_bytes",
        "_sampled_tokens",
        "_scale",
        "rules",
        "stats",
    )

    def __init__(self, rules: CacheAwareRules = CacheAwareRules(), seed: int | None = None) -> None:
        self.rules = rules
        self._index = PrefixIndex(rules.max_blocks_per_backend)
        self._counter = itertools.count(seed or 0)
        self.stats: dict[str, RouteStats] = {}
        self._members: list[str] = []
        self._reported: dict[str, int] = {}  # url -> the tokens its cache holds
        self._sample = itertools.count()
        self._sampled_bytes = 0
        self._sampled_tokens = 0
        self._bytes_per_token = rules.bytes_per_token or _FIRST_GUESS_BYTES_PER_TOKEN
        self._pressure: dict[str, float] = {}  # url -> recent prompt bytes, times _scale
        self._scale = 1.0
        self._decay = 1.0

    def inherit(self, previous: CacheAware) -> None:
        """Take over what a balancer this one replaces (a reload) learnt: the engines' caches
        did not change, and counters must not go back."""
        self._index = previous._index
        self._index.resize(self.rules.max_blocks_per_backend)
        self.stats = previous.stats
        self._members = previous._members
        self._reported = previous._reported
        self._sampled_bytes = previous._sampled_bytes
        self._sampled_tokens = previous._sampled_tokens
        self._pressure = previous._pressure
        self._scale = previous._scale
        self._decay = previous._decay
        if self.rules.bytes_per_token is None:
            self._bytes_per_token = previous._bytes_per_token
        self._relimit()

    def set_members(self, urls: Sequence[str]) -> None:
        self._index.keep_only(urls)
        self._members = list(urls)
        keep = set(urls)
        for url in [u for u in self.stats if u not in keep]:
            del self.stats[url]
        for url in [u for u in self._reported if u not in keep]:
            del self._reported[url]
        for url in [u for u in self._pressure if u not in keep]:
            del self._pressure[url]
        self._decay = 1 - 1 / (_PRESSURE_PROMPTS * max(len(urls), 1))
        self._relimit()

    def forget(self, url: str) -> None:
        """The backend restarted: its cache is empty."""
        self._index.forget(url)
        self._pressure.pop(url, None)

    def report(self, url: str, tokens: int | None) -> None:
        """What the backend says its cache holds, in tokens (None: it did not say)."""
        if tokens is None:
            self._reported.pop(url, None)
        else:
            self._reported[url] = tokens
        self._index.limit(url, self._limit(url))

    def _limit(self, url: str) -> int | None:
        rules = self.rules
        tokens = rules.engine_cache_tokens
        if tokens is None and rules.reported:
            tokens = self._reported.get(url)
        if tokens is None:
            return None
        # Never under one prompt's worth (config/models.py refuses such a figure; a tiny
        # report or a learnt figure must not make every prompt evict itself).
        return max(int(tokens * self._bytes_per_token), MIN_CACHE_BYTES)

    def _relimit(self) -> None:
        for url in self._members:
            self._index.limit(url, self._limit(url))

    def cache_limit(self, url: str) -> int | None:
        """The request bytes the backend's cache is taken to hold (None: unbounded)."""
        return self._index.limit_of(url)

    @property
    def bytes_per_token(self) -> float:
        return self._bytes_per_token

    def _learn(self, body: bytes, start: int, considered: int) -> None:
        counted = min(considered, _SAMPLE_BYTES)
        self._sampled_bytes += counted
        self._sampled_tokens += prompt_tokens(body, start, start + counted)
        if self._sampled_tokens > _SAMPLED_TOKENS_KEPT:
            self._sampled_bytes >>= 1
            self._sampled_tokens >>= 1
        learnt = self._sampled_bytes / self._sampled_tokens
        if abs(learnt - self._bytes_per_token) > _RELIMIT_STEP * self._bytes_per_token:
            self._bytes_per_token = learnt
            self._relimit()

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
        if not names:
            least = self._least_loaded(candidates)
            self._count(least.url, NO_PROMPT, 0, 0)
            return least
        lightest = self._least_loaded(candidates)
        least = self._place(candidates, lightest) if rules.place_by_pressure else lightest
        index = self._index
        best = least
        best_blocks = index.matched(least.url, names)
        for c in candidates:
            m = index.matched(c.url, names)
            if m > best_blocks or (m == best_blocks and c.inflight < best.inflight):
                best, best_blocks = c, m
        considered = min(len(body) - start, rules.max_prompt_bytes)
        if rules.bytes_per_token is None and not next(self._sample) % _SAMPLE_EVERY:
            self._learn(body, start, considered)
        matched = ends[best_blocks - 1] if best_blocks else 0
        if not best_blocks or matched < rules.cache_threshold * considered:
            chosen, decision = least, UNMATCHED
            matched = index.matched(least.url, names)
            matched = ends[matched - 1] if matched else 0
        elif best is not least and rules.balance.overloaded(best.inflight, lightest.inflight):
            chosen, decision = least, BALANCED
            held = index.matched(least.url, names)
            matched = ends[held - 1] if held else 0
        else:
            chosen, decision = best, MATCHED
        index.record(chosen.url, names, ends)
        self._count(chosen.url, decision, matched, considered)
        self._press(chosen.url, considered)
        return chosen

    def _place(self, candidates: Sequence[C], least: C) -> C:
        """Where a request that no backend holds enough of goes: the least loaded, unless
        every backend near it in load has had more prompt bytes sent to it lately than
        its cache holds. New work then goes to the least pressed of those (within
        _PRESSURE_SLACK in flight of the least loaded): wherever it lands, it evicts what
        was cached there, and on the least pressed that is the oldest.

        In the virtual-time replay of the routing trace (bench/routing_replay.py, 8 seeds)
        with engines caching 1/32 of the working set it took the hit rate from 0.462 to
        0.505 (agents' sessions 0.28 to 0.35); at 1/16 from 0.768 to 0.761, at 1/8 from
        0.839 to 0.838, both within the spread of full runs. Where any engine's size is
        unknown, load alone decides; `place_by_pressure: false` turns it off."""
        pressure = self._pressure
        if not pressure:
            return least
        index = self._index
        most = least.inflight + _PRESSURE_SLACK
        calmest, calm = least, float("inf")
        for c in candidates:
            if c.inflight > most:
                continue
            limit = index.limit_of(c.url)
            if limit is None:
                return least
            ratio = pressure.get(c.url, 0.0) / limit
            if ratio < calm:
                calmest, calm = c, ratio
        # The pressures are scaled by _scale: `calm` over it is the true ratio.
        return calmest if calm > self._scale else least

    def _press(self, url: str, considered: int) -> None:
        scale = self._scale
        pressure = self._pressure
        pressure[url] = pressure.get(url, 0.0) + considered * scale
        scale /= self._decay
        if scale > _RESCALE_AT:
            for u in pressure:
                pressure[u] /= scale
            scale = 1.0
        self._scale = scale
