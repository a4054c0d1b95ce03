"""HTTP/1.1 facts both of the request path's protocols hold to: the client side
(gateway/edge/server.py) and the backend side (gateway/edge/relay.py).

One place for the limits a head is read under, the reason phrases, the Date header's
value and the one transfer coding the gateway implements, so the two sides cannot drift.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final

CRLF: Final = b"\r\n"
# Header fields per message: as many as aiohttp's server allows; real clients send 5-20.
MAX_HEADERS: Final = 128
# The whole head may be this many times the field limit (limits.max_header_bytes: 128 KiB
# at the default): the fields' own caps allow more, but the bytes of an unfinished head are
# held in memory.
HEAD_FACTOR: Final = 8
# Interim (1xx) responses accepted before the final one. RFC 9110 sets no limit, but every
# real server sends at most a few (100 Continue, 103 Early Hints); each one costs a parse,
# so a backend that streams them without end would stall the loop.
MAX_INTERIM_RESPONSES: Final = 16
# Statuses whose responses never have a body (RFC 9110 s.6.4.1).
NO_BODY_STATUS: Final = frozenset({204, 304})

_PHRASES: Final = {s.value: s.phrase for s in HTTPStatus}


def phrase(status: int) -> str:
    return _PHRASES.get(status, "Unknown")


def only_chunked(values: Iterable[str]) -> bool:
    """Whether Transfer-Encoding field values (every line of it) say exactly `chunked`:
    the one coding the gateway implements (RFC 9112 s.6.1). Empty list elements count for
    nothing (RFC 9110 s.5.6.1)."""
    codings = ",".join(values).lower().split(",")
    return [c for c in map(str.strip, codings) if c] == ["chunked"]


class _Date:
    """The Date header's value, formatted once a second rather than per reply."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = ""

    def now(self) -> str:
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._value = formatdate(second, usegmt=True)
        return self._value


date: Final = _Date()
