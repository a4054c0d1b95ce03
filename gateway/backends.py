"""Backend state and selection: who can take the next request.

One pool owns all mutable per-backend state (health, in-flight count, passive ejection);
balancers only choose among the candidates it offers. No I/O here: the health prober
and the proxy report outcomes in, the pool decides.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

log = logging.getLogger("gateway.backends")


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not probed yet: routable, but does not make the gateway ready
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class Backend:
    """One upstream SGLang server and what the gateway knows about it."""

    __slots__ = (
        "ejected_until",
        "failures",
        "health",
        "inflight",
        "successes",
        "url",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.health = Health.UNKNOWN
        self.inflight = 0
        self.failures = 0  # consecutive failed probes or connects
        self.successes = 0  # consecutive good probes
        self.ejected_until = 0.0

    def __repr__(self) -> str:
        return f"Backend({self.url!r}, {self.health.value}, inflight={self.inflight})"


class Balancer(Protocol):
    def choose(self, candidates: Sequence[Backend]) -> Backend: ...


class RoundRobin:
    __slots__ = ("_counter",)

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        return candidates[next(self._counter) % len(candidates)]


class LeastInflight:
    """Fewest requests in flight: LLM requests vary 1000x in cost, so load beats turns.

    Ties rotate, so an idle fleet still spreads requests instead of piling on the first.
    """

    __slots__ = ("_counter",)

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        n = len(candidates)
        start = next(self._counter) % n
        best = candidates[start]
        for i in range(1, n):
            b = candidates[(start + i) % n]
            if b.inflight < best.inflight:
                best = b
        return best


BALANCERS: dict[str, Callable[[], Balancer]] = {
    "least_inflight": LeastInflight,
    "round_robin": RoundRobin,
}


class BackendPool:
    """The backends of the current snapshot and their health."""

    def __init__(
        self,
        urls: Iterable[str],
        balancer: Balancer,
        *,
        healthy_threshold: int = 1,
        unhealthy_threshold: int = 3,
        eject_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends: tuple[Backend, ...] = tuple(Backend(u) for u in dict.fromkeys(urls))
        self._balancer = balancer
        self._healthy_threshold = healthy_threshold
        self._unhealthy_threshold = unhealthy_threshold
        self._eject_s = eject_s
        self._clock = clock

    def _routable(self, b: Backend, now: float) -> bool:
        if b.health is Health.UNHEALTHY:
            return False
        return b.ejected_until <= now

    def pick(self, exclude: Sequence[Backend] = ()) -> Backend | None:
        now = self._clock()
        candidates = [b for b in self.backends if b not in exclude and self._routable(b, now)]
        if not candidates:
            return None
        return self._balancer.choose(candidates)

    @property
    def ready(self) -> bool:
        """At least one backend has been seen working and is not ejected."""
        now = self._clock()
        return any(b.health is Health.HEALTHY and b.ejected_until <= now for b in self.backends)

    def _set(self, b: Backend, health: Health, why: str) -> None:
        if b.health is not health:
            # Only transitions are logged: a flapping fleet must not flood the log.
            level = logging.WARNING if health is Health.UNHEALTHY else logging.INFO
            log.log(level, "backend %s: %s -> %s (%s)", b.url, b.health.value, health.value, why)
            b.health = health

    def probe_ok(self, b: Backend) -> None:
        b.failures = 0
        b.successes += 1
        if b.health is not Health.HEALTHY and b.successes >= self._healthy_threshold:
            b.ejected_until = 0.0
            self._set(b, Health.HEALTHY, "probe succeeded")

    def probe_failed(self, b: Backend, why: str) -> None:
        b.successes = 0
        b.failures += 1
        if b.health is Health.UNKNOWN or b.failures >= self._unhealthy_threshold:
            self._set(b, Health.UNHEALTHY, why)

    def request_ok(self, b: Backend) -> None:
        """A request got a response: the backend is reachable."""
        b.failures = 0
        if b.health is Health.UNKNOWN:
            self._set(b, Health.HEALTHY, "answered a request")

    def connect_failed(self, b: Backend, why: str) -> None:
        """Passive ejection: a refused connection takes the backend out for a while.

        Nothing was sent, so the request itself moves on to another backend. The prober
        (or, with probes off, the end of the ejection period) lets it back in.
        """
        b.successes = 0
        b.failures += 1
        now = self._clock()
        if b.ejected_until <= now:
            log.warning("backend %s: ejected for %.1fs (%s)", b.url, self._eject_s, why)
        b.ejected_until = now + self._eject_s
