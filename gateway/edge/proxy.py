"""The request path: read -> inspect -> pick a backend -> forward -> stream back.

Everything is decided before the first byte goes to the client (status, backend, any
retry); after that bytes are only piped, and an upstream failure ends the client's
transfer visibly broken (connection aborted), never as a clean, truncated reply.

`Proxy.handle` builds one `Call` per request, which holds what the steps read and runs
them in order: authenticate, read, inspect, admit, forward, relay. The operator routes
(fleet control, the worker registry) leave the path after the route is known, for
gateway/edge/fleet_control.py.
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

from gateway.contract import replies
from gateway.contract.inspection import check_headers, inspect_body
from gateway.contract.policy import (
    BodyRules,
    MaskDemand,
    Mode,
    Rejection,
    Verdict,
)
from gateway.contract.prompt import prompt_start
from gateway.contract.replies import Outcome
from gateway.contract.routes import ErrorShape, Kind, Route, RouteTable, canonical_path
from gateway.contract.skim import SKIM_MIN_BODY
from gateway.edge import pd
from gateway.edge.adapters import AdapterCatalog, holders, unavailable_message
from gateway.edge.auth import ApiKeys
from gateway.edge.budget import InspectionBudget, parse_cost
from gateway.edge.control import ControlAccess
from gateway.edge.engine_metrics import Limits as EngineMetricsLimits
from gateway.edge.fleet_control import FleetControl
from gateway.edge.headers import (
    REQUEST_ID,
    SERVER,
    WEIGHT_VERSION,
    ForwardedHeaders,
    valid_request_id,
)
from gateway.edge.large_bodies import inspect_large
from gateway.edge.server import BodyTooLarge, Reply, Request
from gateway.edge.surfaces import Surfaces
from gateway.edge.tracing import NO_TRACING, Tracer
from gateway.edge.upstream import (
    ConnectFailed,
    Upstream,
    UpstreamFailure,
    UpstreamResponse,
    UpstreamTimeout,
)
from gateway.fleet.capability import MaskVerdicts, Needs, only_disaggregated
from gateway.fleet.membership import Fleet
from gateway.fleet.pool import HOLD_EXPIRED, HOLD_MEMORY, HOLDS_FULL, Backend, HoldRefused
from gateway.fleet.prefix_index import Prompt
from gateway.ops.observe import USER_AGENT_MAX, Exchange, Observer
from gateway.ops.redact import describe

USER_AGENT: Final = "User-Agent"
TRACEPARENT: Final = "traceparent"

log = logging.getLogger("gateway.edge.proxy")

# Routes for operators (and, for membership and the abort of one rid, the engines and
# clients), answered by gateway/edge/fleet_control.py.
_OPERATOR_KINDS: Final = (Kind.CONTROL, Kind.REGISTRY)
_NO_RIDS: Final[tuple[str, ...]] = ()


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
    body_rules: BodyRules
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
    engine_metrics: EngineMetricsLimits  # GET /engine_metrics and /metrics: bounds per read
    pause_hold: float = 0.0  # backends.pause_hold_s in force: how long a paused fleet holds one


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
        self.upstream = upstream
        self.pool = fleet.pool
        self._observers = tuple(observers)
        self._details = any(getattr(o, "wants_details", False) for o in observers)
        self._ids = _RequestIds()
        self.inflight = 0
        self.budget = InspectionBudget(settings.max_inspecting)
        self.pool.hold_memory = self.budget  # bodies held for a paused fleet take from it too
        self.control = FleetControl(upstream, fleet)
        self.owners = self.control.owners  # where the forward path records whom a rid went to
        self.adapters = AdapterCatalog(self.control.fanout, fleet.pool)
        self.surfaces = Surfaces(upstream, fleet)  # what the gateway answers itself (SMG's)
        self._idle: asyncio.Event | None = None  # only while someone waits for idleness
        # Untraced (None), the module's own functions are called, looked up at each call
        # like any global: one test of an attribute per request, no wrapper.
        traced = tracer is not NO_TRACING
        self.traced_inspect = tracer.inspection(inspect_body) if traced else None
        self.traced_inspect_large = tracer.inspection_async(inspect_large) if traced else None

    async def wait_idle(self) -> None:
        """Return once no request is in flight (the drain waits on this)."""
        if not self.inflight:
            return
        self._idle = asyncio.Event()
        try:
            await self._idle.wait()
        finally:
            self._idle = None

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
        call = Call(self, request, settings, route, exchange)
        self.inflight += 1
        try:
            return await call.run()
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
            body = replies.render(call.shape, 500, "The gateway failed to handle the request.")
            return call.reply(500, body, Outcome.GATEWAY_ERROR, close=True)
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


class Call:
    """One request on its way through the gateway, built once by Proxy.handle.

    It holds what every step reads (the request, the settings captured at its start, its
    route and the error shape that goes with it, its exchange record, SGLang's request ids
    in its body) and runs the steps: authenticate, read, inspect, admit, forward, relay.
    Each step passes the request on or answers it.
    """

    __slots__ = ("adapters", "exchange", "proxy", "request", "rids", "route", "settings")

    def __init__(
        self,
        proxy: Proxy,
        request: Request,
        settings: ProxySettings,
        route: Route | None,
        exchange: Exchange,
    ) -> None:
        self.proxy = proxy
        self.request = request
        self.settings = settings
        self.route = route
        self.exchange = exchange
        # SGLang's request ids in the body: who serves them, for aborts (inspected routes).
        self.rids: Sequence[str] = _NO_RIDS
        # The LoRA adapters it names: only an engine holding them may serve it.
        self.adapters: Sequence[str] = _NO_RIDS

    @property
    def raw_path(self) -> str:
        """The request target as sent: path and query."""
        return self.request.raw_path

    @property
    def inspected(self) -> bool:
        """A generation route, whose body the gateway reads."""
        route = self.route
        return route is not None and route.inspected

    @property
    def shape(self) -> ErrorShape:
        """The shape of the route's error bodies."""
        route = self.route
        return route.shape if route is not None else ErrorShape.PLAIN

    async def run(self) -> Reply | None:
        """The steps in order: the gateway's reply, or None once the backend's was relayed."""
        route = self.route
        if route is not None and route.kind in _OPERATOR_KINDS:
            # Operators by their own keys or address; the engines' network for membership; a
            # client for the abort of one rid (gateway/edge/fleet_control.py checks which).
            return await self.proxy.control.handle(self, route)
        keys = self.settings.auth
        if keys is not None and (denied := self.authenticate(keys)) is not None:
            return denied
        if route is None:
            return self.reply(404, replies.NOT_FOUND, Outcome.NOT_FOUND)
        if self.request.method not in route.methods:
            return self.wrong_method(route.methods)
        if route.kind is Kind.GATEWAY:
            return await self.proxy.surfaces.handle(self, route)
        if (refused := self.inspect_headers(route)) is not None:
            return refused
        body = await self.read()
        if isinstance(body, Reply):
            return body
        verdict: Verdict = None
        if route.inspected:
            cost = self.budget_now(body)
            if cost is not None:  # most bodies: inspected at once, with nothing awaited
                verdict = self.inspect(route.kind, body, cost)
            else:
                verdict = await self.inspect_large(route.kind, body)
        # What a backend must have for it: the weights it asks for, the adapters it names, a
        # mask it may hold.
        version = self.wanted_version()
        adapters = self.adapters
        needs = None
        if version is not None or adapters:
            needs = Needs(version, adapters=frozenset(adapters))
        if verdict is not None:
            admitted = self.admit(verdict, needs)
            if isinstance(admitted, Reply):
                return admitted
            needs = admitted
        if adapters and (refused := await self.adapters_refusal(frozenset(adapters))):
            return refused
        return await self.forward(body, needs)

    # -- the steps -----------------------------------------------------------------------

    def authenticate(self, keys: ApiKeys) -> Reply | None:
        # Checked before routing, so an unauthenticated client learns nothing about paths.
        route = self.route
        path = route.path if route is not None else canonical_path(self.raw_path.partition("?")[0])
        if path in self.settings.auth_exempt:
            return None
        reason = keys.check(self.request.headers.get("Authorization"))
        if reason is None:
            return None
        denied = Rejection(401, "auth", reason, "Missing or invalid API key.")
        resp = self.reject(denied, close=self.request.body_exists)
        resp.headers.append(("WWW-Authenticate", "Bearer"))
        return resp

    def inspect_headers(self, route: Route) -> Reply | None:
        """The refusal of a body the gateway cannot read (its media type, its encoding)."""
        headers = self.request.headers
        encodings = headers.getall("Content-Encoding", None)
        rejection = check_headers(
            headers.get("Content-Type") if route.inspected else None,
            # Every line: one `identity` line followed by a `gzip` one encodes the body as
            # surely as a single `identity, gzip`.
            None if encodings is None else ", ".join(encodings),
        )
        if rejection is None:
            return None
        return self.reject(rejection, close=self.request.body_exists)

    async def read(self) -> bytes | Reply:
        """The request body, or the 413 / 408 reply for one too large or too slow."""
        request, settings = self.request, self.settings
        if not request.body_exists:
            return b""
        length = request.content_length
        if length is not None and length > settings.max_body:
            return self._too_large()
        if (
            request.version >= (1, 1)  # HTTP/1.0 has no 100 (RFC 9110 s.10.1.1)
            and request.headers.get("Expect", "").lower() == "100-continue"
        ):
            # Sent only once the declared size passed the cap, so an oversized upload is
            # refused before the client transmits it.
            request.send_continue()
        try:
            if request.body_complete and request.body_joins_at_once:
                # The whole body came with the headers (most requests): take it without
                # arming a deadline timer, which costs more than the rest of the read. (A
                # large body that is all there already is joined by read_body, off the loop.)
                body = request.take_body()
                if len(body) > settings.max_body:
                    raise BodyTooLarge
            else:
                async with asyncio.timeout(settings.body_timeout):
                    body = await request.read_body(settings.max_body)
        except BodyTooLarge:
            return self._too_large()
        except TimeoutError:
            slow = Rejection(
                408, "request_body", "body_timeout", "Request body was not received in time."
            )
            return self.reject(slow, close=True)
        self.exchange.bytes_in = len(body)
        return body

    def budget_now(self, body: bytes) -> int | None:
        """A small body's share of the inspection budget, taken now; None for a large body,
        or when the budget has no room for it now (inspect_large waits for its share)."""
        # A large body's cost takes a pass over it (gateway/edge/budget.py): counted
        # once, by inspect_large, not here as well.
        if len(body) >= SKIM_MIN_BODY:
            return None
        cost = parse_cost(body)
        return cost if self.proxy.budget.try_acquire(cost) else None

    def inspect(self, kind: Kind, body: bytes, cost: int) -> Verdict:
        """The policy's verdict on a body whose share of the budget (`cost`) is taken; the
        request ids it names go to `rids`."""
        settings = self.settings
        rids: list[str] = []
        self.rids = rids
        adapters: list[str] = []
        self.adapters = adapters
        try:
            return (self.proxy.traced_inspect or inspect_body)(
                kind,
                body,
                settings.body_rules,
                skip_parse_without_key=settings.skip_parse,
                rids=rids,
                adapters=adapters,
            )
        finally:
            self.proxy.budget.release(cost)

    async def inspect_large(self, kind: Kind, body: bytes) -> Verdict:
        """The verdict on a large body (skimmed, gateway/edge/large_bodies.py) or on one that
        waits for its share of the budget."""
        settings = self.settings
        rids: list[str] = []
        self.rids = rids
        adapters: list[str] = []
        self.adapters = adapters
        return await (self.proxy.traced_inspect_large or inspect_large)(
            kind,
            body,
            settings.body_rules,
            self.proxy.budget,
            wait_s=settings.queue_timeout,
            skip_parse_without_key=settings.skip_parse,
            rids=rids,
            adapters=adapters,
        )

    def admit(self, verdict: Rejection | MaskDemand, wanted: Needs | None) -> Reply | Needs | None:
        """What a backend must have for a request the inspection judged (`wanted`: what it
        needs besides), or its refusal. A mask request goes only where a backend's own
        admission serves it; a refusal of a rule in log_only mode is forwarded anywhere."""
        if isinstance(verdict, MaskDemand):
            mask = MaskVerdicts(verdict)
            rejection = mask.edge_refusal(self.proxy.pool, wanted)
            if rejection is None:
                if wanted is None:
                    return Needs(None, mask)
                return Needs(wanted.version, mask, wanted.adapters)
        else:
            rejection = verdict
        if self.settings.body_rules.mode_of(rejection) is Mode.LOG_ONLY:
            # log_only: count and log what enforce would refuse, then forward.
            exchange = self.exchange
            log.warning(
                "request %s would be rejected (%s): forwarded in log_only mode",
                exchange.request_id,
                rejection.reason,
            )
            exchange.log_only = rejection.rule
            exchange.reason = rejection.reason
            exchange.profile = rejection.profile
            return wanted
        resp = self.reject(rejection)
        if rejection.status == 503:
            resp.headers.append(("Retry-After", "1"))
        return resp

    def wanted_version(self) -> str | None:
        """The weight version a request must be served by: its own X-Weight-Version, or
        the latest installed with routing.weight_version: latest; None: any."""
        version = self.request.headers.get(WEIGHT_VERSION)
        if version is None and self.settings.latest_weights:
            version = self.proxy.pool.latest_version
        return version

    async def forward(
        self, body: bytes, needs: Needs | None, role: str | None = None
    ) -> Reply | None:
        """Send the request to a backend that has what it `needs` (another one after a
        connection that failed, up to the attempts allowed) and relay the answer. On a
        prefill/decode fleet a generation goes to a pair (gateway/edge/pd.py); `role`: a
        worker of that type instead of a plain one."""
        request, settings, exchange = self.request, self.settings, self.exchange
        proxy, rids = self.proxy, self.rids
        pool = proxy.pool
        if pool.pd is not None and role is None:
            return await pd.forward(self, body, needs)
        headers = self.upstream_headers(settings.forwarding)
        data = body if request.body_exists else None
        key = request.headers.get(settings.hash_header) if settings.hash_header else None
        prompt = self.prompt(body) if pool.prefix is not None else None
        tried: list[Backend] = []
        # A generation waits for a paused fleet as a paused engine queues it; other routes
        # (model info, health) only as long as for a free slot.
        hold_s = settings.pause_hold if self.inspected else settings.queue_timeout
        while len(tried) < settings.attempts:
            try:
                backend = await pool.acquire(
                    tried,
                    key,
                    settings.queue_timeout,
                    fits=needs,
                    prompt=prompt,
                    hold_s=hold_s,
                    hold_bytes=len(body),
                    role=role,
                )
            except HoldRefused as refused:  # not `exc`: mypyc/mypyc#620 (tests/test_build.py)
                return self.not_held(refused.reason, needs)
            if backend is None:
                return self.no_backend(tried, needs)
            tried.append(backend)
            exchange.attempts = len(tried)
            exchange.backend = backend.url
            if rids:
                proxy.owners.claim(rids, backend.url)
            try:
                try:
                    upstream = await proxy.upstream.request(
                        backend.url,
                        request.method,
                        request.raw_path,
                        headers,
                        data,
                        connect_s=settings.connect_s,
                        ttfb_s=settings.ttfb_s,
                        total_s=settings.total_s,
                    )
                except UpstreamFailure as exc:
                    failed = self._failed(backend, exc)
                    if failed is not None:
                        return failed
                else:
                    await self.relay(upstream, backend)
                    return None
            finally:
                pool.release(backend)
                if rids:
                    proxy.owners.release(rids, backend.url)
        return self.unavailable(Outcome.NO_BACKEND)

    def prompt(self, body: bytes) -> Prompt | None:
        """Where the body's prompt starts, for cache_aware (gateway/contract/prompt.py)."""
        route = self.route
        if route is None or not body:
            return None
        start = prompt_start(route.kind, body)
        return None if start is None else Prompt(body, start)

    def _failed(self, backend: Backend, exc: UpstreamFailure) -> Reply | None:
        """The reply to an attempt that failed; None when nothing reached the backend, so
        another one may be tried."""
        exchange = self.exchange
        if isinstance(exc, ConnectFailed):
            if exc.local:
                # Out of descriptors or buffers: the gateway's own fault. Blaming the
                # backend would eject healthy ones in turn; another would fare no better.
                log.warning("request %s: cannot connect upstream: %s", exchange.request_id, exc)
                exchange.detail = f"local resource: {exc.cause}"
                return self.unavailable(Outcome.GATEWAY_OVERLOADED)
            # Nothing reached the backend: safe to try another one.
            self.proxy.pool.connect_failed(backend, exc.cause)
            exchange.connect_failed = (*exchange.connect_failed, backend.url)
            exchange.detail = f"connect failed: {exc.cause}"
            return None
        exchange.detail = exc.cause
        if isinstance(exc, UpstreamTimeout):
            return self._upstream_failed(504, Outcome.UPSTREAM_TIMEOUT)
        # UpstreamError, and any other after the send: the request went out and the backend
        # dropped it. Never replay a generation that may have started.
        return self._upstream_failed(502, Outcome.UPSTREAM_ERROR)

    async def relay(self, upstream: UpstreamResponse, backend: Backend) -> None:
        """Stream `backend`'s answer, whose head just came, to the client as it arrives."""
        request, exchange = self.request, self.exchange
        self.proxy.pool.response(backend, upstream.status)
        # Headers are in: from now on bound the silence between chunks, not the (much
        # longer) wait for the first byte.
        upstream.set_idle_timeout(self.settings.idle_s)
        weight_version = backend.weight_version
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

    def upstream_headers(self, forwarding: ForwardedHeaders) -> list[tuple[str, str]]:
        """The request's headers as a backend gets them (hop-by-hop ones dropped,
        forwarding ones added by `forwarding`'s rules)."""
        request = self.request
        return forwarding.upstream(
            request.headers.items(),
            peer=request.remote,
            scheme=request.scheme,
            request_id=self.exchange.request_id,
        )

    # -- gateway-made replies ------------------------------------------------------------

    def reply(self, status: int, body: bytes, outcome: Outcome, *, close: bool = False) -> Reply:
        exchange = self.exchange
        exchange.status = status
        exchange.outcome = outcome
        exchange.bytes_out = len(body)
        # close: the unread rest of the body would otherwise be parsed as the next request.
        return Reply(status, body, headers=[(REQUEST_ID, exchange.request_id), SERVER], close=close)

    def reject(self, rejection: Rejection, *, close: bool = False) -> Reply:
        """The refusal in the route's error shape."""
        body = replies.render_rejection(self.shape, rejection)
        exchange = self.exchange
        exchange.reason = rejection.reason
        if rejection.detail:
            exchange.detail = rejection.detail
        exchange.rejected_by = rejection.rule
        exchange.profile = rejection.profile
        return self.reply(rejection.status, body, Outcome.REJECTED, close=close)

    def wrong_method(self, methods: frozenset[str]) -> Reply:
        resp = self.reply(405, replies.METHOD_NOT_ALLOWED, Outcome.METHOD_NOT_ALLOWED)
        resp.headers.append(("Allow", ", ".join(sorted(methods))))
        return resp

    async def adapters_refusal(self, names: frozenset[str]) -> Reply | None:
        """The 400 for LoRA adapters no engine holds (gateway/edge/adapters.py)."""
        headers = self.settings.control_forwarding.upstream(
            (), peer=self.request.remote, scheme="http", request_id=self.exchange.request_id
        )
        refused = await self.proxy.adapters.refusal(names, headers, self.settings.connect_s)
        return None if refused is None else self.reject(refused)

    def no_backend(self, tried: Sequence[Backend], needs: Needs | None) -> Reply:
        """The 503 when no backend could be had for the request, saying why."""
        pool = self.proxy.pool
        if (disaggregated := only_disaggregated(pool)) is not None:
            return self.reject(disaggregated)
        if needs is not None and needs.adapters:
            body = replies.render(self.shape, 503, unavailable_message(needs.adapters))
            resp = self.reply(503, body, Outcome.NO_BACKEND)
            resp.headers.append(("Retry-After", "1"))
            return resp
        saturated = pool.saturated(tried)
        return self.unavailable(Outcome.NO_CAPACITY if saturated else Outcome.NO_BACKEND)

    def unavailable(self, outcome: Outcome) -> Reply:
        status = 503
        if outcome is Outcome.NO_CAPACITY:
            message = "All backends are at their concurrency limit; retry later."
        elif outcome is Outcome.GATEWAY_OVERLOADED:
            message = "The gateway is out of resources for new upstream connections; retry later."
        else:
            message = "No healthy backend is available; retry later."
        resp = self.reply(status, replies.render(self.shape, status, message), outcome)
        resp.headers.append(("Retry-After", "1"))
        return resp

    def not_held(self, reason: str, needs: Needs | None = None) -> Reply:
        """503 for a request only paused or asleep engines could serve, that was not held
        for them or whose hold ran out (gateway/fleet/pool.py), naming the setting."""
        settings = self.settings
        # Generations are held for pause_hold_s, other routes as long as for a free slot.
        hold, setting = settings.pause_hold, "backends.pause_hold_s"
        if not self.inspected:
            hold, setting = settings.queue_timeout, "backends.queue_timeout_s"
        if reason == HOLD_EXPIRED:
            why = f"stayed paused or asleep for {setting} ({hold:g} s)"
        elif reason == HOLDS_FULL:
            why = (
                "is paused, and the requests already held for it fill the slots it will have "
                "(backends.max_inflight_per_backend each)"
            )
        elif reason == HOLD_MEMORY:
            why = (
                "is paused, and the requests held for it take all the memory "
                "limits.max_inspecting_bytes allows"
            )
        else:
            why = f"is paused or asleep, and {setting} is 0: requests are not held"
        which = f" {holders(needs.adapters)}" if needs is not None and needs.adapters else ""
        message = f"Every backend that could serve this request{which} {why}; retry later."
        self.exchange.detail = reason
        resp = self.reply(503, replies.render(self.shape, 503, message), Outcome.PAUSED)
        resp.headers.append(("Retry-After", "1"))
        return resp

    def _too_large(self) -> Reply:
        limit = self.settings.max_body
        rejection = Rejection(
            413,
            "request_body",
            "too_large",
            f"Request body exceeds the gateway's limit of {limit} bytes.",
        )
        return self.reject(rejection, close=True)

    def _upstream_failed(self, status: int, outcome: Outcome) -> Reply:
        message = (
            "The backend did not answer in time."
            if status == 504
            else "The backend failed to answer the request."
        )
        return self.reply(status, replies.render(self.shape, status, message), outcome)


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
