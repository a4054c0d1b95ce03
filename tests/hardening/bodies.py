"""Hypothesis strategies for generation-request bodies, written at the byte level.

Every field that decides the sampling-mask rule gets random types and spellings; the bytes are
written by hand so that a body can carry what no serializer produces: duplicate keys (orjson,
like SGLang, keeps the last one), `\\u`-escaped key names, numbers orjson cannot write (2**64,
1e300, -0.0) and varied spacing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import strategies as st

# --- a JSON writer that allows what serializers do not -------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON token written verbatim (numbers orjson cannot produce)."""

    text: bytes


@dataclass(frozen=True)
class Obj:
    """A JSON object as ordered (key, value) pairs: keys may repeat."""

    pairs: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Style:
    escape_keys: bool = False  # write some key characters as \\u escapes
    spaced: bool = False  # spaces and newlines between tokens


def _key(name: str, style: Style, salt: int) -> bytes:
    if not style.escape_keys or not name:
        return orjson.dumps(name)
    i = salt % len(name)
    escaped = name[:i] + f"\\u{ord(name[i]):04x}" + name[i + 1 :]
    if salt % 3 == 0:
        escaped = "".join(f"\\u{ord(c):04X}" for c in name)
    return b'"' + escaped.encode() + b'"'


def dump(value: Any, style: Style = Style(), _salt: int = 0) -> bytes:
    sep, colon = (b" ,\n ", b" : ") if style.spaced else (b",", b":")
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Obj):
        parts = [
            _key(k, style, _salt + i) + colon + dump(v, style, _salt + i + 1)
            for i, (k, v) in enumerate(value.pairs)
        ]
        return b"{" + sep.join(parts) + b"}"
    if isinstance(value, dict):
        return dump(Obj(tuple(value.items())), style, _salt)
    if isinstance(value, list | tuple):
        return b"[" + sep.join(dump(v, style, _salt + i) for i, v in enumerate(value)) + b"]"
    return orjson.dumps(value)


# --- values ---------------------------------------------------------------------------------------

ABSENT = object()

MASK_ON = [True, 1, 1.0, "true", "True", "t", "y", "yes", "YES", "on", "On", "1"]
MASK_OFF = [False, 0, 0.0, "false", "f", "n", "no", "off", "OFF", "0", None]
MASK_ODD = [2, -1, 0.5, "maybe", "", " yes", [], [True], [False], [True, False], ["no"], {}]

TOP_K_FINITE = [1, 2, 5, 40, 100, 4096, 5.0, True, 1073741823]
TOP_K_UNBOUNDED = [
    None,
    -1,
    -1.0,
    1073741824,
    1073741825,
    2**31,
    Raw(b"18446744073709551616"),
    Raw(b"1e300"),
    Raw(b"1073741824.0"),
]
TOP_K_ODD = [0, -2, False, 0.5, 5.5, "5", " 5 ", "5.0", "+5", "abc", [5], {}]

TEMPERATURES = [0, 0.0, Raw(b"-0.0"), 1e-7, 1e-6, 0.5, 1.0, None, True, False, "0", -1]


def _maybe(values: st.SearchStrategy[Any] | list[Any], p_absent: float) -> st.SearchStrategy[Any]:
    """`values`, or ABSENT (the key is left out) with probability about p_absent."""
    if isinstance(values, list):
        absent = round(p_absent * 20)
        pool = [ABSENT] * absent * len(values) + values * (20 - absent)
        return st.sampled_from(pool)
    return st.one_of(st.just(ABSENT), values)


MASK_VALUES = MASK_ON * 2 + MASK_OFF + MASK_ODD
# A finite top_k is the common case; every unbounded and odd spelling still comes up often.
TOP_K_VALUES = TOP_K_FINITE * 3 + TOP_K_UNBOUNDED + TOP_K_ODD
mask_values = st.sampled_from(MASK_VALUES)

_TOP_K = _maybe(TOP_K_VALUES, 0.3)
_TEMPERATURE = _maybe(TEMPERATURES, 0.6)
_TOP_P = _maybe([0.9, 1.0], 0.6)
_MAX_NEW = _maybe([1, 4, 8], 0.5)
_N = _maybe([1, 2, 2.0, True], 0.85)
_IS_NORMALIZED = _maybe([True, 1, False], 0.95)


def _obj(fields: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in fields if v is not ABSENT]


@st.composite
def sampling_params(draw: st.DrawFn) -> Obj:
    fields = [
        ("top_k", draw(_TOP_K)),
        ("temperature", draw(_TEMPERATURE)),
        ("top_p", draw(_TOP_P)),
        ("max_new_tokens", draw(_MAX_NEW)),
        ("n", draw(_N)),
        ("is_normalized", draw(_IS_NORMALIZED)),
    ]
    return Obj(tuple(_obj(fields)))


_MASK_ITEM = st.sampled_from(MASK_ON + MASK_OFF[:-1])


@st.composite
def mask_field(draw: st.DrawFn, batch: int) -> Any:
    kind = draw(st.sampled_from(["absent", "scalar", "scalar", "scalar", "scalar", "list"]))
    if kind == "absent":
        return ABSENT
    if kind == "scalar":
        return draw(mask_values)
    size = draw(st.sampled_from([batch, batch, 0, 1, batch + 1]))
    return [draw(_MASK_ITEM) for _ in range(size)]


_SHAPES = ["text"] * 4 + ["text_list"] * 3 + ["ids", "ids_batch", "embeds", "embeds_batch"]
_SHAPES += ["text+embeds", "ids+embeds", "text+ids"]
_TEXTS = st.sampled_from(["Hi", "x y z", "h\u00e9llo \u2603"])
_PARAMS_KIND = st.sampled_from(["absent", "null", "dict", "dict", "dict", "dict", "list", "odd"])
_STREAM = _maybe([False, True, "yes"], 0.7)
_DECOY_TOP_K = _maybe([5, 1], 0.8)
_RID = _maybe(["r-1"], 0.8)


@st.composite
def generate_body(draw: st.DrawFn) -> tuple[str, Obj]:
    shape = draw(st.sampled_from(_SHAPES))
    batch = draw(st.integers(0, 3)) if "list" in shape or "batch" in shape else 1
    fields: list[tuple[str, Any]] = []
    if shape in ("text", "text+embeds", "text+ids"):
        fields.append(("text", draw(_TEXTS)))
    if shape == "text_list":
        fields.append(("text", [f"prompt {i}" for i in range(batch)]))
    if shape in ("ids", "ids+embeds"):
        fields.append(("input_ids", [1, 2, 3]))
    if shape in ("ids_batch", "text+ids"):
        fields.append(("input_ids", [[1, 2], [3], [4]][: max(batch, 2)]))
    if shape == "embeds":
        fields.append(("input_embeds", [[0.1, 0.2], [0.3, 0.4]]))
    if shape in ("embeds_batch", "text+embeds", "ids+embeds"):
        fields.append(("input_embeds", [[[0.1, 0.2]]] * max(batch, 2)))
    params_kind = draw(_PARAMS_KIND)
    if params_kind == "null":
        fields.append(("sampling_params", None))
    elif params_kind == "dict":
        fields.append(("sampling_params", draw(sampling_params())))
    elif params_kind == "list":
        size = draw(st.sampled_from([batch, batch, batch, 0, 1, batch + 1]))
        fields.append(("sampling_params", [draw(sampling_params()) for _ in range(size)]))
    elif params_kind == "odd":
        fields.append(("sampling_params", draw(st.sampled_from(["x", [1], 5]))))
    fields.append(("return_sampling_mask", draw(mask_field(batch))))
    fields.append(("stream", draw(_STREAM)))
    # Decoys: keys SGLang ignores on /generate.
    fields.append(("top_k", draw(_DECOY_TOP_K)))
    fields.append(("rid", draw(_RID)))
    return "/generate", Obj(tuple(_obj(fields)))


MESSAGES = [{"role": "user", "content": "Hi"}]
_CHAT_PATH = st.sampled_from(["/v1/chat/completions"] * 4 + ["/invocations"])
_MODEL = _maybe(["stub-model"], 0.3)
_MESSAGES = st.sampled_from([MESSAGES] * 5 + [[]])
_CHAT_TOP_K = _maybe(TOP_K_VALUES, 0.25)
_CHAT_N = _maybe([1, 2], 0.8)
_CHAT_MASK = _maybe(MASK_VALUES, 0.2)
_META = _maybe([True, True, "yes", 1, False, "no"], 0.2)
_CHAT_STREAM = _maybe([False, True, "on", "off"], 0.75)
_MAX_TOKENS = _maybe([4], 0.5)
_DECOY_PARAMS = _maybe([{"top_k": 5}], 0.85)


@st.composite
def chat_body(draw: st.DrawFn) -> tuple[str, Obj]:
    path = draw(_CHAT_PATH)
    fields = [
        ("model", draw(_MODEL)),
        ("messages", draw(_MESSAGES)),
        ("top_k", draw(_CHAT_TOP_K)),
        ("temperature", draw(_TEMPERATURE)),
        ("top_p", draw(_TOP_P)),
        ("n", draw(_CHAT_N)),
        ("return_sampling_mask", draw(_CHAT_MASK)),
        ("return_meta_info", draw(_META)),
        ("stream", draw(_CHAT_STREAM)),
        ("max_tokens", draw(_MAX_TOKENS)),
        # Decoys: SGLang ignores these keys on chat.
        ("sampling_params", draw(_DECOY_PARAMS)),
        ("extra_body", draw(_DECOY_PARAMS)),
    ]
    return path, Obj(tuple(_obj(fields)))


_INSTANCE = st.sampled_from(
    [{"text": "a"}, {"text": "b"}, {"input_ids": [1, 2]}, {"input_embeds": [0.1, 0.2]}, {}]
)
_VERTEX_PARAMS_KIND = st.sampled_from(["absent", "null", "dict", "dict", "dict", "dict"])
_VERTEX_SP = _maybe(sampling_params(), 0.2)
_VERTEX_TEXT = _maybe(["from parameters"], 0.9)
_VERTEX_STREAM = _maybe([False], 0.9)


@st.composite
def vertex_body(draw: st.DrawFn) -> tuple[str, Obj]:
    instances = [draw(_INSTANCE) for _ in range(draw(st.integers(0, 3)))]
    kind = draw(_VERTEX_PARAMS_KIND)
    fields: list[tuple[str, Any]] = [("instances", instances)]
    if kind == "null":
        fields.append(("parameters", None))
    elif kind == "dict":
        params = [
            ("sampling_params", draw(_VERTEX_SP)),
            ("return_sampling_mask", draw(mask_field(len(instances)))),
            ("text", draw(_VERTEX_TEXT)),
            ("stream", draw(_VERTEX_STREAM)),
        ]
        fields.append(("parameters", Obj(tuple(_obj(params)))))
    return "/vertex_generate", Obj(tuple(_obj(fields)))


_OTHER_PATH = st.sampled_from(["/v1/completions", "/v1/responses"])
_OTHER_TOP_K = _maybe(TOP_K_VALUES, 0.5)
_OTHER_MASK = _maybe(MASK_VALUES, 0.5)


@st.composite
def openai_other_body(draw: st.DrawFn) -> tuple[str, Obj]:
    path = draw(_OTHER_PATH)
    fields = [
        ("model", "stub-model"),
        ("prompt" if path == "/v1/completions" else "input", "Hi"),
        ("top_k", draw(_OTHER_TOP_K)),
        ("temperature", draw(_TEMPERATURE)),
        ("return_sampling_mask", draw(_OTHER_MASK)),
    ]
    return path, Obj(tuple(_obj(fields)))


_DECOY_VALUES = st.sampled_from([True, False, None, -1, 5, "yes", [False], {}])
_PATHS = st.sampled_from(["/generate"] * 6 + ["/%67enerate", "/generate/"])
_ROUTE = st.sampled_from(["generate"] * 4 + ["chat"] * 3 + ["vertex", "other"])
_BUILDERS = {
    "generate": generate_body,
    "chat": chat_body,
    "vertex": vertex_body,
    "other": openai_other_body,
}


@st.composite
def mutate(draw: st.DrawFn, body: Obj) -> Obj:
    """Byte-level tricks on top-level and nested keys: duplicates with decoy values."""
    pairs = list(body.pairs)
    if pairs and draw(st.booleans()):
        i = draw(st.integers(0, len(pairs) - 1))
        key = pairs[i][0]
        decoy = draw(_DECOY_VALUES)
        # The decoy goes before (ignored: the last wins) or after (it wins) the real value.
        pairs.insert(i + draw(st.integers(0, 1)), (key, decoy))
    return Obj(tuple(pairs))


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, body bytes) for any inspected generation route."""
    path, body = draw(_BUILDERS[draw(_ROUTE)]())
    if draw(st.integers(0, 3)) == 0:
        body = draw(mutate(body))
    if path == "/generate":
        path = draw(_PATHS)
    style = Style(escape_keys=draw(st.integers(0, 4)) == 0, spaced=draw(st.booleans()))
    return path, dump(body, style)
