"""Whether a body may name a key the gateway must read, proved without parsing it.

With policy.skip_parse_without_mask_key a body is forwarded unparsed when it provably holds
no key the gateway acts on: `return_sampling_mask` (the policy), and where adapters route
requests `lora_path` and, on the OpenAI routes, a `model` written `base:adapter`
(gateway/contract/adapters.py). All of them are asked in one walk over the body: a body
searched once per key costs a pass of the two-way substring search per key (627 KB of
token ids: about 220 us each, most of the skip path's CPU).

JSON spells a key either literally or with escapes; every key here is lowercase letters and
underscores, which no escape but `\\uXXXX` can produce. So a body holding neither a literal
key nor any `\\u` escape cannot name it, in any spelling, at any depth.

Escapes are walked from one backslash to the next: in JSON text a backslash only occurs
inside a string, where it opens an escape of one character (or `u` and four hex digits,
never a backslash), so stepping two bytes past each one keeps the walk aligned and an
escaped backslash followed by `u` is not taken for an escape. A body that is not JSON may
be misjudged, but SGLang refuses such a body itself. (A scan for the two-byte `\\u` would be
simpler, but CPython searches a two-byte needle far slower than it finds one byte with
memchr.)

Keys are then looked for after each quote (memchr finds a quote at about 45 GB/s, CPython
searches a 20-byte key at about 1.8): a quote followed by the key, a closing quote and (after
blanks) a colon. Every quote is tried, opening, closing or escaped, so no string boundary is
trusted. A body with many strings goes over to a search of the rest for each key after
_MAX_QUOTES_WALKED quotes, and a small one is searched at once (a walk's fixed cost is above
the search's).

The walk is written once, as a generator that asks for each search (a needle from a
position) and is told where it matched, so the synchronous reading and the sliced one of
multi-MB bodies (gateway/contract/scan.py) follow the same steps.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Final

from gateway.contract import scan
from gateway.contract.adapters import LORA_KEY
from gateway.contract.routes import Kind

MASK_KEY: Final = b"return_sampling_mask"
MODEL_KEY: Final = b"model"
_QUOTE: Final = b'"'
_BACKSLASH: Final = b"\\"
_U: Final = ord("u")
_COLON: Final = ord(":")
# Past this many escapes a full read at C speed is cheaper than walking them one by one.
_MAX_ESCAPES_WALKED: Final = 64
_MAX_QUOTES_WALKED: Final = 32
_QUOTE_WALK_FROM: Final = 4096
_BLANKS_BEFORE_COLON: Final = 64
# A `model` value without a colon or an escape names no adapter; one longer than this is
# read rather than matched here.
_MODEL_VALUE: Final = re.compile(rb'[ \t\r\n]*"[^":\\]*"')
_MODEL_WINDOW: Final = 512
# `"model"` strings judged in the rest of a body past the walk (a prompt may say it).
_MAX_MODEL_SEEN: Final = 8
_MODEL_QUOTED: Final = MODEL_KEY + _QUOTE  # as the walk matches it, past a quote
_MODEL_STRING: Final = _QUOTE + _MODEL_QUOTED  # as the search past the walk looks for it


class Keys:
    """The keys a body must provably not name to be forwarded unparsed.

    `names`: keys whose mere presence needs a parse; `model`: a `model` key counts only
    when its value may name an adapter (is not a plain string without a colon)."""

    __slots__ = ("model", "names", "quoted")

    def __init__(self, names: tuple[bytes, ...], *, model: bool = False) -> None:
        self.names: Final = names
        self.quoted: Final = tuple(name + _QUOTE for name in names)  # as the walk matches them
        self.model: Final = model


MASK: Final = Keys((MASK_KEY,))
_WITH_ADAPTERS: Final = Keys((MASK_KEY, LORA_KEY))
_WITH_MODEL_ADAPTERS: Final = Keys((MASK_KEY, LORA_KEY), model=True)


def keys_for(kind: Kind, adapters: bool) -> Keys:
    """What a body of `kind` must not name to skip its parse; `adapters`: the request's
    LoRA adapters are wanted (they route it)."""
    if not adapters:
        return MASK
    return _WITH_MODEL_ADAPTERS if kind is Kind.CHAT or kind is Kind.COMPLETIONS else _WITH_ADAPTERS


_Walk = Generator[scan.Search, int, bool]


def may_name(body: bytes, keys: Keys = MASK) -> bool:
    """False only when the body provably names none of `keys`."""
    return scan.run_walk(_walk(body, keys), body)


async def may_name_sliced(body: bytes, keys: Keys = MASK) -> bool:
    """may_name, its searches a slice at a time: over a 64 MiB body the search for one key
    alone held the loop for 25 ms."""
    return await scan.run_walk_sliced(_walk(body, keys), body)


def _walk(body: bytes, keys: Keys) -> _Walk:
    n = len(body)
    # Escapes first: a body rich in them is read anyway, without also searching for keys.
    at = yield (_BACKSLASH, 0, n)
    for _ in range(_MAX_ESCAPES_WALKED):
        if at < 0:
            break
        if at + 1 < n and body[at + 1] == _U:
            return True
        at = yield (_BACKSLASH, at + 2, n)
    else:
        if at >= 0:
            return True  # still more escapes: read it rather than walk on
    if n < _QUOTE_WALK_FROM:
        for name in keys.names:
            if (yield (name, 0, n)) >= 0:
                return True
        return keys.model and (yield from _models(body, 0))
    quoted = keys.quoted
    at = yield (_QUOTE, 0, n)
    for _ in range(_MAX_QUOTES_WALKED):
        if at < 0:
            return False
        past = at + 1
        for key in quoted:
            if body.startswith(key, past) and _colon_follows(body, past + len(key)) >= 0:
                return True
        if keys.model and _names_adapter(body, past):
            return True
        at = yield (_QUOTE, past, n)
    if at < 0:
        return False
    for key in quoted:
        if (yield (key, at, n)) >= 0:
            return True
    return keys.model and (yield from _models(body, at))


def _models(body: bytes, start: int) -> Generator[scan.Search, int, bool]:
    """Whether a `model` key from `start` on may name an adapter; one that says `model` too
    often is read rather than judged."""
    at = start
    for _ in range(_MAX_MODEL_SEEN):
        at = yield (_MODEL_STRING, at, len(body))
        if at < 0:
            return False
        if _names_adapter(body, at + 1):
            return True
        at += len(_MODEL_STRING)
    return True


def _names_adapter(body: bytes, past: int) -> bool:
    """The quote before `past` opens a `model` key whose value may name an adapter."""
    if not body.startswith(_MODEL_QUOTED, past):
        return False
    colon = _colon_follows(body, past + len(_MODEL_QUOTED))
    if colon < 0:
        return False  # a value, not a key
    end = min(len(body), colon + 1 + _MODEL_WINDOW)
    return _MODEL_VALUE.match(body, colon + 1, end) is None


def _colon_follows(body: bytes, past: int) -> int:
    """Where the colon is that comes next after blanks (the string that ended before `past`
    is a key), or -1 where something else does."""
    m = scan.BLANKS.match(body, past, past + _BLANKS_BEFORE_COLON)
    colon = past if m is None else m.end()
    if colon == past + _BLANKS_BEFORE_COLON:
        return colon  # a long run of blanks: count it as a key rather than walk them here
    return colon if colon < len(body) and body[colon] == _COLON else -1
