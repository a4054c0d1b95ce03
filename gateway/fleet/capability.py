"""Capability routing: a mask request goes only to a backend whose own admission serves it.

A fleet mixes SGLang releases and settings (gateway/contract/profiles.py), so whether a
mask request can be served depends on where it goes. The body is read once into a
MaskDemand; each backend's profile judges it (once per distinct profile, not per backend),
the balancer picks among the backends that admit it, and when no member admits it the
edge answers with the refusal of the backend closest to admitting it, so the client
learns what to change (a lower top_k, say, rather than a setting it cannot touch).
"""

from __future__ import annotations

from gateway.contract.policy import MaskDemand, Rejection
from gateway.contract.profiles import MaskProfile
from gateway.fleet.pd import DECODE_ROLE
from gateway.fleet.pool import Backend, BackendPool, Fit


class MaskVerdicts:
    """One mask request's verdict at each backend."""

    __slots__ = ("_verdicts", "demand")

    def __init__(self, demand: MaskDemand) -> None:
        self.demand = demand
        self._verdicts: dict[MaskProfile, Rejection | None] = {}

    def verdict(self, backend: Backend) -> Rejection | None:
        profile = backend.profile
        try:
            return self._verdicts[profile]
        except KeyError:
            verdict = self._verdicts[profile] = self.demand.verdict(profile)
            return verdict

    def fits(self, backend: Backend) -> bool:
        return self.verdict(backend) is None

    def edge_refusal(self, pool: BackendPool, wanted: Fit | None = None) -> Rejection | None:
        """None when some member admits the request (it waits for that one if it is busy or
        paused); else the refusal of the routable member closest to admitting it. `wanted`:
        what else the request needs (the weights it asks for): only those members count."""
        # On a prefill/decode fleet the decode engine samples: its admission decides.
        role = None if pool.pd is None else DECODE_ROLE
        members = [
            b
            for b in pool.backends
            if not b.removed
            and (b.plain if role is None else b.worker_type == role)
            and (wanted is None or wanted(b))
        ]
        if not members or any(self.fits(b) for b in members):
            return None
        now = pool.now()
        candidates = [b for b in members if pool.routable(b, now, role)] or members
        closest = max(candidates, key=_closeness)
        return self.verdict(closest)


def _closeness(backend: Backend) -> tuple[int, int, int]:
    return backend.profile.closeness()


class Needs:
    """What a request needs of a backend beyond being routable (the pool's `fits`): the
    weights it asks for, the LoRA adapters it names, and for a mask request the admission
    of the backend's profile. Made only for a request that needs any of them."""

    __slots__ = ("adapters", "mask", "version")

    def __init__(
        self,
        version: str | None,
        mask: MaskVerdicts | None = None,
        adapters: frozenset[str] = frozenset(),
    ) -> None:
        self.version = version
        self.mask = mask
        self.adapters = adapters

    def __call__(self, backend: Backend) -> bool:
        if self.version is not None and backend.weight_version != self.version:
            return False
        if self.adapters and not self.adapters <= backend.adapters:
            return False
        mask = self.mask
        return mask is None or mask.fits(backend)


def only_disaggregated(pool: BackendPool) -> Rejection | None:
    """The refusal of an ordinary request when every member is a prefill or decode worker
    and the gateway does not pair them (backends.mode regular): none of them can serve it
    alone."""
    members = [b for b in pool.backends if not b.removed]
    if pool.pd is not None or not members or any(b.plain for b in members):
        return None
    return Rejection(
        503,
        "routing",
        "disaggregated_only",
        "Only prefill and decode workers are registered (worker_type), and the gateway "
        "pairs them only with backends.mode: pd: no worker can serve a request on its own. "
        "Set backends.mode: pd, or register a regular worker.",
    )
