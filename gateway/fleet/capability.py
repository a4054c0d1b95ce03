"""Capability routing: a mask request goes only to a backend whose own admission serves it.

A fleet mixes SGLang releases and settings (gateway/contract/profiles.py), so whether a
mask request can be served depends on where it goes. The body is read once into a
MaskDemand; each backend's profile judges it (once per distinct profile, not per backend),
the balancer picks among the backends that admit it, and when no member admits it the
edge answers with the refusal of the backend closest to admitting it, so the client
learns what to change (a lower top_k, say, rather than a setting it cannot touch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.contract.policy import MaskDemand, Rejection
from gateway.contract.profiles import MaskProfile
from gateway.fleet.pool import Backend


class Admission:
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

    def edge_refusal(
        self,
        backends: Sequence[Backend],
        routable: Callable[[Backend], bool],
        wanted: Callable[[Backend], bool] | None = None,
    ) -> Rejection | None:
        """None when some member admits the request (it waits for that one if it is busy or
        paused); else the refusal of the routable member closest to admitting it. `wanted`:
        what else the request needs (the weights it asks for): only those members count."""
        members = [b for b in backends if not b.removed and (wanted is None or wanted(b))]
        if not members or any(self.fits(b) for b in members):
            return None
        candidates = [b for b in members if routable(b)] or members
        closest = max(candidates, key=lambda b: b.profile.closeness())
        return self.verdict(closest)
