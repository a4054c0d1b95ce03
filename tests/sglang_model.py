"""A test-only model of how SGLang 0.5.19 reads and normalises a generation request.

Ported from SGLang 0.5.19's released source (the PyPI wheel, `python/sglang/srt/`):
- `entrypoints/http_server.py`: routes, `ORJSONRequest` (orjson parses bodies), the
  `/vertex_generate` handler (which builds `GenerateReqInput(**parameters)` WITHOUT pydantic),
  `validate_json_request` (chat/completions/responses need media type `application/json`);
- `managers/io_struct.py`: `GenerateReqInput` field types (pydantic validates them, lax, when
  FastAPI builds the dataclass from a `/generate` body), `normalize_batch_and_arguments`,
  `_determine_batch_size`, `_handle_parallel_sampling`, `_normalize_*`, `__getitem__`;
- `managers/tokenizer_manager.py`: items are tokenized and sent to the scheduler one by one,
  so in a batch the items before a failing one still run;
- `sampling/sampling_params.py`: `SamplingParams(**d)` (a msgspec Struct: no type checks,
  unknown keys raise), `__post_init__` (None defaults, greedy forcing top_k = 1, -1 ->
  TOP_K_ALL, all skipped when `is_normalized` is truthy) and `verify()`;
- `entrypoints/openai/protocol.py` + `serving_chat.py`: `ChatCompletionRequest` (pydantic),
  `_validate_request`, the streaming/meta_info rule, `to_sampling_params`;
- `managers/scheduler.py`: the mask is read with Python truthiness (`if req.return_sampling_mask`).

It deliberately does NOT import `gateway.contract.lax` or `gateway.contract.policy`: it is the
independent reading that the gateway's own reading is checked against, so that a misreading in
one can never be silently copied into the other. pydantic, SGLang's own validation library, does the
lax coercions here exactly as it does inside SGLang.

The question it answers for a (method, path, body): does SGLang refuse the request, or which
items reach the scheduler, each with "mask on?" and the normalised top_k. An item with the mask
on and a top_k >= TOP_K_ALL is the one the gateway must never let through (SGLang 0.5.19's own
admission check is `top_k == TOP_K_ALL`; the gateway also counts anything larger as unbounded).
SGLang's own admission check is not modelled as a refusal: it is the thing being guarded.
"""

from __future__ import annotations

import email.message
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import unquote

import orjson
from pydantic import BaseModel, ConfigDict, PlainValidator, TypeAdapter, ValidationError

TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6
_MAX_MODELLED_N = 1 << 16  # beyond this, SGLang's own list building exhausts memory

# SamplingParams' fields (msgspec Struct kwargs): any other key in sampling_params raises.
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "beam_width",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        # internal fields, still accepted as keyword arguments
        "stop_strs",
        "stop_regex_strs",
        "stop_str_max_len",
        "stop_regex_max_len",
        "is_normalized",
    }
)

# GenerateReqInput's dataclass fields: /vertex_generate passes `parameters` as **kwargs.
GENERATE_FIELDS = frozenset(
    """rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes
    mm_content_hashes use_audio_in_video video_config sampling_params return_logprob
    logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask
    return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_top_logprobs_b64
    stream log_metrics return_hidden_states return_routed_experts routed_experts_start_len
    return_indexer_topk modalities session_params lora_path lora_id custom_logit_processor
    positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key
    decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank routing_key
    conversation_id http_worker_ipc background require_reasoning max_thinking_tokens priority
    extra_key no_logs custom_labels return_bytes return_entropy return_prompt_token_ids
    external_trace_header received_time need_wait_for_mm_inputs num_items_assigned
    encoder_urls max_dynamic_patch min_dynamic_patch image_max_dynamic_patch
    video_max_dynamic_patch images_config multi_item_delimiter_indices cache_salt""".split()  # noqa: SIM905 - a copied list
)

ROUTES: Mapping[str, frozenset[str]] = {
    "/generate": frozenset({"POST", "PUT"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/invocations": frozenset({"POST"}),
    "/v1/completions": frozenset({"POST"}),
    "/v1/responses": frozenset({"POST"}),
    "/vertex_generate": frozenset({"POST"}),
}
_JSON_MEDIA_ONLY = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


@dataclass(frozen=True)
class Item:
    """One request as the scheduler gets it."""

    mask: bool  # the scheduler would build a sampling mask for it
    top_k: object  # normalised top_k (SGLang keeps whatever numeric type it was given)
    # The item's sampling parameters as sent (for reports and test predicates only).
    sent: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def unbounded_mask(self) -> bool:
        return self.mask and _at_least_top_k_all(self.top_k)


@dataclass(frozen=True)
class Reading:
    """SGLang's reading of one request."""

    status: int  # 200: every item runs; otherwise the refusal (items before it still ran)
    reason: str
    items: tuple[Item, ...] = ()

    @property
    def runs_unbounded_mask(self) -> bool:
        """Some item reaches the scheduler with the mask on and an unbounded top_k."""
        return any(item.unbounded_mask for item in self.items)

    @property
    def accepted(self) -> bool:
        """SGLang runs it all, and nothing in it is an unbounded mask request."""
        return self.status == 200 and not self.runs_unbounded_mask


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _at_least_top_k_all(top_k: object) -> bool:
    return isinstance(top_k, int | float) and top_k >= TOP_K_ALL


# --- pydantic views of the bodies, with SGLang's field types ------------------------------------


def _validate_input_ids(v: Any) -> Any:
    # sglang.srt.utils.field_validators.validate_optional_list_i64_1d_2d
    def one_d(row: Any) -> None:
        if not isinstance(row, list):
            raise ValueError("must be list")
        if row and not isinstance(row[0], int):
            raise ValueError("elements must be int")
        for x in row:
            if not isinstance(x, int) or not -(2**63) <= x < 2**63:
                raise ValueError("contains non-int64 element")

    if v is None:
        return v
    if not isinstance(v, list):
        raise ValueError("must be list or null")
    if not v:
        return v
    if isinstance(v[0], int):
        one_d(v)
        return v
    if isinstance(v[0], list):
        for row in v:
            one_d(row)
        return v
    raise ValueError("elements must be int or list")


@dataclass
class _GenerateBody:
    """The GenerateReqInput fields this model needs, typed as in SGLang (others are ignored)."""

    rid: str | list[str] | None = field(default=None, kw_only=True)
    text: list[str] | str | None = None
    input_ids: Annotated[
        list[list[int]] | list[int] | None, PlainValidator(_validate_input_ids)
    ] = None
    input_embeds: list[list[list[float]]] | list[list[float]] | None = None
    image_data: Any = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    return_sampling_mask: list[bool] | bool | None = None
    stream: bool = False


_GENERATE = TypeAdapter(_GenerateBody)


class _ChatBody(BaseModel):
    """ChatCompletionRequest's fields that decide the mask and the sampling parameters."""

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]]
    model: str = "default"
    n: int = 1
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int = 0
    return_meta_info: bool = False
    return_sampling_mask: bool = False


class _CompletionBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: list[int] | list[list[int]] | str | list[str]
    top_k: int = -1
    temperature: float = 1.0
    top_p: float = 1.0


class _ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[Any]
    top_k: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class _VertexBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    instances: list[dict[str, Any]]
    parameters: dict[str, Any] | None = None


# --- SamplingParams ------------------------------------------------------------------------------


def _sampling_params(kwargs: object) -> dict[str, Any]:
    """SamplingParams(**kwargs) + __post_init__ + verify(), as plain Python would run them.

    Raises TypeError/ValueError/etc. exactly where SGLang's code would.
    """
    if not isinstance(kwargs, Mapping):
        raise TypeError("argument after ** must be a mapping")
    for key in kwargs:
        if key not in SAMPLING_FIELDS:
            raise TypeError(f"Unexpected keyword argument {key!r}")
    sp: dict[str, Any] = {
        "max_new_tokens": 128,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": TOP_K_ALL,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "n": 1,
        "beam_width": None,
        "json_schema": None,
        "regex": None,
        "ebnf": None,
        "structural_tag": None,
        "logit_bias": None,
        "is_normalized": False,
    }
    sp.update(kwargs)
    if not sp["is_normalized"]:
        for name, default in (
            ("temperature", 1.0),
            ("top_p", 1.0),
            ("top_k", -1),
            ("min_p", 0.0),
            ("frequency_penalty", 0.0),
            ("presence_penalty", 0.0),
            ("repetition_penalty", 1.0),
            ("min_new_tokens", 0),
            ("n", 1),
        ):
            if sp[name] is None:
                sp[name] = default
        if 0 <= sp["temperature"] < SAMPLING_EPS:  # greedy: top_k = 1 whatever was sent
            sp["temperature"] = 1.0
            sp["top_k"] = 1
        if sp["top_k"] == -1:
            sp["top_k"] = TOP_K_ALL
    # verify()
    if sp["beam_width"] is not None and sp["beam_width"] < 1:
        raise ValueError("beam_width must be at least 1")
    if not math.isfinite(sp["temperature"]) or sp["temperature"] < 0.0:
        raise ValueError("temperature must be a non-negative finite number")
    if not 0.0 < sp["top_p"] <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    if not 0.0 <= sp["min_p"] <= 1.0:
        raise ValueError("min_p must be in [0, 1]")
    if sp["top_k"] < 1 or sp["top_k"] == -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {sp['top_k']}.")
    if not -2.0 <= sp["frequency_penalty"] <= 2.0:
        raise ValueError("frequency_penalty must be in [-2, 2]")
    if not -2.0 <= sp["presence_penalty"] <= 2.0:
        raise ValueError("presence_penalty must be in [-2, 2]")
    if not 0.0 < sp["repetition_penalty"] <= 2.0:
        raise ValueError("repetition_penalty must be in (0, 2]")
    if sp["min_new_tokens"] < 0:
        raise ValueError("min_new_tokens must be in [0, max_new_tokens]")
    if sp["max_new_tokens"] is not None:
        if sp["max_new_tokens"] < 0:
            raise ValueError("max_new_tokens must be at least 0")
        if not sp["min_new_tokens"] <= sp["max_new_tokens"]:
            raise ValueError("min_new_tokens must be in [0, max_new_tokens]")
    if sp["logit_bias"] is not None:
        for token_id in sp["logit_bias"]:
            int(token_id)
    grammars = [sp["json_schema"], sp["regex"], sp["ebnf"], sp["structural_tag"]]
    if sum(x is not None for x in grammars) > 1:
        raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    return sp


# --- GenerateReqInput normalisation ----------------------------------------------------------


@dataclass
class _Gen:
    """The mutable GenerateReqInput fields normalize_batch_and_arguments() works on."""

    text: Any = None
    input_ids: Any = None
    input_embeds: Any = None
    sampling_params: Any = None
    return_sampling_mask: Any = None
    rid: Any = None


def _run_generate(g: _Gen) -> Reading:
    """normalize_batch_and_arguments(), then item by item as the tokenizer manager sends them."""
    try:
        single, items_params, items_mask, n_items = _normalise(g)
    except ValueError as exc:
        return Reading(400, f"normalise: {exc}")
    except Exception as exc:  # SGLang answers any other exception with a 500
        return Reading(500, f"normalise: {type(exc).__name__}: {exc}")
    texts = g.text
    ran: list[Item] = []
    for i in range(n_items):
        try:
            params = items_params(i)
            mask = items_mask(i)
            # _tokenize_one_request: input_embeds, else input_ids, else the text is tokenized.
            text_i = texts if single or texts is None else texts[i]
            ids_i = g.input_ids if single or g.input_ids is None else g.input_ids[i]
            if g.input_embeds is None and ids_i is not None:
                _int64_row(ids_i)  # array("q", input_ids)
            elif g.input_embeds is None and not text_i:
                raise ValueError("texts cannot be empty and tokenizer must be initialized")
            sp = _sampling_params(params)
        except ValueError as exc:
            return Reading(400, f"item {i}: {exc}", tuple(ran))
        except Exception as exc:
            return Reading(500, f"item {i}: {type(exc).__name__}: {exc}", tuple(ran))
        ran.append(Item(mask=bool(mask), top_k=sp["top_k"], sent=params))
    return Reading(200, "runs", tuple(ran))


def _int64_row(ids: object) -> None:
    if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
        raise TypeError("array('q', input_ids): an integer is required")


def _normalise(g: _Gen) -> tuple[bool, Any, Any, int]:
    # _validate_inputs
    given = [g.text is not None, g.input_ids is not None, g.input_embeds is not None]
    if not any(given) or all(given):
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    # _determine_batch_size
    if g.text is not None:
        single = isinstance(g.text, str)
        batch_size = 1 if single else len(g.text)
        g.input_embeds = None
    elif g.input_ids is not None:
        if len(g.input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        single = isinstance(g.input_ids[0], int)
        batch_size = 1 if single else len(g.input_ids)
        g.input_embeds = None
    else:
        single = isinstance(g.input_embeds[0][0], float)
        batch_size = 1 if single else len(g.input_embeds)
    # _handle_parallel_sampling
    sp = g.sampling_params
    if sp is None:
        n: Any = 1
    else:
        if isinstance(sp, dict):
            n = sp.get("n", 1)
        else:
            n = sp[0].get("n", 1)
            for p in sp:
                if n != p.get("n", 1):
                    raise ValueError("The parallel_sample_num should be the same for all samples")
        if isinstance(sp, dict):
            beam = sp.get("beam_width") or 1
        elif isinstance(sp, list) and sp:
            beam = sp[0].get("beam_width") or 1
        else:
            beam = 1
        if beam > 1:
            n = 1
        if n > 1 and single:
            single = False
            if g.text is not None:
                g.text = [g.text]
            if g.input_ids is not None:
                g.input_ids = [g.input_ids]
            if g.input_embeds is not None:
                g.input_embeds = [g.input_embeds]

    if isinstance(n, int) and n > _MAX_MODELLED_N:
        # SGLang builds lists of batch_size * n entries here ([{}] * num, text * n): with a
        # huge n the tokenizer manager runs out of memory. Nothing is generated.
        raise MemoryError(f"n = {n}: lists of {n} items")

    if single:
        params = {} if sp is None else sp
        mask = False if g.return_sampling_mask is None else g.return_sampling_mask
        return True, (lambda _i: params), (lambda _i: mask), 1

    num = batch_size if n == 1 else batch_size * n
    # _expand_inputs
    if g.text is not None:
        if not isinstance(g.text, list):
            raise ValueError("Text should be a list for batch processing.")
        g.text = g.text * n
    elif g.input_ids is not None:
        if not isinstance(g.input_ids, list) or not isinstance(g.input_ids[0], list):
            raise ValueError("input_ids should be a list of lists for batch processing.")
        g.input_ids = g.input_ids * n
    elif g.input_embeds is not None:
        if not isinstance(g.input_embeds, list):
            raise ValueError("input_embeds should be a list for batch processing.")
        g.input_embeds = g.input_embeds * n
    # _normalize_rid
    if isinstance(g.rid, list):
        if len(g.rid) != batch_size:
            raise ValueError("The specified rids length mismatch with the batch_size")
    elif g.rid is not None and not isinstance(g.rid, str):
        raise ValueError("The rid should be a string or a list of strings.")
    # _normalize_sampling_params
    if sp is None:
        params_list: Any = [{}] * num
    elif isinstance(sp, dict):
        params_list = [sp] * num
    else:
        params_list = sp * n
    # _normalize_logprob_params(return_sampling_mask)
    m = g.return_sampling_mask
    if m is None:
        masks: Any = [False] * num
    elif not isinstance(m, list):
        masks = [m] * num
    else:
        if n > 1:
            raise ValueError("Cannot use list return_sampling_mask with parallel_sample_num > 1")
        masks = m
    # __getitem__ per original item (parallel copies share the item's params and flag)
    return False, (lambda i: params_list[i]), (lambda i: masks[i]), batch_size


# --- routes -------------------------------------------------------------------------------------


def _fastapi_json(path: str, body: bytes, content_type: str | None) -> Any:
    """How FastAPI (with SGLang's ORJSONRequest) turns a body into the value it validates."""
    if path in _JSON_MEDIA_ONLY:
        media = (content_type or "").lower().split(";", maxsplit=1)[0]
        if media != "application/json":
            raise _Refused(400, "Unsupported Media Type")
    if not body:
        raise _Refused(400, "body required")
    if content_type:
        msg = email.message.Message()
        msg["content-type"] = content_type
        subtype = msg.get_content_subtype()
        if msg.get_content_maintype() != "application" or not (
            subtype == "json" or subtype.endswith("+json")
        ):
            raise _Refused(400, "body is not JSON for FastAPI")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _Refused(400, f"JSON decode error: {exc}") from None


def _route(method: str, raw_path: str) -> str | Reading:
    path = unquote(raw_path.partition("?")[0])  # uvicorn decodes once
    if path not in ROUTES and path.endswith("/") and path.rstrip("/") in ROUTES:
        path = path.rstrip("/")  # Starlette answers 307; a client that follows it lands here
    if path not in ROUTES:
        return Reading(404, "Not Found")
    if method not in ROUTES[path]:
        return Reading(405, "Method Not Allowed")
    return path


def read(
    method: str,
    raw_path: str,
    body: bytes,
    content_type: str | None = "application/json",
    generation_config: Mapping[str, Any] | None = None,
) -> Reading:
    """SGLang 0.5.19's reading of one request (see the module docstring).

    `generation_config` stands for the model's generation_config.json, which fills chat fields
    the request omits; empty (the default) means OpenAI's defaults, i.e. top_k -1 (unbounded).
    """
    path = _route(method, raw_path)
    if isinstance(path, Reading):
        return path
    try:
        value = _fastapi_json(path, body, content_type)
        if path == "/generate":
            return _read_generate(value)
        if path == "/vertex_generate":
            return _read_vertex(value)
        if path in ("/v1/chat/completions", "/invocations"):
            return _read_chat(value, generation_config or {})
        return _read_openai_other(path, value)
    except _Refused as exc:
        return Reading(exc.status, exc.reason)
    except ValidationError as exc:
        return Reading(400, f"validation: {exc.error_count()} errors")


def _read_generate(value: Any) -> Reading:
    body = _GENERATE.validate_python(value)
    g = _Gen(
        text=body.text,
        input_ids=body.input_ids,
        input_embeds=body.input_embeds,
        sampling_params=body.sampling_params,
        return_sampling_mask=body.return_sampling_mask,
        rid=body.rid,
    )
    return _run_generate(g)


def _read_vertex(value: Any) -> Reading:
    body = _VertexBody.model_validate(value)
    if not body.instances:
        return Reading(200, "no instances")
    inputs: dict[str, Any] = {}
    for key in ("text", "input_ids", "input_embeds"):
        if body.instances[0].get(key):
            inputs[key] = [instance.get(key) for instance in body.instances]
            break
    inputs["image_data"] = [
        inst.get("image_data") for inst in body.instances if inst.get("image_data") is not None
    ] or None
    # GenerateReqInput(**inputs, image_data=..., **parameters): a plain dataclass call.
    params = body.parameters or {}
    for key in params:
        if key in inputs:
            return Reading(500, f"got multiple values for keyword argument {key!r}")
        if key not in GENERATE_FIELDS:
            return Reading(500, f"unexpected keyword argument {key!r}")
    kwargs = {**inputs, **params}
    g = _Gen(
        text=kwargs.get("text"),
        input_ids=kwargs.get("input_ids"),
        input_embeds=kwargs.get("input_embeds"),
        sampling_params=kwargs.get("sampling_params"),
        return_sampling_mask=kwargs.get("return_sampling_mask"),
        rid=kwargs.get("rid"),
    )
    return _run_generate(g)


def _read_openai_other(path: str, value: Any) -> Reading:
    # Neither request model has a return_sampling_mask field: the key is ignored.
    req: _CompletionBody | _ResponsesBody
    if path == "/v1/completions":
        req = _CompletionBody.model_validate(value)
        kwargs = {"top_k": req.top_k, "temperature": req.temperature, "top_p": req.top_p}
    else:
        req = _ResponsesBody.model_validate(value)
        kwargs = {
            "top_k": -1 if req.top_k is None else req.top_k,
            "temperature": 0.7 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
        }
    try:
        sp = _sampling_params(kwargs)
    except ValueError as exc:
        return Reading(400, str(exc))
    return Reading(200, "runs; no mask field on this route", (Item(False, sp["top_k"]),))


def _read_chat(value: Any, generation_config: Mapping[str, Any]) -> Reading:
    req = _ChatBody.model_validate(value)
    if not req.messages:
        return Reading(400, "Messages cannot be empty.")
    if req.return_sampling_mask and not req.return_meta_info:
        return Reading(400, "return_sampling_mask requires return_meta_info=true.")
    if req.stream and req.return_meta_info:
        return Reading(400, "return_meta_info is not supported with streaming.")
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    defaults["repetition_penalty"] = 1.0

    def param(name: str) -> Any:
        v = getattr(req, name)
        return generation_config.get(name, defaults[name]) if v is None else v

    kwargs = {
        "temperature": param("temperature"),
        "max_new_tokens": req.max_completion_tokens or req.max_tokens,
        "min_new_tokens": req.min_tokens,
        "top_p": param("top_p"),
        "top_k": param("top_k"),
        "min_p": param("min_p"),
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": param("repetition_penalty"),
        "n": req.n,
    }
    try:
        sp = _sampling_params(kwargs)
    except ValueError as exc:
        return Reading(400, str(exc))
    sent = value if isinstance(value, dict) else {}
    return Reading(200, "runs", (Item(req.return_sampling_mask, sp["top_k"], sent),))
