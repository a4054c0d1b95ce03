"""What the gateway may say about an exception in a log line: its type and where it was
raised, never its message.

Exception messages on the request path quote their input: aiohttp's parser errors repeat the
header line or the bytes that broke the parse (an Authorization value, a prompt), a KeyError
names a key from a body. A log line may carry neither header values nor body bytes, so
tracebacks are written as frames and type names only.
"""

from __future__ import annotations

import logging
import traceback
from typing import Final

# aiohttp's own loggers: its server logs parse errors with the offending bytes attached.
AIOHTTP_LOGGERS: Final = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
)


def describe(exc: BaseException) -> str:
    """`Type` for each exception in the chain, innermost last, each with its frames."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)
        where = "; ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-8:])
        parts.append(f"{type(current).__qualname__}" + (f" (at {where})" if where else ""))
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


class RedactExceptions(logging.Filter):
    """Replace a record's attached exception with its description (types and frames)."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = record.exc_info
        if info and info[1] is not None:
            record.msg = f"{record.getMessage()} [{describe(info[1])}]"
            record.args = None
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


_installed = False


def install() -> None:
    """Attach the filter to aiohttp's loggers (a filter on a logger sees only its own
    records, so each one is named); idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    redact = RedactExceptions()
    for name in AIOHTTP_LOGGERS:
        logging.getLogger(name).addFilter(redact)
