"""A hand-written corpus of adversarial generation requests, each with its expected outcome.

`expect` is "forward" (the stub must receive the exact bytes) or the status the gateway must
answer itself (and then nothing may reach the stub). Bodies are bytes, written by hand where
the spelling matters: duplicate keys, `\\u` escapes, numbers no serializer writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

FORWARD = "forward"


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    expect: str | int
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def j(**fields: object) -> bytes:
    return orjson.dumps(fields)


def gen(mask: object = None, params: object = None, **extra: object) -> bytes:
    """A single /generate body; None leaves the field out."""
    body: dict[str, object] = {"text": "Hi"}
    if params is not None:
        body["sampling_params"] = params
    if mask is not None:
        body["return_sampling_mask"] = mask
    body.update(extra)
    return orjson.dumps(body)


def raw_gen(mask: bytes = b"true", top_k: bytes | None = None, extra: bytes = b"") -> bytes:
    params = b"{}" if top_k is None else b'{"top_k": ' + top_k + b"}"
    return (
        b'{"text": "Hi", "sampling_params": '
        + params
        + b', "return_sampling_mask": '
        + mask
        + extra
        + b"}"
    )


MSG = [{"role": "user", "content": "Hi"}]


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "stub-model", "messages": MSG, **fields})


CASES: list[Case] = []


def add(name: str, path: str, body: bytes, expect: str | int, **kw: object) -> None:
    CASES.append(Case(name, path, body, expect, **kw))  # type: ignore[arg-type]


# -- every spelling of "mask on" SGLang accepts, with top_k omitted: refused ----------------------
for spelling in [
    b"true",
    b"1",
    b"1.0",
    b'"true"',
    b'"TRUE"',
    b'"t"',
    b'"y"',
    b'"yes"',
    b'"On"',
    b'"1"',
]:
    add(f"mask {spelling.decode()} without top_k", "/generate", raw_gen(spelling), 400)
for spelling in [b"[false]", b"[true]", b'["no"]', b"[0]"]:
    # On a single request any non-empty list is truthy in SGLang, even [false].
    add(f"mask {spelling.decode()} (single) without top_k", "/generate", raw_gen(spelling), 400)

# -- spellings of "off": forwarded even without top_k ---------------------------------------------
for spelling in [b"false", b"0", b"0.0", b'"false"', b'"no"', b'"OFF"', b'"n"', b"null", b"[]"]:
    add(f"mask {spelling.decode()} is off", "/generate", raw_gen(spelling), FORWARD)

# -- not a boolean at all: SGLang's pydantic refuses it, so does the gateway ----------------------
for spelling in [b"2", b'"maybe"', b'" yes"', b"{}", b"-1"]:
    add(f"mask {spelling.decode()} is invalid", "/generate", raw_gen(spelling), 400)

# -- unbounded top_k spellings with the mask on: refused ------------------------------------------
for top_k in [
    b"null",
    b"-1",
    b"-1.0",
    b"1073741824",
    b"1073741824.0",
    b"1073741825",
    b"2147483648",
    b"18446744073709551616",
    b"1e300",
]:
    add(f"top_k {top_k.decode()} is unbounded", "/generate", raw_gen(b"true", top_k), 400)

# -- finite top_k spellings: forwarded ------------------------------------------------------------
for top_k in [b"1", b"40", b"5.0", b"true", b"1073741823", b"4096"]:
    add(f"top_k {top_k.decode()} is finite", "/generate", raw_gen(b"true", top_k), FORWARD)

# -- odd top_k: SGLang refuses (or crashes), the gateway answers 400 itself -----------------------
for top_k in [b"0", b"-2", b"false", b"0.5", b"5.5", b'"5"', b"[5]", b"{}", b"-0.0"]:
    add(f"top_k {top_k.decode()} is refused", "/generate", raw_gen(b"true", top_k), 400)

# -- greedy items: SGLang forces top_k = 1 --------------------------------------------------------
for temp, expect in [
    (b"0", FORWARD),
    (b"0.0", FORWARD),
    (b"-0.0", FORWARD),
    (b"1e-7", FORWARD),
    (b"1e-6", 400),  # not below 1e-6: sampled, unbounded
    (b"0.7", 400),
    (b"true", 400),  # true is 1: sampled, unbounded
    (b"false", FORWARD),  # SGLang compares 0 <= false < 1e-6: greedy, top_k = 1
    (b'"0"', 400),  # no pydantic on /generate: a string temperature is no number
]:
    body = b'{"text": "Hi", "sampling_params": {"temperature": ' + temp + b"}, "
    body += b'"return_sampling_mask": true}'
    add(f"temperature {temp.decode()}", "/generate", body, expect)
add(
    "greedy with is_normalized skips greedy forcing",
    "/generate",
    gen(True, {"temperature": 0, "is_normalized": True}),
    400,
)
add("greedy with an odd top_k", "/generate", gen(True, {"temperature": 0, "top_k": "x"}), FORWARD)

# -- duplicate keys: the last one wins, as in orjson and SGLang -----------------------------------
add(
    "duplicate mask, last on",
    "/generate",
    b'{"text": "Hi", "return_sampling_mask": false, "return_sampling_mask": true}',
    400,
)
add(
    "duplicate mask, last off",
    "/generate",
    b'{"text": "Hi", "return_sampling_mask": true, "return_sampling_mask": false}',
    FORWARD,
)
add(
    "duplicate top_k, last unbounded",
    "/generate",
    b'{"text": "Hi", "sampling_params": {"top_k": 5, "top_k": -1}, "return_sampling_mask": 1}',
    400,
)
add(
    "duplicate top_k, last finite",
    "/generate",
    b'{"text": "Hi", "sampling_params": {"top_k": -1, "top_k": 5}, "return_sampling_mask": 1}',
    FORWARD,
)
add(
    "duplicate sampling_params, last empty",
    "/generate",
    b'{"text": "Hi", "sampling_params": {"top_k": 5}, "sampling_params": {},'
    b' "return_sampling_mask": true}',
    400,
)
add(
    "duplicate temperature, last not greedy",
    "/generate",
    b'{"text": "Hi", "sampling_params": {"temperature": 0, "temperature": 0.5},'
    b' "return_sampling_mask": true}',
    400,
)

# -- \u-escaped key names: the same keys once decoded ---------------------------------------------
add(
    "escaped mask key",
    "/generate",
    b'{"text": "Hi", "return\\u005fsampling_mask": true}',
    400,
)
add(
    "fully escaped mask key",
    "/generate",
    b'{"text": "Hi", "\\u0072\\u0065\\u0074\\u0075\\u0072\\u006e\\u005f\\u0073\\u0061\\u006d'
    b'\\u0070\\u006c\\u0069\\u006e\\u0067\\u005f\\u006d\\u0061\\u0073\\u006b": "yes"}',
    400,
)
add(
    "escaped top_k key counts",
    "/generate",
    b'{"text": "Hi", "sampling_params": {"\\u0074op_k": 5}, "return_sampling_mask": true}',
    FORWARD,
)
add(
    "escaped sampling_params key",
    "/generate",
    b'{"text": "Hi", "sampling\\u005Fparams": {"top_k": -1}, "return_sampling_mask": true}',
    400,
)
add(
    "escaped key then plain duplicate",
    "/generate",
    b'{"text": "Hi", "return_sampling_mask": false, "return_sampling_\\u006dask": true}',
    400,
)
add(
    "case-changed key is another key",
    "/generate",
    b'{"text": "Hi", "Return_Sampling_Mask": true}',
    FORWARD,
)

# -- decoys SGLang ignores ------------------------------------------------------------------------
add("top-level top_k on /generate is ignored", "/generate", gen(True, top_k=5), 400)
add(
    "mask inside sampling_params is not the mask",
    "/generate",
    gen(None, {"return_sampling_mask": True}),
    FORWARD,
)

# -- batches and parallel sampling ----------------------------------------------------------------
add(
    "batch: per-item mask and params, finite where on",
    "/generate",
    j(text=["a", "b"], sampling_params=[{"top_k": 5}, {}], return_sampling_mask=[True, False]),
    FORWARD,
)
add(
    "batch: second item on and unbounded",
    "/generate",
    j(text=["a", "b"], sampling_params=[{"top_k": 5}, {}], return_sampling_mask=[False, "yes"]),
    400,
)
add(
    "batch: shared mask, one unbounded item",
    "/generate",
    j(text=["a", "b"], sampling_params=[{"top_k": 5}, {"top_p": 0.5}], return_sampling_mask=1),
    400,
)
add(
    "batch: mask list shorter than the batch",
    "/generate",
    j(text=["a", "b"], return_sampling_mask=[True]),
    400,
)
add(
    "batch: params list shorter than the batch",
    "/generate",
    j(text=["a", "b"], sampling_params=[{"top_k": 5}], return_sampling_mask=True),
    400,
)
add(
    "batch of input_ids, shared finite top_k",
    "/generate",
    j(input_ids=[[1, 2], [3]], sampling_params={"top_k": 3}, return_sampling_mask=True),
    FORWARD,
)
add(
    "batch of input_ids, shared unbounded",
    "/generate",
    j(input_ids=[[1, 2], [3]], return_sampling_mask=[True, True]),
    400,
)
# An empty batch runs nothing: SGLang answers [] (checked against the released code).
add("empty batch with the mask", "/generate", j(text=[], return_sampling_mask=1), FORWARD)
add(
    "n > 1 with a list mask",
    "/generate",
    j(text="Hi", sampling_params={"n": 2, "top_k": 3}, return_sampling_mask=[True]),
    400,
)
add(
    "n > 1 with a scalar mask and finite top_k",
    "/generate",
    j(text="Hi", sampling_params={"n": 2, "top_k": 3}, return_sampling_mask=True),
    FORWARD,
)
add(
    "n > 1 with a scalar mask, unbounded",
    "/generate",
    j(text="Hi", sampling_params={"n": 3}, return_sampling_mask=True),
    400,
)
add(
    "text decides the shape over batch-shaped input_embeds",
    "/generate",
    j(text="Hi", input_embeds=[[[0.1]], [[0.2]]], return_sampling_mask=[False]),
    400,
)
add(
    "flat input_ids decide the shape over input_embeds",
    "/generate",
    j(input_ids=[1, 2], input_embeds=[[[0.1]], [[0.2]]], return_sampling_mask=[False, False]),
    400,
)

# -- /vertex_generate: parameters are never validated by pydantic ---------------------------------
V = [{"text": "a"}]
add(
    "vertex: mask true",
    "/vertex_generate",
    j(instances=V, parameters={"return_sampling_mask": True}),
    400,
)
for spelling in ["false", "no", "0"]:
    add(
        f"vertex: mask {spelling!r} is truthy there",
        "/vertex_generate",
        j(instances=V, parameters={"return_sampling_mask": spelling}),
        400,
    )
add(
    "vertex: text in parameters makes a single request",
    "/vertex_generate",
    j(instances=[{}], parameters={"text": "a", "return_sampling_mask": [False]}),
    400,
)
add(
    "vertex: finite top_k",
    "/vertex_generate",
    j(instances=V * 2, parameters={"return_sampling_mask": True, "sampling_params": {"top_k": 8}}),
    FORWARD,
)
add(
    "vertex: mask off",
    "/vertex_generate",
    j(instances=V, parameters={"return_sampling_mask": False}),
    FORWARD,
)
add("vertex: no parameters", "/vertex_generate", j(instances=V), FORWARD)

# -- chat and the other OpenAI routes -------------------------------------------------------------
CHAT = "/v1/chat/completions"
add("chat: mask without meta_info", CHAT, chat(return_sampling_mask=True, top_k=5), 400)
add(
    "chat: mask, meta_info, no top_k",
    CHAT,
    chat(return_sampling_mask=True, return_meta_info=True),
    400,
)
add(
    "chat: mask, meta_info, top_k null",
    CHAT,
    chat(return_sampling_mask="on", return_meta_info=1, top_k=None),
    400,
)
add(
    "chat: mask, meta_info, top_k -1",
    CHAT,
    chat(return_sampling_mask=1, return_meta_info="yes", top_k=-1),
    400,
)
add(
    "chat: mask, meta_info, top_k 5",
    CHAT,
    chat(return_sampling_mask=True, return_meta_info=True, top_k=5),
    FORWARD,
)
add(
    "chat: lax spellings everywhere",
    CHAT,
    chat(return_sampling_mask="on", return_meta_info="yes", top_k="5"),
    FORWARD,
)
add(
    "chat: top_k with spaces (pydantic reads it as 5)",
    CHAT,
    chat(return_sampling_mask=True, return_meta_info=True, top_k=" 5 "),
    FORWARD,
)
add(
    "chat: greedy temperature",
    CHAT,
    chat(return_sampling_mask=True, return_meta_info=True, temperature=0),
    FORWARD,
)
add(
    "chat: streamed mask",
    CHAT,
    chat(return_sampling_mask=True, return_meta_info=True, top_k=5, stream=True),
    400,
)
add(
    "chat: top_k inside a literal sampling_params is ignored",
    CHAT,
    chat(return_sampling_mask=True, return_meta_info=True, sampling_params={"top_k": 5}),
    400,
)
add(
    "chat: top_k inside a literal extra_body is ignored",
    CHAT,
    chat(return_sampling_mask=True, return_meta_info=True, extra_body={"top_k": 5}),
    400,
)
add("chat: no mask, no top_k", CHAT, chat(), FORWARD)
add(
    "invocations is chat",
    "/invocations",
    chat(return_sampling_mask=True, return_meta_info=True),
    400,
)
add(
    "completions: mask fails closed",
    "/v1/completions",
    j(prompt="Hi", return_sampling_mask=True),
    400,
)
add(
    "completions: mask with top_k",
    "/v1/completions",
    j(prompt="Hi", return_sampling_mask=True, top_k=4),
    FORWARD,
)
add("completions: no mask", "/v1/completions", j(prompt="Hi"), FORWARD)
add("responses: mask fails closed", "/v1/responses", j(input="Hi", return_sampling_mask="y"), 400)

# -- route spellings and methods ------------------------------------------------------------------
add("percent-encoded path", "/%67enerate", gen(True), 400)
add("trailing slash", "/generate/", gen(True), 400)
add("two trailing slashes", "/generate//", gen(True), 400)
add("PUT /generate", "/generate", gen(True), 400, method="PUT")
add(
    "chat with a trailing slash",
    CHAT + "/",
    chat(return_sampling_mask=True, return_meta_info=True),
    400,
)
add("double-encoded path is another path", "/%2567enerate", gen(True), 404)
add("upper-case path is another path", "/GENERATE", gen(True), 404)
add("GET /generate", "/generate", b"", 405, method="GET")
add("query string does not hide the route", "/generate?x=/health", gen(True), 400)

# -- bodies no JSON reader agrees on: never forwarded ---------------------------------------------
add("UTF-8 BOM", "/generate", b"\xef\xbb\xbf" + gen(True, {"top_k": 5}), 400)
add("UTF-16 body", "/generate", gen(False).decode().encode("utf-16"), 400)
add("UTF-32 body", "/generate", gen(False).decode().encode("utf-32"), 400)
add("invalid UTF-8", "/generate", b'{"text": "\xff\xfe", "return_sampling_mask": false}', 400)
add("lone surrogate", "/generate", b'{"text": "\\ud800", "return_sampling_mask": false}', 400)
add("NaN", "/generate", raw_gen(b"true", b"NaN"), 400)
add("Infinity", "/generate", raw_gen(b"true", b"Infinity"), 400)
add("1e400", "/generate", raw_gen(b"true", b"1e400"), 400)
add("trailing data", "/generate", gen(False) + b' {"return_sampling_mask": true}', 400)
add("deep nesting", "/generate", b'{"text": "Hi", "x": ' + b"[" * 1100 + b"]" * 1100 + b"}", 400)
add("top-level array", "/generate", b'[{"text": "Hi", "return_sampling_mask": true}]', 400)
add("empty body", "/generate", b"", 400)
add("single quotes", "/generate", b"{'text': 'Hi'}", 400)
add("comment", "/generate", b'{"text": "Hi" /* , "return_sampling_mask": true */}', 400)

# -- headers that change how the body is read -----------------------------------------------------
ok = gen(True, {"top_k": 5})
add("gzip request", "/generate", ok, 415, headers={"Content-Encoding": "gzip"})
add("br request", "/generate", ok, 415, headers={"Content-Encoding": "br"})
add("deflate request", "/generate", ok, 415, headers={"Content-Encoding": "deflate"})
add("text/plain", "/generate", ok, 415, headers={"Content-Type": "text/plain"})
add("form", "/generate", ok, 415, headers={"Content-Type": "application/x-www-form-urlencoded"})
add("latin-1", "/generate", ok, 415, headers={"Content-Type": "application/json; charset=latin-1"})
add(
    "utf-16 charset",
    CHAT,
    chat(),
    415,
    headers={"Content-Type": "application/json; charset=utf-16"},
)
add(
    "utf-8 charset",
    "/generate",
    ok,
    FORWARD,
    headers={"Content-Type": "application/json; charset=UTF-8"},
)
add(
    "+json media type", "/generate", ok, FORWARD, headers={"Content-Type": "application/vnd.x+json"}
)
