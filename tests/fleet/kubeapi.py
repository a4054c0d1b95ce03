"""A fake Kubernetes API server on loopback: EndpointSlice list and watch over real HTTP.

Just enough of the API server for discovery, and the ways a real one refuses or fails: a
token it does not accept (401), RBAC that does not grant the verb (403, with the Status the
API server sends, naming the user and the missing permission), a watch whose resource
version expired (410, as an ERROR event or as the watch's own status), a server answering
an error status while it restarts, and a server that goes away and comes back on its port.
"""

from __future__ import annotations

import asyncio
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


class FakeKubernetesApi:
    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.slices: dict[str, dict[str, Any]] = {}
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

    def put(self, item: dict[str, Any], kind: str = "MODIFIED") -> None:
        self.version += 1
        self.slices[item["metadata"]["name"]] = item
        self.events.put_nowait({"type": kind, "object": item})

    def expire_watch(self) -> None:
        """The running watch's resource version is compacted away: an ERROR event."""
        self.events.put_nowait({"type": "ERROR", "object": expired()})

    def _refusal(self, request: web.Request, verb: str) -> web.Response | None:
        if self.tokens is not None:
            presented = request.headers.get("Authorization", "")
            if presented.removeprefix("Bearer ") not in self.tokens:
                return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if verb not in self.granted:
            message = (
                f'endpointslices.discovery.k8s.io is forbidden: User "{SA_USER}" cannot {verb} '
                f'resource "endpointslices" in API group "discovery.k8s.io" in the namespace '
                f'"{self.namespace}"'
            )
            body = status(
                403, "Forbidden", message, group="discovery.k8s.io", kind="endpointslices"
            )
            return web.json_response(body, status=403)
        if self.fail_status is not None:
            body = status(
                self.fail_status, "ServiceUnavailable", "the server is currently unable to handle"
            )
            return web.json_response(body, status=self.fail_status)
        return None

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        self.selectors.append(request.query.get("labelSelector", ""))
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
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": list(self.slices.values()),
                }
            )
        if self.expire_watches > 0:
            self.expire_watches -= 1
            return web.json_response(expired(), status=410)
        resp = web.StreamResponse()
        await resp.prepare(request)
        while True:
            event = await self.events.get()
            await resp.write(orjson.dumps(event) + b"\n")
