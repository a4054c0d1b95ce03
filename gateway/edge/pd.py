"""The request path of a prefill/decode fleet (backends.mode: pd), as sglang-router pairs.

A generation (/generate, chat, completions; batches too) goes to one prefill and one
decode worker at once, each picked by its role's balancer (gateway/fleet/pd.py). Both get
the request with `bootstrap_host` (the prefill worker's host), `bootstrap_port` (its
registered bootstrap port, or null) and `bootstrap_room` (a random 63-bit integer; one per
item, as lists, for a batch): SGLang's decode engine fetches the prompt's KV cache from
that prefill engine's bootstrap server by that room. This is the one place the gateway
changes a request body: the three keys are spliced into the bytes as they came, before the
object's closing brace, so every other byte reaches both engines unchanged, and the keys
come last, where a parser that keeps the last of duplicated keys (orjson, Python's json,
as SGLang reads) takes the gateway's over any the client sent, as sglang-router's insert
replaces them.

The decode worker's answer is relayed as the plain path relays any (streams too,
unbuffered). The prefill worker's is read to its end and dropped, except that its
`meta_info.input_token_logprobs` go in front of the decode's for a /generate with
`return_logprob`, as sglang-router merges them: in an answer sent whole (a batch's item by
item), and in each event of a streamed one that carries its own
(gateway/edge/pd_logprobs.py; the stream stays unbuffered, only those events are
re-serialised) - the one case where a reply body is.
Either side failing ends the pair: the other side's connection is closed (SGLang aborts a
request whose connection closed), and the client gets the failing side's own error reply,
or, once the decode's answer is under way, a connection that ends visibly broken. A client
that leaves closes both.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import orjson

from gateway.contract import replies
from gateway.contract.policy import Rejection
from gateway.contract.prompt import prompt_start
from gateway.contract.replies import Outcome
from gateway.contract.routes import Kind
from gateway.edge.failures import ConnectFailed, UpstreamFailure, UpstreamTimeout
from gateway.edge.headers import SERVER, WEIGHT_VERSION, ForwardedHeaders
from gateway.edge.pd_logprobs import StreamMerge, prefill_logprobs
from gateway.edge.server import Reply, Request
from gateway.edge.upstream import UpstreamResponse
from gateway.fleet.cache_aware import CacheAware
from gateway.fleet.capability import Needs
from gateway.fleet.pd import (
    BROKEN,
    CONNECT,
    DECODE_ROLE,
    ERROR_STATUS,
    NO_WORKER,
    PREFILL_ROLE,
    TIMEOUT,
    PdRouting,
)
from gateway.fleet.pool import Backend, HoldRefused

if TYPE_CHECKING:
    from gateway.edge.proxy import Call

# Routes whose requests are paired (sglang-router's PD router serves these three).
PAIRED: Final = frozenset({Kind.GENERATE, Kind.CHAT, Kind.COMPLETIONS})
# Generation routes sglang-router's PD router does not serve either (its 501).
UNPAIRED: Final = frozenset({Kind.RESPONSES, Kind.VERTEX})

# The most of a body the logprob merge holds (each side's): a larger answer is relayed
# as it came, unmerged, rather than held whole in memory.
MERGE_MAX_BYTES: Final = 64 << 20
# The most of a failing side's error body read, to relay it.
ERROR_MAX_BYTES: Final = 64 << 10

_BLANKS: Final = b" \t\r\n"
_OPEN: Final = ord("{")
_CLOSE: Final = ord("}")
_LIST: Final = ord("[")
_QUOTE: Final = ord('"')


# -- the room ----------------------------------------------------------------------------

_rng = random.Random()


def _reseed() -> None:
    # Rooms must differ between processes (--workers): two pairs sharing a room on one
    # prefill engine would get each other's KV cache.
    _rng.seed(os.urandom(16))


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_room() -> int:
    """A random room in [0, 2**63 - 1], as sglang-router and SGLang draw one."""
    return _rng.getrandbits(63)


@functools.lru_cache(maxsize=4096)
def bootstrap_host(url: str) -> str:
    """The host of a prefill worker's URL, as sglang-router sends it (an IPv6 address
    without its brackets)."""
    return urlsplit(url).hostname or "localhost"


# -- the body ----------------------------------------------------------------------------


def splice(body: bytes, fields: bytes) -> bytes | None:
    """`body` with `fields` (object members, `"k":v,...`) added before the top-level
    object's closing brace; None when the body is not an object."""
    end = len(body)
    while end and body[end - 1] in _BLANKS:
        end -= 1
    start = 0
    while start < end and body[start] in _BLANKS:
        start += 1
    if end - start < 2 or body[start] != _OPEN or body[end - 1] != _CLOSE:
        return None
    last = end - 1
    inner = last - 1
    while inner > start and body[inner] in _BLANKS:
        inner -= 1
    comma = b"" if inner == start else b","
    # memoryview slices: the join is the one copy of a multi-MB body, not three.
    view = memoryview(body)
    return b"".join((view[:last], comma, fields, view[last:]))


@dataclass(frozen=True, slots=True)
class Shape:
    """What the pairing reads of a body: the rooms a batch needs (None: one request, one
    room), and whether the input logprobs are to be merged."""

    rooms: int | None = None
    logprob: bool = False


_SINGLE: Final = Shape()


def _starts_list(body: bytes, at: int | None, *, items: tuple[int, ...]) -> bool:
    """The value at `at` is a list whose first element starts with one of `items`."""
    if at is None or at >= len(body) or body[at] != _LIST:
        return False
    i = at + 1
    while i < len(body) and body[i] in _BLANKS:
        i += 1
    return i < len(body) and body[i] in items


def shape(kind: Kind, body: bytes) -> Shape:
    """The body's Shape. Most requests are single and ask no logprobs: those are read
    without a parse (a look at the prompt's first bytes, a search for a key); only a batch,
    a chat `n`, or a logprob request is parsed."""
    batch = False
    if kind is Kind.GENERATE:
        start = prompt_start(kind, body)
        batch = _starts_list(body, start, items=(_QUOTE, _LIST))
        wants = batch or b'"return_logprob"' in body
    elif kind is Kind.COMPLETIONS:
        batch = _starts_list(body, prompt_start(kind, body), items=(_QUOTE, _LIST))
        wants = batch
    else:
        wants = b'"n"' in body
    if not wants:
        return _SINGLE
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _SINGLE  # SGLang refuses it itself; one room is as good as any
    if not isinstance(parsed, dict):
        return _SINGLE
    return Shape(_rooms(kind, parsed), kind is Kind.GENERATE and _logprob(parsed))


def _n(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def _rooms(kind: Kind, body: dict[str, Any]) -> int | None:
    """Rooms for every request SGLang makes of the body: its items times its parallel
    samples. (SGLang repeats a room list per parallel sample, so a list of items alone would
    give two samples one room; a single room it counts up per item itself.)"""
    if kind is Kind.CHAT:
        n = _n(body.get("n"))
        return n if n > 1 else None  # sglang-router's chat batch: n
    if kind is Kind.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return len(prompt) * _n(body.get("n"))
        return None
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        size = len(text)
    elif text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        size = len(ids)
    else:
        return None
    params = body.get("sampling_params")
    first = params[0] if isinstance(params, list) and params else params
    return size * _n(first.get("n") if isinstance(first, dict) else None) or None


def _logprob(body: dict[str, Any]) -> bool:
    value = body.get("return_logprob")
    return any(value) if isinstance(value, list) else bool(value)


def bootstrap_fields(prefill: Backend, rooms: int | None) -> bytes:
    """The members spliced into the body for a pair with `prefill`."""
    host, port = bootstrap_host(prefill.url), prefill.bootstrap_port
    fields: dict[str, object]
    if rooms is None:
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_room()}
    else:
        fields = {
            "bootstrap_host": [host] * rooms,
            "bootstrap_port": [port] * rooms,
            "bootstrap_room": [new_room() for _ in range(rooms)],
        }
    return orjson.dumps(fields)[1:-1]


def merge_logprobs(prefill_body: bytes, decode_body: bytes) -> bytes | None:
    """The decode answer with the prefill's input_token_logprobs in front of its own (as
    sglang-router merges them); for a batch answered whole, item by item, in order (both
    sides answer a batch as a list of its items). None where nothing could be merged."""
    try:
        prefill, decode = orjson.loads(prefill_body), orjson.loads(decode_body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(prefill, dict) and isinstance(decode, dict):
        merged = _merge_item(prefill, decode)
    elif isinstance(prefill, list) and isinstance(decode, list) and len(prefill) == len(decode):
        # Every item is merged (no short cut past the first that was).
        merged = any([_merge_item(p, d) for p, d in zip(prefill, decode, strict=True)])
    else:
        return None
    if not merged:
        return None
    try:
        return orjson.dumps(decode)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: leave the answer as it came
        return None


def _merge_item(prefill: object, decode: object) -> bool:
    """The prefill item's input logprobs in front of the decode item's; False where either
    is not an answer that has them."""
    if not (isinstance(prefill, dict) and isinstance(decode, dict)):
        return False
    p_meta, d_meta = prefill.get("meta_info"), decode.get("meta_info")
    if not (isinstance(p_meta, dict) and isinstance(d_meta, dict)):
        return False
    p_lp, d_lp = p_meta.get("input_token_logprobs"), d_meta.get("input_token_logprobs")
    if not (isinstance(p_lp, list) and isinstance(d_lp, list)):
        return False
    d_meta["input_token_logprobs"] = p_lp + d_lp
    return True


# -- the request path --------------------------------------------------------------------


async def forward(call: Call, body: bytes, needs: Needs | None) -> Reply | None:
    """A request on a PD fleet: paired, refused, or (operational routes) sent to a prefill
    worker, as sglang-router sends them to its first one."""
    route = call.route
    kind = route.kind if route is not None else None
    if kind in PAIRED:
        assert kind is not None
        return await _paired(call, body, needs, kind)
    if kind in UNPAIRED:
        return call.reject(
            Rejection(
                501,
                "routing",
                "pd_unsupported",
                "This route is not served by prefill/decode pairs (backends.mode: pd); "
                "use /generate, /v1/chat/completions or /v1/completions.",
            )
        )
    return await call.forward(body, needs, role=PREFILL_ROLE)


_RETRY: Final = object()


async def _paired(call: Call, body: bytes, needs: Needs | None, kind: Kind) -> Reply | None:
    proxy, settings = call.proxy, call.settings
    pool = proxy.pool
    pd = pool.pd
    assert pd is not None
    read = shape(kind, body)
    hash_header = settings.hash_header
    key = call.request.headers.get(hash_header) if hash_header else None
    prompt = call.prompt(body) if isinstance(pd.balancer(PREFILL_ROLE), CacheAware) else None
    tried: list[Backend] = []  # workers a connection failed to, either role
    # A paused side holds the request as a paused plain fleet does (gateway/fleet/pool.py);
    # the body is charged to the hold once, on the side that holds it.
    hold_s, hold_bytes = settings.pause_hold, len(body)
    while True:
        try:
            prefill = await pool.acquire(
                tried,
                key,
                settings.queue_timeout,
                fits=needs,
                prompt=prompt,
                role=PREFILL_ROLE,
                hold_s=hold_s,
                hold_bytes=hold_bytes,
            )
        except HoldRefused as refused:  # not `exc`: mypyc/mypyc#620 (tests/test_build.py)
            return call.not_held(refused.reason, needs)
        if prefill is None:
            return _no_worker(call, pd, PREFILL_ROLE, tried)
        try:
            try:
                decode = await pool.acquire(
                    tried,
                    key,
                    settings.queue_timeout,
                    fits=needs,
                    role=DECODE_ROLE,
                    hold_s=hold_s,
                    hold_bytes=hold_bytes,
                )
            except HoldRefused as refused:
                return call.not_held(refused.reason, needs)
            if decode is None:
                return _no_worker(call, pd, DECODE_ROLE, tried)
            try:
                answer = await _pair(call, body, read, prefill, decode, pd=pd)
            finally:
                pool.release(decode)
        finally:
            pool.release(prefill)
        if answer is not _RETRY:
            assert answer is None or isinstance(answer, Reply)
            return answer
        tried.append(prefill if call.exchange.connect_failed[-1] == prefill.url else decode)
        if len(tried) >= settings.attempts:
            return call.unavailable(Outcome.NO_BACKEND)


def _no_worker(call: Call, pd: PdRouting, role: str, tried: list[Backend]) -> Reply:
    pd.failed(role, NO_WORKER)
    if tried:
        return call.unavailable(Outcome.NO_BACKEND)
    pool = call.proxy.pool
    if pool.saturated(role=role):
        return call.unavailable(Outcome.NO_CAPACITY)
    status = 503
    message = f"No {role} worker is available (backends.mode: pd pairs one of each); retry later."
    resp = call.reply(status, replies.render(call.shape, status, message), Outcome.NO_BACKEND)
    resp.headers.append(("Retry-After", "1"))
    return resp


@dataclass(slots=True)
class _Side:
    """What became of the prefill side: its answer's body when kept, or why it failed."""

    body: bytes | None = None
    cause: str = ""  # empty: it answered 2xx, to its end
    failure: UpstreamFailure | None = None
    status: int = 0
    error_body: bytes = b""
    headers: list[tuple[str, str]] | None = None


async def _pair(
    call: Call, body: bytes, read: Shape, prefill: Backend, decode: Backend, *, pd: PdRouting
) -> Reply | object | None:
    """One attempt on the pair: the answer, or _RETRY when a connection to either could
    not be made (the other side's request was closed)."""
    settings, exchange, request = call.settings, call.exchange, call.request
    data = splice(body, bootstrap_fields(prefill, read.rooms))
    if data is None:
        return call.reject(
            Rejection(
                400,
                "request_body",
                "not_an_object",
                "Invalid request body: the top level must be a JSON object.",
                validation=True,
            )
        )
    headers = call.upstream_headers(settings.forwarding)
    exchange.attempts += 1
    exchange.backend = decode.url
    upstream = call.proxy.upstream
    send = functools.partial(
        upstream.request,
        method=request.method,
        target=request.raw_path,
        headers=headers,
        body=data,
        connect_s=settings.connect_s,
        ttfb_s=settings.ttfb_s,
        total_s=settings.total_s,
    )
    p_task = asyncio.ensure_future(send(prefill.url))
    d_task = asyncio.ensure_future(send(decode.url))
    p_side = asyncio.ensure_future(_prefill_side(call, prefill, p_task, keep=read.logprob))
    pd.paired(prefill.url, decode.url)
    try:
        await asyncio.wait((p_side, d_task), return_when=asyncio.FIRST_COMPLETED)
        if p_side.done() and p_side.result().cause:
            return _prefill_failed(call, pd, prefill, p_side.result())
        try:
            d_resp = await d_task
        except UpstreamFailure as exc:
            pd.failed(DECODE_ROLE, _cause(exc), decode.url)
            failed = call._failed(decode, exc)
            return _RETRY if failed is None else failed
        if not 200 <= d_resp.status < 300:
            # The decode engine's own refusal goes to the client as it came.
            pd.failed(DECODE_ROLE, ERROR_STATUS, decode.url)
            await call.relay(d_resp, decode)
            return None
        length = d_resp.content_length
        if read.logprob and length is not None and length <= MERGE_MAX_BYTES:
            return await _merged(
                call, pd=pd, prefill=prefill, decode=decode, p_side=p_side, d_resp=d_resp
            )
        if read.logprob and length is None:
            return await _streamed(
                call, pd=pd, prefill=prefill, decode=decode, p_side=p_side, d_resp=d_resp
            )
        # A prefill that fails from here on leaves the decode engine waiting for a KV cache
        # that never comes: its connection is closed, which ends the relay visibly broken.
        p_side.add_done_callback(functools.partial(_end_decode_if_failed, d_resp))
        await call.relay(d_resp, decode)
        # The prefill engine ends before its decode partner starts in SGLang: one still
        # under way once the answer went out gets one idle period more, then is closed.
        await asyncio.wait((p_side,), timeout=settings.idle_s)
        if not p_side.done():
            pd.failed(PREFILL_ROLE, TIMEOUT, prefill.url)
            return None
        side = p_side.result()
        if side.cause:
            pd.failed(PREFILL_ROLE, side.cause, prefill.url)
            exchange.detail = f"prefill failed: {side.cause}"
        return None
    finally:
        for task in (p_side, p_task, d_task):
            _discard(task)


def _end_decode_if_failed(d_resp: UpstreamResponse, p_side: asyncio.Future[_Side]) -> None:
    if not p_side.cancelled() and p_side.exception() is None and p_side.result().cause:
        d_resp.close()


async def _prefill_side(
    call: Call, prefill: Backend, p_task: asyncio.Future[UpstreamResponse], *, keep: bool
) -> _Side:
    """The prefill's answer, read to its end (kept, up to MERGE_MAX_BYTES, when `keep`)."""
    try:
        resp = await p_task
    except UpstreamFailure as exc:
        return _Side(cause=_cause(exc), failure=exc)
    call.proxy.pool.response(prefill, resp.status)
    ok = 200 <= resp.status < 300
    resp.set_idle_timeout(call.settings.idle_s)
    pieces: list[bytes] = []
    held = 0
    limit = (MERGE_MAX_BYTES if keep else 0) if ok else ERROR_MAX_BYTES
    try:
        while chunk := await resp.read():
            if held + len(chunk) <= limit:
                pieces.append(chunk)
                held += len(chunk)
            elif not ok:
                break
            else:
                pieces, limit = [], 0  # too large to merge: drained, not held
    except UpstreamFailure as exc:
        resp.close()
        return _Side(cause=BROKEN if ok else ERROR_STATUS, failure=exc, status=resp.status)
    if not ok:
        resp.close()
        return _Side(
            cause=ERROR_STATUS,
            status=resp.status,
            error_body=b"".join(pieces),
            headers=resp.headers,
        )
    resp.release()
    return _Side(body=b"".join(pieces) if keep and limit else None)


def _prefill_failed(call: Call, pd: PdRouting, prefill: Backend, side: _Side) -> Reply | object:
    """The reply when the prefill side failed before the decode's answer began."""
    pd.failed(PREFILL_ROLE, side.cause, prefill.url)
    exchange = call.exchange
    if side.failure is not None and side.cause != ERROR_STATUS:
        failed = call._failed(prefill, side.failure)
        return _RETRY if failed is None else failed
    exchange.detail = f"prefill answered {side.status}"
    # The prefill engine's own refusal (a 400 for a bad parameter, say), as it came.
    content_type = "application/json"
    for name, value in side.headers or ():
        if name.lower() == "content-type":
            content_type = value
    body = side.error_body
    if not body:
        message = "The prefill worker failed to answer the request."
        body = replies.render(call.shape, side.status, message)
    reply = call.reply(side.status, body, Outcome.UPSTREAM_ERROR)
    reply.content_type = content_type
    return reply


async def _merged(
    call: Call,
    *,
    pd: PdRouting,
    prefill: Backend,
    decode: Backend,
    p_side: asyncio.Future[_Side],
    d_resp: UpstreamResponse,
) -> Reply | object | None:
    """A whole decode answer with the prefill's input logprobs merged in."""
    side = await p_side
    if side.cause:
        return _prefill_failed(call, pd, prefill, side)
    pieces: list[bytes] = []
    d_resp.set_idle_timeout(call.settings.idle_s)
    try:
        while chunk := await d_resp.read():
            pieces.append(chunk)
    except UpstreamFailure as exc:
        d_resp.close()
        pd.failed(DECODE_ROLE, _cause(exc), decode.url)
        call.exchange.detail = exc.cause
        status = 504 if isinstance(exc, UpstreamTimeout) else 502
        return call._upstream_failed(
            status, Outcome.UPSTREAM_TIMEOUT if status == 504 else Outcome.UPSTREAM_ERROR
        )
    d_resp.release()
    call.proxy.pool.response(decode, d_resp.status)
    decoded = b"".join(pieces)
    merged = None if side.body is None else merge_logprobs(side.body, decoded)
    reply = call.reply(d_resp.status, decoded if merged is None else merged, Outcome.OK)
    content_type = d_resp.header("Content-Type")
    if content_type is not None:
        reply.content_type = content_type
    if decode.weight_version is not None:
        reply.headers.append((WEIGHT_VERSION, decode.weight_version))
    return reply


async def _streamed(
    call: Call,
    *,
    pd: PdRouting,
    prefill: Backend,
    decode: Backend,
    p_side: asyncio.Future[_Side],
    d_resp: UpstreamResponse,
) -> Reply | object | None:
    """A streamed decode answer with the prefill's input logprobs merged into the events
    that carry their own (gateway/edge/pd_logprobs.py). The prefill's answer is awaited
    first, as sglang-router awaits it: SGLang's prefill ends before its decode partner's
    first token, so this holds back nothing the client could have had."""
    side = await p_side
    if side.cause:
        return _prefill_failed(call, pd, prefill, side)
    # Only the serialised lists are kept for the stream's length, not the prefill's body.
    merge = StreamMerge(prefill_logprobs(side.body) if side.body else {})
    del side
    request, exchange = call.request, call.exchange
    call.proxy.pool.response(decode, d_resp.status)
    d_resp.set_idle_timeout(call.settings.idle_s)
    exchange.first_byte = time.perf_counter()
    exchange.status = d_resp.status
    exchange.streamed = True
    headers = ForwardedHeaders.downstream(d_resp.headers, exchange.request_id, SERVER)
    if decode.weight_version is not None:
        headers.append((WEIGHT_VERSION, decode.weight_version))
    sent, clean = 0, False
    try:
        request.start(d_resp.status, d_resp.reason, headers, sized=False)
        request.flush_head()
        while chunk := await d_resp.read():
            out = merge.feed(chunk)
            if out:
                request.send([out], last=False)
                sent += len(out)
                if request.writing_paused:
                    await _drained(request)
        rest = merge.flush()
        request.send([rest], last=True)
        sent += len(rest)
        clean = True
    except UpstreamFailure as exc:
        # Broken off mid-stream: the client's connection ends visibly broken, as a relay's.
        pd.failed(DECODE_ROLE, _cause(exc), decode.url)
        exchange.outcome = Outcome.UPSTREAM_BROKEN
        exchange.detail = exc.cause
        request.abort()
    except ConnectionError:
        exchange.outcome = Outcome.CLIENT_DISCONNECT
    finally:
        exchange.bytes_out = sent
        if clean:
            d_resp.release()
        else:
            d_resp.close()  # SGLang aborts a generation whose connection closed
    return None


async def _drained(request: Request) -> None:
    """Wait until the client's socket buffer drained below its high-water mark."""
    waiter = asyncio.get_running_loop().create_future()

    def resumed() -> None:
        if not waiter.done():
            waiter.set_result(None)

    request.on_resume(resumed)
    if request.writing_paused:
        await waiter


def _cause(exc: UpstreamFailure) -> str:
    if isinstance(exc, ConnectFailed):
        return CONNECT
    if isinstance(exc, UpstreamTimeout):
        return TIMEOUT
    return BROKEN


def _discard(task: asyncio.Future[Any]) -> None:
    """End one side's part of the exchange: a request still under way is cancelled (its
    connection is closed on the way out, so SGLang aborts it); an answer not read to its
    end is closed."""
    if not task.done():
        task.cancel()
        task.add_done_callback(_retrieve)
        return
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    if isinstance(result, UpstreamResponse):
        result.close()  # a no-op once released or closed


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failure after the pair ended is no news
