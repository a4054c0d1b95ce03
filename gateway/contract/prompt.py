"""Where a generation request's prompt starts in its body, for prefix-aware routing.

Found in the bytes the gateway already holds, without a parse: cache_aware matches the
prompt's bytes from there on (gateway/fleet/cache_aware.py). Equal prefixes of those bytes
are equal prefixes of the prompt, and what follows the prompt in the body (other fields)
costs only the last block or two of a match. A key written with escapes, or placed past the
first `SEARCH_BYTES` of the body, is not found: the request is then routed by load alone,
which is what a wrong guess would cost anyway (the body is forwarded as it came).
"""

from __future__ import annotations

from typing import Final

from gateway.contract.routes import Kind

# Bytes of the body searched for the prompt's key: a few microseconds at most, and past any
# plausible set of fields before it (tools, sampling parameters).
SEARCH_BYTES: Final = 64 << 10

# Per route kind, the top-level keys that hold the prompt, in SGLang's order of preference.
_KEYS: Final[dict[Kind, tuple[bytes, ...]]] = {
    Kind.GENERATE: (b'"text"', b'"input_ids"'),
    Kind.CHAT: (b'"messages"',),
    Kind.COMPLETIONS: (b'"prompt"',),
    Kind.RESPONSES: (b'"input"',),
    Kind.VERTEX: (b'"instances"',),
}
_BLANKS: Final = b" \t\r\n"
_COLON: Final = ord(":")


def prompt_start(kind: Kind, body: bytes) -> int | None:
    """The offset of the prompt's value in `body`, or None where it was not found."""
    keys = _KEYS.get(kind)
    if keys is None:
        return None
    end = min(len(body), SEARCH_BYTES)
    for key in keys:
        at = body.find(key, 0, end)
        while at >= 0:
            # A key is followed by a colon; the same word as a string value is not.
            i = at + len(key)
            while i < end and body[i] in _BLANKS:
                i += 1
            if i < end and body[i] == _COLON:
                i += 1
                while i < end and body[i] in _BLANKS:
                    i += 1
                return i
            at = body.find(key, at + 1, end)
    return None
