"""The routes the gateway answers itself on the main port, as SMG answers them.

An RL framework or an orchestrator written against SMG (sglang-router) probes
`/liveness` and `/readiness` on the router's own port and reads `/engine_metrics` there;
these answer the same way (model_gateway/src/health.rs, server.rs):

    GET /liveness        200 "OK": the process answers (also while draining)
    GET /readiness       200 {"status": "ready", "healthy_workers", "total_workers"};
                         503 {"status": "not ready", "reason": "insufficient healthy
                         workers" | "draining"}
    GET /engine_metrics  every engine's /metrics, merged, SMG's names (engine_metrics.py)
    GET /metrics         the same merge with SGLang's own names

The probes are client routes, like SGLang's /health beside them: with `auth.enabled` they
need a client key unless listed in `auth.exempt_paths`. The metrics name every engine's
address and load, which the registry shows operators only (GET /workers), so they take the
registry's caller check: an operator key (control.keys) or an address in
control.trusted_cidrs (SMG serves /engine_metrics to anyone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import orjson

from gateway.contract import replies
from gateway.contract.policy import Rejection
from gateway.contract.replies import Outcome
from gateway.contract.routes import ErrorShape, Route
from gateway.edge.control import relayed
from gateway.edge.engine_metrics import CONTENT_TYPE, EngineMetrics, merge
from gateway.edge.headers import REQUEST_ID
from gateway.edge.server import Reply
from gateway.edge.upstream import Upstream
from gateway.fleet.membership import Fleet
from gateway.fleet.pool import worker_id

if TYPE_CHECKING:
    from gateway.edge.proxy import Call

_LIVE: Final = b"OK"
_DRAINING: Final = orjson.dumps({"status": "not ready", "reason": "draining"})
_NO_WORKERS: Final = orjson.dumps({"status": "not ready", "reason": "insufficient healthy workers"})


class Surfaces:
    """Answers the gateway's own client routes (contract/routes.py GATEWAY_ROUTES)."""

    def __init__(self, upstream: Upstream, fleet: Fleet) -> None:
        self._pool = fleet.pool
        self.metrics = EngineMetrics(upstream)
        # Set by the gateway: readiness turns 503 as soon as the drain begins.
        self.draining: Callable[[], bool] = lambda: False

    async def handle(self, call: Call, route: Route) -> Reply:
        resp = await self._answer(call, route)
        # A body sent with one of these GETs is never read: it would be taken for the
        # connection's next request.
        resp.close = resp.close or call.request.body_exists
        return resp

    async def _answer(self, call: Call, route: Route) -> Reply:
        path = route.path
        if path == "/liveness":
            resp = call.reply(200, _LIVE, Outcome.OK)
            resp.content_type = "text/plain; charset=utf-8"
            return resp
        if path == "/readiness":
            return self._readiness(call)
        if (refused := self._operator(call)) is not None:
            return refused
        return await self._engine_metrics(call, smg_names=path == "/engine_metrics")

    def _operator(self, call: Call) -> Reply | None:
        """The refusal of a caller who may not read the fleet's metrics, else None."""
        request = call.request
        access = call.settings.control_access
        via_proxy = relayed(request.headers)
        if access.caller(request.headers.get("Authorization"), request.remote, relayed=via_proxy):
            return None
        self.metrics.counts["forbidden"] = self.metrics.counts.get("forbidden", 0) + 1
        message = (
            "The engines' metrics name every worker: they need an operator key "
            "(control.keys) or a caller from control.trusted_cidrs."
        )
        if via_proxy and access.trusted_address(request.remote):
            message += (
                " This request carries forwarding headers, so its address vouches for no one."
            )
        return call.reject(Rejection(403, "control", "forbidden", message))

    def _readiness(self, call: Call) -> Reply:
        if self.draining():
            return call.reply(503, _DRAINING, Outcome.NO_BACKEND)
        pool = self._pool
        healthy = pool.ready_count()
        if not healthy:
            return call.reply(503, _NO_WORKERS, Outcome.NO_BACKEND)
        body = {"status": "ready", "healthy_workers": healthy, "total_workers": len(pool.backends)}
        return call.reply(200, orjson.dumps(body), Outcome.OK)

    async def _engine_metrics(self, call: Call, *, smg_names: bool) -> Reply:
        settings, exchange = call.settings, call.exchange
        urls = [b.url for b in self._pool.backends]
        if not urls:
            body = replies.render(ErrorShape.PLAIN, 503, "No workers to read metrics from.")
            return call.reply(503, body, Outcome.NO_BACKEND)
        headers = [(REQUEST_ID, exchange.request_id)]
        if (authorization := settings.control_forwarding.authorization) is not None:
            headers.append(("Authorization", authorization))
        scrapes = await self.metrics.collect(
            urls, headers, settings.engine_metrics, connect_s=settings.connect_s
        )
        exchange.attempts = len(scrapes)
        if all(s.text is None for s in scrapes):
            failures = [
                {"id": worker_id(s.url), "result": s.result, "error": s.why} for s in scrapes
            ]
            body = orjson.dumps(
                {"detail": "No engine's /metrics could be read.", "failures": failures}
            )
            exchange.detail = "every engine failed"
            return call.reply(502, body, Outcome.UPSTREAM_ERROR)
        resp = call.reply(200, merge(scrapes, smg_names=smg_names).encode(), Outcome.OK)
        resp.content_type = CONTENT_TYPE
        return resp
