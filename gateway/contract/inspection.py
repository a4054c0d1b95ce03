"""Read an inspected request once and decide: forward the original bytes, or reject.

The chain is short and ordered, and the first rejection wins (docs/sglang-contract.md s.8):
  1. headers: a request Content-Encoding or a non-JSON media type is refused (415);
  2. body: read once, exactly as orjson (SGLang's own parser) reads it; anything orjson
     cannot read, or a top level that is not an object, is refused (400): a body the gateway
     could not read is never forwarded. Only the fields the policy needs become Python
     objects (gateway/contract/jsonview.py);
  3. the sampling-mask policy on the parsed view.
The parsed object is only read, never re-serialised: the proxy forwards the bytes it got.
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

from gateway.contract.adapters import requested_adapters
from gateway.contract.jsonview import read_view
from gateway.contract.keyscan import keys_for, may_name
from gateway.contract.policy import (
    READS,
    SHAPE_ONLY,
    BodyRules,
    Rejection,
    Verdict,
    request_ids,
)
from gateway.contract.rids import top_level_rids
from gateway.contract.routes import Kind
from gateway.contract.shapes import Head, first_of, length_of
from gateway.contract.skim import Skimmed

_JSON_SUBTYPE: Final = "json"


def check_headers(content_type: str | None, content_encoding: str | None) -> Rejection | None:
    """Refuse what SGLang would read differently from the gateway, before the body is read."""
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        # aiohttp would inflate the body for us, but SGLang would get the compressed bytes:
        # two readings of one request. Refuse rather than guess.
        return Rejection(
            415,
            "request_body",
            "content_encoding",
            "Content-Encoding is not supported on requests; send an uncompressed JSON body.",
        )
    if not content_type:
        return None  # FastAPI parses a body without Content-Type as JSON, and so does the gateway
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    maintype, _, subtype = media.partition("/")
    if maintype != "application" or not (
        subtype == _JSON_SUBTYPE or subtype.endswith("+" + _JSON_SUBTYPE)
    ):
        return Rejection(
            415,
            "request_body",
            "media_type",
            "Unsupported media type; this route accepts application/json.",
        )
    if params:
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
                "utf-8",
                "utf8",
            ):
                return Rejection(
                    415,
                    "request_body",
                    "charset",
                    "Unsupported charset; JSON bodies must be UTF-8.",
                )
    return None


# Below this size orjson's full parse is cheaper than simdjson's setup, and a tree of a small
# body costs little (where they cross: docs/bench.md, "Tuned constants").
_VIEW_MIN_BYTES: Final = 4096
# orjson 3.13 refuses some valid bodies ("failed to allocate memory"): every one found by a
# fuzz of 20,000 bodies with dense arrays opened with two or more blanks after the top-level
# brace, as indented JSON does. simdjson reads those bodies fine, so the view would forward
# what SGLang (orjson) refuses; such bodies are read by orjson itself.
ORJSON_SENSITIVE: Final = re.compile(rb"[ \t\r\n]*\{[ \t\r\n]{2}")


def parse_object(
    body: bytes, kind: Kind | None = None, skimmed: Skimmed | None = None
) -> dict[str, Any] | Rejection:
    """orjson's reading of a body, which must be a JSON object.

    With a kind, a body of 4 KB or more has only the fields that kind's policy check reads
    converted to Python objects (gateway/contract/jsonview.py); the whole body is still validated,
    exactly as orjson would. With `skimmed`, `body` is its reduced form (gateway/contract/skim.py):
    the view gets the lengths of the original arrays, and an error its original place.
    """
    parsed = skimmed.body if skimmed is not None else body
    try:
        if kind is None or len(parsed) < _VIEW_MIN_BYTES or ORJSON_SENSITIVE.match(parsed):
            obj = orjson.loads(parsed)
        else:
            obj = read_view(parsed, READS.get(kind), SHAPE_ONLY)
    except orjson.JSONDecodeError as exc:
        if skimmed is None:
            line, column = exc.lineno, exc.colno
        else:
            at = skimmed.original_offset(exc.pos)
            line = body.count(b"\n", 0, at) + 1
            column = at - (body.rfind(b"\n", 0, at) + 1) + 1
        # Where, in plain words; the parser's own message goes to the log only.
        return Rejection(
            400,
            "request_body",
            "invalid_json",
            f"Invalid JSON body (line {line}, column {column}).",
            validation=True,
            detail=exc.msg,
        )
    if not isinstance(obj, dict):
        return Rejection(
            400,
            "request_body",
            "not_an_object",
            "Invalid request body: the top level must be a JSON object.",
            validation=True,
        )
    if skimmed is not None:
        for key, extra in skimmed.extra_elements.items():
            value = obj.get(key)
            length = length_of(value)
            if length > 0:
                obj[key] = Head(first_of(value), length + extra)
    return obj


def inspect_body(
    kind: Kind,
    body: bytes,
    rules: BodyRules,
    *,
    skip_parse_without_key: bool = False,
    rids: list[str] | None = None,
    adapters: list[str] | None = None,
) -> Verdict:
    """Parse an inspected route's body once and apply the policy to it: a refusal, the mask
    demand each backend's profile decides, or None (forward it anywhere).

    With `skip_parse_without_key`, a body that cannot hold the mask key is forwarded
    unparsed: no mask can be requested by it, and SGLang (same parser) refuses it itself if
    it is malformed. This trades the gateway's own 400 for malformed or mistyped bodies
    (rules 1 and 5 of the contract) for not building a Python object tree of a large body.
    `rids`, when given, receives the body's request ids (policy.request_ids); a skipped
    body's are read by a walk of its structure (gateway/contract/rids.py), and one whose
    rid that walk cannot vouch for is parsed and judged after all. `adapters` receives the
    LoRA adapters it names (contract/adapters.py); a body that may name one (`lora_path`, or
    a `model` written `base:adapter` on the OpenAI routes) is parsed for them even with
    `skip_parse_without_key`. Which keys prevent the skip: gateway/contract/keyscan.py.
    """
    if skip_parse_without_key and not may_name(body, keys_for(kind, adapters is not None)):
        if rids is None:
            return None
        found = top_level_rids(body)
        if found is not None:
            rids += found
            return None
    return judge(kind, parse_object(body, kind), rules, rids, adapters)


def judge(
    kind: Kind,
    parsed: dict[str, Any] | Rejection,
    rules: BodyRules,
    rids: list[str] | None,
    adapters: list[str] | None,
) -> Verdict:
    """The verdict on a body read once (inspect_body, inspect_large), its rids and adapters
    noted where asked for."""
    if isinstance(parsed, Rejection):
        return parsed
    if rids is not None:
        rids += request_ids(parsed)
    if adapters is not None:
        adapters += requested_adapters(kind, parsed)
    return rules.assess(kind, parsed)
