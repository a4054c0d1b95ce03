"""SGLang 0.5.19's rules as the stub plays them: what a request asks for, what SGLang
refuses and in which shape, and what a generation answers.

Coded independently of the gateway (gateway/contract/), so that the two can check each
other. The lax readings only approximate SGLang's: `lax_bool` and `lax_int` read the same
values on every route, where SGLang is lax on chat only (pydantic) and reads `/generate`
fields with Python truthiness and `SamplingParams.verify()`; they do not reject every value
pydantic rejects (a float string as an int), and there is no 0.5.23 strict schema. The
faithful model of how SGLang reads a request is `tests/sglang_model.py`, which the
differential tests use: the stub serves traffic, it does not judge the gateway's reading.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from gateway.testing.stub.logprobs import OUTPUT_ID_BASE, Ask, Logprobs, prompt_ids

TOP_K_ALL = 1 << 30

VOCAB_SIZE = 32000

DEFAULT_MAX_NEW_TOKENS = 16

MAX_NEW_TOKENS_CAP = 4096

MASK_TOP_K_MESSAGE = (
    "return_sampling_mask requires finite top_k; top_p-only sampling is valid but can return huge"
    " masks in the tail, blowing up metadata, so we need a safety cap."
)

MASK_TOP_P_MESSAGE = (
    "return_sampling_mask cannot return the full vocabulary; set top_p < 1 or a finite top_k."
)

MASK_CAP_MESSAGE = (
    "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= {cap}; "
    "got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens."
)

GENERATION_PATHS = frozenset(
    {"/generate", "/v1/chat/completions", "/invocations", "/v1/completions"}
    | {"/v1/responses", "/vertex_generate"}
)

_TRUE_STRINGS = frozenset({"true", "t", "y", "yes", "on", "1"})

_Json = dict[str, Any]


@dataclass(eq=False)
class Reject(Exception):
    """A request SGLang would refuse; `admission` marks refusals a stream reports in-band."""

    message: str
    status: int = 400
    parse: bool = False
    admission: bool = False


@dataclass(slots=True)
class Item:
    prompt_tokens: int
    max_new: int  # the tokens it generates: max_new_tokens, or up to its stop token
    mask_k: int | None
    rid: str
    logprobs: Logprobs | None = None  # set when it asked for return_logprob
    stop_id: int | None = None  # the stop_token_ids entry its last token matches


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error(path: str, message: str, status: int, *, parse: bool = False) -> web.Response:
    if status in (204, 304) or status < 200:
        return web.Response(status=status)
    if parse or path.startswith("/v1/") or path == "/invocations":
        kind = "Bad Request" if parse else "BadRequestError" if status == 400 else _phrase(status)
        body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
        return json_response(body, status)
    return json_response({"error": {"message": message}}, status)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def lax_bool(value: object) -> bool:
    # pydantic's lax booleans; a list (single /generate request) counts when non-empty.
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_STRINGS
    if isinstance(value, bool | int | float | list):
        return bool(value)
    return False


def lax_int(value: object, name: str) -> int:
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise Reject(f"{name} must be an integer, got {value!r}.")


def max_tokens(value: object) -> int:
    n = DEFAULT_MAX_NEW_TOKENS if value is None else lax_int(value, "max_new_tokens")
    return max(0, min(n, MAX_NEW_TOKENS_CAP))


@dataclass(frozen=True, slots=True)
class Release:
    """The SGLang release the stub plays, and the server settings its admission reads."""

    version: str = "0.5.19"
    mask_max_tokens: int = 4096  # --sampling-mask-max-tokens (0.5.20 and later)
    speculative_algorithm: str | None = None

    @property
    def patch(self) -> int:
        parts = self.version.split(".")
        digits = "".join(ch for ch in (parts[2] if len(parts) > 2 else "") if ch.isdigit())
        return int(digits or 0)

    def refusal(self, k: int, top_p: object) -> str | None:
        """What this release says to a mask item of normalised top_k `k`, or None."""
        if self.patch == 18:
            below_one = isinstance(top_p, int | float) and not isinstance(top_p, bool) and top_p < 1
            if k == TOP_K_ALL and not below_one:
                return MASK_TOP_P_MESSAGE
        elif self.patch >= 20:
            cap = self.mask_max_tokens
            if not (k == 1 or 1 < k <= cap):
                return MASK_CAP_MESSAGE.format(cap=cap, top_k=k)
        elif k == TOP_K_ALL:
            return MASK_TOP_K_MESSAGE
        if self.speculative_algorithm is not None:
            return "return_sampling_mask is not supported with speculative decoding."
        return None


def mask_top_k(
    top_k: object, temperature: object, top_p: object = None, release: Release = Release()
) -> int:
    """The row width of a mask-requesting item, or the release's refusal."""
    if isinstance(temperature, int | float) and 0 <= temperature < 1e-6:
        k = 1  # SGLang forces greedy items to top_k = 1 whatever was sent
    else:
        k = TOP_K_ALL if top_k is None else lax_int(top_k, "top_k")
        if k == -1:
            k = TOP_K_ALL
        if k < 1:
            raise Reject(f"top_k must be -1 (disable) or at least 1, got {k}.", admission=True)
    refused = release.refusal(k, top_p)
    if refused is not None:
        raise Reject(refused, admission=True)
    return k


def mask_meta(n: int, k: int) -> _Json:
    width = min(k, VOCAB_SIZE)
    ids = list(range(width))
    logprobs = [round(-0.01 * (j + 1), 4) for j in range(width)]
    return {
        "output_token_sampling_mask": [ids] * n,
        "output_token_sampling_logprobs": [logprobs] * n,
        "output_token_sampling_mask_length": [width] * n,
    }


def token_pieces(n: int) -> list[str]:
    return [f" w{i}" for i in range(n)]


def ids(n: int) -> list[int]:
    return [100 + i for i in range(n)]


def words(value: object) -> int:
    if isinstance(value, str):
        return max(1, len(value.split()))
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # token ids
        return sum(words(v) for v in value)
    if isinstance(value, dict):
        return words(value.get("content"))
    return 1


def parse(body: bytes) -> _Json:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Reject(f"Invalid JSON body: {exc}", parse=True) from exc
    if not isinstance(obj, dict):
        raise Reject("Request body must be a JSON object.", parse=True)
    return obj


def _per_item(value: object, i: int, batch: bool) -> object:
    # SGLang's normalize_param: a list holds one value per batch item, a scalar is shared.
    return value[i] if batch and isinstance(value, list) and i < len(value) else value


def logprob_ask(body: _Json, i: int, batch: bool, prompt: list[int]) -> Ask | None:
    """What item i asked of return_logprob, as SGLang's scheduler resolves it (scheduler.py
    `handle_generate_request`), or None when it asked for no logprobs."""
    if not lax_bool(_per_item(body.get("return_logprob"), i, batch)):
        return None
    start_v, top_v = (
        _per_item(body.get(k), i, batch) for k in ("logprob_start_len", "top_logprobs_num")
    )
    start = -1 if start_v is None else lax_int(start_v, "logprob_start_len")
    top = 0 if top_v is None else max(0, lax_int(top_v, "top_logprobs_num"))
    ids_v = body.get("token_ids_logprob")
    if batch and isinstance(ids_v, list) and ids_v and isinstance(ids_v[0], list):
        ids_v = ids_v[i] if i < len(ids_v) else None
    token_ids = tuple(t for t in ids_v if isinstance(t, int)) if isinstance(ids_v, list) else None
    token_ids = token_ids or None  # SGLang: an empty list is None
    n = len(prompt)
    if start == -1:
        # The output's logprobs only; with token_ids_logprob SGLang keeps -1, which slices
        # the prompt's last position.
        start = n if token_ids is None else max(0, n - 1)
    elif start < 0:
        start = max(0, n + start)  # origin_input_ids[start:], as Python slices it
    elif start > n:
        raise Reject(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len.",
            admission=True,
        )
    return Ask(start, top, token_ids, lax_bool(body.get("return_text_in_logprobs")))


def _stop_at(sp: _Json, n: int) -> tuple[int, int | None]:
    """The tokens generated and the stop token matched: output token i is id 100 + i, so
    `stop_token_ids` naming one of them ends the output there (the token is kept)."""
    stops = sp.get("stop_token_ids")
    if isinstance(stops, list):
        hits = [t - OUTPUT_ID_BASE for t in stops if isinstance(t, int) and not isinstance(t, bool)]
        first = min((h for h in hits if 0 <= h < n), default=None)
        if first is not None:
            return first + 1, OUTPUT_ID_BASE + first
    return n, None


def generate_items(body: _Json, release: Release = Release()) -> tuple[list[Item], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    prompts: list[object]
    if isinstance(text, list):
        prompts, batch = list(text), True
    elif isinstance(text, str):
        prompts, batch = [text], False
    elif isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        prompts, batch = list(input_ids), True
    elif isinstance(input_ids, list):
        prompts, batch = [input_ids], False
    else:
        raise Reject("Either text, input_ids or input_embeds should be provided.")
    params, mask, rid = (body.get(k) for k in ("sampling_params", "return_sampling_mask", "rid"))
    items = []
    for i, prompt in enumerate(prompts):
        sp = params[i] if isinstance(params, list) and i < len(params) else params
        sp = sp if isinstance(sp, dict) else {}
        on = mask[i] if batch and isinstance(mask, list) and i < len(mask) else mask
        mask_k = (
            mask_top_k(sp.get("top_k"), sp.get("temperature"), sp.get("top_p"), release)
            if lax_bool(on)
            else None
        )
        item_rid = rid[i] if isinstance(rid, list) and i < len(rid) else rid
        item_rid = item_rid if isinstance(item_rid, str) else uuid.uuid4().hex
        n, stop_id = _stop_at(sp, max_tokens(sp.get("max_new_tokens")))
        logprobs = None
        if body.get("return_logprob"):
            ids = prompt_ids(prompt)
            ask = logprob_ask(body, i, batch, ids)
            logprobs = None if ask is None else Logprobs(ask, ids)
        items.append(Item(words(prompt), n, mask_k, item_rid, logprobs, stop_id))
    return items, batch


def finish_reason(item: Item, n: int) -> _Json:
    if item.stop_id is not None and n == item.max_new:
        return {"type": "stop", "matched": item.stop_id}
    return {"type": "length", "length": n}


def generate_out(
    item: Item,
    n: int,
    started: float,
    *,
    final: bool = True,
    weight_version: str = "default",
    reason: _Json | None = None,
) -> _Json:
    """One /generate answer after `n` tokens, in the key order of SGLang's tokenizer manager
    (`_handle_batch_output`); `reason` ends it otherwise than by its length (an abort)."""
    if final and reason is None:
        reason = finish_reason(item, n)
    meta: _Json = {
        "id": item.rid,
        "finish_reason": reason if final else None,
        "prompt_tokens": item.prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
    }
    if item.logprobs is not None:
        meta.update(item.logprobs.meta(n))
    if item.mask_k is not None and final:
        meta.update(mask_meta(n, item.mask_k))
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = n
    meta["cached_tokens"] = 0
    if final:  # SGLang stamps the latency when the request finishes
        meta["e2e_latency"] = round(time.monotonic() - started, 6)
    # A matched stop token stays in output_ids and leaves the text (detokenizer_manager.py
    # `trim_matched_stop`).
    shown = n - 1 if final and reason is not None and reason.get("type") == "stop" else n
    return {"text": "".join(token_pieces(shown)), "output_ids": ids(n), "meta_info": meta}


def usage(prompt: int, n: int) -> _Json:
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}}
