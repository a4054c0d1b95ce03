"""Prefill and decode workers found as Kubernetes Pods, by their labels.

EndpointSlices carry no pod labels, so backends.mode pd with Kubernetes discovery lists and
watches the namespace's Pods instead, as sglang-router (SMG) does with
`--service-discovery --prefill-selector ... --decode-selector ...`: its
sgl-router/src/service_discovery.rs (sgl-project/sglang) gives a pod the prefill role when
every label of the prefill selector matches (then decode's; an empty selector matches
nothing), takes a pod as healthy when its Ready condition is True and its phase Running,
removes it once it has a deletionTimestamp, and reads a prefill pod's bootstrap port from
the annotation `sglang.ai/bootstrap-port` (`--bootstrap-port-annotation`). Here the same,
with two differences: a pod matching both selectors is refused (SMG makes it a prefill
worker), and so is a prefill pod whose annotation is not a port (SMG sends null, which
points decode at the engine's default port, likely the wrong one).

The list, the watch, the backoff, the relist after 410 and the last set kept while the API
fails are KubernetesDiscovery's; this adds what a pod says (its URL, its role) and hands the
roles to the fleet as a registered worker's `worker_type` and `bootstrap_port`
(WorkerRegistry.extras), so the pool types them as it types registered workers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from gateway.fleet.discovery import (
    CAUSES,
    KubernetesDiscovery,
    ListWatchApi,
    Publish,
    backend_url,
)
from gateway.fleet.pd import DECODE_ROLE, PREFILL_ROLE

log = logging.getLogger("gateway.fleet.discovery")

# A pod that is not taken, for the `cause` label: counted once per pod and fault, and the
# rest of the set is still taken (the discovery is not failing for it).
AMBIGUOUS: Final = "ambiguous_role"  # its labels match both role selectors
BAD_ANNOTATION: Final = "bad_annotation"  # a prefill pod's bootstrap-port annotation is no port


def matches(labels: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    """Every label of the selector, with its value; an empty selector matches nothing."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def ready(pod: Mapping[str, Any]) -> bool:
    """Running, its Ready condition True, and not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def container_port(pod: Mapping[str, Any], name: str) -> int | None:
    """The number of the pod's container port called `name`."""
    for container in (pod.get("spec") or {}).get("containers") or ():
        for p in container.get("ports") or ():
            if p.get("name") == name and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return None


def bootstrap_port(text: object) -> int | None:
    """An annotation's port, or None if it is not one (annotations are strings)."""
    if not isinstance(text, str) or not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


class PodDiscovery(KubernetesDiscovery):
    """Ready pods of either role, each with its role and (prefill) bootstrap port."""

    causes: tuple[str, ...] = (*CAUSES, AMBIGUOUS, BAD_ANNOTATION)
    nothing = "no ready prefill or decode pod"

    def __init__(
        self,
        api: ListWatchApi,
        *,
        prefill_selector: Mapping[str, str],
        decode_selector: Mapping[str, str],
        bootstrap_port_annotation: str,
        scheme: str,
        port: int | None,
        port_name: str | None,
        resync_s: float,
        retry_base_s: float = 1.0,
        retry_max_s: float = 30.0,
        **seams: Any,
    ) -> None:
        super().__init__(
            api,
            scheme=scheme,
            port=port,
            port_name=port_name,
            resync_s=resync_s,
            retry_base_s=retry_base_s,
            retry_max_s=retry_max_s,
            **seams,
        )
        self._selectors = (
            (PREFILL_ROLE, dict(prefill_selector)),
            (DECODE_ROLE, dict(decode_selector)),
        )
        self._annotation = bootstrap_port_annotation
        # By pod name: its URL's worker_type and bootstrap_port, as a worker registers them.
        self._pods: dict[str, tuple[str, dict[str, Any]]] = {}
        # Pods refused, with why: each is counted and logged once, until it changes.
        self._refused: dict[str, str] = {}
        self._roles: dict[str, dict[str, Any]] = {}  # by URL, as last published

    def extras(self, url: str) -> Mapping[str, Any]:
        """What the pod at `url` is, as WorkerRegistry.extras says of a registered worker."""
        return self._roles.get(url, {})

    def _urls(self, item: dict[str, Any]) -> list[str]:
        metadata = item.get("metadata") or {}
        name = metadata["name"]
        self._pods.pop(name, None)
        labels = metadata.get("labels") or {}
        roles = [role for role, selector in self._selectors if matches(labels, selector)]
        if not roles:
            self._refused.pop(name, None)
            return []  # the API's selector is wider than the roles': not one of ours
        if len(roles) > 1:
            self._refuse(
                name,
                AMBIGUOUS,
                "its labels match both prefill_selector and "
                "decode_selector; it is given neither role",
            )
            return []
        extras: dict[str, Any] = {"worker_type": roles[0]}
        if roles[0] == PREFILL_ROLE:
            text = (metadata.get("annotations") or {}).get(self._annotation)
            port = bootstrap_port(text)
            if text is not None and port is None:
                self._refuse(
                    name,
                    BAD_ANNOTATION,
                    f"its annotation {self._annotation} is "
                    "not a port number from 1 to 65535; it is left out",
                )
                return []
            extras["bootstrap_port"] = port
        self._refused.pop(name, None)
        if not ready(item):
            return []
        host = (item.get("status") or {}).get("podIP")
        chosen = self._port if self._port_name is None else container_port(item, self._port_name)
        if not isinstance(host, str) or not host or chosen is None:
            return []
        url = backend_url(self._scheme, host, chosen)
        self._pods[name] = (url, extras)
        return [url]

    def _refuse(self, name: str, cause: str, why: str) -> None:
        if self._refused.get(name) == cause:
            return  # counted when it first came: a relist or a new event is the same fault
        self._refused[name] = cause
        self._count(cause, why, failing=False)
        # A pod's name is the API's text: kept to one printable line.
        shown = "".join(c if c.isprintable() else "?" for c in str(name)[:253])
        log.warning("kubernetes discovery: pod %s in %s: %s", shown, self._api.target, why)

    def _take(self, items: list[dict[str, Any]]) -> None:
        self._pods = {}
        super()._take(items)
        listed = set(self._slices)
        self._refused = {n: c for n, c in self._refused.items() if n in listed}

    def _drop(self, name: str) -> None:
        super()._drop(name)
        self._pods.pop(name, None)
        self._refused.pop(name, None)

    def _publish(self, publish: Publish) -> None:
        roles = dict(self._pods.values())
        if roles and roles != self._roles:
            # The same URLs in another role (or with another bootstrap port) must reach
            # the pool too: it types its members on every publish.
            self._last = None

        def publish_roles(urls: tuple[str, ...]) -> None:
            self._roles = roles
            publish(urls)

        super()._publish(publish_roles)
