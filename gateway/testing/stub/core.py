"""The stub's state and the plumbing every route shares: the record of each request, the
scripted faults (``X-Stub-*`` headers and per-instance attributes), pause and abort, and the
writers of chunked bodies and SSE streams. The routes live beside it, by SGLang surface:
generation.py, engine_ops.py, server_info.py; app.py puts them together."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.testing.stub.cache import PrefixCache
from gateway.testing.stub.faults import (
    CTX,
    MID_BODY_EVENTS,
    Ctx,
    Run,
    header_int,
)
from gateway.testing.stub.pd import PdStub
from gateway.testing.stub.rules import (
    GENERATION_PATHS,
    Reject,
    Release,
    error,
    generate_items,
    generate_out,
    json_response,
    parse,
)

_Json = dict[str, Any]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Received:
    """One request as the stub saw it on the wire."""

    method: str
    path: str
    raw_path: str
    headers: CIMultiDictProxy[str]
    body: bytes
    sha256: str


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _run_of(body: bytes) -> Run:
    """The rids a generation carries (the `rid` field, a string or a list for a batch)."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    sent: _Json = parsed if isinstance(parsed, dict) else {}
    rid, text, ids = sent.get("rid"), sent.get("text"), sent.get("input_ids")
    if isinstance(rid, str):
        rids: tuple[str, ...] = (rid,)
    elif isinstance(rid, list):
        rids = tuple(r for r in rid if isinstance(r, str))
    else:
        rids = ()
    batch_ids = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    if isinstance(text, list):
        size = len(text)
    elif isinstance(ids, list) and batch_ids:
        size = len(ids)
    elif isinstance(rid, list):
        size = len(rid)
    else:
        size = 1
    return Run(rids, isinstance(text, list) or batch_ids or isinstance(rid, list), size)


class StubCore:
    """The state of one stub engine and the steps its routes share (see StubBackend)."""

    def __init__(
        self,
        *,
        model: str = "stub-model",
        version: str = "0.5.19",
        delay_s: float = 0.0,
        chunk_delay_s: float = 0.0,
        fail_status: int | None = None,
        drop: str | None = None,
        health_status: int = 200,
        health_delay_s: float = 0.0,
        idle_close_s: float | None = None,
        keep: int | None = None,
        keep_body_bytes: int | None = None,
        sampling_mask_max_tokens: int = 4096,
        speculative_algorithm: str | None = None,
        weight_version_route: bool = True,
        prefix_cache: PrefixCache | None = None,
        pd: PdStub | None = None,
    ) -> None:
        self.model = model
        # One half of a prefill/decode pair (gateway/testing/stub/pd.py); None: a regular
        # engine, which takes requests without bootstrap keys.
        self.pd = pd
        # SGLang's radix cache in miniature (gateway/testing/stub/cache.py); None: none, and
        # every cached_tokens is 0.
        self.prefix_cache = prefix_cache
        self.version = version
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self.speculative_algorithm = speculative_algorithm
        self.delay_s = delay_s
        self.chunk_delay_s = chunk_delay_s
        self.fail_status = fail_status
        self.drop = drop
        self.health_status = health_status
        # SGLang's /health runs a one-token generation: a hung engine's probe hangs too.
        self.health_delay_s = health_delay_s
        self.server_info_status = 200  # anything else: /server_info fails with it
        self.idle_close_s = idle_close_s
        # The requests seen, newest last. A long-lived stub (compose, the CLI) keeps only the
        # last `keep`, each body cut to `keep_body_bytes`; tests keep everything.
        self.received: deque[Received] = deque(maxlen=keep)
        self._keep_body_bytes = keep_body_bytes
        self.requests_seen = 0
        self.generations_seen = 0
        self.completed = 0
        self.cancelled = 0
        self.dropped = 0
        self.disconnect_event = asyncio.Event()
        self._running = 0
        # An RL engine's state: pause_generation holds new generations until
        # continue_generation; weight updates set the version every answer reports.
        self.weight_version = "default"
        # GET /get_weight_version answers {"weight_version"} (slime's patched SGLang) when
        # on, upstream SGLang's 404 when off.
        self.weight_version_route = weight_version_route
        self.asleep = False
        self.pause_mode: str | None = None  # abort, retract or in_place while paused
        self.aborted = 0  # generations ended by abort_request or pause_generation
        self.arrived_paused = 0  # generations that arrived while the engine was paused
        # Scripts the engine operations (pause, weight updates, ...): this status and
        # {"success": false} instead of doing them, as an engine whose weight load failed.
        self.engine_op_status: int | None = None
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded: name -> path
        self._runs: set[Run] = set()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._waiting = 0  # generation requests held in the queue
        self._waiting_items = 0  # their batch items, as SGLang counts waiting requests
        self._generated_tokens = 0
        self._runner: web.AppRunner | None = None
        self._host = "127.0.0.1"
        self._port = 0
        self._stopping = False

    @property
    def serving(self) -> bool:
        """The listener is up and not shutting down."""
        return self._runner is not None and not self._stopping

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    def generation_requests(self) -> list[Received]:
        return [r for r in self.received if r.path in GENERATION_PATHS]

    @property
    def release(self) -> Release:
        return Release(self.version, self.sampling_mask_max_tokens, self.speculative_algorithm)

    # --- plumbing ------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        generation = request.path in GENERATION_PATHS
        self._running += generation
        run: Run | None = None
        try:
            body = await request.read()
            digest = hashlib.sha256(body).hexdigest()
            headers = CIMultiDictProxy(CIMultiDict(request.headers))
            kept = body if self._keep_body_bytes is None else body[: self._keep_body_bytes]
            self.received.append(
                Received(request.method, request.path, request.raw_path, headers, kept, digest)
            )
            self.requests_seen += 1
            self.generations_seen += generation
            ctx = Ctx(index=self.requests_seen, sha256=digest, started=time.monotonic())
            request[CTX] = ctx
            if generation:
                self.arrived_paused += not self._unpaused.is_set()
                ctx.run = run = _run_of(body)
                self._runs.add(run)
            response = await self._dispatch(request, handler, ctx)
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            # Only the client leaving counts, not a scripted drop or our own shutdown. A write can
            # notice the loss before the cancellation arrives, hence ConnectionResetError too.
            ctx_now = request.get(CTX)
            if not self._stopping and not (ctx_now is not None and ctx_now.dropped):
                self.cancelled += 1
                self.disconnect_event.set()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return web.Response()  # nobody is left to read it
        finally:
            self._running -= generation
            if run is not None:
                self._runs.discard(run)
        if ctx.dropped:
            self.dropped += 1
        else:
            self.completed += 1
        return response

    async def _dispatch(
        self, request: web.Request, handler: _Handler, ctx: Ctx
    ) -> web.StreamResponse:
        routed = request.match_info.http_exception is None
        gen = routed and request.path in GENERATION_PATHS
        delay_ms = header_int(request, "X-Stub-Delay-Ms")
        delay = delay_ms / 1000 if delay_ms is not None else (self.delay_s if gen else 0.0)
        chunk_ms = header_int(request, "X-Stub-Chunk-Delay-Ms")
        ctx.chunk_delay_s = chunk_ms / 1000 if chunk_ms is not None else self.chunk_delay_s
        status = header_int(request, "X-Stub-Status")
        if status is None and gen:
            status = self.fail_status
        ctx.drop = request.headers.get("X-Stub-Drop") or (self.drop if gen else None)

        if gen:
            # Paused when it came: it waits in the queue (then in place or not, it queues).
            if await self._hold(ctx, delay, arriving=not self._unpaused.is_set()):
                return await self._aborted_reply(request, ctx)
        elif delay > 0:
            await asyncio.sleep(delay)
        if ctx.drop == "before-headers":
            self._abort(request, ctx)
            return web.Response()
        if (location := request.headers.get("X-Stub-Redirect")) is not None:
            return web.Response(status=307, headers={"Location": location})

        response: web.StreamResponse
        if status is not None:
            response = error(request.path, f"stub: scripted status {status}", status)
        elif not routed:
            response = self._route_error(request)
        else:
            try:
                if gen and self.pd is not None:
                    await self.pd.serve(request.path, await request.read())
                response = await handler(request)
                if self.pd is not None:
                    self.pd.finish(response)
            except Reject as exc:
                response = error(request.path, exc.message, exc.status, parse=exc.parse)

        if ctx.drop == "mid-body" and isinstance(response, web.Response) and not response.prepared:
            body = response.body if isinstance(response.body, bytes) else b""
            halves = [body[: len(body) // 2], body[len(body) // 2 :]]
            return await self._send_chunks(
                request, halves, len(body), response.status, response.content_type
            )
        return response

    def _route_error(self, request: web.Request) -> web.StreamResponse:
        if isinstance(request.match_info.http_exception, web.HTTPMethodNotAllowed):
            return json_response({"detail": "Method Not Allowed"}, 405)
        stripped = request.path.rstrip("/")
        if request.path != stripped and self._is_route(request, stripped):
            # Starlette's redirect_slashes, which SGLang inherits.
            location = request.url.with_path(stripped).with_query(request.query_string)
            return web.Response(status=307, headers={"Location": str(location)})
        return json_response({"detail": "Not Found"}, 404)

    @staticmethod
    def _is_route(request: web.Request, path: str) -> bool:
        return any(r.canonical == path for r in request.app.router.resources() if r.canonical != "")

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        ctx = request.get(CTX)
        if ctx is not None:
            response.headers["X-Stub-Body-Sha256"] = ctx.sha256
            response.headers["X-Stub-Request-Count"] = str(ctx.index)
        if (request_id := request.headers.get("X-Request-Id")) is not None:
            response.headers["X-Request-Id"] = request_id

    async def _hold(self, ctx: Ctx, delay: float, *, arriving: bool = False) -> bool:
        """One step of a generation: `delay` seconds, then for as long as the engine is
        paused. True when the generation was aborted meanwhile, which ends it at once.

        New requests and retracted ones wait in the queue (`waiting` in /v1/loads);
        `in_place` keeps running ones where they are (still `running`)."""
        run = ctx.run
        if run is None:
            if delay > 0:
                await asyncio.sleep(delay)
            return False
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.aborted.wait(), delay)
        if self._unpaused.is_set() or run.aborted.is_set():
            return run.aborted.is_set()
        queued = arriving or self.pause_mode != "in_place"
        self._waiting += queued
        self._waiting_items += run.size * queued
        try:
            waits = {
                asyncio.ensure_future(self._unpaused.wait()),
                asyncio.ensure_future(run.aborted.wait()),
            }
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        finally:
            self._waiting -= queued
            self._waiting_items -= run.size * queued
        return run.aborted.is_set()

    def _abort_runs(self, runs: Iterable[Run], message: str = "Abort request") -> None:
        for run in runs:
            if not run.aborted.is_set():
                run.abort_message = message
                run.aborted.set()
                self.aborted += 1

    async def _aborted_out(self, request: web.Request, ctx: Ctx) -> list[_Json]:
        """What an aborted generation answers: SGLang's finish_reason of type abort, on a
        /generate answer as full as a finished one (the tokens so far, their logprobs when
        asked, the counts), since RL clients read those fields on aborts too."""
        run = ctx.run
        size = run.size if run is not None else 1
        rids = list(run.rids) if run is not None and run.rids else []
        rids += [uuid.uuid4().hex for _ in range(size - len(rids))]
        reason = {"type": "abort", "message": run.abort_message if run else "Abort request"}
        if request.path == "/generate":
            if ctx.items is None:  # aborted before it was read: read it now
                try:
                    ctx.items, _ = generate_items(parse(await request.read()), self.release)
                except Reject:
                    ctx.items = []
            if len(ctx.items) != size:
                meta = {"finish_reason": reason, "weight_version": self.weight_version}
                outs = [{"text": "", "output_ids": [], "meta_info": {"id": r} | meta} for r in rids]
                return outs
            done = ctx.done or [0] * size
            outs = []
            for i, item in enumerate(ctx.items):
                out = generate_out(
                    item, done[i], ctx.started, weight_version=self.weight_version, reason=reason
                )
                if ctx.done is not None and run is not None and run.batch:
                    out["index"] = i  # a batch stream's events name their item
                outs.append(out)
            return outs
        choice = {"index": 0, "text": "", "finish_reason": "abort"}
        return [{"id": rids[0], "choices": [choice]}]

    async def _aborted_reply(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        outs = await self._aborted_out(request, ctx)
        batch = ctx.run is not None and ctx.run.batch
        return json_response(outs if batch else outs[0])

    @staticmethod
    def _abort(request: web.Request, ctx: Ctx) -> None:
        ctx.dropped = True
        if request.transport is not None:
            request.transport.abort()

    async def _send_chunks(
        self,
        request: web.Request,
        chunks: Iterable[bytes],
        total: int,
        status: int = 200,
        content_type: str = "application/json",
    ) -> web.StreamResponse:
        """Write a body of known length chunk by chunk, honouring chunk delay and mid-body drop."""
        ctx = request[CTX]
        resp = web.StreamResponse(status=status)
        resp.content_type = content_type
        resp.content_length = total
        await resp.prepare(request)
        sent = 0
        for i, chunk in enumerate(chunks):
            if ctx.drop == "mid-body" and sent >= total // 2:
                self._abort(request, ctx)
                return resp
            if i and ctx.chunk_delay_s > 0:
                await asyncio.sleep(ctx.chunk_delay_s)
            await resp.write(chunk)
            sent += len(chunk)
        return resp

    async def _stream(self, request: web.Request, events: Iterable[object]) -> web.StreamResponse:
        """Write an SSE stream one event per write, so readers can watch events arrive."""
        ctx = request[CTX]
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        for i, event in enumerate(events):
            if ctx.drop == "mid-body" and i >= MID_BODY_EVENTS:
                break
            if await self._hold(ctx, ctx.chunk_delay_s if i else 0.0):
                for out in await self._aborted_out(request, ctx):
                    await resp.write(_sse(out))
                break
            if self.pd is not None:
                self.pd.event(event)
            await resp.write(_sse(event))
        if ctx.drop == "mid-body":
            self._abort(request, ctx)
            return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _events(self, request: web.Request, default: int) -> int:
        n = header_int(request, "X-Stub-Events")
        return default if n is None else max(0, n)
