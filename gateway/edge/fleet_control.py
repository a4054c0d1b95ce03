"""The operator routes as one gateway process answers them: fleet control and the registry.

The proxy hands over a Call on a control or registry route once its route is known. Here
the caller is checked (an operator; the engines' network on a membership route; a client
on the abort of one rid: gateway/edge/control.py), the body read, and then either the
worker registry answers (gateway/edge/registry_api.py) or the call goes to the engines it
means: the one worker an address names, the one engine serving the rid an abort names,
else every member. What a call did to the engines is recorded (gateway/fleet/engines.py,
through control.apply_state) and shared with the other worker processes, and the reply
says what each engine answered, or that the change could not be shared.

The forward path records here which backend serves each rid in flight (RidOwners), so an
abort of one rid reaches its owner alone.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import orjson

from gateway.contract import replies
from gateway.contract.policy import Rejection
from gateway.contract.replies import Outcome
from gateway.contract.routes import (
    ADDRESSABLE_ROUTES,
    ADDRESSED_PATH,
    FLEET_READ_ROUTES,
    ErrorShape,
    Kind,
    Route,
    addressed,
    canonical_path,
)
from gateway.edge import fleet_reads, registry_api
from gateway.edge.control import (
    MEMBERSHIP_ROUTES,
    BackendResult,
    ControlCall,
    FanOut,
    apply_state,
    changes_fleet,
    log_action,
    names_one_rid,
    relayed,
    reply_body,
    updated_weights,
)
from gateway.edge.server import Reply
from gateway.edge.upstream import Upstream
from gateway.fleet.etcd_state import LockBusy, StoreDown
from gateway.fleet.membership import Fleet
from gateway.fleet.rid_owners import RidPublisher
from gateway.fleet.shared import SharingFailed
from gateway.runtime import Shielded

if TYPE_CHECKING:
    from gateway.edge.proxy import Call

log = logging.getLogger("gateway.control")

# How long a weight update's reply waits for each engine's /model_info.
_VERSION_READ_S: Final = 10.0


class RidOwners:
    """rid -> the backend serving it, for requests in flight: an abort of a known rid goes
    to its owner alone. Once shared (state.backend: etcd), it also notes what changed for
    gateway/fleet/rid_owners.py to write in batches: a dict write per rid, nothing more on
    the request path."""

    __slots__ = ("_by_rid", "_pending", "_shared")

    def __init__(self) -> None:
        self._by_rid: dict[str, str] = {}
        # rid -> its owner to write, or None to delete; None itself: not shared.
        self._pending: dict[str, str | None] | None = None
        self._shared: set[str] = set()  # rids written (or being written) to the store

    def __len__(self) -> int:
        return len(self._by_rid)

    def claim(self, rids: Sequence[str], url: str) -> None:
        """The attempt on `url` serves `rids` from now on."""
        by_rid = self._by_rid
        pending = self._pending
        for rid in rids:
            by_rid[rid] = url
            if pending is not None:
                pending[rid] = url

    def release(self, rids: Sequence[str], url: str) -> None:
        """The attempt on `url` ended: forget the rids it still owns (a later attempt
        elsewhere may own them already)."""
        by_rid = self._by_rid
        pending = self._pending
        for rid in rids:
            if by_rid.get(rid) == url:
                del by_rid[rid]
                if pending is None:
                    continue
                if rid in self._shared:
                    pending[rid] = None
                else:
                    # Ended before its batch was written: it never reaches the store.
                    pending.pop(rid, None)

    def owner(self, rid: str) -> str | None:
        return self._by_rid.get(rid)

    # -- sharing (gateway/fleet/rid_owners.py) -------------------------------------------

    def share(self) -> None:
        """Note changes from now on, and every rid in flight as one to write."""
        self._pending = dict(self._by_rid)

    @property
    def unwritten(self) -> int:
        return len(self._pending) if self._pending is not None else 0

    def take(self, limit: int) -> list[tuple[str, str | None]]:
        """Up to `limit` changes to write, oldest first; the rids put count as shared."""
        pending = self._pending
        if not pending:
            return []
        batch: list[tuple[str, str | None]] = []
        for rid, url in pending.items():
            batch.append((rid, url))
            if len(batch) >= limit:
                break
        for rid, url in batch:
            del pending[rid]
            if url is not None:
                self._shared.add(rid)
        return batch

    def written(self, batch: list[tuple[str, str | None]]) -> None:
        """`batch` is in the store: its deleted rids are no longer there."""
        pending = self._pending
        for rid, url in batch:
            if url is None and (pending is None or rid not in pending):
                self._shared.discard(rid)

    def unwritten_again(self, batch: list[tuple[str, str | None]]) -> None:
        """Writing `batch` failed: its changes are due again, unless newer ones replaced them."""
        pending = self._pending
        if pending is None:
            return
        for rid, url in batch:
            pending.setdefault(rid, url)

    def rewrite_all(self) -> None:
        """The store lost what was written (a new lease): every rid in flight anew."""
        if self._pending is not None:
            self._shared.clear()
            self._pending.update(self._by_rid)


class FleetControl:
    """Answers the control and registry routes for one gateway process."""

    def __init__(self, upstream: Upstream, fleet: Fleet) -> None:
        self._fleet = fleet
        self._pool = fleet.pool
        self.fanout = FanOut(upstream)
        self.owners = RidOwners()
        # state.backend: etcd: an abort of a rid routed by another replica finds its owner.
        self.publisher: RidPublisher | None = None
        self._runs = Shielded()

    async def handle(self, call: Call, route: Route) -> Reply | None:
        """Answer `call`, on the control or registry route `route`."""
        caller = self._caller(call, route)
        if isinstance(caller, Reply):
            return caller
        engine_path: tuple[str, str] | None = None  # an addressed call's worker and path
        if route.path == ADDRESSED_PATH:
            found = self._addressable(call, route)
            if isinstance(found, Reply):
                return found
            engine_path = found
        elif call.request.method not in route.methods:
            return call.wrong_method(route.methods)
        body = await call.read()
        if isinstance(body, Reply):
            return body
        if caller == _CLIENT and not names_one_rid(body):
            self.fanout.count(route.path, "forbidden")
            return call.reject(Rejection(403, "control", "forbidden", _FLEET_ABORT))
        if route.path in FLEET_READ_ROUTES:
            return self._fleet_read(call, route)
        if route.kind is Kind.REGISTRY:
            return await self._registry(call, route, caller, body)
        owner = None
        if route.path == "/abort_request" and engine_path is None:
            owner = await self._abort_owner(body)
        targets = self._targets(call, route, engine_path, owner)
        if isinstance(targets, Reply):
            return targets
        return await self._fan_out(call, route, caller, targets, body, engine_path=engine_path)

    def _caller(self, call: Call, route: Route) -> str | Reply:
        """How the caller is allowed: "key" or "trusted" (an operator), "member" (the
        engines' network, on a membership route), "client" (an abort whose body must still
        name one rid); or the refusal, naming the setting that would allow the call."""
        request = call.request
        access = call.settings.control_access
        via_proxy = relayed(request.headers)
        caller = access.caller(
            request.headers.get("Authorization"), request.remote, relayed=via_proxy
        )
        if caller is not None:
            return caller
        if route.path in MEMBERSHIP_ROUTES:
            if access.member(request.remote, relayed=via_proxy):
                return "member"
            message = _MEMBERSHIP
        elif route.path == "/abort_request":
            if not access.client_abort:
                self.fanout.count(route.path, "forbidden")
                off = Rejection(403, "control", "client_abort_off", _CLIENT_ABORT_OFF)
                return call.reject(off, close=request.body_exists)
            if _may_generate(call):
                return _CLIENT
            message = _CLIENT_ABORT_KEY
        else:
            message = _OPERATOR
        if via_proxy and (access.trusted_address(request.remote) or access.member(request.remote)):
            message = _RELAYED
        self.fanout.count(route.path, "forbidden")
        denied = Rejection(403, "control", "forbidden", message)
        return call.reject(denied, close=request.body_exists)

    def _addressable(self, call: Call, route: Route) -> tuple[str, str] | Reply:
        """The worker and engine path an addressed call names, or the refusal of a path
        outside the fixed list (never forwarded, whatever it would reach)."""
        found = addressed(canonical_path(call.raw_path.partition("?")[0]))
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
            return call.reject(refused, close=call.request.body_exists)
        if call.request.method not in methods:
            return call.wrong_method(methods)
        return found

    async def _registry(self, call: Call, route: Route, caller: str, body: bytes) -> Reply:
        request, exchange, fanout = call.request, call.exchange, self.fanout
        fleet = self._fleet

        async def change_registry() -> tuple[int, bytes, SharingFailed | None]:
            # Under the fleet's lock when it changes: two replicas never interleave.
            held = fleet.exclusive(route.path) if request.method != "GET" else _UNLOCKED
            async with held:
                status, answer, change = registry_api.handle(
                    fleet, request.method, route.path, call.raw_path, body
                )
                try:
                    await fleet.share(change)
                except SharingFailed as exc:
                    return status, answer, exc
            return status, answer, None

        try:
            work = change_registry()
            # Only a change must outlive its caller; a read is the caller's alone.
            status, answer, unshared = await (
                work if request.method == "GET" else self._runs.run(work)
            )
        except (StoreDown, LockBusy) as exc:
            return self._refused(call, route, exc)
        if unshared is not None:
            fanout.count(route.path, "unshared")
            exchange.detail = "unshared"
            reply = {
                "detail": _unshared_detail("The registry change was made", unshared),
                "shared": False,
                "result": orjson.loads(answer),
            }
            return call.reply(503, orjson.dumps(reply), Outcome.CONTROL_FAILED)
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
        return call.reply(status, answer, outcome)

    def _targets(
        self, call: Call, route: Route, engine_path: tuple[str, str] | None, owner: str | None
    ) -> tuple[list[str], str] | Reply:
        """The backends a control call goes to, and the target each one gets."""
        raw_path = call.raw_path
        target = raw_path
        if engine_path is not None:
            worker, path = engine_path
            backend = self._pool.find(worker)
            if backend is None:
                self.fanout.count(route.path, "failed")
                missing = replies.render(ErrorShape.PLAIN, 404, f"No worker {worker!r}.")
                return call.reply(404, missing, Outcome.NOT_FOUND)
            urls = [backend.url]
            # The path as checked, never as sent: the engine must match exactly what was
            # allowed, whatever spelling reached the gateway.
            query = raw_path.partition("?")[2]
            target = path + "?" + query if query else path
        else:
            urls = [b.url for b in self._pool.backends]
            if owner is not None and owner in urls:
                urls = [owner]
        if not urls:
            self.fanout.count(route.path, "failed")
            return call.unavailable(Outcome.NO_BACKEND)
        return urls, target

    async def _fan_out(
        self,
        call: Call,
        route: Route,
        caller: str,
        targets: tuple[list[str], str],
        body: bytes,
        *,
        engine_path: tuple[str, str] | None = None,
    ) -> Reply:
        request, settings, exchange = call.request, call.settings, call.exchange
        urls, target = targets
        headers = call.upstream_headers(settings.control_forwarding)
        exchange.first_byte = time.perf_counter()
        control = ControlCall(
            request.method,
            target,
            headers,
            body if request.body_exists else None,
            connect_s=settings.connect_s,
            timeout_s=settings.control_timeout,
        )
        # Run to its end even if the caller goes away: the engines act on the call either
        # way, so what the gateway records of them (and shares) must follow.
        engine_route = route.path if engine_path is None else engine_path[1]
        try:
            results, unshared = await self._runs.run(
                self._locked_run(
                    engine_route, urls, control, log_as=(route.path, caller, request.remote)
                )
            )
        except (StoreDown, LockBusy) as exc:
            return self._refused(call, route, exc)
        ok = all(r.ok for r in results)
        exchange.attempts = len(results)
        if unshared is not None:
            # Never the engines' plain answer: that would read as the whole gateway knowing.
            self.fanout.count(route.path, "unshared")
            exchange.detail = "unshared"
            reply = orjson.loads(reply_body(results))
            reply.update(
                success=False,
                shared=False,
                detail=_unshared_detail("The engines listed acted on the call", unshared),
            )
            return call.reply(503, orjson.dumps(reply), Outcome.CONTROL_FAILED)
        if route.path in fleet_reads.LOADS_PATHS:
            return self._loads(call, route, results)
        self.fanout.count(route.path, "ok" if ok else "failed")
        if route.path == ADDRESSED_PATH:
            (only,) = results
            exchange.backend = only.url
            if only.status:  # the engine's own answer, relayed as it came
                resp = call.reply(
                    only.status, only.raw, Outcome.OK if ok else Outcome.CONTROL_FAILED
                )
                resp.content_type = only.content_type.partition(";")[0] or "application/json"
                return resp
        return call.reply(
            200 if ok else 502,
            reply_body(results),
            Outcome.OK if ok else Outcome.CONTROL_FAILED,
        )

    async def _locked_run(
        self,
        engine_route: str,
        urls: list[str],
        call: ControlCall,
        *,
        log_as: tuple[str, str, str | None],
    ) -> tuple[list[BackendResult], SharingFailed | None]:
        """_run, under the fleet's lock when the call changes the fleet (StoreDown or
        LockBusy before any engine is asked, when it cannot be had)."""
        if not changes_fleet(engine_route):
            return await self._run(urls, call, log_as=log_as)
        async with self._fleet.exclusive(engine_route):
            return await self._run(urls, call, log_as=log_as)

    def _refused(self, call: Call, route: Route, exc: StoreDown | LockBusy) -> Reply:
        """A fleet-changing call not made: the store is away (503) or another call holds
        the fleet's lock (409). No engine was asked."""
        busy = isinstance(exc, LockBusy)
        result = "busy" if busy else "store_unavailable"
        self.fanout.count(route.path, result)
        call.exchange.detail = result
        status = 409 if busy else 503
        reply = call.reply(status, orjson.dumps({"detail": exc.reason}), Outcome.CONTROL_FAILED)
        if not busy:
            reply.headers.append(("Retry-After", "1"))
        return reply

    async def _run(
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

    def _loads(self, call: Call, route: Route, results: list[BackendResult]) -> Reply:
        """The fleet's /v1/loads, shaped like one engine's (gateway/edge/fleet_reads.py)."""
        ok, body = fleet_reads.merged_loads(results)
        self.fanout.count(route.path, "ok" if ok else "failed")
        return call.reply(200 if ok else 502, body, Outcome.OK if ok else Outcome.CONTROL_FAILED)

    def _fleet_read(self, call: Call, route: Route) -> Reply:
        """An engine read route answered for the fleet from the gateway's own view."""
        self.fanout.count(route.path, "ok")
        return call.reply(200, fleet_reads.weight_version(self._pool), Outcome.OK)

    async def _abort_owner(self, body: bytes) -> str | None:
        """The backend serving the one rid an abort names, if this gateway (or, through
        etcd, another replica) routed it there. An abort of all, of a list, of a prefix, or
        of an unknown rid (queued anywhere, or routed by another gateway process without a
        shared store) goes to every backend."""
        try:
            parsed = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            return None
        if not isinstance(parsed, dict) or parsed.get("abort_all"):
            return None
        if parsed.get("prefix") not in (None, False):
            # Miles aborts every request of an adapter by its rid prefix ({"rid": p, "prefix":
            # true}): they may run on any engine, whatever this gateway routed under p itself.
            return None
        rid = parsed.get("rid")
        if not isinstance(rid, str):
            return None
        if self.publisher is not None:
            return await self.publisher.lookup(rid)
        return self.owners.owner(rid)


_CLIENT: Final = "client"
_UNLOCKED: Final = contextlib.nullcontext()


def _may_generate(call: Call) -> bool:
    """Whether the caller passes the client authentication a generation request needs."""
    settings = call.settings
    keys = settings.auth
    if keys is None or "/abort_request" in settings.auth_exempt:
        return True
    return keys.check(call.request.headers.get("Authorization")) is None


# Each refusal names what would allow the call.
_OPERATOR: Final = (
    "Fleet control routes need an operator key (control.keys) or a caller from "
    "control.trusted_cidrs. control.membership.trusted_cidrs grants registering, listing and "
    "removing workers only, and a client key only the abort of one request by its rid."
)
_MEMBERSHIP: Final = (
    "Registering, listing and removing workers needs a caller from "
    "control.membership.trusted_cidrs (the engines' network) or control.trusted_cidrs, or "
    "an operator key (control.keys): add the caller's network to "
    "control.membership.trusted_cidrs or use a control key."
)
_CLIENT_ABORT_OFF: Final = (
    "Aborting a request by its rid is for operators here (control.client_abort is false): "
    "set control.client_abort: true to let clients abort their requests, or use an operator "
    "key (control.keys) or a caller from control.trusted_cidrs."
)
_CLIENT_ABORT_KEY: Final = (
    "Aborting a request by its rid needs a client key (auth.keys), as generation does, or "
    "an operator key (control.keys) or a caller from control.trusted_cidrs."
)
_FLEET_ABORT: Final = (
    'A client may abort one request by its rid ({"rid": "<id>"}, control.client_abort). '
    "abort_all, a prefix abort, an abort without a string rid, or a body that is not such "
    "a JSON object acts on the whole fleet: that needs an operator key (control.keys) or a "
    "caller from control.trusted_cidrs."
)
_RELAYED: Final = (
    "This request was relayed by a proxy (it carries forwarding headers), so the address "
    "it comes from vouches for no caller: through a proxy this call needs an operator key "
    "(control.keys)."
)


def _unshared_detail(done: str, exc: SharingFailed) -> str:
    return (
        f"{done}, and this gateway process routes by it, but it could not be shared with "
        f"the gateway's other worker processes ({exc.reason}): they route as before. The "
        "next change that is shared replaces it in this process too. Repeat the call once "
        "the state can be written."
    )
