"""SGLang's request ids (`rid`) of a body that is forwarded without being parsed.

With policy.skip_parse_without_mask_key a body that provably holds no mask key goes out
unparsed, yet an abort of one rid must still reach the engine serving it alone, so the
gateway needs that body's top-level `rid`. It is found here by a walk over the body's
structure alone: from one quote or brace to the next, each found with memchr, skipping
string contents whole. A 100k-token `input_ids` array holds none of them, so it costs
three memchr passes over the body, not a parse.

What it cannot prove cheaply it leaves to a parse (None): a top-level key spelled with an
escape (`"r\\u0069d"` is `rid` to SGLang), a `rid` value with escapes or of another type
than a string, null or a list of strings, a second top-level `rid` (SGLang's parser keeps
the last), more than _MAX_TOKENS structural tokens before the body's last `"rid"` bytes.
A `"rid"` string anywhere else (a prompt that says it, a nested key, a value) is walked
past as what it is. The walk assumes the body is JSON; one that is not is refused by
SGLang itself, so a rid read from it is never served and its owner is forgotten when
that request ends.

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
_QUOTE: Final = 0x22
_BACKSLASH: Final = 0x5C
_COLON: Final = 0x3A
_OPEN: Final = 0x7B
# Strings and objects: a key of an object one brace deep is a key of the top-level object,
# whatever arrays it sits in, unless the top level is an array, which SGLang refuses.
# Brackets need not be walked, so an integer array costs three memchr passes, not five.
_STRUCTURAL: Final = (b'"', b"{", b"}")
_SLOT: Final = {byte[0]: k for k, byte in enumerate(_STRUCTURAL)}
# Tokens walked before the rest of the body is only searched for the key: an RL body
# (input_ids, sampling_params, a few flags) is about a dozen; a chat body with a long
# message list is not walked to its end.
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

# A search the walk asks for: (needle, from where); it is told where the needle starts, or -1.
_Search = tuple[bytes, int]
_Walk = Generator[_Search, int, list[str] | None]


def top_level_rids(body: bytes) -> list[str] | None:
    """The rids of the body's top-level `rid` ([] when it has none), or None when they
    cannot be read without a parse."""
    if len(body) < _WALK_FROM:
        return _parsed(body)
    walk = _walk(body)
    try:
        needle, start = next(walk)
        while True:
            needle, start = walk.send(body.find(needle, start))
    except StopIteration as done:
        rids: list[str] | None = done.value
        return rids


async def top_level_rids_sliced(body: bytes) -> list[str] | None:
    """top_level_rids, its searches a slice at a time (a multi-MB body)."""
    if len(body) < _WALK_FROM:
        return _parsed(body)
    walk = _walk(body)
    try:
        needle, start = next(walk)
        while True:
            if len(needle) == 1:
                at = await scan.find(body, needle, start)
            else:
                at = start if await scan.contains(body, needle, start) else -1
            needle, start = walk.send(at)
    except StopIteration as done:
        rids: list[str] | None = done.value
        return rids


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
    # Where each structural byte next occurs at or after the walk (n: nowhere).
    nxt = [n] * len(_STRUCTURAL)
    for k, byte in enumerate(_STRUCTURAL):
        at = yield (byte, 0)
        nxt[k] = at if at >= 0 else n
    depth = 0
    rids: list[str] | None = None  # None: no top-level rid met yet
    budget = [_MAX_TOKENS]  # searches left, shared with _string_end
    while budget[0] > 0:
        budget[0] -= 1
        i = min(nxt)
        if i >= n:
            return rids or []
        c = body[i]
        if c != _QUOTE:
            depth += 1 if c == _OPEN else -1
            k = _SLOT[c]
            at = yield (_STRUCTURAL[k], i + 1)
            nxt[k] = at if at >= 0 else n
            continue
        end = yield from _string_end(body, i, budget)
        if end == _UNTERMINATED:
            return rids or []  # not JSON: refused by SGLang
        if end == _OUT_OF_STEPS:
            break  # the search for the key below starts at this string
        past = end + 1
        if depth == 1 and _is_key(body, past):
            # A key of the top-level object.
            if end - i == 4 and body.startswith(b"rid", i + 1):
                if rids is not None:
                    return None  # a second one: SGLang's parser keeps the last; parse
                m = _VALUE.match(body, past, min(n, past + _VALUE_WINDOW))
                if m is None:
                    return None  # escapes, another type, or too long to read here
                rids = _values(m)
                if rids is None:
                    return None
                past = m.end()
            elif body.find(b"\\", i + 1, end) >= 0:
                return None  # an escaped key may spell rid
        for k, byte in enumerate(_STRUCTURAL):
            if nxt[k] < past:
                at = yield (byte, past)
                nxt[k] = at if at >= 0 else n
    # Too many tokens to walk: the rest of the body is only searched for the key.
    at = yield (RID_KEY, min(nxt))
    return None if at >= 0 else rids or []


_UNTERMINATED: Final = -1
_OUT_OF_STEPS: Final = -2


def _string_end(body: bytes, start: int, budget: list[int]) -> Generator[_Search, int, int]:
    """Where the string opened by the quote at `start` closes: at the first quote after it
    that no escaping backslash precedes (_UNTERMINATED: none; _OUT_OF_STEPS: the walk's
    budget ran out on its escaped quotes)."""
    at = start
    while True:
        if budget[0] <= 0:
            return _OUT_OF_STEPS
        budget[0] -= 1
        at = yield (b'"', at + 1)
        if at < 0:
            return _UNTERMINATED
        k = at - 1
        while body[k] == _BACKSLASH:
            k -= 1
        if (at - 1 - k) % 2 == 0:
            return at


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
