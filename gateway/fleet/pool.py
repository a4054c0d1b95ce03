"""Backend state and membership: who can take the next request.

One pool owns all mutable per-backend state (health, in-flight count, passive ejection)
and the membership, which discovery replaces with immutable snapshots; the engine state a
Backend carries (paused, asleep, weight version) is written by gateway/fleet/engines.py.
Balancers only choose among the candidates it offers. No I/O here: the prober and the
proxy report outcomes in, the pool decides.

A request that only paused or asleep engines could serve is held here, as a paused SGLang
engine queues it, until one of them continues or resumes (or its hold runs out); held
requests are handed their engines in arrival order.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from gateway.contract.profiles import DEFAULT_CAP, MaskProfile, MaskRule, ServerInfo, profile_of
from gateway.fleet.balancers import Balancer
from gateway.fleet.cache_aware import CacheAware
from gateway.fleet.pd import ROLES, PdRouting
from gateway.fleet.prefix_index import Prompt

log = logging.getLogger("gateway.fleet.pool")


def worker_id(url: str) -> str:
    """A backend's id in the worker registry and control replies: stable across gateway
    replicas and restarts (derived from the URL alone)."""
    return hashlib.blake2b(url.encode(), digest_size=6).hexdigest()


# Registered worker types (sglang-router's and SMG's `worker_type`). Prefill and decode
# engines get no plain traffic: with backends.mode pd a request goes to one of each
# (gateway/edge/pd.py), else they serve none.
REGULAR: Final = "regular"
DISAGGREGATED: Final = frozenset(ROLES)


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not probed yet: routable, but does not make the gateway ready
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failed active probes: no traffic until probes pass again


class Backend:
    """One upstream SGLang server and what the gateway knows about it."""

    __slots__ = (
        "adapters",
        "asleep",
        "bootstrap_port",
        "connect_failures",
        "ejected_until",
        "ejections",
        "ejections_total",
        "errors_5xx",
        "flaps",
        "health",
        "inflight",
        "info_read_at",
        "paused",
        "probe_failures",
        "probe_successes",
        "profile",
        "recovered",
        "removed",
        "server_info",
        "url",
        "version_writes",
        "weight_version",
        "worker_type",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.health = Health.UNKNOWN
        self.inflight = 0
        self.probe_failures = 0  # consecutive failed probes
        self.probe_successes = 0  # consecutive good probes
        self.connect_failures = 0  # consecutive refused/timed-out connects
        self.errors_5xx = 0  # consecutive 5xx answers
        self.ejections = 0  # consecutive ejections, for the back-off
        self.ejections_total = 0  # every ejection that took it out, for the metric
        # Passed a probe or answered a request since it was last ejected (or joined): only
        # an ejection after that is a flap. A dead backend is ejected again and again, but
        # flaps once, when it died.
        self.recovered = False
        self.flaps = 0
        self.ejected_until = 0.0
        self.removed = False  # dropped from membership; in-flight requests still finish
        # Engine state, written by gateway/fleet/engines.py alone (control calls, the shared
        # document): a paused engine holds new generations, an asleep one has released its
        # memory.
        self.paused = False
        self.asleep = False
        self.weight_version: str | None = None
        # The LoRA adapters it has loaded, by name: a request naming one goes only to an
        # engine that has it.
        self.adapters: frozenset[str] = frozenset()
        # What it was registered as (`worker_type`): a prefill or decode engine of a
        # disaggregated pair serves no plain request on its own.
        self.worker_type = REGULAR
        # A prefill engine's KV bootstrap port (sglang-router's --prefill URL PORT), which
        # its decode partner connects to; None: the engine's default.
        self.bootstrap_port: int | None = None
        # Counts every write of weight_version: a read of the engine's version that began
        # before a write is older than it and must not replace it.
        self.version_writes = 0
        # What the backend said about itself (/server_info), and the mask admission that
        # follows from it (gateway/contract/profiles.py): the strictest until it says.
        self.server_info: ServerInfo | None = None
        self.info_read_at: float | None = None  # when it was last asked
        self.profile = MaskProfile(MaskRule.STRICT, DEFAULT_CAP)

    def __repr__(self) -> str:
        return f"Backend({self.url!r}, {self.health.value}, inflight={self.inflight})"

    @property
    def id(self) -> str:
        return worker_id(self.url)

    @property
    def plain(self) -> bool:
        """Takes ordinary requests: not one half of a prefill/decode pair."""
        return self.worker_type not in DISAGGREGATED


# What a request needs of a backend beyond being routable (proxy: weights, mask admission).
Fit = Callable[["Backend"], bool]

# Why a request that only paused or asleep engines could serve was not served: its hold ran
# out, holding is off (a hold of 0 s), every slot those engines will have is promised to a
# request held before it, or the memory its body takes was not to be had.
HOLD_EXPIRED: Final = "hold_expired"
NOT_HELD: Final = "not_held"
HOLDS_FULL: Final = "holds_full"
HOLD_MEMORY: Final = "hold_memory"
# What became of holds, for the metrics: taken, ended with an engine (or with the fleet no
# longer paused), ran out, left by their client, refused.
HOLD_EVENTS: Final = ("held", "released", "expired", "abandoned", "refused")


class HoldRefused(Exception):
    """A request that only paused or asleep engines could serve was not held, or its hold ran
    out: `reason` is one of HOLD_EXPIRED, NOT_HELD, HOLDS_FULL, HOLD_MEMORY."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class HoldMemory(Protocol):
    """The memory a held request's body takes while it waits (the proxy's inspection budget,
    gateway/edge/budget.py): what accumulates during a long pause stays bounded."""

    def try_hold(self, size: int) -> bool: ...

    def release(self, cost: int) -> None: ...


class _Hold:
    """One held request: what it needs of a backend, and the future its engine is handed to
    (None: the fleet is no longer paused for it; it looks again)."""

    __slots__ = ("exclude", "fits", "future", "key", "prompt", "role")

    def __init__(
        self,
        exclude: Sequence[Backend],
        key: str | None,
        fits: Fit | None,
        future: asyncio.Future[Backend | None],
        *,
        prompt: Prompt | None,
        role: str | None,
    ) -> None:
        self.exclude = exclude
        self.key = key
        self.fits = fits
        self.future = future
        self.prompt = prompt
        self.role = role


@dataclass(frozen=True, slots=True)
class EjectionRules:
    """When live traffic takes a backend out, and for how long."""

    consecutive_connect_failures: int = 1
    consecutive_5xx: int = 5
    base_eject_s: float = 2.0
    max_eject_s: float = 60.0


@dataclass(frozen=True, slots=True)
class PoolRules:
    """The pool's rules, swapped whole on reload."""

    healthy_threshold: int = 1
    unhealthy_threshold: int = 3
    passive: EjectionRules = EjectionRules()
    max_inflight: int | None = None  # per backend; None: no cap
    probes: bool = True  # active probes run (else a not-yet-probed backend counts as ready)
    # A backend takes traffic only once a probe passed (registered workers: an engine is
    # often registered before it finished loading). Else a not-yet-probed one is routable.
    probation: bool = False
    # policy.sampling_mask.profile pinned to a release: every backend gets this profile,
    # whatever it says. None: each its own (auto).
    pinned_profile: MaskProfile | None = None


class BackendPool:
    """The current membership and its state."""

    def __init__(
        self,
        urls: Iterable[str],
        balancer: Balancer,
        rules: PoolRules = PoolRules(),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends: tuple[Backend, ...] = ()
        self._balancer = balancer
        self.prefix = balancer if isinstance(balancer, CacheAware) else None
        # backends.mode pd: the balancer of each role and the pairs' counters; None: plain.
        self.pd: PdRouting | None = None
        self._rules = rules
        self._clock = clock
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        # Requests held for paused or asleep engines, in arrival order. Entries whose request
        # went away stay until the next hand-out or compaction; `holding` counts the live ones.
        self._holds: deque[_Hold] = deque()
        self.holding = 0
        self._hold_dead = 0
        self.hold_counts = dict.fromkeys(HOLD_EVENTS, 0)
        self.hold_memory: HoldMemory | None = None  # set by the proxy that owns the budget
        # The newest weight version in the fleet (routing: latest): the one most recently
        # installed through the gateway or first seen on an engine, written by
        # gateway/fleet/engines.py.
        self.latest_version: str | None = None
        # Every weight version a member was seen to serve, oldest first (bounded): one seen
        # before is a rollback or a restart, never newer weights.
        self.versions_seen: dict[str, None] = {}
        self.update(urls)

    # -- membership ----------------------------------------------------------------------

    def update(self, urls: Iterable[str]) -> tuple[list[Backend], list[Backend]]:
        """Replace the membership; unchanged backends keep their state.

        Removed backends are only marked: requests already on them hold a reference and
        finish normally. Returns (added, removed).
        """
        wanted = list(dict.fromkeys(urls))
        current = {b.url: b for b in self.backends}
        added = [Backend(u) for u in wanted if u not in current]
        fresh = {b.url: b for b in added}
        kept = set(wanted)
        removed = [b for url, b in current.items() if url not in kept]
        for b in removed:
            b.removed = True
        self.backends = tuple(current.get(u) or fresh[u] for u in wanted)
        self._balancer.set_members(wanted)
        if self.pd is not None:
            self.pd.set_members(wanted)
        if added or removed:
            self._reprofile()
        if added:
            self._serve_holds()  # a new engine may take what is held
        if added or removed:
            log.info(
                "membership: %d backends (+%d -%d)%s%s",
                len(self.backends),
                len(added),
                len(removed),
                "".join(f" +{b.url}" for b in added),
                "".join(f" -{b.url}" for b in removed),
            )
        return added, removed

    def reconfigure(
        self, balancer: Balancer, rules: PoolRules, pd: PdRouting | None = None
    ) -> None:
        """Swap rules on reload; backend state is kept."""
        urls = [b.url for b in self.backends]
        balancer.set_members(urls)
        if pd is not None:
            pd.set_members(urls)
            if self.pd is not None:
                pd.inherit(self.pd)
        self.pd = pd
        prefix = balancer if isinstance(balancer, CacheAware) else None
        if prefix is not None and self.prefix is not None:
            prefix.inherit(self.prefix)
        self._balancer = balancer
        self.prefix = prefix
        self._rules = rules
        self._reprofile()
        # A balancer that was not cache_aware before has heard no engine's size yet.
        for prefix in self._prefix_balancers():
            for b in self.backends:
                if b.server_info is not None:
                    prefix.report(b.url, b.server_info.cache_tokens)

    # -- what each backend admits ----------------------------------------------------------

    def learn(self, b: Backend, info: ServerInfo | None) -> None:
        """Record what `b` said about itself (None: it could not be read)."""
        b.info_read_at = self._clock()
        if info != b.server_info and info is not None:
            b.server_info = info
            self._reprofile()
            for prefix in self._prefix_balancers():
                prefix.report(b.url, info.cache_tokens)

    def forget(self, b: Backend) -> None:
        """What `b` said about itself may be stale (it restarted): ask again."""
        b.server_info = None
        b.info_read_at = None
        self._reprofile()
        if self.prefix is not None:
            self.prefix.forget(b.url)  # and its prefix cache with it
        if self.pd is not None:
            self.pd.forget(b.url)

    def _prefix_balancers(self) -> list[CacheAware]:
        found = [self.prefix] if self.prefix is not None else []
        if self.pd is not None:
            found += [b for b in self.pd.balancers() if isinstance(b, CacheAware)]
        return found

    def prefix_of(self, b: Backend) -> CacheAware | None:
        """The cache_aware balancer that routes to `b` (its role's on a PD fleet), if any."""
        if b.plain or self.pd is None:
            return self.prefix
        balancer = self.pd.balancer(b.worker_type)
        return balancer if isinstance(balancer, CacheAware) else None

    def prompt_balancer(self) -> CacheAware | None:
        """The cache_aware balancer prompts reach first: a PD fleet's prefill side (where
        the cache lives), else its decode side, else the plain one."""
        if self.pd is not None:
            for role in ROLES:
                balancer = self.pd.balancer(role)
                if isinstance(balancer, CacheAware):
                    return balancer
        return self.prefix

    def _reprofile(self) -> None:
        # A backend of unknown release gets every known rule at once, with the smallest cap
        # any member runs: it may be any of them.
        pinned = self._rules.pinned_profile
        caps = [
            b.server_info.sampling_mask_max_tokens
            for b in self.backends
            if b.server_info is not None and b.server_info.sampling_mask_max_tokens
        ]
        strict_cap = min([DEFAULT_CAP, *caps])
        for b in self.backends:
            b.profile = pinned or profile_of(b.server_info, strict_cap=strict_cap)

    # -- selection and capacity ----------------------------------------------------------

    def available(self, b: Backend, now: float) -> bool:
        """Working, as far as the gateway can tell: not failed by probes, not ejected, and
        (registered workers) probed at least once. Readiness asks this."""
        if b.health is Health.UNHEALTHY or b.ejected_until > now:
            return False
        return b.health is Health.HEALTHY or not self._rules.probation

    def routable(self, b: Backend, now: float, role: str | None = None) -> bool:
        """May take a new request at `now` (concurrency aside): available, neither paused
        nor asleep, and a plain worker (with a `role`: a worker of that type). The one rule
        pick, saturation and the metrics read."""
        return (
            self.available(b, now)
            and not b.paused
            and not b.asleep
            and (b.plain if role is None else b.worker_type == role)
        )

    def wake_waiters(self) -> None:
        """Capacity came back (a backend continued or resumed): let every waiter look, and
        hand the held requests their engines."""
        waiters, self._slot_waiters = self._slot_waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._serve_holds()

    def now(self) -> float:
        return self._clock()

    def pick(
        self,
        exclude: Sequence[Backend] = (),
        key: str | None = None,
        *,
        fits: Fit | None = None,
        prompt: Prompt | None = None,
        role: str | None = None,
    ) -> Backend | None:
        """A routable backend below its concurrency cap (and one that `fits` the request:
        the weights it asks for, a mask it can serve), or None. With cache_aware, `prompt`
        (the body and where its prompt starts) picks among them. With a `role` (prefill,
        decode), a worker of that type, by that role's balancer."""
        now = self._clock()
        cap = self._rules.max_inflight
        candidates = [
            b
            for b in self.backends
            if self.routable(b, now, role)
            and (cap is None or b.inflight < cap)
            and b not in exclude
            and (fits is None or fits(b))
        ]
        if not candidates:
            return None
        balancer = self._balancer
        prefix = self.prefix
        if role is not None and self.pd is not None:
            balancer = self.pd.balancer(role)
            prefix = balancer if isinstance(balancer, CacheAware) else None
        if prompt is not None and prefix is not None:
            return prefix.choose_for(candidates, prompt)
        return balancer.choose(candidates, key)

    def saturated(self, exclude: Sequence[Backend] = (), role: str | None = None) -> bool:
        """Some routable backend exists but all of them are at their concurrency cap.

        Then waiting briefly for a slot makes sense; otherwise nothing will come.
        """
        if self._rules.max_inflight is None:
            return False
        now = self._clock()
        return any(self.routable(b, now, role) and b not in exclude for b in self.backends)

    async def acquire(
        self,
        exclude: Sequence[Backend],
        key: str | None,
        wait_s: float,
        *,
        fits: Fit | None = None,
        prompt: Prompt | None = None,
        hold_s: float = 0.0,
        hold_bytes: int = 0,
        role: str | None = None,
    ) -> Backend | None:
        """Take a slot on a backend for the next attempt: picked and counted in flight.

        If every routable backend is at its concurrency cap, wait up to `wait_s` for a slot
        rather than overload one or fail at once; None when there is none to have. If only
        paused or asleep engines could serve it, hold it up to `hold_s` for them (its body,
        `hold_bytes`, charged to hold_memory meanwhile): HoldRefused when it is not held or
        its hold runs out.
        """
        backend = self.pick(exclude, key, fits=fits, prompt=prompt, role=role)
        if backend is None:
            return await self._wait(
                exclude, key, fits, wait_s, hold=(hold_s, hold_bytes), prompt=prompt, role=role
            )
        backend.inflight += 1
        return backend

    async def _wait(
        self,
        exclude: Sequence[Backend],
        key: str | None,
        fits: Fit | None,
        wait_s: float,
        *,
        hold: tuple[float, int],
        prompt: Prompt | None = None,
        role: str | None = None,
    ) -> Backend | None:
        """The slow path of acquire: a held request, or one waiting for a free slot, until
        it has a backend (counted in flight) or none is to come."""
        hold_s, hold_bytes = hold
        loop = asyncio.get_running_loop()
        slot_deadline: float | None = None
        hold_deadline: float | None = None
        while True:
            engines = self._paused_for(exclude, fits, role)
            if engines:
                if hold_deadline is None:
                    hold_deadline = self._start_hold(engines, hold_s, hold_bytes)
                    try:
                        backend = await self._hold(
                            exclude, key, fits, hold_deadline, prompt=prompt, role=role
                        )
                    finally:
                        if hold_bytes and self.hold_memory is not None:
                            self.hold_memory.release(hold_bytes)
                else:
                    # Paused again after its hold ended (a continue, then a pause before
                    # it looked): the rest of its hold, its body no longer charged.
                    self.hold_counts["held"] += 1
                    backend = await self._hold(
                        exclude, key, fits, hold_deadline, prompt=prompt, role=role
                    )
                if backend is not None:
                    return backend
                continue  # no longer held: busy engines, or none at all
            if wait_s <= 0 or not self.saturated(exclude, role):
                return None
            if slot_deadline is None:
                slot_deadline = loop.time() + wait_s
            if (remaining := slot_deadline - loop.time()) <= 0:
                return None
            waiter: asyncio.Future[None] = loop.create_future()
            self._slot_waiters.append(waiter)
            try:
                async with asyncio.timeout(remaining):
                    await waiter
            except TimeoutError:
                return None
            finally:
                if not waiter.done():
                    waiter.cancel()
            backend = self.pick(exclude, key, fits=fits, prompt=prompt, role=role)
            if backend is not None:
                backend.inflight += 1
                return backend

    # -- holds for a paused fleet ----------------------------------------------------------

    def _paused_for(
        self, exclude: Sequence[Backend], fits: Fit | None, role: str | None = None
    ) -> int:
        """How many working engines that are paused or asleep could serve the request (plain
        workers, or with a `role` workers of that type), when no routable one could (busy or
        not); else 0: it is not for a hold."""
        now = self._clock()
        paused = 0
        for b in self.backends:
            if (
                b in exclude
                or not (b.plain if role is None else b.worker_type == role)
                or not self.available(b, now)
                or (fits is not None and not fits(b))
            ):
                continue
            if not (b.paused or b.asleep):
                return 0  # a routable engine serves it: a wait for a slot, if any
            paused += 1
        return paused

    def _start_hold(self, engines: int, hold_s: float, hold_bytes: int) -> float:
        """Admit a request to the holds, or refuse it (HoldRefused); its hold's deadline."""
        counts = self.hold_counts
        reason = None
        cap = self._rules.max_inflight
        if hold_s <= 0:
            reason = NOT_HELD
        elif cap is not None and self.holding >= cap * engines:
            # Each held request takes a slot the engines will have when they continue: more
            # than those would only wait for a slot after the continue, then fail.
            reason = HOLDS_FULL
        elif (
            hold_bytes
            and self.hold_memory is not None
            and not self.hold_memory.try_hold(hold_bytes)
        ):
            reason = HOLD_MEMORY
        if reason is not None:
            counts["refused"] += 1
            raise HoldRefused(reason)
        counts["held"] += 1
        return asyncio.get_running_loop().time() + hold_s

    async def _hold(
        self,
        exclude: Sequence[Backend],
        key: str | None,
        fits: Fit | None,
        deadline: float,
        *,
        prompt: Prompt | None = None,
        role: str | None = None,
    ) -> Backend | None:
        """Wait in the holds until handed an engine (counted in flight), or None once the
        fleet is no longer paused for the request; HoldRefused when `deadline` passes."""
        loop = asyncio.get_running_loop()
        counts = self.hold_counts
        future: asyncio.Future[Backend | None] = loop.create_future()
        self._holds.append(_Hold(exclude, key, fits, future, prompt=prompt, role=role))
        self.holding += 1
        try:
            async with asyncio.timeout(deadline - loop.time()):
                backend = await future
        except BaseException as exc:
            answered = future.done() and not future.cancelled()
            granted = future.result() if answered else None
            if answered:
                self.holding -= 1  # answered (and taken off the queue) just as it ended
            else:
                future.cancel()  # the wait's cancellation has cancelled it already, as a rule
                self._left_hold()
            if isinstance(exc, TimeoutError):
                if granted is not None:
                    counts["released"] += 1
                    return granted
                counts["expired"] += 1
                raise HoldRefused(HOLD_EXPIRED) from None
            if granted is not None:
                self.release(granted)  # its client left before it could use the engine
            counts["abandoned"] += 1
            raise
        self.holding -= 1
        counts["released"] += 1
        return backend

    def _left_hold(self) -> None:
        """A held request went away: its entry is dropped lazily, the queue compacted once
        most of it is dead (so clients that leave during a long pause cost no scan each)."""
        self.holding -= 1
        self._hold_dead += 1
        if self._hold_dead > 64 and self._hold_dead * 2 > len(self._holds):
            self._holds = deque(h for h in self._holds if not h.future.done())
            self._hold_dead = 0

    def _serve_holds(self) -> None:
        """Hand the held requests the engines that can take them now, in arrival order; those
        no longer held for a paused engine are let go to look again. Runs when engines
        continue, resume, join or change health: rare events, so a walk of the queue."""
        holds = self._holds
        if not holds:
            return
        kept: deque[_Hold] = deque()
        for h in holds:
            future = h.future
            if future.done():
                continue
            backend = self.pick(h.exclude, h.key, fits=h.fits, prompt=h.prompt, role=h.role)
            if backend is not None:
                backend.inflight += 1  # now, so the next one's pick sees it
                future.set_result(backend)
            elif self._paused_for(h.exclude, h.fits, h.role):
                kept.append(h)
            else:
                future.set_result(None)
        self._holds = kept
        self._hold_dead = 0

    def release(self, backend: Backend) -> None:
        """The attempt on `backend` ended: free its slot and wake one waiter."""
        backend.inflight -= 1
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    @property
    def ready(self) -> bool:
        """At least one backend has been seen working (or, with probes off, is not known to
        be broken) and is not ejected."""
        now = self._clock()
        ok = (Health.HEALTHY,) if self._rules.probes else (Health.HEALTHY, Health.UNKNOWN)
        # Paused or asleep engines still count: an RL fleet mid weight-update is not broken.
        return any(b.health in ok and self.available(b, now) for b in self.backends)

    def ready_count(self) -> int:
        """How many backends count towards `ready` (SMG's /readiness reports the number)."""
        now = self._clock()
        ok = (Health.HEALTHY,) if self._rules.probes else (Health.HEALTHY, Health.UNKNOWN)
        return sum(1 for b in self.backends if b.health in ok and self.available(b, now))

    def find(self, worker: str) -> Backend | None:
        """The member a worker id or URL names (the registry and addressed calls use both)."""
        return next((b for b in self.backends if worker in (b.id, b.url)), None)

    def ejected(self, b: Backend) -> bool:
        return b.ejected_until > self._clock()

    # -- outcomes ----------------------------------------------------------------------

    def _set(self, b: Backend, health: Health, why: str) -> None:
        if b.health is not health:
            # Only transitions are logged: a flapping fleet must not flood the log.
            level = logging.WARNING if health is Health.UNHEALTHY else logging.INFO
            log.log(level, "backend %s: %s -> %s (%s)", b.url, b.health.value, health.value, why)
            b.health = health
            if self._holds:
                self._serve_holds()  # an engine held requests wait for came or went

    def probe_ok(self, b: Backend) -> None:
        b.recovered = True
        b.probe_failures = 0
        b.probe_successes += 1
        if b.health is not Health.HEALTHY and b.probe_successes >= self._rules.healthy_threshold:
            if b.ejected_until:
                # A passing probe ends a passive ejection early.
                b.ejected_until = 0.0
                b.ejections = 0
                b.connect_failures = b.errors_5xx = 0
            self._set(b, Health.HEALTHY, "probe succeeded")

    def probe_failed(self, b: Backend, why: str) -> None:
        b.probe_successes = 0
        b.probe_failures += 1
        if b.health is Health.UNKNOWN or b.probe_failures >= self._rules.unhealthy_threshold:
            self._set(b, Health.UNHEALTHY, why)

    def response(self, b: Backend, status: int) -> None:
        """A backend answered. 5xx in a row eject it; a 4xx (a refusal of the request, not
        a sign of a broken backend) counts neither way."""
        b.connect_failures = 0
        if status >= 500:
            b.errors_5xx += 1
            if b.errors_5xx >= self._rules.passive.consecutive_5xx:
                self._eject(b, f"{b.errors_5xx} consecutive 5xx")
                b.errors_5xx = 0
            return
        if status < 400:
            b.recovered = True
            b.errors_5xx = 0
            b.ejections = 0
        if b.health is Health.UNKNOWN:
            self._set(b, Health.HEALTHY, "answered a request")

    def connect_failed(self, b: Backend, why: str) -> None:
        """Passive ejection: refused connections take the backend out for a while.

        Nothing was sent, so the request itself moves on to another backend. The prober,
        or the end of the ejection period, lets it back in.
        """
        b.connect_failures += 1
        if b.connect_failures >= self._rules.passive.consecutive_connect_failures:
            self._eject(b, why)
            b.connect_failures = 0

    def _eject(self, b: Backend, why: str) -> None:
        now = self._clock()
        p = self._rules.passive
        # Exponential back-off, so a dead backend costs ever fewer failed attempts.
        period = min(p.max_eject_s, p.base_eject_s * (2 ** min(b.ejections, 16)))
        if b.ejected_until <= now:
            log.warning("backend %s: ejected for %.1fs (%s)", b.url, period, why)
            b.ejections_total += 1
            if b.recovered:
                b.flaps += 1
            b.recovered = False
        b.ejections += 1
        b.ejected_until = now + period
