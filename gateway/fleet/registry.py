"""A worker registry: membership changed over HTTP, as sglang-router and SMG take it.

RL frameworks start their engines, then register each with the router (`POST /workers`
with `{"url": ...}`, or `POST /add_worker?url=` on older sglang-router) and remove them the
same way. This is the discovery source `backends.discovery: registry`: seeded with
`backends.static`, changed by gateway/edge/registry_api.py, published to the pool at once.
It lives as long as the gateway: a reload keeps its members.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.config import normalize_backend_url
from gateway.fleet.discovery import Failure, Publish


class RegistryError(ValueError):
    """A registration that cannot be taken; the message says why."""


class WorkerRegistry:
    name = "registry"
    causes: tuple[str, ...] = ()  # callers are refused (RegistryError); its answers never fail

    def __init__(
        self, seed: Sequence[str] = (), seed_extras: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        # url -> what the caller registered with it besides the URL (worker_type,
        # bootstrap_port, ...), kept and shown back as given. The seed's come from
        # backends.prefill and backends.decode.
        extras = seed_extras or {}
        self._workers: dict[str, dict[str, Any]] = {url: dict(extras.get(url, {})) for url in seed}
        self._publish: Publish | None = None
        self.updates = 0
        self.errors: dict[str, int] = {}
        self.failing: Failure | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def extras(self, url: str) -> Mapping[str, Any]:
        return self._workers.get(url, {})

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        self._changed()

    def _changed(self) -> None:
        if self._publish is not None:
            self.updates += 1
            self._publish(self.urls)

    def add(self, url: object, extras: Mapping[str, Any] | None = None) -> tuple[str, bool]:
        """Register a worker; (its normalised URL, whether it is new). Registering a member
        again changes nothing (idempotent, as RL frameworks retry)."""
        if not isinstance(url, str) or not url:
            raise RegistryError("a worker needs a 'url' string, e.g. http://10.0.0.5:30000")
        try:
            normal = normalize_backend_url(url)
        except ValueError as exc:
            raise RegistryError(f"worker url {url!r} {exc}") from None
        if normal in self._workers:
            return normal, False
        self._workers[normal] = dict(extras or {})
        self._changed()
        return normal, True

    def update(self, url: str, extras: Mapping[str, Any]) -> None:
        """Replace what a member was registered with (PUT/PATCH /workers/{id})."""
        if url in self._workers and self._workers[url] != dict(extras):
            self._workers[url] = dict(extras)
            self._changed()  # what a member is registered as may decide where it serves

    def replace(self, workers: Mapping[str, Mapping[str, Any]]) -> None:
        """Take the membership another worker process of this gateway changed."""
        if list(workers) == list(self._workers) and all(
            self._workers[u] == dict(e) for u, e in workers.items()
        ):
            return
        self._workers = {url: dict(extras) for url, extras in workers.items()}
        self._changed()

    def remove(self, url: str) -> bool:
        if url not in self._workers:
            return False
        del self._workers[url]
        self._changed()
        return True
