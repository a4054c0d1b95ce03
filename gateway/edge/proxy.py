"""The request path: read -> inspect -> pick a backend -> forward -> stream back.

Everything is decided before the first byte goes to the client (status, backend, any
retry); after that bytes are only piped, and an upstream failure ends the client's
transfer visibly broken (connection aborted), never as a clean, truncated reply.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import orjson

from gateway.contract import replies
from gateway.contract.inspection import check_headers, inspect_body
from gateway.contract.policy import (
    AdmissionRules,
    MaskDemand,
    Mode,
    Rejection,
)
from gateway.contract.replies import Outcome
from gateway.contract.routes import (
    ADDRESSABLE_ROUTES,
    ADDRESSED_PATH,
    Family,
    Kind,
    Route,
    RouteTable,
    addressed,
    canonical_path,
)
from gateway.contract.skim import SKIM_MIN_BODY
from gateway.edge import registry_api
from gateway.edge.admission import inspect_large
from gateway.edge.auth import ApiKeys
from gateway.edge.budget import InspectionBudget, parse_cost
from gateway.edge.control import (
    BackendResult,
    ControlAccess,
    ControlCall,
    FanOut,
    apply_state,
    log_action,
    relayed,
    reply_body,
    updated_weights,
)
from gateway.edge.headers import (
    REQUEST_ID,
    SERVER,
    WEIGHT_VERSION,
    ForwardedHeaders,
    valid_request_id,
)
from gateway.edge.server import BodyTooLarge, Reply, Request
from gateway.edge.tracing import NO_TRACING, Tracer
from gateway.edge.upstream import (
    ConnectFailed,
    Upstream,
    UpstreamFailure,
    UpstreamResponse,
    UpstreamTimeout,
)
from gateway.fleet.capability import Admission
from gateway.fleet.membership import Fleet
from gateway.fleet.pool import Backend, Fit
from gateway.fleet.shared import SharingFailed
from gateway.ops.observe import USER_AGENT_MAX, Exchange, Observer
from gateway.ops.redact import describe
from gateway.runtime import Unstoppable

USER_AGENT: Final = "User-Agent"
TRACEPARENT: Final = "traceparent"

log = logging.getLogger("gateway.edge.proxy")

# How long a weight update's reply waits for each engine's /model_info.
_VERSION_READ_S: Final = 10.0

_JSON: Final = "application/json"


class _RequestIds:
    """Ids for requests that came without one: a random per-process prefix and a counter.

    Unique across processes and restarts like uuid4, at a fraction of its cost per request.
    """

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """Everything the request path reads from config, swapped whole on reload.

    A request captures the settings once at its start, so a reload never changes the
    rules in the middle of one. Built from the config by app.proxy_settings.
    """

    routes: RouteTable
    admission: AdmissionRules
    forwarding: ForwardedHeaders
    max_body: int
    max_inspecting: int
    body_timeout: float
    attempts: int
    queue_timeout: float
    hash_header: str | None
    latest_weights: bool  # routing.weight_version: latest
    connect_s: float
    ttfb_s: float  # the wait for the response head (a long prompt's prefill)
    total_s: float | None  # the whole exchange, body included
    idle_s: float
    skip_parse: bool  # forward bodies that cannot hold the mask key without parsing
    auth: ApiKeys | None  # None: no client authentication
    auth_exempt: frozenset[str]
    control_access: ControlAccess
    control_forwarding: ForwardedHeaders  # never passes the caller's Authorization on
    control_timeout: float


class Proxy:
    """The gateway's request handler (gateway.edge.server's Handler)."""

    def __init__(
        self,
        settings: ProxySettings,
        upstream: Upstream,
        fleet: Fleet,
        observers: Sequence[Observer] = (),
        tracer: Tracer = NO_TRACING,
    ) -> None:
        self.settings = settings
        self._upstream = upstream
        self._fleet = fleet
        self._pool = fleet.pool
        self._observers = tuple(observers)
        self._details = any(getattr(o, "wants_details", False) for o in observers)
        self._ids = _RequestIds()
        self.inflight = 0
        self.budget = InspectionBudget(settings.max_inspecting)
        self.fanout = FanOut(upstream)
        self._control_runs = Unstoppable()
        # rid -> the backend serving it, for requests in flight: an abort of a known rid goes
        # to its owner alone.
        self.owners: dict[str, str] = {}
        self._idle: asyncio.Event | None = None  # only while someone waits for idleness
        # Untraced (None), the module's own functions are called, looked up at each call
        # like any global: one test of an attribute per request, no wrapper.
        traced = tracer is not NO_TRACING
        self._inspect_body = tracer.inspection(inspect_body) if traced else None
        self._inspect_large = tracer.inspection_async(inspect_large) if traced else None

    async def wait_idle(self) -> None:
        """Return once no request is in flight (the drain waits on this)."""
        if not self.inflight:
            return
        self._idle = asyncio.Event()
        try:
            await self._idle.wait()
        finally:
            self._idle = None

    # -- entry point ---------------------------------------------------------------

    async def handle(self, request: Request) -> Reply | None:
        rid = request.headers.get(REQUEST_ID)
        if not valid_request_id(rid):
            rid = self._ids.next()
        assert rid is not None
        settings = self.settings
        raw_path = request.raw_path
        path, _, _ = raw_path.partition("?")
        route = settings.routes.match(path)
        exchange = Exchange(rid, request.method, route.path if route else "unmatched")
        if self._details:
            # An unknown path is the client's free text (a key pasted in the wrong place),
            # and so is what fills a templated route (/workers/{id}): only a path the route
            # table spells out is logged as sent, a templated one as its template.
            shown = "" if route is None else route.path if "{" in route.path else path
            _describe_client(request, shown, exchange)
        self.inflight += 1
        try:
            return await self._handle(request, settings, route, raw_path, exchange)
        except asyncio.CancelledError:
            # The client went away (handler cancellation); the upstream request, if any,
            # was closed on the way out so SGLang aborts the generation.
            exchange.outcome = Outcome.CLIENT_DISCONNECT
            exchange.status = exchange.status or 499
            raise
        except ConnectionError:
            exchange.outcome = Outcome.CLIENT_DISCONNECT  # the client's socket broke under a write
            exchange.status = exchange.status or 499
            raise
        except Exception as exc:
            # A bug in the gateway, not a client or backend failure. The traceback goes to the
            # log under the request id; the client gets the route's shape and nothing else.
            log.error("request %s failed inside the gateway: %s", rid, describe(exc))
            exchange.detail = type(exc).__name__
            if request.started:
                raise  # a reply is already under way: the connection is dropped
            family = route.family if route is not None else Family.PLAIN
            body = replies.render(family, 500, "The gateway failed to handle the request.")
            return self._reply(exchange, 500, body, Outcome.GATEWAY_ERROR, close=True)
        finally:
            self.inflight -= 1
            if self._idle is not None and not self.inflight:
                self._idle.set()
            exchange.finished = time.perf_counter()
            for obs in self._observers:
                try:
                    obs.finish(exchange)
                except Exception as exc:
                    # An observer's fault (a log line that cannot be written) must not
                    # replace the reply the client is getting.
                    log.error("request %s: %s failed: %s", rid, type(obs).__name__, describe(exc))

    async def _handle(
        self,
        request: Request,
        settings: ProxySettings,
        route: Route | None,
        raw_path: str,
        exchange: Exchange,
    ) -> Reply | None:
        if route is not None and route.kind in (Kind.CONTROL, Kind.REGISTRY):
            # Operators only, by their own keys or address: a client key grants nothing here.
            return await self._control(request, settings, route, raw_path, exchange)
        if settings.auth is not None:
            denied = self._authenticate(
                request,
                keys=settings.auth,
                exempt=settings.auth_exempt,
                route=route,
                raw_path=raw_path,
                exchange=exchange,
            )
            if denied is not None:
                return denied
        if route is None:
            return self._reply(exchange, 404, replies.NOT_FOUND, Outcome.NOT_FOUND)
        if request.method not in route.methods:
            return self._wrong_method(exchange, route.methods)

        headers = request.headers
        encodings = headers.getall("Content-Encoding", None)
        rejection = check_headers(
            headers.get("Content-Type") if route.inspected else None,
            # Every line: one `identity` line followed by a `gzip` one encodes the body as
            # surely as a single `identity, gzip`.
            None if encodings is None else ", ".join(encodings),
        )
        if rejection is not None:
            return self._reject(exchange, route.family, rejection, close=request.body_exists)

        body = await self._body_or_refusal(request, settings, exchange, route.family)
        if isinstance(body, Reply):
            return body

        rids: list[str] = []  # SGLang's request ids in the body: who serves them, for aborts
        admission: Admission | None = None  # a mask request: only where it is admitted
        if route.inspected:
            budget = self.budget
            # A large body's cost takes a pass over it (gateway/edge/budget.py): counted
            # once, by inspect_large, not here as well.
            small = len(body) < SKIM_MIN_BODY
            cost = parse_cost(body) if small else 0
            if small and budget.try_acquire(cost):
                # Most bodies: inspected at once, with no await on the way.
                try:
                    verdict = (self._inspect_body or inspect_body)(
                        route.kind,
                        body,
                        settings.admission,
                        skip_parse_without_key=settings.skip_parse,
                        rids=rids,
                    )
                finally:
                    budget.release(cost)
            else:
                verdict = await (self._inspect_large or inspect_large)(
                    route.kind,
                    body,
                    settings.admission,
                    budget,
                    wait_s=settings.queue_timeout,
                    skip_parse_without_key=settings.skip_parse,
                    rids=rids,
                )
            if isinstance(verdict, MaskDemand):
                admission = Admission(verdict)
                pool, now = self._pool, self._pool.now()
                rejection = admission.edge_refusal(
                    pool.backends,
                    lambda b: pool.routable(b, now),
                    _fits(self._wanted_version(request, settings), None),
                )
            else:
                rejection = verdict
            if rejection is not None:
                admission = None  # refused, or forwarded anywhere in log_only mode
                if settings.admission.mode_of(rejection) is Mode.LOG_ONLY:
                    # log_only: count and log what enforce would refuse, then forward.
                    log.warning(
                        "request %s would be rejected (%s): forwarded in log_only mode",
                        exchange.request_id,
                        rejection.reason,
                    )
                    exchange.log_only = rejection.rule
                    exchange.reason = rejection.reason
                    exchange.profile = rejection.profile
                else:
                    resp = self._reject(exchange, route.family, rejection)
                    if rejection.status == 503:
                        resp.headers.append(("Retry-After", "1"))
                    return resp

        return await self._forward(
            request,
            settings=settings,
            route=route,
            raw_path=raw_path,
            body=body,
            exchange=exchange,
            rids=rids,
            admission=admission,
        )

    def _wanted_version(self, request: Request, settings: ProxySettings) -> str | None:
        """The weight version a request must be served by: its own X-Weight-Version, or
        the latest installed with routing.weight_version: latest; None: any."""
        version = request.headers.get(WEIGHT_VERSION)
        if version is None and settings.latest_weights:
            version = self._pool.latest_version
        return version

    def _authenticate(
        self,
        request: Request,
        *,
        keys: ApiKeys,
        exempt: frozenset[str],
        route: Route | None,
        raw_path: str,
        exchange: Exchange,
    ) -> Reply | None:
        # Checked before routing, so an unauthenticated client learns nothing about paths.
        path = route.path if route is not None else canonical_path(raw_path.partition("?")[0])
        if path in exempt:
            return None
        reason = keys.check(request.headers.get("Authorization"))
        if reason is None:
            return None
        family = route.family if route is not None else Family.PLAIN
        denied = Rejection(401, "auth", reason, "Missing or invalid API key.")
        resp = self._reject(exchange, family, denied, close=request.body_exists)
        resp.headers.append(("WWW-Authenticate", "Bearer"))
        return resp

    def _wrong_method(self, exchange: Exchange, methods: frozenset[str]) -> Reply:
        resp = self._reply(exchange, 405, replies.METHOD_NOT_ALLOWED, Outcome.METHOD_NOT_ALLOWED)
        resp.headers.append(("Allow", ", ".join(sorted(methods))))
        return resp

    # -- fleet control -----------------------------------------------------------------

    async def _control(
        self,
        request: Request,
        settings: ProxySettings,
        route: Route,
        raw_path: str,
        exchange: Exchange,
    ) -> Reply | None:
        fanout = self.fanout
        access = settings.control_access
        via_proxy = relayed(request.headers)
        caller = access.caller(
            request.headers.get("Authorization"), request.remote, relayed=via_proxy
        )
        if caller is None:
            fanout.count(route.path, "forbidden")
            message = (
                "Fleet control routes need an operator key (control.keys) or a caller from "
                "control.trusted_cidrs."
            )
            if via_proxy and access.trusted_address(request.remote):
                message = (
                    "This request was relayed by a proxy (it carries forwarding headers), so "
                    "the address it comes from vouches for no caller: fleet control through a "
                    "proxy needs an operator key (control.keys)."
                )
            denied = Rejection(403, "control", "forbidden", message)
            return self._reject(exchange, Family.PLAIN, denied, close=request.body_exists)
        engine_path: tuple[str, str] | None = None  # an addressed call's worker and path
        if route.path == ADDRESSED_PATH:
            found = self._addressable(request, raw_path, route, exchange)
            if isinstance(found, Reply):
                return found
            engine_path = found
        elif request.method not in route.methods:
            return self._wrong_method(exchange, route.methods)
        body = await self._body_or_refusal(request, settings, exchange, Family.PLAIN)
        if isinstance(body, Reply):
            return body
        if route.kind is Kind.REGISTRY:
            status, answer, change = registry_api.handle(
                self._fleet, request.method, route.path, raw_path, body
            )
            try:
                await self._fleet.share(change)
            except SharingFailed as exc:
                fanout.count(route.path, "unshared")
                exchange.detail = "unshared"
                reply = {
                    "detail": _unshared_detail("The registry change was made", exc),
                    "shared": False,
                    "result": orjson.loads(answer),
                }
                return self._reply(exchange, 503, orjson.dumps(reply), Outcome.CONTROL_FAILED)
            result = "ok" if status < 400 else "failed"
            fanout.count(route.path, result)
            if request.method != "GET":
                log.info(
                    "registry %s %s by %s (%s): %d",
                    request.method,
                    route.path,
                    caller,
                    request.remote or "-",
                    status,
                )
            outcome = Outcome.OK if status < 400 else Outcome.REJECTED
            if outcome is Outcome.REJECTED:
                exchange.rejected_by = "registry"
                exchange.reason = "invalid" if status == 400 else "not_found"
            return self._reply(exchange, status, answer, outcome)
        target = raw_path
        if engine_path is not None:
            worker, path = engine_path
            backend = self._pool.find(worker)
            if backend is None:
                fanout.count(route.path, "failed")
                missing = replies.render(Family.PLAIN, 404, f"No worker {worker!r}.")
                return self._reply(exchange, 404, missing, Outcome.NOT_FOUND)
            urls = [backend.url]
            # The path as checked, never as sent: the engine must match exactly what was
            # allowed, whatever spelling reached the gateway.
            query = raw_path.partition("?")[2]
            target = path + "?" + query if query else path
        else:
            urls = [b.url for b in self._pool.backends]
            if route.path == "/abort_request":
                owner = self._abort_owner(body)
                if owner is not None and owner in urls:
                    urls = [owner]
        if not urls:
            fanout.count(route.path, "failed")
            return self._unavailable(exchange, Family.PLAIN, Outcome.NO_BACKEND)
        headers = settings.control_forwarding.upstream(
            request.headers.items(),
            peer=request.remote,
            scheme=request.scheme,
            request_id=exchange.request_id,
        )
        exchange.first_byte = time.perf_counter()
        call = ControlCall(
            request.method,
            target,
            headers,
            body if request.body_exists else None,
            connect_s=settings.connect_s,
            timeout_s=settings.control_timeout,
        )
        # Run to its end even if the caller goes away: the engines act on the call either
        # way, so what the gateway records of them (and shares) must follow.
        results, unshared = await self._control_runs.run(
            self._run_control(urls, call, log_as=(route.path, caller, request.remote))
        )
        ok = all(r.ok for r in results)
        exchange.attempts = len(results)
        if unshared is not None:
            # Never the engines' plain answer: that would read as the whole gateway knowing.
            fanout.count(route.path, "unshared")
            exchange.detail = "unshared"
            reply = orjson.loads(reply_body(results))
            reply.update(
                success=False,
                shared=False,
                detail=_unshared_detail("The engines listed acted on the call", unshared),
            )
            return self._reply(exchange, 503, orjson.dumps(reply), Outcome.CONTROL_FAILED)
        fanout.count(route.path, "ok" if ok else "failed")
        if route.path == ADDRESSED_PATH:
            (only,) = results
            exchange.backend = only.url
            if only.status:  # the engine's own answer, relayed as it came
                resp = self._reply(
                    exchange, only.status, only.raw, Outcome.OK if ok else Outcome.CONTROL_FAILED
                )
                resp.content_type = only.content_type.partition(";")[0] or "application/json"
                return resp
        return self._reply(
            exchange,
            200 if ok else 502,
            reply_body(results),
            Outcome.OK if ok else Outcome.CONTROL_FAILED,
        )

    def _addressable(
        self, request: Request, raw_path: str, route: Route, exchange: Exchange
    ) -> tuple[str, str] | Reply:
        """The worker and engine path an addressed call names, or the refusal of a path
        outside the fixed list (never forwarded, whatever it would reach)."""
        found = addressed(canonical_path(raw_path.partition("?")[0]))
        assert found is not None  # the route table matched /workers/{id}/...
        methods = ADDRESSABLE_ROUTES.get(found[1])
        if methods is None:
            self.fanout.count(route.path, "refused")
            refused = Rejection(
                404,
                "control",
                "not_addressable",
                "Only an engine's own control calls can be sent to one worker, as "
                "/workers/{id}/<path>; generation and every other route go to their own path, "
                "where they are inspected. Allowed paths: " + ", ".join(ADDRESSABLE_ROUTES) + ".",
            )
            return self._reject(exchange, Family.PLAIN, refused, close=request.body_exists)
        if request.method not in methods:
            return self._wrong_method(exchange, methods)
        return found

    async def _run_control(
        self, urls: list[str], call: ControlCall, *, log_as: tuple[str, str, str | None]
    ) -> tuple[list[BackendResult], SharingFailed | None]:
        """Fan one control call out, then record and share what it did to the engines; the
        results, and why the change could not be shared with the other workers, if not."""
        results = await self.fanout.call(urls, call)
        log_action(*log_as, results)
        try:
            # Shared before the read-back below, which may take a while.
            await self._fleet.share(apply_state(self._pool, call.target, call.body or b"", results))
            if updated := updated_weights(call.target, results):
                # The engine's own word on what it now serves, over what the call asked for.
                timeout_s = min(call.timeout_s, _VERSION_READ_S)
                await self._fleet.share(await self._fleet.confirm_versions(updated, timeout_s))
        except SharingFailed as exc:
            return results, exc
        return results, None

    def _abort_owner(self, body: bytes) -> str | None:
        """The backend serving the one rid an abort names, if this gateway routed it there.
        An abort of all, of a list, or of an unknown rid (queued anywhere, or routed by
        another gateway process) goes to every backend."""
        try:
            parsed = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            return None
        if not isinstance(parsed, dict) or parsed.get("abort_all"):
            return None
        rid = parsed.get("rid")
        return self.owners.get(rid) if isinstance(rid, str) else None

    # -- request body ----------------------------------------------------------------

    async def _body_or_refusal(
        self,
        request: Request,
        settings: ProxySettings,
        exchange: Exchange,
        family: Family,
    ) -> bytes | Reply:
        """The request body, or the 413 / 408 reply for one too large or too slow."""
        try:
            return await self._read_body(request, settings, exchange)
        except BodyTooLarge:
            rejection = Rejection(
                413,
                "request_body",
                "too_large",
                f"Request body exceeds the gateway's limit of {settings.max_body} bytes.",
            )
        except TimeoutError:
            rejection = Rejection(
                408, "request_body", "body_timeout", "Request body was not received in time."
            )
        return self._reject(exchange, family, rejection, close=True)

    async def _read_body(
        self, request: Request, settings: ProxySettings, exchange: Exchange
    ) -> bytes:
        if not request.body_exists:
            return b""
        length = request.content_length
        if length is not None and length > settings.max_body:
            raise BodyTooLarge
        if (
            request.version >= (1, 1)  # HTTP/1.0 has no 100 (RFC 9110 s.10.1.1)
            and request.headers.get("Expect", "").lower() == "100-continue"
        ):
            # Sent only once the declared size passed the cap, so an oversized upload is
            # refused before the client transmits it.
            request.send_continue()
        if request.body_complete and request.body_joins_at_once:
            # The whole body came with the headers (most requests): take it without arming
            # a deadline timer, which costs more than the rest of the read. (A large body
            # that is all there already is joined by read_body, off the loop.)
            body = request.take_body()
            if len(body) > settings.max_body:
                raise BodyTooLarge
        else:
            async with asyncio.timeout(settings.body_timeout):
                body = await request.read_body(settings.max_body)
        exchange.bytes_in = len(body)
        return body

    # -- gateway-made replies ----------------------------------------------------------

    def _reply(
        self, exchange: Exchange, status: int, body: bytes, outcome: Outcome, *, close: bool = False
    ) -> Reply:
        exchange.status = status
        exchange.outcome = outcome
        exchange.bytes_out = len(body)
        # close: the unread rest of the body would otherwise be parsed as the next request.
        return Reply(status, body, headers=[(REQUEST_ID, exchange.request_id), SERVER], close=close)

    def _reject(
        self, exchange: Exchange, family: Family, rejection: Rejection, *, close: bool = False
    ) -> Reply:
        body = replies.render_rejection(family, rejection)
        exchange.reason = rejection.reason
        if rejection.detail:
            exchange.detail = rejection.detail
        exchange.rejected_by = rejection.rule
        exchange.profile = rejection.profile
        return self._reply(exchange, rejection.status, body, Outcome.REJECTED, close=close)

    def _unavailable(self, exchange: Exchange, family: Family, outcome: Outcome) -> Reply:
        status = 503
        if outcome is Outcome.NO_CAPACITY:
            message = "All backends are at their concurrency limit; retry later."
        elif outcome is Outcome.GATEWAY_OVERLOADED:
            message = "The gateway is out of resources for new upstream connections; retry later."
        else:
            message = "No healthy backend is available; retry later."
        resp = self._reply(exchange, status, replies.render(family, status, message), outcome)
        resp.headers.append(("Retry-After", "1"))
        return resp

    # -- forwarding ----------------------------------------------------------------------

    async def _forward(
        self,
        request: Request,
        *,
        settings: ProxySettings,
        route: Route,
        raw_path: str,
        body: bytes,
        exchange: Exchange,
        rids: Sequence[str] = (),
        admission: Admission | None = None,
    ) -> Reply | None:
        headers = settings.forwarding.upstream(
            request.headers.items(),
            peer=request.remote,
            scheme=request.scheme,
            request_id=exchange.request_id,
        )
        data = body if request.body_exists else None
        key = request.headers.get(settings.hash_header) if settings.hash_header else None
        fits = _fits(self._wanted_version(request, settings), admission)
        tried: list[Backend] = []
        saturated = False
        while len(tried) < settings.attempts:
            backend = await self._pool.acquire(tried, key, settings.queue_timeout, fits=fits)
            if backend is None:
                saturated = self._pool.saturated(tried)
                break
            tried.append(backend)
            exchange.attempts = len(tried)
            exchange.backend = backend.url
            owners = self.owners
            for rid in rids:
                owners[rid] = backend.url
            try:
                try:
                    upstream = await self._upstream.request(
                        backend.url,
                        request.method,
                        raw_path,
                        headers,
                        data,
                        connect_s=settings.connect_s,
                        ttfb_s=settings.ttfb_s,
                        total_s=settings.total_s,
                    )
                except ConnectFailed as exc:
                    if exc.local:
                        # Out of descriptors or buffers: the gateway's own fault. Blaming the
                        # backend would eject healthy ones in turn; another would fare no better.
                        log.warning(
                            "request %s: cannot connect upstream: %s", exchange.request_id, exc
                        )
                        exchange.detail = f"local resource: {exc.cause}"
                        return self._unavailable(exchange, route.family, Outcome.GATEWAY_OVERLOADED)
                    # Nothing reached the backend: safe to try another one.
                    self._pool.connect_failed(backend, exc.cause)
                    exchange.connect_failed = (*exchange.connect_failed, backend.url)
                    exchange.detail = f"connect failed: {exc.cause}"
                    continue
                except UpstreamTimeout as exc:
                    exchange.detail = exc.cause
                    return self._upstream_failed(
                        exchange, route.family, 504, Outcome.UPSTREAM_TIMEOUT
                    )
                except UpstreamFailure as exc:  # UpstreamError, and any other after the send
                    # The request went out and the backend dropped it: never replay a
                    # generation that may have started.
                    exchange.detail = exc.cause
                    return self._upstream_failed(
                        exchange, route.family, 502, Outcome.UPSTREAM_ERROR
                    )
                self._pool.response(backend, upstream.status)
                # Headers are in: from now on bound the silence between chunks, not the
                # (much longer) wait for the first byte.
                upstream.set_idle_timeout(settings.idle_s)
                return await self._relay(request, upstream, exchange, backend.weight_version)
            finally:
                self._pool.release(backend)
                for rid in rids:
                    if owners.get(rid) == backend.url:
                        del owners[rid]
        return self._unavailable(
            exchange, route.family, Outcome.NO_CAPACITY if saturated else Outcome.NO_BACKEND
        )

    def _upstream_failed(
        self, exchange: Exchange, family: Family, status: int, outcome: Outcome
    ) -> Reply:
        message = (
            "The backend did not answer in time."
            if status == 504
            else "The backend failed to answer the request."
        )
        return self._reply(exchange, status, replies.render(family, status, message), outcome)

    async def _relay(
        self,
        request: Request,
        upstream: UpstreamResponse,
        exchange: Exchange,
        weight_version: str | None,
    ) -> Reply | None:
        exchange.first_byte = time.perf_counter()
        exchange.status = upstream.status
        length = upstream.content_length
        exchange.streamed = length is None
        clean = False
        try:
            headers = ForwardedHeaders.downstream(upstream.headers, exchange.request_id, SERVER)
            if weight_version is not None:
                # The weights that served it, for RL: a header, so the body stays the backend's.
                headers.append((WEIGHT_VERSION, weight_version))
            try:
                # A sized body (a whole JSON reply) goes out with its head in one write; a
                # stream (SSE, chunked) gets its head at once, before its first event.
                request.start(upstream.status, upstream.reason, headers, sized=length is not None)
                # The body goes from the backend's socket to the client's as it arrives.
                await upstream.relay(request)
                request.end()
            except UpstreamFailure as exc:
                # The backend broke off or fell silent mid-body. Abort the client's
                # connection so the truncation is visible (no final chunk, short
                # Content-Length).
                exchange.outcome = Outcome.UPSTREAM_BROKEN
                exchange.detail = exc.cause
                request.abort()
                return None
            except ConnectionError:
                # The client left: the upstream is closed below so SGLang aborts the
                # generation.
                exchange.outcome = Outcome.CLIENT_DISCONNECT
                return None
            clean = True
            return None
        finally:
            # Counted by the connection as it goes: a client that leaves cancels this
            # handler mid-body.
            exchange.bytes_out = upstream.relayed
            if clean:
                upstream.release()
            else:
                # Closing (not releasing) the connection is what tells SGLang the client
                # is gone, so it aborts the generation instead of finishing it for nobody.
                upstream.close()


def _unshared_detail(done: str, exc: SharingFailed) -> str:
    return (
        f"{done}, and this gateway process routes by it, but it could not be shared with "
        f"the gateway's other worker processes ({exc.reason}): they route as before. The "
        "next change that is shared replaces it in this process too. Repeat the call once "
        "the state can be written."
    )


def _describe_client(request: Request, path: str, exchange: Exchange) -> None:
    """The client-side fields of the access log line."""
    exchange.client = request.remote or ""
    exchange.path = _printable(path) if not path.isascii() else path
    version = request.version
    exchange.http_version = f"{version.major}.{version.minor}"
    headers = request.headers
    agent = headers.get(USER_AGENT)
    if agent:
        agent = agent[:USER_AGENT_MAX]
        exchange.user_agent = agent if agent.isascii() else _printable(agent)
    traceparent = headers.get(TRACEPARENT)
    if traceparent:
        exchange.traceparent = traceparent


def _printable(text: str) -> str:
    """Header bytes that are not UTF-8 come from the parser as lone surrogates, which no
    JSON encoder takes: logged as U+FFFD instead."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _fits(version: str | None, admission: Admission | None) -> Fit | None:
    """What the request needs of a backend: the weights it asks for, a mask it may have."""
    if admission is None:
        return None if version is None else (lambda b: b.weight_version == version)
    if version is None:
        return admission.fits
    return lambda b: b.weight_version == version and admission.fits(b)
