"""Scans of multi-MB bodies a slice at a time, pausing for the event loop between slices.

One call of bytes.find, bytes.count or a regex over a 64 MiB body holds the loop for 6 to
150 ms, and every connection of the process waits behind it; with two such bodies in
flight their steps queue up behind each other (docs/hardening.md, "Loop stall with large
bodies"). Each function here returns exactly what the one call it stands for returns:
- the needles of `find` and `count` are single bytes, the patterns of `search` match
  exactly one byte each (a character class, no anchors or lookarounds) and those of
  `run_end` a repeated one, so no match can straddle two slices;
- `contains` overlaps its slices by the needle's length less one byte;
- `rstrip_end` strips a copy of one slice at a time, from the end.

Slices are sized so that each costs about a millisecond on the 2-core development VM,
the slowest machine the gateway is measured on, with two large bodies scanned at once; a
pause is one turn of the loop (it polls for I/O once), about 20 us under uvloop.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Generator
from typing import Final, TypeVar

# memchr: 11 GB/s over a body in the cache, 3 GB/s or less over two 64 MiB bodies at
# once on a busy machine (a search over 16 MiB then took 5 ms).
FIND_SLICE: Final = 2 << 20
# Counting a byte that is dense in the body (commas in token ids): about 1.6 GB/s.
COUNT_SLICE: Final = 2 << 20
# A one-byte regex class, or a greedy run of one: about 0.4 GB/s (0.15 GB/s with two
# bodies at once on a busy machine).
CLASS_SLICE: Final = 256 << 10
# A multi-byte needle (two-way search): about 2.8 GB/s.
SUBSTRING_SLICE: Final = 4 << 20
# Slices copied to be stripped, or to become part of a new body (memcpy, with the GIL).
COPY_SLICE: Final = 256 << 10
# Joins from this size are done in a thread: CPython copies the parts of a bytes join
# without holding the GIL from 1 MiB up (stringlib/join.h), so the loop runs on meanwhile.
# Below it the join is cheaper than the hand-off (8 MiB: about 1 ms from glibc's heap; a
# 64 MiB block is a fresh mapping, page-faulted in during the copy: 47 ms).
JOIN_IN_THREAD: Final = 8 << 20
# Bytes looked at one by one before a strip goes over to copied slices.
_STEPPED: Final = 64

# JSON's blanks, for run_end.
BLANKS: Final = re.compile(rb"[ \t\r\n]*")


_T = TypeVar("_T")
# A search a walk over a body asks for: (needle, start, end); it is told where the needle
# first starts in body[start:end], or -1. A needle of more than one byte is only ever
# searched to the end. Walks written this way (gateway/contract/keyscan.py, rids.py) run
# whole (run_walk) or a slice at a time (run_walk_sliced) with the same steps.
Search = tuple[bytes, int, int]


def run_walk(walk: Generator[Search, int, _T], body: bytes) -> _T:
    """The walk's answer, each search made at once."""
    try:
        needle, start, end = next(walk)
        while True:
            needle, start, end = walk.send(body.find(needle, start, end))
    except StopIteration as done:
        answer: _T = done.value
        return answer


async def run_walk_sliced(walk: Generator[Search, int, _T], body: bytes) -> _T:
    """run_walk, each search a slice at a time."""
    try:
        needle, start, end = next(walk)
        while True:
            if len(needle) == 1:
                at = await find(body, needle, start, end)
            else:
                at = await find_substring(body, needle, start)
            needle, start, end = walk.send(at)
    except StopIteration as done:
        answer: _T = done.value
        return answer


async def pause() -> None:
    """One turn of the event loop: ready callbacks run and I/O is polled before this
    coroutine goes on."""
    await asyncio.sleep(0)


async def find(body: bytes, byte: bytes, start: int, end: int | None = None) -> int:
    """body.find(byte, start, end) for a one-byte `byte`."""
    stop = len(body) if end is None else min(end, len(body))
    at = start
    while True:
        upto = min(at + FIND_SLICE, stop)
        where = body.find(byte, at, upto)
        if where >= 0 or upto >= stop:
            return where
        at = upto
        await pause()


async def search(
    pattern: re.Pattern[bytes], body: bytes, start: int, end: int | None = None
) -> int:
    """Where `pattern`, which matches exactly one byte, first matches in body[start:end];
    -1 where it does not."""
    stop = len(body) if end is None else min(end, len(body))
    at = start
    while True:
        upto = min(at + CLASS_SLICE, stop)
        m = pattern.search(body, at, upto)
        if m is not None:
            return m.start()
        if upto >= stop:
            return -1
        at = upto
        await pause()


async def run_end(
    pattern: re.Pattern[bytes], body: bytes, start: int, end: int | None = None
) -> int:
    """The end of the run of bytes from `start` on that `pattern`, one byte class repeated
    (`[...]*`), matches: the first byte it does not match, or the end. A greedy match of
    a class runs at twice the speed of a search for its complement."""
    stop = len(body) if end is None else min(end, len(body))
    at = start
    while at < stop:
        upto = min(at + CLASS_SLICE, stop)
        m = pattern.match(body, at, upto)
        assert m is not None  # a repetition matches, if only the empty string
        if m.end() < upto:
            return m.end()
        at = upto
        if at < stop:
            await pause()
    return max(at, start)


async def count(body: bytes, byte: bytes, start: int = 0, end: int | None = None) -> int:
    """body.count(byte, start, end) for a one-byte `byte`."""
    stop = len(body) if end is None else min(end, len(body))
    total = 0
    at = start
    while at < stop:
        upto = min(at + COUNT_SLICE, stop)
        total += body.count(byte, at, upto)
        at = upto
        if at < stop:
            await pause()
    return total


async def contains(body: bytes, needle: bytes, start: int = 0) -> bool:
    """`needle in body[start:]`."""
    return await find_substring(body, needle, start) >= 0


async def find_substring(body: bytes, needle: bytes, start: int = 0) -> int:
    """body.find(needle, start) for a needle of any length."""
    step = max(SUBSTRING_SLICE, 2 * len(needle))
    at = start
    while True:
        upto = min(at + step, len(body))
        where = body.find(needle, at, upto)
        if where >= 0:
            return where
        if upto >= len(body):
            return -1
        at = upto - len(needle) + 1  # a needle that starts in this slice may end in the next
        await pause()


async def rstrip_end(body: bytes, start: int, end: int, chars: bytes) -> int:
    """The index just past the last byte of body[start:end] that is not one of `chars`,
    or `start` when all are: len(body[start:end].rstrip(chars)) + start, without copying
    the whole range."""
    # Usually a few bytes are stripped: step over them before copying anything.
    stepped = max(start, end - _STEPPED)
    while end > stepped and body[end - 1] in chars:
        end -= 1
    while end > start and body[end - 1] in chars:
        lo = max(start, end - COPY_SLICE)
        kept = len(body[lo:end].rstrip(chars))
        if kept:
            return lo + kept
        end = lo
        await pause()
    return end


async def copy(out: list[bytes], body: bytes, start: int, end: int) -> None:
    """Append body[start:end] to `out`, in pieces of at most COPY_SLICE bytes."""
    at = start
    while end - at > COPY_SLICE:
        out.append(body[at : at + COPY_SLICE])
        at += COPY_SLICE
        await pause()
    if end > at:
        out.append(body[at:end])


async def join(pieces: list[bytes]) -> bytes:
    """b"".join(pieces); in a thread when the result is large (see JOIN_IN_THREAD)."""
    if len(pieces) == 1:
        return pieces[0]
    if sum(len(piece) for piece in pieces) < JOIN_IN_THREAD:
        return b"".join(pieces)
    # A tuple: the thread copies from exactly these parts, whatever becomes of the list.
    parts = tuple(pieces)
    return await asyncio.get_running_loop().run_in_executor(None, b"".join, parts)
