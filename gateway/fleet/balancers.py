"""Choosing one backend among the routable candidates.

A balancer sees only candidates the pool already judged routable (healthy or not yet
probed, not ejected, below its concurrency cap) and never returns anything else. All are
deterministic given a seed, so their tests are too.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Candidate(Protocol):
    """What a balancer reads of a backend (fleet.pool.Backend is one)."""

    @property
    def url(self) -> str: ...

    @property
    def inflight(self) -> int: ...


C = TypeVar("C", bound=Candidate)


class Balancer(Protocol):
    def choose(self, candidates: Sequence[C], key: str | None) -> C: ...

    def set_members(self, urls: Sequence[str]) -> None:
        """Told the whole membership (not just the candidates) whenever it changes."""


class RoundRobin:
    __slots__ = ("_counter",)

    def __init__(self, seed: int | None = None) -> None:
        self._counter = itertools.count(seed or 0)

    def choose(self, candidates: Sequence[C], key: str | None) -> C:
        return candidates[next(self._counter) % len(candidates)]

    def set_members(self, urls: Sequence[str]) -> None:
        pass


class Random:
    """Any candidate, uniformly (sglang-router's `random`)."""

    __slots__ = ("_rng",)

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[C], key: str | None) -> C:
        return candidates[self._rng.randrange(len(candidates))]

    def set_members(self, urls: Sequence[str]) -> None:
        pass


class LeastInflight:
    """Fewest requests in flight: LLM requests vary 1000x in cost, so load beats turns.

    Ties rotate, so an idle fleet still spreads requests instead of piling on the first.
    """

    __slots__ = ("_counter",)

    def __init__(self, seed: int | None = None) -> None:
        self._counter = itertools.count(seed or 0)

    def choose(self, candidates: Sequence[C], key: str | None) -> C:
        return least_loaded(candidates, self._counter)

    def set_members(self, urls: Sequence[str]) -> None:
        pass


def least_loaded(candidates: Sequence[C], turns: Iterator[int]) -> C:
    """The candidate with the fewest requests in flight; ties rotate by `turns`, so an idle
    fleet still spreads requests instead of piling on the first."""
    n = len(candidates)
    start = next(turns) % n
    best = candidates[start]
    for i in range(1, n):
        b = candidates[(start + i) % n]
        if b.inflight < best.inflight:
            best = b
    return best


class PowerOfTwo:
    """Two random candidates, the less loaded one wins: near least-inflight quality at
    O(1), and no herd onto a single idle backend when many gateways share a fleet."""

    __slots__ = ("_rng",)

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[C], key: str | None) -> C:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        return a if a.inflight <= b.inflight else b

    def set_members(self, urls: Sequence[str]) -> None:
        pass


@dataclass(frozen=True, slots=True)
class BalanceRule:
    """When the backend a request belongs to (its session, its cached prefix) is too loaded
    to take it: more in flight than the least loaded candidate by over `abs_threshold`
    *and* by a factor over `rel_threshold` (sglang-router's --balance-abs-threshold and
    --balance-rel-threshold, asked of that backend instead of the fleet's busiest)."""

    abs_threshold: int = 8
    rel_threshold: float = 1.5

    def overloaded(self, load: int, least: int) -> bool:
        return load - least > self.abs_threshold and load > least * self.rel_threshold


def _hash(value: str) -> int:
    # Stable across processes and restarts (unlike hash()), so every gateway replica sends a
    # session to the same worker.
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")


class ConsistentHash:
    """A hash ring over backend URLs, keyed by a request header (e.g. X-Session-Id).

    All turns of an RL rollout land on the same worker (its prefix cache stays warm) while
    that worker is routable; when it is not, only its keys move, to the next routable one
    clockwise. The ring holds every member (virtual nodes for an even spread) and is rebuilt
    only when membership changes, not when health flaps. Requests without the header fall
    back to least-inflight. With a `spill` rule, a session whose worker is overloaded by it
    goes to the least loaded one instead of piling on.
    """

    __slots__ = ("_fallback", "_points", "_spill", "_urls", "_vnodes")

    def __init__(
        self, seed: int | None = None, vnodes: int = 160, spill: BalanceRule | None = None
    ) -> None:
        self._vnodes = vnodes
        self._spill = spill
        self._fallback = LeastInflight(seed)
        self._points: list[int] = []
        self._urls: list[str] = []

    def set_members(self, urls: Sequence[str]) -> None:
        ring = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(self._vnodes))
        self._points = [p for p, _ in ring]
        self._urls = [u for _, u in ring]

    def choose(self, candidates: Sequence[C], key: str | None) -> C:
        if key is None or not self._points:
            return self._fallback.choose(candidates, None)
        by_url = {c.url: c for c in candidates}
        n = len(self._points)
        start = bisect.bisect(self._points, _hash(key))
        for step in range(n):
            backend = by_url.get(self._urls[(start + step) % n])
            if backend is not None:
                spill = self._spill
                if spill is not None and backend.inflight > spill.abs_threshold:
                    least = min(c.inflight for c in candidates)
                    if spill.overloaded(backend.inflight, least):
                        return self._fallback.choose(candidates, None)
                return backend
        # Candidates the ring does not know (membership not yet announced): stay correct.
        return self._fallback.choose(candidates, None)


BALANCERS: dict[str, Callable[[int | None], Balancer]] = {
    "least_inflight": LeastInflight,
    "round_robin": RoundRobin,
    "power_of_two": PowerOfTwo,
    "consistent_hash": ConsistentHash,
    "random": Random,
}
