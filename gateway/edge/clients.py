"""The gateway's own HTTP calls, over aiohttp: health probes and the Kubernetes API.

fleet/ decides what to probe and what a discovery answer means, and imports no HTTP client;
these are the implementations it is given (`AiohttpClients`), so aiohttp's errors stop here
and fleet/ sees only probe results and OSError.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.config import GatewayConfig, KubernetesConfig
from gateway.contract.profiles import ServerInfo
from gateway.fleet.discovery import (
    BAD_RESPONSE,
    UNAUTHORIZED,
    UNREACHABLE,
    ApiError,
    ListWatchApi,
)
from gateway.fleet.health import ProbeResult
from gateway.runtime import LOCAL_ERRNOS


def make_session(cfg: GatewayConfig) -> aiohttp.ClientSession:
    """The client for health probes and discovery (the request path has its own)."""
    t = cfg.timeouts
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=0,
        # Below uvicorn's 5 s idle timeout, like the request path's pool: a probe never
        # goes out on a connection the backend is closing.
        keepalive_timeout=t.upstream_keepalive_s,
        ttl_dns_cache=10,
    )
    return aiohttp.ClientSession(
        connector=connector,
        # A default only: health probes and the Kubernetes list and watch set their own.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.ttfb_s),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        max_line_size=cfg.limits.max_header_bytes,
        max_field_size=cfg.limits.max_header_bytes,
    )


# How many engines of a release before the /model_info rename are remembered as such.
_LEGACY_KEPT = 1024


class AiohttpClients:
    """fleet.membership.FleetClients over one aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        # Engines that answer /get_model_info but not /model_info (oldest first, bounded).
        self._legacy_model_info: dict[str, None] = {}

    async def probe(self, url: str, timeout_s: float) -> ProbeResult:
        try:
            async with self._session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    return ProbeResult(True, "probe succeeded")
                return ProbeResult(False, f"probe status {resp.status}")
        except TimeoutError:
            return ProbeResult(False, "probe timed out")
        except aiohttp.ClientError as exc:
            if isinstance(exc, aiohttp.ClientOSError) and exc.errno in LOCAL_ERRNOS:
                # The gateway is out of descriptors: it says nothing about the backend.
                return ProbeResult(False, f"probe not sent: {type(exc).__name__}", counted=False)
            return ProbeResult(False, f"probe failed: {type(exc).__name__}")

    async def _json(self, url: str, timeout_s: float) -> tuple[int, object]:
        """(status, its JSON object or None); status 0 when nothing usable came back."""
        try:
            async with self._session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return resp.status, None
                return 200, orjson.loads(await resp.read())
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
            return 0, None

    async def weight_version(self, url: str, timeout_s: float) -> str | None:
        # Read on every good probe, so an engine of a release before the rename is asked at
        # its old path from the first 404 on, not twice every time.
        legacy = self._legacy_model_info
        old = url in legacy
        status, info = await self._json(
            url + ("/get_model_info" if old else "/model_info"), timeout_s
        )
        if status == 404 and not old:
            status, info = await self._json(url + "/get_model_info", timeout_s)
            if status == 200:
                legacy[url] = None
                if len(legacy) > _LEGACY_KEPT:
                    del legacy[next(iter(legacy))]
        version = info.get("weight_version") if isinstance(info, dict) else None
        return version if isinstance(version, str) else None

    async def server_info(self, url: str, timeout_s: float) -> ServerInfo | None:
        status, info = await self._json(url + "/server_info", timeout_s)
        if status == 404:  # releases before the rename
            status, info = await self._json(url + "/get_server_info", timeout_s)
        return ServerInfo.from_json(info) if isinstance(info, dict) else None

    def endpoint_slices(self, cfg: KubernetesConfig) -> ListWatchApi:
        return self._kubernetes(cfg, "endpointslices")

    def pods(self, cfg: KubernetesConfig) -> ListWatchApi:
        return self._kubernetes(cfg, "pods")

    def _kubernetes(self, cfg: KubernetesConfig, resource: str) -> ListWatchApi:
        return KubernetesApi(
            self._session,
            api_server=cfg.api_server,
            namespace=cfg.namespace,
            label_selector=cfg.selector,
            token_file=cfg.token_file,
            ca_file=cfg.ca_file,
            resource=resource,
        )


def _no_answer(exc: BaseException) -> str:
    """What went wrong with a call that got no usable answer, in the gateway's words (an
    aiohttp error's text can quote the request URL and what the server sent)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer was cut off"
    return type(exc).__name__


def _json(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


# Where each resource discovery reads lives in the API, under the namespace.
_PATHS = {"endpointslices": "/apis/discovery.k8s.io/v1", "pods": "/api/v1"}
_LISTS = {"endpointslices": "EndpointSliceList", "pods": "PodList"}


class KubernetesApi:
    """discovery.ListWatchApi over aiohttp (no client library): EndpointSlices or Pods."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        api_server: str,
        namespace: str,
        label_selector: str,
        token_file: str | None,
        ca_file: str | None,
        list_timeout_s: float = 30.0,
        resource: str = "endpointslices",
    ) -> None:
        self._session = session
        # A list is one bounded JSON reply; a hung API server must not hold discovery for the
        # session's default read timeout (ttfb_s, meant for prefill).
        self._list_timeout = aiohttp.ClientTimeout(total=list_timeout_s)
        self.resource = resource
        self._base = f"{api_server.rstrip('/')}{_PATHS[resource]}/namespaces/{namespace}/{resource}"
        self._selector = label_selector
        qualified = "endpointslices.discovery.k8s.io" if resource == "endpointslices" else resource
        self.target = (
            f'{qualified} in namespace "{namespace}" (labelSelector {label_selector or "none"})'
        )
        self._token_file = token_file
        self._ssl: ssl.SSLContext | bool = True
        if ca_file is not None and api_server.startswith("https"):
            self._ssl = ssl.create_default_context(cafile=ca_file)

    async def _headers(self, verb: str) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_file is not None:
            # Re-read every call: projected service-account tokens rotate. In a thread, so
            # a slow volume never stalls the event loop.
            path = Path(self._token_file)
            try:
                text = await asyncio.to_thread(path.read_text, encoding="utf-8")
            except (OSError, UnicodeError) as exc:
                # No credential to send: the API server would only answer 401.
                why = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
                raise ApiError(
                    UNAUTHORIZED,
                    verb,
                    message=f"cannot read the token file {path}: {why}",
                    resource=self.resource,
                ) from exc
            headers["Authorization"] = f"Bearer {text.strip()}"
        return headers

    async def list(self) -> tuple[list[dict[str, Any]], str]:
        params = {"labelSelector": self._selector}
        try:
            async with self._session.get(
                self._base,
                params=params,
                headers=await self._headers("list"),
                ssl=self._ssl,
                timeout=self._list_timeout,
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise ApiError.answered("list", resp.status, _json(raw), self.resource)
        except TimeoutError as exc:
            # An error to count and back off from, not the watch's periodic-relist timeout.
            raise ApiError(
                UNREACHABLE,
                "list",
                message=f"timed out after {self._list_timeout.total} s",
                resource=self.resource,
            ) from exc
        except aiohttp.ClientError as exc:
            raise ApiError(
                UNREACHABLE, "list", message=_no_answer(exc), resource=self.resource
            ) from exc
        body = _json(raw)
        metadata = body.get("metadata") if isinstance(body, dict) else None
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(metadata, dict) or not isinstance(items, list | None):
            kind = _LISTS[self.resource]
            raise ApiError(BAD_RESPONSE, "list", 200, f"not a {kind}", resource=self.resource)
        return list(items or []), str(metadata.get("resourceVersion", ""))

    async def watch(
        self, resource_version: str, timeout_s: float
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        params = {
            "labelSelector": self._selector,
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(timeout_s)),
        }
        try:
            async with self._session.get(
                self._base,
                params=params,
                headers=await self._headers("watch"),
                ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout_s + 30),
            ) as resp:
                if resp.status != 200:
                    raise ApiError.answered(
                        "watch", resp.status, _json(await resp.read()), self.resource
                    )
                async for line in resp.content:
                    if line.strip():
                        event = _json(line)
                        if not isinstance(event, dict):
                            raise ApiError(
                                BAD_RESPONSE,
                                "watch",
                                200,
                                "not a watch event",
                                resource=self.resource,
                            )
                        obj = event.get("object")
                        yield str(event.get("type")), obj if isinstance(obj, dict) else {}
        except aiohttp.ClientError as exc:
            raise ApiError(
                UNREACHABLE, "watch", message=_no_answer(exc), resource=self.resource
            ) from exc
