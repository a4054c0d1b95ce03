"""The generation routes: /generate, the OpenAI routes (chat, completions, responses) and
Vertex, with their streams, batches, logprobs and prefix-cache counts."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator

import orjson
from aiohttp import web

from gateway.testing.stub.cache import generate_prompts, stamp, stamped
from gateway.testing.stub.core import StubCore, _Json
from gateway.testing.stub.faults import (
    CTX,
    PAD_RESERVE,
    PAD_SENTINEL,
    Ctx,
    header_int,
    padded_rows,
)
from gateway.testing.stub.logprobs import Ask, Logprobs, openai_chat, openai_completion, prompt_ids
from gateway.testing.stub.rules import (
    Item,
    Reject,
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


def _openai_logprobs(prompt: object, top: object) -> Logprobs:
    """The OpenAI routes ask the engine for output logprobs with their text (serving_chat.py,
    serving_completions.py: `return_text_in_logprobs=True`)."""
    ids = prompt_ids(prompt)
    k = 0 if top is None else max(0, lax_int(top, "top_logprobs"))
    return Logprobs(Ask(len(ids), k, None, True), ids)


class GenerationRoutes(StubCore):
    """SGLang's generation surface."""

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
