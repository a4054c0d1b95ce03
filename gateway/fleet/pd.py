"""Prefill/decode disaggregation (backends.mode: pd): each role's balancer, and the pairs'
counters.

SGLang splits a generation over two engines: a prefill engine computes the prompt's KV
cache and sends it to a decode engine, which generates. A request goes to one of each at
once (gateway/edge/pd.py), each picked by its own balancer among the routable workers
registered with that `worker_type`, as sglang-router's --prefill-policy and
--decode-policy pick. No I/O here: the request path reports outcomes in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gateway.fleet.balancers import Balancer

PREFILL_ROLE: Final = "prefill"
DECODE_ROLE: Final = "decode"
ROLES: Final = (PREFILL_ROLE, DECODE_ROLE)

# Why a paired request failed, by side (the metric's `cause` label: a closed set).
NO_WORKER: Final = "no_worker"  # no routable worker of the role
CONNECT: Final = "connect"  # no connection could be made (nothing was sent to it)
TIMEOUT: Final = "timeout"  # no head (or body) in time
ERROR_STATUS: Final = "error_status"  # it answered a status that is not 2xx
BROKEN: Final = "broken"  # it dropped the exchange after the request went out
CAUSES: Final = (NO_WORKER, CONNECT, TIMEOUT, ERROR_STATUS, BROKEN)


class RoleStats:
    """Per worker: the pairs it served its side of, and those that failed on its side."""

    __slots__ = ("failed", "paired")

    def __init__(self) -> None:
        self.paired = 0
        self.failed = 0


class PdRouting:
    """The balancer of each role, and what became of the pairs."""

    __slots__ = ("_balancers", "failures", "pairs", "stats")

    def __init__(self, prefill: Balancer, decode: Balancer) -> None:
        self._balancers = {PREFILL_ROLE: prefill, DECODE_ROLE: decode}
        self.pairs = 0  # requests sent to a prefill and a decode worker together
        self.failures: dict[tuple[str, str], int] = {
            (side, cause): 0 for side in ROLES for cause in CAUSES
        }
        self.stats: dict[str, RoleStats] = {}

    def balancer(self, role: str) -> Balancer:
        return self._balancers[role]

    def balancers(self) -> list[Balancer]:
        return list(self._balancers.values())

    def set_members(self, urls: Sequence[str]) -> None:
        # Each balancer is told every member: it only ever chooses among the candidates of
        # its role that the pool offers, so a ring over all members stays correct.
        for balancer in self._balancers.values():
            balancer.set_members(urls)
        keep = set(urls)
        for url in [u for u in self.stats if u not in keep]:
            del self.stats[url]

    def forget(self, url: str) -> None:
        """The worker restarted: its prefix cache is gone."""
        for balancer in self._balancers.values():
            forget = getattr(balancer, "forget", None)
            if forget is not None:
                forget(url)

    def inherit(self, previous: PdRouting) -> None:
        """A reload: counters must not go back, and what a cache_aware balancer learnt of
        the engines' caches still holds."""
        self.pairs = previous.pairs
        self.failures = previous.failures
        self.stats = previous.stats
        for role, balancer in self._balancers.items():
            inherit = getattr(balancer, "inherit", None)
            old = previous._balancers[role]
            if inherit is not None and type(old) is type(balancer):
                inherit(old)

    def _of(self, url: str) -> RoleStats:
        stats = self.stats.get(url)
        if stats is None:
            stats = self.stats[url] = RoleStats()
        return stats

    def paired(self, prefill: str, decode: str) -> None:
        self.pairs += 1
        self._of(prefill).paired += 1
        self._of(decode).paired += 1

    def failed(self, side: str, cause: str, url: str | None = None) -> None:
        self.failures[(side, cause)] += 1
        if url is not None:
            self._of(url).failed += 1
