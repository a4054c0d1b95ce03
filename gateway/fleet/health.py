"""Active health probes: one owned task per backend, at most one probe in flight each.

SGLang's /health runs a one-token generation, so under load a probe can take seconds;
a backend is never probed again while its previous probe is still running. Tasks follow
membership: new backends get a prober, removed ones lose theirs.

Each good probe also reads the weight version the engine serves (its /model_info), so the
gateway's view (GET /workers, X-Weight-Version, routing.weight_version: latest) follows an
engine updated directly within one probe interval. Its cost, measured against the stub on a
kept-alive connection: one more GET per engine per interval in each gateway worker process,
after the probe, of 51 bytes out and 394 bytes back (a 256-byte head, 138 bytes of JSON;
SGLang's answer is about as large: a shorter uvicorn head, a longer body with its paths and
model flags). 100 engines at the default 5 s interval: 20 reads/s, about 1 KB/s out and
8 KB/s in per worker process, beside as many /health probes. An engine of a release before
the /model_info rename is read at /get_model_info from its first 404 on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config import HealthConfig
from gateway.contract.profiles import ServerInfo
from gateway.fleet import engines
from gateway.fleet.pool import Backend, BackendPool, Health

log = logging.getLogger("gateway.fleet.health")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    why: str
    # False when the probe could not be sent for a reason of the gateway's own (out of
    # descriptors): it says nothing about the backend and changes no state.
    counted: bool = True


class Prober(Protocol):
    async def probe(self, url: str, timeout_s: float) -> ProbeResult: ...

    async def weight_version(self, url: str, timeout_s: float) -> str | None:
        """The weights a backend serves (its /model_info), or None if it does not say."""
        ...

    async def server_info(self, url: str, timeout_s: float) -> ServerInfo | None:
        """What a backend says about its release and settings (its /server_info)."""
        ...


# A backend whose /server_info could not be read is asked again this often (it keeps the
# strictest profile meanwhile).
INFO_RETRY_S = 30.0


class HealthChecker:
    def __init__(self, pool: BackendPool, prober: Prober, cfg: HealthConfig) -> None:
        self._pool = pool
        self._prober = prober
        self.cfg = cfg
        self._tasks: dict[Backend, asyncio.Task[None]] = {}

    def sync(self, backends: Sequence[Backend]) -> None:
        """Start probers for new members and stop those of removed ones. With probes off
        the gateway never calls a backend on its own, so it learns no profile (pin one)."""
        wanted = set(backends) if self.cfg.enabled else set()
        for backend in list(self._tasks):
            if backend not in wanted:
                self._tasks.pop(backend).cancel()
        for backend in backends:
            if backend in wanted and backend not in self._tasks:
                self._tasks[backend] = asyncio.create_task(
                    self._loop(backend), name=f"health:{backend.url}"
                )

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def probe_once(self, backend: Backend) -> bool:
        result = await self._prober.probe(backend.url + self.cfg.path, self.cfg.timeout_s)
        if not result.counted:
            log.warning("health probe of %s: %s", backend.url, result.why)
        elif result.ok:
            restarted = backend.health is Health.UNHEALTHY  # it may run another release now
            if restarted:
                self._pool.forget(backend)  # the strictest profile until it says again
            self._pool.probe_ok(backend)
            read_at = backend.info_read_at
            if (
                restarted
                or read_at is None
                or (backend.server_info is None and self._pool.now() - read_at >= INFO_RETRY_S)
            ):
                info = await self._prober.server_info(backend.url, self.cfg.timeout_s)
                self._pool.learn(backend, info)
            # On every good probe: an RL framework may update the engine behind the
            # gateway's back (slime and Miles call each engine's /update_weights_from_*).
            since = engines.mark(backend)
            version = await self._prober.weight_version(backend.url, self.cfg.timeout_s)
            engines.reported(self._pool, backend, version, since)
        else:
            self._pool.probe_failed(backend, result.why)
        return result.ok

    async def _loop(self, backend: Backend) -> None:
        while True:
            try:
                await self.probe_once(backend)
            except asyncio.CancelledError:
                raise
            except Exception:  # a prober must outlive any one bad probe
                log.exception("health probe of %s crashed", backend.url)
            await asyncio.sleep(self.cfg.interval_s)
