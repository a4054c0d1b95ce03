"""A fake Kubernetes API server on loopback: EndpointSlice (or Pod) list and watch over
real HTTP.

Just enough of the API server for discovery, and the ways a real one refuses or fails: a
token it does not accept (401), RBAC that does not grant the verb (403, with the Status the
API server sends, naming the user and the missing permission), a watch whose resource
version expired (410, as an ERROR event or as the watch's own status), a server answering
an error status while it restarts, and a server that goes away and comes back on its port.
Pods are filtered by the call's labelSelector (equality and `in` terms) as the API server
filters them, so a selector that leaves a role out shows; slices are served as stored.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
from aiohttp import web

SA_USER = "system:serviceaccount:sglang:sglang-gateway"


def status(code: int, reason: str, message: str, **details: str) -> dict[str, Any]:
    """A `Status` object as the API server writes it in an error answer or ERROR event."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def expired() -> dict[str, Any]:
    return status(410, "Expired", "too old resource version: 1 (5)")


def selected(labels: dict[str, str], selector: str) -> bool:
    """Whether a labelSelector of `k=v` and `k in (a,b)` terms selects these labels."""
    for found in re.findall(r"[^,(]+(?:\([^)]*\))?", selector):
        term = found.strip()
        if " in (" in term:
            key, values = term.split(" in (", 1)
            if labels.get(key) not in values.rstrip(")").split(","):
                return False
        elif term:
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
    return True


class FakeKubernetesApi:
    def __init__(self, namespace: str = "llm", resource: str = "endpointslices") -> None:
        self.namespace = namespace
        self.resource = resource
        group = "/apis/discovery.k8s.io/v1" if resource == "endpointslices" else "/api/v1"
        self.path = f"{group}/namespaces/{namespace}/{resource}"
        self.slices: dict[str, dict[str, Any]] = {}  # the stored objects (slices, or pods)
        self.version = 1
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.lists = 0
        self.watches = 0
        self.auth: list[str | None] = []
        self.selectors: list[str] = []
        self.hang_lists = False  # a wedged API server: lists never answer
        # Bearer tokens the server accepts; None: it does not check.
        self.tokens: set[str] | None = None
        # What the service account's RoleBinding grants on endpointslices.
        self.granted = {"list", "watch"}
        # Every call answered with this status (an API server restarting: 503), if set.
        self.fail_status: int | None = None
        # The next this many watches are answered 410 Gone themselves (not with an ERROR
        # event in a 200 stream).
        self.expire_watches = 0
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> str:
        """Listen on 127.0.0.1 (on `port` again when coming back); the server's URL."""
        app = web.Application()
        app.router.add_get(self.path, self.handler)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    async def stop(self) -> None:
        """Go away: the listener closes and open watches are cut."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def endpoint_slice(
        self, name: str, endpoints: list[tuple[str, bool | None]], port: int
    ) -> dict[str, Any]:
        eps = []
        for address, ready in endpoints:
            ep: dict[str, Any] = {"addresses": [address]}
            if ready is not None:
                ep["conditions"] = {"ready": ready}
            eps.append(ep)
        return {
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "sglang"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": eps,
        }

    def pod(
        self,
        name: str,
        ip: str,
        labels: dict[str, str],
        *,
        ready: bool = True,
        annotations: dict[str, str] | None = None,
        port: int | None = None,
    ) -> dict[str, Any]:
        """A Pod as the API server shows it: Running, its Ready condition as `ready`."""
        container: dict[str, Any] = {"name": "sglang"}
        if port is not None:
            container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        return {
            "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
            "spec": {"containers": [container]},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    def put(self, item: dict[str, Any], kind: str = "MODIFIED") -> None:
        self.version += 1
        self.slices[item["metadata"]["name"]] = item
        self.events.put_nowait({"type": kind, "object": item})

    def delete(self, name: str) -> None:
        self.version += 1
        item = self.slices.pop(name)
        self.events.put_nowait({"type": "DELETED", "object": item})

    def expire_watch(self) -> None:
        """The running watch's resource version is compacted away: an ERROR event."""
        self.events.put_nowait({"type": "ERROR", "object": expired()})

    def _refusal(self, request: web.Request, verb: str) -> web.Response | None:
        if self.tokens is not None:
            presented = request.headers.get("Authorization", "")
            if presented.removeprefix("Bearer ") not in self.tokens:
                return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if verb not in self.granted:
            group = "discovery.k8s.io" if self.resource == "endpointslices" else ""
            qualified = f"{self.resource}.{group}" if group else self.resource
            message = (
                f'{qualified} is forbidden: User "{SA_USER}" cannot {verb} '
                f'resource "{self.resource}" in API group "{group}" in the namespace '
                f'"{self.namespace}"'
            )
            body = status(403, "Forbidden", message, group=group, kind=self.resource)
            return web.json_response(body, status=403)
        if self.fail_status is not None:
            body = status(
                self.fail_status, "ServiceUnavailable", "the server is currently unable to handle"
            )
            return web.json_response(body, status=self.fail_status)
        return None

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        selector = request.query.get("labelSelector", "")
        self.selectors.append(selector)
        verb = "watch" if request.query.get("watch") == "1" else "list"
        if verb == "list":
            self.lists += 1
        else:
            self.watches += 1
        refused = self._refusal(request, verb)
        if refused is not None:
            return refused
        if verb == "list":
            if self.hang_lists:
                await asyncio.sleep(3600)
            items = [i for i in self.slices.values() if self._selects(i, selector)]
            return web.json_response(
                {
                    "kind": "EndpointSliceList" if self.resource == "endpointslices" else "PodList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        if self.expire_watches > 0:
            self.expire_watches -= 1
            return web.json_response(expired(), status=410)
        resp = web.StreamResponse()
        await resp.prepare(request)
        while True:
            event = await self.events.get()
            obj = event.get("object")
            if event["type"] != "ERROR" and not self._selects(obj, selector):
                # What no longer matches the watch's selector leaves it, as the API server
                # tells a watcher: a DELETED event.
                event = {"type": "DELETED", "object": obj}
            await resp.write(orjson.dumps(event) + b"\n")

    def _selects(self, item: Any, selector: str) -> bool:
        if self.resource == "endpointslices" or not isinstance(item, dict):
            return True
        return selected((item.get("metadata") or {}).get("labels") or {}, selector)
