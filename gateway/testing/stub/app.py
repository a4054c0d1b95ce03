"""The stub backend that speaks SGLang 0.5.19's HTTP surface, for tests and local runs.

It reproduces the shapes the gateway cares about (see docs/sglang-contract.md): generation
responses, error bodies, SSE streams written event by event, and SGLang's own sampling-mask
admission rule, coded independently of the gateway so that the two can check each other.
Faults are scripted per request with ``X-Stub-*`` headers or per instance with attributes.

SGLang's rules live in rules.py (with where they only approximate SGLang), the faults it
plays in faults.py, the token logprobs it reports in logprobs.py.

RL frameworks read it as they read an engine: `/generate` with `return_logprob` answers
`meta_info.output_token_logprobs` / `input_token_logprobs` ([logprob, token_id, text]
triples, fixed by the prompt's ids), aborted generations answer as fully as finished ones,
`/v1/loads` counts the batch items running now, and `/get_weight_version` follows the
weight updates (see docs/sglang-contract.md s.7 and s.9 for the shapes).
A long-lived stub (compose, `sglang-gateway stub`) remembers only its last `--keep` requests,
each body cut to `--keep-body-bytes`, so its memory stays bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import os
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway import runtime
from gateway.testing.stub.admin import start_admin
from gateway.testing.stub.cache import PrefixCache, generate_prompts, stamp, stamped
from gateway.testing.stub.faults import (
    CTX,
    MID_BODY_EVENTS,
    PAD_RESERVE,
    PAD_SENTINEL,
    Ctx,
    Run,
    header_int,
    padded_rows,
)
from gateway.testing.stub.logprobs import Ask, Logprobs, openai_chat, openai_completion, prompt_ids
from gateway.testing.stub.pd import PdStub
from gateway.testing.stub.rules import (
    GENERATION_PATHS,
    Item,
    Reject,
    Release,
    error,
    generate_items,
    generate_out,
    json_response,
    lax_bool,
    lax_int,
    mask_top_k,
    max_tokens,
    parse,
    token_pieces,
    usage,
    words,
)

_Json = dict[str, Any]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

_DISAGG_COUNTS = (
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
)

_MAX_TOTAL_TOKENS = 1 << 20  # the KV pool it claims: large enough never to be the limit

_MAX_RUNNING_REQUESTS = 1024


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


def _openai_logprobs(prompt: object, top: object) -> Logprobs:
    """The OpenAI routes ask the engine for output logprobs with their text (serving_chat.py,
    serving_completions.py: `return_text_in_logprobs=True`)."""
    ids = prompt_ids(prompt)
    k = 0 if top is None else max(0, lax_int(top, "top_logprobs"))
    return Logprobs(Ask(len(ids), k, None, True), ids)


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


class StubBackend:
    """An SGLang look-alike; attributes mirror the constructor and may be changed at run time.

    The ``X-Stub-*`` request headers script any route; the constructor's ``delay_s``,
    ``fail_status`` and ``drop`` script the generation routes only, so that health probes and
    info calls keep working while generation fails. Every request lands in ``received``, then
    in exactly one of ``completed``, ``cancelled`` (the client went away) or ``dropped`` (the
    stub cut the connection on purpose).
    """

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

    # --- lifecycle -----------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._middleware, self._lora_gate], client_max_size=1 << 30
        )
        routes: list[tuple[str, str, _Handler]] = [
            ("POST", "/generate", self._generate),
            ("PUT", "/generate", self._generate),
            ("POST", "/v1/chat/completions", self._chat),
            ("POST", "/invocations", self._chat),
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/responses", self._responses),
            ("POST", "/vertex_generate", self._vertex),
            ("GET", "/health", self._health),
            ("GET", "/health_generate", self._health),
            ("GET", "/model_info", self._model_info),
            ("GET", "/get_model_info", self._model_info),
            ("GET", "/server_info", self._server_info),
            ("GET", "/get_server_info", self._server_info),
            ("GET", "/v1/models", self._models),
            ("POST", "/abort_request", self._abort_request),
            ("POST", "/pause_generation", self._engine_op),
            ("POST", "/continue_generation", self._engine_op),
            ("POST", "/update_weights_from_disk", self._engine_op),
            ("POST", "/release_memory_occupation", self._engine_op),
            ("POST", "/resume_memory_occupation", self._engine_op),
            ("POST", "/start_profile", self._engine_op),
            ("POST", "/stop_profile", self._engine_op),
            ("POST", "/init_weights_update_group", self._engine_op),
            ("POST", "/update_weights_from_distributed", self._engine_op),
            ("POST", "/update_weights_from_tensor", self._engine_op),
            ("POST", "/destroy_weights_update_group", self._engine_op),
            ("POST", "/weights_checker", self._engine_op),
            ("POST", "/load_lora_adapter", self._lora),
            ("POST", "/unload_lora_adapter", self._lora),
            ("POST", "/load_lora_adapter_from_tensors", self._lora),
            ("GET", "/v1/loads", self._loads),
            ("GET", "/get_loads", self._loads),
            ("GET", "/get_load", self._get_load),
            ("GET", "/get_weight_version", self._weight_version),
            ("GET", "/weight_version", self._weight_version),
            ("GET", "/flush_cache", self._flush_cache),
            ("POST", "/flush_cache", self._flush_cache),
            ("GET", "/metrics", self._metrics),
        ]
        if self.pd is not None:
            routes.append(("GET", "/stub/pd", self._pd_state))
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        app.on_response_prepare.append(self._stamp)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._stopping = False
        keepalive = 75.0 if self.idle_close_s is None else self.idle_close_s
        # A short shutdown timeout: tests stop the stub with streams still hanging open.
        runner = web.AppRunner(
            self.make_app(),
            handler_cancellation=True,
            keepalive_timeout=keepalive,
            access_log=None,
            shutdown_timeout=0.1,
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self._port = int(runner.addresses[0][1])
        if self.pd is not None:
            await self.pd.start(host)
        return self._port

    async def stop(self) -> None:
        if self._runner is not None:
            self._stopping = True
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self.pd is not None:
            await self.pd.stop()

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

    # --- generation routes ---------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        ctx = request[CTX]
        body = parse(await request.read())
        stream = lax_bool(body.get("stream"))
        try:
            items, batch = generate_items(body, self.release)
        except Reject as exc:
            if not (stream and exc.admission):
                raise
            # SGLang reports a refused streaming request in-band: 200, an abort chunk, [DONE].
            reason = {"type": "abort", "message": exc.message, "status_code": exc.status}
            meta = {"id": uuid.uuid4().hex, "finish_reason": reason, "prompt_tokens": 0}
            return await self._stream(request, [{"text": "", "output_ids": [], "meta_info": meta}])
        ctx.items = items
        cache = self.prefix_cache
        cached = await cache.serve(generate_prompts(body)) if cache is not None else []
        if stream:
            events = self._generate_events(request, items, batch, ctx)
            return await self._stream(request, stamped(events, cached) if cached else events)
        outs = [
            generate_out(it, it.max_new, ctx.started, weight_version=self.weight_version)
            for it in items
        ]
        stamp(outs, cached)
        self._generated_tokens += sum(it.max_new for it in items)
        payload: object = outs if batch else outs[0]
        target = header_int(request, "X-Stub-Response-Bytes")
        if target is None or not outs:
            return json_response(payload)
        outs[0]["meta_info"]["output_token_sampling_mask"] = PAD_SENTINEL
        head, _, tail = orjson.dumps(payload).partition(orjson.dumps(PAD_SENTINEL))
        # The row count depends on the target alone, so identical requests get identical bodies
        # whatever the digits of their latencies; blanks then bring the size to the target.
        overhead = len(head) + len(tail) + 2
        size, padding = padded_rows(target - PAD_RESERVE, target - overhead)
        chunks = itertools.chain([head + b"["], padding, [b"]" + tail])
        return await self._send_chunks(request, chunks, overhead + size)

    def _generate_events(
        self, request: web.Request, items: list[Item], batch: bool, ctx: Ctx
    ) -> Iterator[_Json]:
        counts = [self._events(request, it.max_new) for it in items]
        ctx.done = [0] * len(items)
        for step in range(1, max(counts, default=0) + 1):
            for index, (item, n) in enumerate(zip(items, counts, strict=True)):
                if step > n:
                    continue
                self._generated_tokens += 1
                out = generate_out(
                    item, step, ctx.started, final=step == n, weight_version=self.weight_version
                )
                if batch:
                    out["index"] = index
                yield out
                # Resumed only once that event was written: an abort meanwhile reports it.
                ctx.done[index] = step

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = parse(await request.read())
        stream = lax_bool(body.get("stream"))
        with_meta = lax_bool(body.get("return_meta_info"))
        mask_k = None
        if lax_bool(body.get("return_sampling_mask")):
            mask_k = mask_top_k(
                body.get("top_k"), body.get("temperature"), body.get("top_p"), self.release
            )
            if not with_meta:
                raise Reject("return_sampling_mask requires return_meta_info=true.")
        if stream and with_meta:
            raise Reject(
                "return_meta_info is not supported with streaming. "
                "Please set stream=false when using return_meta_info=true."
            )
        n = max_tokens(body.get("max_completion_tokens", body.get("max_tokens")))
        base = self._openai_base(body, "chatcmpl-", "chat.completion.chunk")
        lp = None
        if lax_bool(body.get("logprobs")):  # serving_chat.py: top_logprobs or 0, with text
            lp = _openai_logprobs(body.get("messages"), body.get("top_logprobs"))
        if stream:
            # The role rides on the first content delta so that X-Stub-Events counts every event.
            def delta(i: int, piece: str) -> _Json:
                part = {"delta": {"content": piece} | ({"role": "assistant"} if i == 0 else {})}
                return part | ({"logprobs": openai_chat(lp, i, i + 1)} if lp else {})

            return await self._choice_stream(request, base, n, delta)
        prompt = words(body.get("messages"))
        cache = self.prefix_cache
        cached = await cache.serve([body.get("messages")]) if cache is not None else []
        message = {"role": "assistant", "content": self._text(n), "tool_calls": None}
        logprobs = openai_chat(lp, 0, n) if lp else None
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": "length"}
        if with_meta:
            item = Item(prompt, n, mask_k, base["id"])
            choice["meta_info"] = generate_out(
                item, n, request[CTX].started, weight_version=self.weight_version
            )["meta_info"]
            stamp([choice], cached)
        return json_response(
            base | {"object": "chat.completion", "choices": [choice]} | usage(prompt, n)
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = parse(await request.read())
        n = max_tokens(body.get("max_tokens"))
        base = self._openai_base(body, "cmpl-", "text_completion")
        lp = None
        if body.get("logprobs") is not None:  # an int: the top logprobs wanted, 0 for none
            lp = _openai_logprobs(body.get("prompt"), body.get("logprobs"))
        if lax_bool(body.get("stream")):

            def part(i: int, piece: str) -> _Json:
                return {"text": piece} | (
                    {"logprobs": openai_completion(lp, i, i + 1)} if lp else {}
                )

            return await self._choice_stream(request, base, n, part)
        logprobs = openai_completion(lp, 0, n) if lp else None
        choice = {
            "index": 0,
            "text": self._text(n),
            "logprobs": logprobs,
            "finish_reason": "length",
        }
        return json_response(base | {"choices": [choice]} | usage(words(body.get("prompt")), n))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = parse(await request.read())
        n = max_tokens(body.get("max_output_tokens"))
        base = self._openai_base(body, "resp_", "response")
        if lax_bool(body.get("stream")):
            pieces = token_pieces(self._events(request, n))
            self._generated_tokens += len(pieces)
            kind = "response.output_text.delta"
            return await self._stream(
                request, ({"type": kind, "response_id": base["id"], "delta": p} for p in pieces)
            )
        text = {"type": "output_text", "text": self._text(n), "annotations": []}
        message = {"type": "message", "role": "assistant", "status": "completed", "content": [text]}
        prompt = words(body.get("input"))
        usage = {"input_tokens": prompt, "output_tokens": n, "total_tokens": prompt + n}
        return json_response(base | {"status": "completed", "output": [message], "usage": usage})

    def _openai_base(self, body: _Json, prefix: str, obj: str) -> _Json:
        model = body.get("model")
        model = model if isinstance(model, str) else self.model
        created = int(time.time())
        return {"id": prefix + uuid.uuid4().hex, "object": obj, "created": created, "model": model}

    def _text(self, n: int) -> str:
        self._generated_tokens += n
        return "".join(token_pieces(n))

    async def _choice_stream(
        self, request: web.Request, base: _Json, n: int, part: Callable[[int, str], _Json]
    ) -> web.StreamResponse:
        pieces = token_pieces(self._events(request, n))
        self._generated_tokens += len(pieces)

        def event(i: int, piece: str) -> _Json:
            finish = "length" if i == len(pieces) - 1 else None
            choice = {"index": 0, "logprobs": None} | part(i, piece) | {"finish_reason": finish}
            return base | {"choices": [choice]}

        return await self._stream(request, (event(i, p) for i, p in enumerate(pieces)))

    async def _vertex(self, request: web.Request) -> web.StreamResponse:
        body = parse(await request.read())
        instances = body.get("instances")
        parameters = body.get("parameters")
        if not isinstance(instances, list) or not instances:
            return json_response([])
        # SGLang builds a batch GenerateReqInput from the instances plus the parameters.
        gen: _Json = dict(parameters) if isinstance(parameters, dict) else {}
        for key in ("text", "input_ids"):
            first = instances[0]
            if isinstance(first, dict) and first.get(key):
                gen[key] = [inst.get(key) if isinstance(inst, dict) else None for inst in instances]
                break
        items, _ = generate_items(gen, self.release)
        self._generated_tokens += sum(it.max_new for it in items)
        started = request[CTX].started
        return json_response(
            {
                "predictions": [
                    generate_out(it, it.max_new, started, weight_version=self.weight_version)
                    for it in items
                ]
            }
        )

    # --- operational routes --------------------------------------------------------------

    async def _pd_state(self, request: web.Request) -> web.StreamResponse:
        """The rooms this half of a pair took part in, for a check across processes."""
        pd = self.pd
        assert pd is not None
        state = {"role": pd.role, "rooms": pd.rooms, "failed": pd.failed}
        return json_response(state | {"handed_over": pd.handed_over})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if self.health_delay_s > 0:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status)

    async def _model_info(self, request: web.Request) -> web.StreamResponse:
        return json_response(
            {
                "model_path": self.model,
                "tokenizer_path": self.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    @property
    def release(self) -> Release:
        return Release(self.version, self.sampling_mask_max_tokens, self.speculative_algorithm)

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        if self.server_info_status != 200:
            return json_response({"detail": "scripted"}, self.server_info_status)
        cap = {"sampling_mask_max_tokens": self.sampling_mask_max_tokens}
        return json_response(
            (cap if self.release.patch >= 20 else {})
            | {
                "version": self.version,
                "model_path": self.model,
                "tokenizer_path": self.model,
                "served_model_name": self.model,
                "speculative_algorithm": self.speculative_algorithm,
                "sampling_backend": "flashinfer",
                "disaggregation_mode": "null",
                "context_length": 32768,
                "internal_states": [{"last_gen_throughput": 0.0}],
            }
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.model,
            "max_model_len": 32768,
        }
        # SGLang lists each loaded LoRA adapter as a model whose parent is the base model.
        adapters = [
            card | {"id": name, "root": path, "parent": self.model, "max_model_len": None}
            for name, path in self.adapters.items()
        ]
        return json_response({"object": "list", "data": [card, *adapters]})

    async def _abort_request(self, request: web.Request) -> web.StreamResponse:
        # SGLang answers 200 with no body whether or not the rid was found.
        body = await request.read()
        parsed = parse(body) if body else {}
        sent = parsed if isinstance(parsed, dict) else {}
        message = sent.get("abort_message")
        text = message if isinstance(message, str) else "Abort request"
        if lax_bool(sent.get("abort_all")):
            self._abort_runs(list(self._runs), text)
        elif isinstance(rid := sent.get("rid"), str) and lax_bool(sent.get("prefix")):
            # Miles' SGLang build: every request whose rid starts with this one (upstream's
            # scheduler matches by prefix too, once the tokenizer knows the exact rid).
            self._abort_runs(
                [r for r in self._runs if any(x.startswith(rid) for x in r.rids)], text
            )
        elif isinstance(rid := sent.get("rid"), str):
            self._abort_runs([r for r in self._runs if rid in r.rids], text)
        return web.Response()

    async def _engine_op(self, request: web.Request) -> web.StreamResponse:
        # SGLang answers its engine operations with {"success": ..., "message": ...}.
        path = request.path
        body = await request.read()
        parsed = parse(body) if body else {}
        sent = parsed if isinstance(parsed, dict) else {}
        if self.engine_op_status is not None:
            failed = {"success": False, "message": f"{path[1:]} failed on port {self._port}"}
            return json_response(failed, self.engine_op_status)
        if path == "/pause_generation":
            mode = sent.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise Reject(f"mode must be abort, retract or in_place, not {mode!r}")
            if mode == "abort":  # running requests end; retract and in_place keep them
                self._abort_runs(list(self._runs))
            self.pause_mode = mode
            self._unpaused.clear()
        elif path == "/continue_generation":
            self.pause_mode = None
            self._unpaused.set()
        elif path == "/release_memory_occupation":
            if self._running - self._waiting > 0:
                # SGLang asserts that no request is running before it frees the memory.
                return json_response(
                    {"success": False, "message": "cannot release memory: requests running"},
                    400,
                )
            self.asleep = True
        elif path == "/resume_memory_occupation":
            self.asleep = False
        elif path.startswith("/update_weights") and isinstance(sent.get("weight_version"), str):
            self.weight_version = sent["weight_version"]
        return json_response({"success": True, "message": f"{path[1:]} done on port {self._port}"})

    async def _lora(self, request: web.Request) -> web.StreamResponse:
        # SGLang's LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput, answered with its
        # LoRAUpdateOutput: 200 with every adapter now loaded, or 400 saying why not.
        # LoadLoRAAdapterFromTensorsReqInput names no path: SGLang records "__tensor__"
        # (io_struct.py, to_ref), and takes the adapter's config and tensors in the body.
        sent = parse(await request.read())
        from_tensors = request.path == "/load_lora_adapter_from_tensors"
        name = sent.get("lora_name")
        path = "__tensor__" if from_tensors else sent.get("lora_path")
        loading = request.path != "/unload_lora_adapter"
        # Upstream names the tensors serialized_named_tensors; Miles' SGLang build
        # (sglang-miles) serialized_tensors: either stands for them here.
        tensors = sent.get("serialized_named_tensors", sent.get("serialized_tensors"))
        if from_tensors and not (isinstance(sent.get("config_dict"), dict) and tensors):
            raise Reject("config_dict and serialized_named_tensors are required", parse=True)
        if not isinstance(name, str) or (loading and not isinstance(path, str)):
            fields = "lora_name and lora_path" if loading else "lora_name"
            raise Reject(f"{fields} must be strings", parse=True)
        failure: str | None = None
        if self.engine_op_status is not None:
            failure = f"{request.path[1:]} failed on port {self._port}"
        elif loading and name in self.adapters:
            failure = f"Failed to load LoRA adapter {name} because it is already loaded"
        elif not loading and name not in self.adapters:
            failure = f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
        if failure is not None:
            refused = {"success": False, "error_message": failure, "loaded_adapters": None}
            return json_response(refused, self.engine_op_status or 400)
        if loading:
            assert isinstance(path, str)
            self.adapters[name] = path
        else:
            del self.adapters[name]
        done = {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}
        return json_response(done)

    @web.middleware
    async def _lora_gate(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Refuse a generation that names an adapter this engine has not loaded, in SGLang's
        words (its LoRA registry): 400, or in-band on a /generate stream."""
        if request.path not in GENERATION_PATHS:
            return await handler(request)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return await handler(request)
        if not isinstance(body, dict):
            return await handler(request)
        lora = body.get("lora_path")
        model = body.get("model")
        if request.path != "/generate" and isinstance(model, str) and ":" in model:
            lora = model.split(":", 1)[1].strip() or lora  # base:adapter wins
        names = [lora] if isinstance(lora, str) and lora else lora if isinstance(lora, list) else []
        for name in names:
            if name is not None and name not in self.adapters:
                message = (
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {list(self.adapters)}."
                )
                if request.path == "/generate" and lax_bool(body.get("stream")):
                    return await self._stream(request, [{"error": {"message": message}}])
                raise Reject(message)
        return await handler(request)

    def _load(self) -> _Json:
        """This engine's one DP rank as SGLang's LoadSnapshot has it (load_snapshot.py), the
        requests counted one per batch item as its scheduler counts them."""
        items = sum(run.size for run in self._runs)
        waiting = self._waiting_items
        core: _Json = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": items - waiting,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": 0,
            "num_total_tokens": 0,
            "num_active_tokens": 0,
        }
        if self.release.patch >= 23:
            core["num_prealloc_ready_tokens"] = 0
        return core | {
            "max_total_num_tokens": _MAX_TOTAL_TOKENS,
            "max_running_requests": _MAX_RUNNING_REQUESTS,
            "token_usage": 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": round(min(1.0, items / _MAX_RUNNING_REQUESTS), 4),
            "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }

    async def _loads(self, request: web.Request) -> web.StreamResponse:
        # GET /v1/loads?include=core,...&dp_rank=N (entrypoints/v1_loads.py, 0.5.19).
        include_q = request.query.get("include")
        include = {s.strip() for s in include_q.split(",")} if include_q else None
        if include is not None and not include <= _LOAD_SECTIONS:
            bad = "{" + ", ".join(repr(s) for s in sorted(include - _LOAD_SECTIONS)) + "}"
            message = f"Invalid include sections: {bad}. Valid options: {sorted(_LOAD_SECTIONS)}"
            body = {"object": "error", "message": message, "type": "400", "param": None}
            return json_response(body | {"code": 400}, 400)
        dp_rank = request.query.get("dp_rank")
        load = self._load()
        sections: frozenset[str] | set[str] = (
            _LOAD_SECTIONS if include is None or "all" in include else include
        )
        # SGLang always builds these three; spec and lora only with those features on.
        if "memory" in sections:
            memory = {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0}
            load["memory"] = memory | {"token_capacity": _MAX_TOTAL_TOKENS}
        if "disagg" in sections:
            load["disaggregation"] = {
                "mode": "null",
                **dict.fromkeys(_DISAGG_COUNTS, 0),
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if "queues" in sections:
            load["queues"] = {
                "waiting": self._waiting_items,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            }
        loads = [load] if dp_rank is None or dp_rank.strip() == "0" else []
        return json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": self.version,
                "accelerator": None,  # SGLang's device name; None where it has none
                "num_accelerators": 1,
                "loads": loads,
            }
        )

    async def _get_load(self, request: web.Request) -> web.StreamResponse:
        # The deprecated list-shaped shim of 0.5.18-0.5.19, built from the same snapshot.
        if self.release.patch >= 23:
            return json_response({"detail": "Not Found"}, 404)
        load = self._load()
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                    "num_waiting_reqs": load["num_waiting_reqs"],
                    "num_tokens": load["num_total_tokens"],
                    "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"],
                    "ts_tic": time.perf_counter(),
                }
            ]
        )

    async def _weight_version(self, request: web.Request) -> web.StreamResponse:
        """GET /get_weight_version and /weight_version. Upstream SGLang answers them 404
        (0.5.18-0.5.19: deprecated, "use /model_info"; 0.5.23: no such route); the SGLang
        that slime ships patches them back to {"weight_version": ...}
        (THUDM/slime docker/patch/latest/sglang.patch), and slime's engine reads it
        (slime/backends/sglang_utils/sglang_engine.py `get_weight_version`). The stub plays
        the patched engine unless `weight_version_route` is off."""
        if self.weight_version_route:
            return json_response({"weight_version": self.weight_version})
        if self.release.patch >= 23:
            return json_response({"detail": "Not Found"}, 404)
        message = (
            "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
            "Please use '/model_info' instead."
        )
        body = {"object": "error", "message": message, "type": "404", "param": None}
        return json_response(body | {"code": 404}, 404)

    async def _flush_cache(self, request: web.Request) -> web.StreamResponse:
        if self._runs or self.pause_mode == "in_place":
            # SGLang flushes only an idle engine (and never one paused in place).
            return web.Response(
                status=400,
                text="Cache not flushed. Please check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be "
                "performed.)\n",
            )
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.\n")

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        label = f'{{model_name="{self.model}"}}'
        lines = [
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{label} {float(self._running)}",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{label} 0.0",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{label} {float(self._generated_tokens)}",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{label} {float(self.generations_seen)}",
        ]
        if (cache := self.prefix_cache) is not None:
            lines += [
                "# TYPE sglang:prompt_tokens_total counter",
                f"sglang:prompt_tokens_total{label} {float(cache.prompt_tokens_total)}",
                "# TYPE sglang:cached_tokens_total counter",
                f"sglang:cached_tokens_total{label} {float(cache.cached_tokens_total)}",
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


# --- CLI -------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.testing.stub", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--admin-port",
        type=int,
        # A string default goes through type=int, so a bad variable fails like a bad flag.
        default=os.environ.get("GATEWAY_ADMIN_PORT") or None,
        help="also serve /livez and /readyz here, on --host (default: $GATEWAY_ADMIN_PORT, "
        "which the image sets; unset: no admin listener, as SGLang has none)",
    )
    parser.add_argument("--model", default="stub-model")
    parser.add_argument(
        "--release", default="0.5.19", help="the SGLang release whose admission it plays"
    )
    parser.add_argument(
        "--sampling-mask-max-tokens", type=int, default=4096, help="the cap (0.5.20 and later)"
    )
    parser.add_argument(
        "--speculative-algorithm", default=None, help="as if speculative decoding were on"
    )
    parser.add_argument("--delay-ms", type=int, default=0)
    parser.add_argument("--chunk-delay-ms", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=None)
    parser.add_argument("--drop", choices=("before-headers", "mid-body"), default=None)
    parser.add_argument(
        "--keep", type=int, default=1000, help="requests remembered (the newest; default 1000)"
    )
    parser.add_argument(
        "--keep-body-bytes",
        type=int,
        default=4096,
        help="bytes of each remembered body (default 4096); the sha256 is of the whole body",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="tokens the prefix cache holds (LRU; default 0: no cache, cached_tokens 0)",
    )
    parser.add_argument(
        "--prefix-block-tokens", type=int, default=16, help="tokens per cached block (16)"
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="prefill time per uncached prompt token, queued per engine (default 0: none)",
    )
    parser.add_argument(
        "--pd-role",
        choices=("prefill", "decode"),
        default=None,
        help="one half of a prefill/decode pair (default: a regular engine)",
    )
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=8998,
        help="a prefill stub's bootstrap port, where decode stubs fetch each room (8998)",
    )
    parser.add_argument(
        "--prefill-ms", type=int, default=0, help="a prefill stub's work per request (0)"
    )
    return parser.parse_args(argv)


def _prefix_cache(args: argparse.Namespace) -> PrefixCache | None:
    if args.prefix_cache_tokens <= 0 and args.prefill_us_per_token <= 0:
        return None
    try:
        return PrefixCache(
            max(args.prefix_cache_tokens, 0),
            args.prefix_block_tokens,
            args.prefill_us_per_token / 1e6,
        )
    except ValueError as exc:
        raise SystemExit(f"stub: {exc}") from exc


async def _serve(args: argparse.Namespace) -> None:
    stub = StubBackend(
        model=args.model,
        delay_s=args.delay_ms / 1000,
        chunk_delay_s=args.chunk_delay_ms / 1000,
        fail_status=args.fail_status,
        drop=args.drop,
        keep=args.keep,
        keep_body_bytes=args.keep_body_bytes,
        version=args.release,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        speculative_algorithm=args.speculative_algorithm,
        prefix_cache=_prefix_cache(args),
        pd=None
        if args.pd_role is None
        else PdStub(
            args.pd_role, bootstrap_port=args.bootstrap_port, prefill_s=args.prefill_ms / 1000
        ),
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    # Signals first: a SIGTERM right after the banner below must stop, not kill.
    async with runtime.Signals() as signals, contextlib.AsyncExitStack() as stack:
        port = await stub.start(args.host, args.port)
        stack.push_async_callback(stub.stop)
        if args.admin_port is not None:
            admin, admin_port = await start_admin(stub, args.host, args.admin_port)
            stack.push_async_callback(admin.cleanup)
            print(f"stub admin on http://{host}:{admin_port} (/livez, /readyz)", flush=True)
        if stub.pd is not None and stub.pd.role == "prefill":
            print(f"stub bootstrap on port {stub.pd.bootstrap_port}", flush=True)
        # Printed last: once it shows, every listener is up.
        print(f"stub listening on http://{host}:{port}", flush=True)
        await signals.wait()


def main(argv: list[str] | None = None) -> None:
    runtime.run(_serve(_parse_args(argv)))
