"""Read a request body into the small view the sampling-mask policy needs, without building
a Python object tree of the whole body.

orjson, SGLang's parser, builds every value of a body: for a /generate request carrying 100k
`input_ids` that is 100k int objects made and freed per request, most of the gateway's CPU
on such traffic. simdjson validates the whole document in C++ (UTF-8, escapes,
numbers, nesting) and lets the gateway convert only the fields the policy reads.

The view must read every body exactly as orjson would, or a filter could be bypassed:
- what simdjson accepts, orjson accepts (tests/contract/test_jsonview.py checks the edge cases and a
  mutation fuzz); the one exception found, a leading UTF-8 BOM, never reaches simdjson,
  because the fast path requires the first non-blank byte to be `{`;
- whenever simdjson refuses a body (including big integers and nesting it is stricter on),
  or a field the view needs is ambiguous (a duplicated top-level key: orjson keeps the last,
  simdjson's lookup the first), the body goes to orjson, whose reading and error decide;
- nested objects are converted by simdjson's `as_dict`, which keeps the last duplicate, as
  orjson does.
"""

from __future__ import annotations

from typing import Any, Final

import orjson
import simdjson

from gateway.contract.shapes import Head

# A parser keeps its buffers between documents; one per process (the event loop is its only
# user, and a view never outlives the synchronous check that reads it). Bodies above this
# size get a parser of their own, so one huge body does not pin its buffers for good.
_SHARED_PARSER_MAX: Final = 8 * 1024 * 1024
_parser = simdjson.Parser()

_BLANK: Final = b" \t\r\n"

# How deep `head` follows first elements: the policy reads at most value[0][0].
_HEAD_DEPTH: Final = 3


def _head(array: simdjson.Array, depth: int) -> Head | list[Any]:
    length = len(array)
    if length == 0:
        return []
    first: Any = array[0]
    if isinstance(first, simdjson.Array):
        first = _head(first, depth - 1) if depth > 1 else Head(None, len(first))
    elif isinstance(first, simdjson.Object):
        first = first.as_dict()
    return Head(first, length)


def _convert(value: Any) -> Any:
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def read_view(
    body: bytes, fields: frozenset[str] | None, shape_only: frozenset[str]
) -> dict[str, Any]:
    """The body's top-level object as the policy sees it.

    fields: the top-level keys the policy reads (None: all of them); others are validated
    but left out. shape_only: keys whose array values the policy reads only for length and
    first element; they come back as Heads (gateway/contract/shapes.py).

    Raises orjson.JSONDecodeError exactly where orjson would, and returns orjson's own
    reading (whole) whenever the fast path cannot vouch for reading the body the same way.
    A top level that is not an object comes back as orjson's value, for the caller to refuse.
    """
    if body[:1] != b"{" and body.lstrip(_BLANK)[:1] != b"{":
        return orjson.loads(body)  # type: ignore[no-any-return]
    parser = _parser if len(body) <= _SHARED_PARSER_MAX else simdjson.Parser()
    try:
        doc = parser.parse(body)
    except (ValueError, RuntimeError):
        # ValueError: simdjson refuses it (orjson decides, and may accept a big integer).
        # RuntimeError: a view of an earlier document is still alive; never expected.
        return orjson.loads(body)  # type: ignore[no-any-return]
    try:
        assert isinstance(doc, simdjson.Object)  # the first byte was "{"
        return _select(doc, fields, shape_only, body)
    finally:
        del doc  # the shared parser can only be reused once no proxy of this one is left


def _select(
    doc: simdjson.Object,
    fields: frozenset[str] | None,
    shape_only: frozenset[str],
    body: bytes,
) -> dict[str, Any]:
    keys = list(doc.keys())
    if len(set(keys)) != len(keys):
        return orjson.loads(body)  # type: ignore[no-any-return]
    if fields is None:
        return doc.as_dict()
    view: dict[str, Any] = {}
    for key in keys:
        if key not in fields:
            continue
        value = doc[key]
        if key in shape_only and isinstance(value, simdjson.Array):
            view[key] = _head(value, _HEAD_DEPTH)
        else:
            view[key] = _convert(value)
    return view
