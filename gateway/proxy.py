"""The request path: read -> inspect -> pick a backend -> forward -> stream back.

Everything is decided before the first byte goes to the client (status, backend, any
retry); after that bytes are only piped, and an upstream failure ends the client's
transfer visibly broken (connection aborted), never as a clean, truncated reply.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Final

import aiohttp
from aiohttp import web
from yarl import URL

from gateway import errors
from gateway.backends import Backend, BackendPool
from gateway.config import GatewayConfig
from gateway.headers import REQUEST_ID, ForwardingPolicy, valid_request_id
from gateway.inspection import check_headers, inspect_body
from gateway.observe import Exchange, Observer
from gateway.policy import MaskPolicy, Rejection
from gateway.routes import Family, Route, RouteTable

log = logging.getLogger("gateway.proxy")

_JSON: Final = "application/json"
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


class _TooLarge(Exception):
    pass


class Proxy:
    """The gateway's request handler (an aiohttp low-level `web.Server` handler)."""

    def __init__(
        self,
        cfg: GatewayConfig,
        session: aiohttp.ClientSession,
        pool: BackendPool,
        observers: Sequence[Observer] = (),
    ) -> None:
        self._session = session
        self._pool = pool
        self._observers = tuple(observers)
        self._routes = RouteTable(
            vertex_path=cfg.routes.vertex_path, extra_passthrough=cfg.routes.passthrough
        )
        mask = cfg.policy.sampling_mask
        self._policy = MaskPolicy(enforce=mask.mode == "enforce", default_top_k=mask.default_top_k)
        self._forwarding = ForwardingPolicy(cfg.forwarding.trusted_proxies)
        self._max_body = cfg.limits.max_body_bytes
        self._body_timeout = cfg.timeouts.body_read_s
        self._attempts = cfg.backends.connect_attempts
        self._max_conns = cfg.limits.max_connections_per_backend
        self.inflight = 0

    # -- entry point ---------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        rid = request.headers.get(REQUEST_ID)
        if not valid_request_id(rid):
            rid = uuid.uuid4().hex
        assert rid is not None
        raw_path = request.raw_path
        path, _, _ = raw_path.partition("?")
        route = self._routes.match(path)
        ex = Exchange(rid, request.method, route.path if route else "unmatched")
        self.inflight += 1
        try:
            return await self._handle(request, route, raw_path, ex)
        except asyncio.CancelledError:
            # The client went away (handler cancellation); the upstream request, if any,
            # was closed on the way out so SGLang aborts the generation.
            ex.outcome = "client_disconnect"
            ex.status = ex.status or 499
            raise
        except ConnectionError:
            ex.outcome = "client_disconnect"  # the client's socket broke under a write
            ex.status = ex.status or 499
            raise
        except Exception as exc:
            # A bug in the gateway, not a client or backend failure. The traceback goes to the
            # log under the request id; the client gets the route's shape and nothing else.
            log.exception("request %s failed inside the gateway", rid)
            ex.detail = type(exc).__name__
            if request.writer.output_size > 0:
                raise  # a reply is already under way: aiohttp drops the connection
            family = route.family if route is not None else Family.PLAIN
            body = errors.render(family, 500, "The gateway failed to handle the request.")
            return self._reply(ex, 500, body, "gateway_error", close=True)
        finally:
            self.inflight -= 1
            ex.finished = time.perf_counter()
            for obs in self._observers:
                obs.finish(ex)

    async def _handle(
        self, request: web.BaseRequest, route: Route | None, raw_path: str, ex: Exchange
    ) -> web.StreamResponse:
        if route is None:
            return self._reply(ex, 404, errors.NOT_FOUND, "not_found")
        if request.method not in route.methods:
            resp = self._reply(ex, 405, errors.METHOD_NOT_ALLOWED, "method_not_allowed")
            resp.headers["Allow"] = ", ".join(sorted(route.methods))
            return resp

        headers = request.headers
        rejection = check_headers(
            headers.get("Content-Type") if route.inspected else None,
            headers.get("Content-Encoding"),
        )
        if rejection is not None:
            return self._reject(ex, route.family, rejection, close=request.body_exists)

        try:
            body = await self._read_body(request, ex)
        except _TooLarge:
            rejection = Rejection(
                413,
                "request_body",
                "too_large",
                f"Request body exceeds the gateway's limit of {self._max_body} bytes.",
            )
            return self._reject(ex, route.family, rejection, close=True)
        except TimeoutError:
            rejection = Rejection(
                408, "request_body", "body_timeout", "Request body was not received in time."
            )
            return self._reject(ex, route.family, rejection, close=True)

        if route.inspected:
            rejection = inspect_body(route.kind, body, self._policy)
            if rejection is not None:
                if rejection.policy == "sampling_mask" and not self._policy.enforce:
                    # log_only: count and log what enforce would refuse, then forward.
                    log.warning(
                        "request %s would be rejected (%s): forwarded in log_only mode",
                        ex.request_id,
                        rejection.reason,
                    )
                    ex.detail = f"log_only:{rejection.policy}:{rejection.reason}"
                else:
                    return self._reject(ex, route.family, rejection)

        return await self._forward(request, route, raw_path, body, ex)

    # -- request body ----------------------------------------------------------------

    async def _read_body(self, request: web.BaseRequest, ex: Exchange) -> bytes:
        if not request.body_exists:
            return b""
        length = request.content_length
        if length is not None and length > self._max_body:
            raise _TooLarge
        if request.headers.get("Expect", "").lower() == "100-continue":
            # Sent only once the declared size passed the cap, so an oversized upload is
            # refused before the client transmits it.
            await request.writer.write(_CONTINUE)
        content = request.content
        async with asyncio.timeout(self._body_timeout):
            if length is not None:
                body = await content.readexactly(length)
            else:
                chunks: list[bytes] = []
                size = 0
                while chunk := await content.readany():
                    size += len(chunk)
                    if size > self._max_body:
                        raise _TooLarge
                    chunks.append(chunk)
                body = b"".join(chunks)
        ex.bytes_in = len(body)
        return body

    # -- gateway-made replies ----------------------------------------------------------

    def _reply(
        self, ex: Exchange, status: int, body: bytes, outcome: str, *, close: bool = False
    ) -> web.Response:
        ex.status = status
        ex.outcome = outcome
        ex.bytes_out = len(body)
        resp = web.Response(status=status, body=body, content_type=_JSON)
        resp.headers[REQUEST_ID] = ex.request_id
        if close:
            # The unread rest of the body would otherwise be parsed as the next request.
            resp.force_close()
        return resp

    def _reject(
        self, ex: Exchange, family: Family, rejection: Rejection, *, close: bool = False
    ) -> web.Response:
        body = errors.render_rejection(family, rejection)
        ex.reason = rejection.reason
        if rejection.detail:
            ex.detail = rejection.detail
        return self._reply(ex, rejection.status, body, f"rejected:{rejection.policy}", close=close)

    def _unavailable(self, ex: Exchange, family: Family, outcome: str) -> web.Response:
        status = 503
        body = errors.render(family, status, "No healthy backend is available; retry later.")
        resp = self._reply(ex, status, body, outcome)
        resp.headers["Retry-After"] = "1"
        return resp

    # -- forwarding ----------------------------------------------------------------------

    async def _forward(
        self,
        request: web.BaseRequest,
        route: Route,
        raw_path: str,
        body: bytes,
        ex: Exchange,
    ) -> web.StreamResponse:
        headers = self._forwarding.upstream(
            request.headers.items(),
            peer=request.remote,
            scheme=request.scheme,
            request_id=ex.request_id,
        )
        data = body if request.body_exists else None
        tried: list[Backend] = []
        busy = False
        while len(tried) < self._attempts:
            backend = self._pool.pick(exclude=tried)
            if backend is None:
                break
            tried.append(backend)
            if backend.inflight >= self._max_conns:
                # Its connection pool is full. Waiting for a free connection would hold the
                # client for up to connect_s and then eject a healthy backend: answer now.
                busy = True
                continue
            ex.attempts = len(tried)
            ex.backend = backend.url
            backend.inflight += 1
            try:
                try:
                    upstream = await self._session.request(
                        request.method,
                        URL(backend.url + raw_path, encoded=True),
                        data=data,
                        headers=headers,
                        allow_redirects=False,
                    )
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                    # Nothing reached the backend: safe to try another one.
                    self._pool.connect_failed(backend, type(exc).__name__)
                    ex.connect_failed = (*ex.connect_failed, backend.url)
                    ex.detail = f"connect failed: {type(exc).__name__}"
                    continue
                except TimeoutError:
                    return self._upstream_failed(ex, route.family, 504, "upstream_timeout")
                except aiohttp.ClientError as exc:
                    # The request went out and the backend dropped it: never replay a
                    # generation that may have started.
                    ex.detail = type(exc).__name__
                    return self._upstream_failed(ex, route.family, 502, "upstream_error")
                self._pool.request_ok(backend)
                return await self._relay(request, upstream, ex)
            finally:
                backend.inflight -= 1
        return self._unavailable(ex, route.family, "backends_busy" if busy else "no_backend")

    def _upstream_failed(
        self, ex: Exchange, family: Family, status: int, outcome: str
    ) -> web.Response:
        message = (
            "The backend did not answer in time."
            if status == 504
            else "The backend failed to answer the request."
        )
        return self._reply(ex, status, errors.render(family, status, message), outcome)

    async def _relay(
        self, request: web.BaseRequest, upstream: aiohttp.ClientResponse, ex: Exchange
    ) -> web.StreamResponse:
        ex.first_byte = time.perf_counter()
        ex.status = upstream.status
        clean = False
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            resp_headers = resp.headers
            for name, value in ForwardingPolicy.downstream(upstream.headers.items(), ex.request_id):
                resp_headers.add(name, value)
            await resp.prepare(request)
            content = upstream.content
            sent = 0
            while True:
                try:
                    chunk = await content.readany()
                except (
                    aiohttp.ClientPayloadError,
                    aiohttp.ClientConnectionError,
                    TimeoutError,
                ) as exc:
                    # The backend broke off mid-body. Abort the client's connection so the
                    # truncation is visible (no final chunk, short Content-Length).
                    ex.outcome = "upstream_broken"
                    ex.detail = type(exc).__name__
                    ex.bytes_out = sent
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if not chunk:
                    break
                try:
                    await resp.write(chunk)
                except ConnectionError:
                    ex.outcome = "client_disconnect"
                    ex.bytes_out = sent
                    return resp
                sent += len(chunk)
            ex.bytes_out = sent
            await resp.write_eof()
            clean = True
            return resp
        finally:
            if clean:
                upstream.release()
            else:
                # Closing (not releasing) the connection is what tells SGLang the client
                # is gone, so it aborts the generation instead of finishing it for nobody.
                upstream.close()
