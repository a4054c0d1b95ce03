"""Where a request that names LoRA adapters may go, and what the gateway knows of them.

The gateway learns which adapters each engine holds from the load and unload calls it fans
out (gateway/edge/control.py). RL frameworks also load adapters engine-direct (Miles loads
them from tensors through its Ray actors), which the gateway never sees: so when a request
names an adapter no engine is known to hold, the engines' `GET /v1/models` is read (SGLang
lists each loaded adapter there as a model with a `parent`) before the request is refused.
Reads are shared: every request that misses while one runs waits for it, and a new one
starts at most every REFRESH_EVERY_S, so a flood of unknown names costs one read per engine
per interval, not one per request.

A name no engine holds even then is refused with SGLang's own 400 (it would refuse it on
any engine); one that some engine holds waits for that engine like any request, and gets a
503 naming the adapter when none of them can take it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Final

from gateway.contract.policy import Rejection
from gateway.edge.control import BackendResult, ControlCall, FanOut
from gateway.fleet import engines
from gateway.fleet.pool import BackendPool

log = logging.getLogger("gateway.edge.adapters")

REFRESH_EVERY_S: Final = 0.5
# One read of an engine's /v1/models; the request that waits for it waits this long at most.
REFRESH_TIMEOUT_S: Final = 5.0
_MODELS: Final = "/v1/models"


class AdapterCatalog:
    """The adapters of every member, refreshed from the engines when a request misses."""

    def __init__(self, fanout: FanOut, pool: BackendPool) -> None:
        self._fanout = fanout
        self._pool = pool
        self._refresh: asyncio.Task[None] | None = None
        self._last = float("-inf")
        self.refreshes = 0

    def held(self, names: frozenset[str]) -> bool:
        """Some plain member holds every one of `names`."""
        return any(not b.removed and b.plain and names <= b.adapters for b in self._pool.backends)

    async def refusal(
        self, names: frozenset[str], headers: list[tuple[str, str]], connect_s: float
    ) -> Rejection | None:
        """None when some engine holds every adapter named (after a read of the engines'
        /v1/models if none was known to); else SGLang's refusal of the names."""
        if self.held(names):
            return None
        task = self._refresh
        if task is None or task.done():
            task = self._refresh = asyncio.ensure_future(self._read(headers, connect_s))
        # Shielded: the read serves every request waiting for it, whoever leaves.
        await asyncio.shield(task)
        if self.held(names):
            return None
        return Rejection(400, "lora", "adapter_not_loaded", self._not_loaded(names))

    async def _read(self, headers: list[tuple[str, str]], connect_s: float) -> None:
        loop = asyncio.get_running_loop()
        wait = self._last + REFRESH_EVERY_S - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last = loop.time()
        self.refreshes += 1
        urls = [b.url for b in self._pool.backends if not b.removed]
        call = ControlCall("GET", _MODELS, headers, None, connect_s, REFRESH_TIMEOUT_S)
        results = await self._fanout.call(urls, call)
        held = {r.url: names for r in results if (names := listed_adapters(r)) is not None}
        # Each worker process reads for itself, as it reads weight versions: not shared.
        engines.hold_adapters(self._pool, held)
        unread = [r.url for r in results if r.url not in held]
        if unread:
            log.info("adapters: %d engines did not list their models", len(unread))

    def _not_loaded(self, names: frozenset[str]) -> str:
        loaded = sorted({a for b in self._pool.backends if not b.removed for a in b.adapters})
        missing = sorted(names - set(loaded)) or sorted(names)
        # SGLang's words (its LoRA registry), so a client that matches them still does.
        message = f"The following requested LoRA adapters are not loaded: {_names(missing)}\n"
        if set(missing) <= set(loaded):
            message = (
                f"No engine holds all the requested LoRA adapters together: {_names(missing)}\n"
            )
        return message + f"Loaded adapters: {_names(loaded) or 'none'}."


def listed_adapters(result: BackendResult) -> frozenset[str] | None:
    """The adapters an engine's /v1/models answer lists (cards with a `parent`); None when
    it did not answer with such a list."""
    body = result.body
    if not result.ok or not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    return frozenset(
        card["id"]
        for card in body["data"]
        if isinstance(card, dict) and card.get("parent") and isinstance(card.get("id"), str)
    )


def unavailable_message(names: Iterable[str]) -> str:
    return (
        f"No engine that holds the LoRA adapters {_names(sorted(names))} can take the "
        "request now; retry later."
    )


def holders(names: Iterable[str]) -> str:
    """The engines a request naming these adapters is for, in a refusal's words."""
    return f"(one that holds the LoRA adapters {_names(sorted(names))})"


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)
