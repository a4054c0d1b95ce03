"""SGLang's request ids (`rid`) of a body that is forwarded without being parsed.

With policy.skip_parse_without_mask_key a body that provably holds no mask key goes out
unparsed, yet an abort of one rid must still reach the engine serving it alone, so the
gateway needs that body's top-level `rid`. It is found here by a walk over the body's
strings alone, from one quote to the next with memchr, skipping string contents whole: a
100k-token `input_ids` array holds no quote, so it costs one memchr pass over the body,
not a parse. A key that names rid (in any spelling: `"r\\u0069d"` is `rid` to SGLang) is
then placed by counting the braces outside strings on its shorter side: one brace deep
is a key of the top-level object, whatever arrays it sits in (unless the top level is an
array, which SGLang refuses).

What it cannot prove cheaply it leaves to a parse (None): a `rid` value with escapes or
of another type than a string, null or a list of strings; a second top-level `rid`
(SGLang's parser keeps the last); more than _MAX_TOKENS strings before the rest of the
body could still hold the key. A `"rid"` string anywhere else (a prompt that says it, a
nested key, a value) is walked past as what it is. The walk assumes the body is JSON; one
that is not is refused by SGLang itself, so a rid read from it is never served and its
owner is forgotten when that request ends.

A body of a few KB is simply parsed (orjson is quicker there than the walk's start).
The walk is written once, as a generator that asks for each search (a byte or the key
from a position) and is told where it matched, so the synchronous reading of small bodies
and the sliced one of large bodies (gateway/contract/scan.py) follow the same steps.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Final

import orjson

from gateway.contract import scan
from gateway.contract.policy import request_ids

RID_KEY: Final = b'"rid"'
_BACKSLASH: Final = 0x5C
_COLON: Final = 0x3A
# Searches before the rest of the body is only searched for the key (and brace counts for
# a rid key given up): an RL body (input_ids, sampling_params, a few flags) takes about
# twenty; a chat body with a long message list is not walked to its end.
_MAX_TOKENS: Final = 512
# The longest `rid` value read here (a batch's list of ids); a longer one is parsed. One
# regex match over it is one step on the loop (gateway/contract/scan.py, CLASS_SLICE).
_VALUE_WINDOW: Final = scan.CLASS_SLICE
# Below this size orjson's parse of the whole body costs less than the walk's fixed part
# (about 20 us on the 2-core VM; orjson: 2 us for 2 KB of text, 11 us for 2 KB of ids).
_WALK_FROM: Final = 4096
_BLANKS: Final = re.compile(rb"[ \t\r\n]*")
_PLAIN: Final = rb'"[^"\\]*"'
_VALUE: Final = re.compile(
    rb"[ \t\r\n]*:[ \t\r\n]*(?:"
    rb'"([^"\\]*)"'  # a string without escapes
    rb"|(null)"
    rb"|(\[[ \t\r\n]*(?:" + _PLAIN + rb"(?:[ \t\r\n]*,[ \t\r\n]*" + _PLAIN + rb")*)?[ \t\r\n]*\])"
    rb")"
)
_ITEM: Final = re.compile(rb'"([^"\\]*)"')

_Walk = Generator[scan.Search, int, list[str] | None]


def top_level_rids(body: bytes) -> list[str] | None:
    """The rids of the body's top-level `rid` ([] when it has none), or None when they
    cannot be read without a parse."""
    if len(body) < _WALK_FROM:
        return _parsed(body)
    return scan.run_walk(_walk(body), body)


async def top_level_rids_sliced(body: bytes) -> list[str] | None:
    """top_level_rids, its searches a slice at a time (a multi-MB body)."""
    if len(body) < _WALK_FROM:
        return _parsed(body)
    return await scan.run_walk_sliced(_walk(body), body)


def _parsed(body: bytes) -> list[str]:
    """A small body's rids, as the full inspection reads them: orjson parses a few KB in
    less time than the walk takes to start. One orjson refuses has none (SGLang refuses it)."""
    if RID_KEY not in body and b"\\" not in body:
        return []  # neither the key nor an escape that could spell it
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    return request_ids(parsed) if isinstance(parsed, dict) else []


def _walk(body: bytes) -> _Walk:
    n = len(body)
    budget = [_MAX_TOKENS]
    # Every string walked, as its opening and closing quotes (flat, in order), and where
    # in that list each key that names rid opens.
    spans: list[int] = []
    rid_keys: list[int] = []
    walked = n  # all strings before this are in spans
    at = yield (b'"', 0, n)
    while at >= 0:
        end = yield from _string_end(body, at, budget)
        if end == _UNTERMINATED:
            return []  # not JSON: refused by SGLang
        if end == _OUT_OF_STEPS:
            # Not walked to its end: the rest may not hold the key in any spelling, literal
            # or through a \u escape (the only escape that makes a letter).
            walked = at
            if (yield (RID_KEY, at, n)) >= 0 or (yield (b"\\u", at, n)) >= 0:
                return None
            break
        if _names_rid(body, at, end) and _is_key(body, end + 1):
            rid_keys.append(len(spans))
        spans += (at, end)
        budget[0] -= 1
        at = yield (b'"', end + 1, n)
    found = None
    budget[0] = _MAX_TOKENS
    for k in rid_keys:
        top = yield from _top_level(body, spans, k, walked, budget)
        if top is None:
            return None  # too many braces to count
        if top:
            if found is not None:
                return None  # a second one: SGLang's parser keeps the last; parse
            found = k
    if found is None:
        return []
    past = spans[found + 1] + 1
    m = _VALUE.match(body, past, min(n, past + _VALUE_WINDOW))
    if m is None:
        return None  # escapes, another type, or too long to read here
    return _values(m)


_UNTERMINATED: Final = -1
_OUT_OF_STEPS: Final = -2
# The longest key that can spell rid with escapes: three \uXXXX and its quotes.
_LONGEST_RID: Final = 3 * 6 + 2


def _string_end(body: bytes, start: int, budget: list[int]) -> Generator[scan.Search, int, int]:
    """Where the string opened by the quote at `start` closes: at the first quote after it
    that no escaping backslash precedes (_UNTERMINATED: none; _OUT_OF_STEPS: the walk's
    budget ran out)."""
    at = start
    while True:
        if budget[0] <= 0:
            return _OUT_OF_STEPS
        budget[0] -= 1
        at = yield (b'"', at + 1, len(body))
        if at < 0:
            return _UNTERMINATED
        k = at - 1
        while body[k] == _BACKSLASH:
            k -= 1
        if (at - 1 - k) % 2 == 0:
            return at


def _names_rid(body: bytes, start: int, end: int) -> bool:
    """The string between the quotes at `start` and `end` is `rid`, in any spelling."""
    if end - start == 4:
        return body.startswith(b"rid", start + 1)
    if end - start > _LONGEST_RID or body.find(b"\\", start + 1, end) < 0:
        return False
    try:
        return bool(orjson.loads(body[start : end + 1]) == "rid")
    except orjson.JSONDecodeError:
        return False


def _top_level(
    body: bytes, spans: list[int], k: int, walked: int, budget: list[int]
) -> Generator[scan.Search, int, bool | None]:
    """Whether the key whose quotes are spans[k], spans[k + 1] is one brace deep: the braces
    outside strings before it open one more than they close, or (when every string after it
    is known) those after it close one more than they open. Counted on the side with fewer
    strings between the gaps; None when the budget ran out."""
    before = k // 2
    after = (len(spans) - k) // 2 - 1
    if walked == len(body) and after < before:
        starts = [spans[k + 1] + 1, *(e + 1 for e in spans[k + 3 :: 2])]
        stops = [*spans[k + 2 :: 2], len(body)]
        want = -1
    else:
        starts = [0, *(e + 1 for e in spans[1:k:2])]
        stops = [*spans[0:k:2], spans[k]]
        want = 1
    balance = 0
    for lo, hi in zip(starts, stops, strict=True):
        for brace, step in ((b"{", 1), (b"}", -1)):
            at = lo
            while True:
                if budget[0] <= 0:
                    return None
                budget[0] -= 1
                at = yield (brace, at, hi)
                if at < 0:
                    break
                balance += step
                at += 1
    return balance == want


def _is_key(body: bytes, past: int) -> bool:
    """The string that ends before `past` is followed by a colon: it is a key."""
    m = _BLANKS.match(body, past)
    colon = m.end() if m is not None else past
    return colon < len(body) and body[colon] == _COLON


def _values(m: re.Match[bytes]) -> list[str] | None:
    """The ids a matched `rid` value holds: a string, null (none) or a list of strings."""
    one, _null, many = m.groups()
    try:
        if one is not None:
            return [one.decode()]
        if many is not None:
            return [item.decode() for item in _ITEM.findall(many)]
    except UnicodeDecodeError:
        return None  # not UTF-8: SGLang refuses the body
    return []
