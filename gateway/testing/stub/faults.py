"""Faults the stub plays on request: per request with ``X-Stub-*`` headers, per instance
with StubBackend's attributes (delays, scripted statuses, drops before the headers or in the
middle of the body, padded bodies of a given size)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

from gateway.testing.stub.rules import Item

PAD_CHUNK = 64 * 1024

PAD_RESERVE = 4096

MID_BODY_EVENTS = 2

PAD_SENTINEL = "\x00stub-padding\x00"

_PAD_ROW = b"[" + b",".join(str(i).encode() for i in range(16)) + b"]"


@dataclass(slots=True)
class Ctx:
    index: int
    sha256: str
    started: float
    drop: str | None = None
    chunk_delay_s: float = 0.0
    dropped: bool = False
    run: Run | None = None  # set on generation requests
    items: list[Item] | None = None  # a /generate request's items, once read
    done: list[int] | None = None  # the tokens a /generate stream has sent, per item


@dataclass(eq=False, slots=True)
class Run:
    """A generation in flight, as abort_request and pause_generation find it."""

    rids: tuple[str, ...]  # in batch order
    batch: bool
    size: int = 1  # items in the batch
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    abort_message: str = "Abort request"


CTX = web.RequestKey("stub_ctx", Ctx)


def header_int(request: web.Request, name: str) -> int | None:
    value = request.headers.get(name)
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def padded_rows(budget: int, size: int) -> tuple[int, Iterator[bytes]]:
    """JSON array contents: as many rows of ids as fit in `budget`, then blanks up to `size`."""
    unit = b"," + _PAD_ROW
    rows = max(0, budget // len(unit))
    filled = max(0, rows * len(unit) - 1)  # the first row has no comma
    blanks = max(0, size - filled)

    def chunks() -> Iterator[bytes]:
        # One reused block of rows: a 64 MB body never exists in memory at once.
        per_block = PAD_CHUNK // len(unit)
        full, rest = divmod(max(0, rows - 1), per_block)
        if rows:
            yield _PAD_ROW
        block = unit * per_block
        for _ in range(full):
            yield block
        yield unit * rest + b" " * blanks

    return filled + blanks, chunks()
