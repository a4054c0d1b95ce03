"""Large integer arrays in shape-only fields: validated and counted, never parsed.

A JSON parser's memory grows with the number of values, not the number of bytes: simdjson
allocates about 14 bytes per byte of a dense `[1,1,1,...]`, so one 64 MiB `input_ids` took
the gateway from 54 MiB to a 950 MiB peak and held the event loop for 2 s. The policy reads
such fields only for their shape (`SHAPE_ONLY`: length and first element), so this module
finds the long runs of integers inside them, checks each run against JSON's grammar with
byte operations (no object per element), and hands the parser a reduced body in which each
run is replaced by `0`. Every scan goes over a bounded slice at a time and pauses for the
event loop between slices (gateway/contract/scan.py): the skim of a 64 MiB body costs
about half a second, and no step of it more than a few milliseconds.

Why the reduced body is read exactly as orjson reads the original:
- a run is a comma-separated list of numbers, preceded (after blanks) by `[` or `,` and
  followed by `]` or `,`. In JSON only an array holds a value after `[` or `,`, and in an
  array a list of values and a single value are interchangeable, so replacing the list by
  one number keeps a valid document valid and an invalid one invalid;
- every number in a run matches orjson's integer grammar with at most 19 digits, 18 when
  negative (orjson reads any such number as an integer; from -2**63 - 1 down it reads a
  float); a run that does not is left in place for the parser to judge;
- the replacement `0` is an integer like every element it stands for, and runs are only
  taken inside top-level shape-only fields that hold no string, so the policy sees the
  same nesting and the same element types; the lengths the runs change are put back
  (`Skimmed.extra_elements`).
Anything the scanner cannot vouch for (a key that appears twice, strings inside the field,
a structure too deep to walk cheaply) leaves the body unskimmed: the parser then reads it
whole, bounded by the inspection budget instead (gateway/edge/budget.py).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import orjson

from gateway.contract import scan

# Bodies below this size are parsed whole: a parser's tape for them is small.
SKIM_MIN_BODY: Final = 1 << 20
# Shorter runs are not worth replacing (each costs a copy of the bytes around it).
_RUN_MIN: Final = 4096
# Bytes of a run validated between two yields to the event loop.
_SLICE: Final = 256 << 10
# Structural steps the scanner takes over one body before it gives up, and between two
# pauses (a step costs a few microseconds).
_MAX_STEPS: Final = 100_000
_STEPS_PER_PAUSE: Final = 256
# Escapes walked inside one string between two pauses.
_ESCAPES_PER_PAUSE: Final = 2048

_BLANKS: Final = b" \t\r\n"
# A maximal stretch of integer-list bytes. Any length, then the short ones are dropped in
# Python: a `{4096,}` repetition would be retried at every start inside each shorter
# stretch, quadratic in its length (a batch of 4 KB sequences held the loop for seconds).
_RUN: Final = re.compile(rb"-?[0-9][0-9,\- \t\r\n]*")
# The bytes of a stretch after its first digit, and those of them that are not digits.
_RUN_BODY: Final = re.compile(rb"[0-9,\- \t\r\n]*")
_RUN_NON_DIGITS: Final = b",- \t\r\n"
# Bytes of a field searched for stretches in one go: 1.5 ms where none starts (blanks or
# brackets: the search tries every byte, at 40 MB/s); a stretch cut short by the window
# goes on a class slice at a time (a greedy match, at 400 MB/s).
_RUN_WINDOW: Final = 64 << 10
# Stretches examined in one field between two yields, and at most in all (a float array has
# one stretch per number: such a field is left to the parser).
_STRETCHES_PER_YIELD: Final = 2048
_MAX_SHORT_STRETCHES: Final = 100_000
_STRUCTURAL_BYTES: Final = (b"[", b"]", b"{", b"}", b'"')
_SCALAR_END: Final = re.compile(rb"[,}\] \t\r\n]")
_ALL_BLANKS_TO_SPACE: Final = bytes.maketrans(b"\t\r\n", b"   ")
# zero -> z, other digits -> d; then z -> d.
_ZERO_DIGIT: Final = bytes.maketrans(b"0123456789", b"zddddddddd")
_ANY_DIGIT: Final = bytes.maketrans(b"z", b"d")
_TWENTY_DIGITS: Final = b"d" * 20
_NEGATIVE_19: Final = b"-" + b"d" * 19
# The longest last element of a list `_valid_slice` can accept: 8 blanks its squeeze
# takes out after the comma before it, a sign and 19 digits (trailing blanks are stripped).
_LONGEST_LAST_ELEMENT: Final = 8 + 20


@dataclass
class Skimmed:
    """The reduced body and what the runs it replaced would have told the policy."""

    body: bytes
    # Top-level field -> elements its array has beyond what the reduced body shows (runs
    # directly inside it, each replaced by one element).
    extra_elements: dict[str, int] = field(default_factory=dict)
    runs: int = 0
    skimmed_bytes: int = 0
    # (offset in the reduced body, bytes the original had there beyond the one `0`), in
    # order: to report a parse error at its place in the original body.
    shifts: list[tuple[int, int]] = field(default_factory=list)

    def original_offset(self, reduced: int) -> int:
        offset = reduced
        for at, extra in self.shifts:
            if at >= reduced:
                break
            offset += extra
        return offset


class _GiveUp(Exception):
    pass


async def _skip_blanks(body: bytes, pos: int) -> int:
    """The index of the first byte from `pos` on that is not a blank, or len(body)."""
    if pos >= len(body) or body[pos] not in _BLANKS:
        return pos
    return await scan.run_end(scan.BLANKS, body, pos)


class _Scanner:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.steps = 0
        # Per structural byte: (where the last search for it started, what it found). The
        # scan only moves forward, so one result answers every search from a place between
        # the two: each byte is searched for over the body about once, where a search per
        # member went to the end of the body for every one (quadratic in members).
        self._next: dict[bytes, tuple[int, int]] = {}
        self.times: Counter[str] = Counter()  # members per top-level key

    def step(self) -> bool:
        """Count a step; True when it is time to pause."""
        self.steps += 1
        if self.steps > _MAX_STEPS:
            raise _GiveUp
        return self.steps % _STEPS_PER_PAUSE == 0

    def _near(self, needle: bytes, at: int) -> int | None:
        """self.body.find(needle, at) when the last result or one slice answers it (no
        coroutine: the walk of a structure asks this at every step), else None."""
        last = self._next.get(needle)
        if last is not None and last[0] <= at and (last[1] < 0 or last[1] >= at):
            return last[1]
        body = self.body
        upto = at + scan.FIND_SLICE
        where = body.find(needle, at, upto)
        if where < 0 and upto < len(body):
            return None
        self._next[needle] = (at, where)
        return where

    async def find(self, needle: bytes, at: int) -> int:
        """self.body.find(needle, at)."""
        where = self._near(needle, at)
        if where is None:
            where = await scan.find(self.body, needle, at + scan.FIND_SLICE)
            self._next[needle] = (at, where)
        return where

    async def string_end(self, pos: int) -> int:
        """Index just past the string that opens at `pos` (a quote)."""
        # memchr for the next quote and the next backslash: a regex search for either byte
        # runs at a hundredth of that speed.
        at = pos + 1
        escapes = 0
        while True:
            quote = await self.find(b'"', at)
            if quote < 0:
                raise _GiveUp
            backslash = await self.find(b"\\", at)
            if backslash < 0 or quote < backslash:
                return quote + 1
            at = backslash + 2  # an escape: one character, or `u` and four hex digits
            escapes += 1
            if escapes % _ESCAPES_PER_PAUSE == 0:
                await scan.pause()

    async def value_end(self, pos: int) -> int:
        body = self.body
        if pos >= len(body):
            raise _GiveUp
        first = body[pos]
        if first == 0x22:
            return await self.string_end(pos)
        if first not in b"[{":
            end = await scan.search(_SCALAR_END, body, pos)
            return end if end >= 0 else len(body)
        # The next place of each structural byte, each found with memchr and searched
        # again only once passed: a regex class search runs at a tenth of that speed.
        ahead = {char: await self.find(char, pos) for char in _STRUCTURAL_BYTES}
        depth = 0
        at = pos
        while True:
            if self.step():
                await scan.pause()
            for needle, where in ahead.items():
                if 0 <= where < at:
                    near = self._near(needle, at)
                    ahead[needle] = await self.find(needle, at) if near is None else near
            found = [where for where in ahead.values() if where >= 0]
            if not found:
                raise _GiveUp
            where = min(found)
            char = body[where]
            if char == 0x22:  # '"'
                at = await self.string_end(where)
                continue
            at = where + 1
            depth += 1 if char in b"[{" else -1
            if depth == 0:
                return at

    async def top_level(self) -> list[tuple[str, int, int]]:
        """(key, value start, value end) of each top-level member, in order."""
        body = self.body
        pos = await _skip_blanks(body, 0)
        if body[pos : pos + 1] != b"{":
            raise _GiveUp
        pos = await _skip_blanks(body, pos + 1)
        members: list[tuple[str, int, int]] = []
        if body[pos : pos + 1] == b"}":
            return members
        while True:
            if self.step():
                await scan.pause()
            if body[pos : pos + 1] != b'"':
                raise _GiveUp
            key_end = await self.string_end(pos)
            try:
                key = orjson.loads(body[pos:key_end])
            except orjson.JSONDecodeError:
                raise _GiveUp from None
            pos = await _skip_blanks(body, key_end)
            if body[pos : pos + 1] != b":":
                raise _GiveUp
            start = await _skip_blanks(body, pos + 1)
            end = await self.value_end(start)
            members.append((key, start, end))
            self.times[key] += 1
            pos = await _skip_blanks(body, end)
            sep = body[pos : pos + 1]
            if sep == b"}":
                return members
            if sep != b",":
                raise _GiveUp
            pos = await _skip_blanks(body, pos + 1)


def _stretches(body: bytes, start: int, end: int) -> Iterator[tuple[int, int] | None]:
    """The spans of `_RUN.finditer(body, start, end)`, in order, and None wherever the
    caller should pause: one finditer over a 64 MiB run held the loop for 150 ms.

    The search goes over one window at a time. A stretch that ends before the window does
    is the one the whole search finds (the class stopped at a byte inside the window); one
    cut short by the window's end runs on to the first byte outside the class, found a
    slice at a time. Every start the window's search turned down it turned down for good,
    except a `-` in its last byte, which may open a stretch with the next window's first
    digit: the next window starts at that `-`.
    """
    at = start
    while at < end:
        stop = min(at + _RUN_WINDOW, end)
        for m in _RUN.finditer(body, at, stop):
            if m.end() < stop or stop == end:
                yield m.span()
                continue
            tail = stop
            while True:
                upto = min(tail + scan.CLASS_SLICE, end)
                run = _RUN_BODY.match(body, tail, upto)
                assert run is not None  # a repetition: it matches, if only the empty string
                tail = run.end()
                if tail < upto or tail >= end:
                    break
                yield None
            yield m.start(), tail
            at = tail
            break
        else:
            at = stop - 1 if stop < end and body[stop - 1] == 0x2D else stop  # '-'
        yield None


async def _core(body: bytes, start: int, end: int) -> tuple[int, int] | None:
    """The run trimmed to start at a number and end at a digit, if its context makes the
    replacement safe (see the module docstring)."""
    # Within a stretch every byte that is not a digit is one of these.
    end = await scan.rstrip_end(body, start, end, _RUN_NON_DIGITS)
    if end - start < _RUN_MIN:
        return None
    before = await scan.rstrip_end(body, 0, start, _BLANKS) - 1
    if before < 0 or body[before] not in b"[,":
        return None
    after = await _skip_blanks(body, end)
    if after >= len(body) or body[after] not in b"],":
        return None
    return start, end


def _valid_slice(piece: bytes) -> int | None:
    """Elements in a comma-separated list of JSON integers, or None if it is not one.

    Written with byte operations only (each a C loop over the slice): digits are mapped to
    `z` (zero) and `d`, signs at element starts dropped, digit runs collapsed; a valid list
    then reads exactly `d,d,...,d`.
    """
    piece = piece.strip(_BLANKS)
    if not piece:
        return None
    if any(b in piece for b in (b" ", b"\t", b"\r", b"\n")):
        piece = piece.translate(_ALL_BLANKS_TO_SPACE)
        for _ in range(8):
            squeezed = piece.replace(b", ", b",").replace(b" ,", b",")
            if squeezed == piece:
                break
            piece = squeezed
        if b" " in piece:
            return None  # blanks inside a number, or more than the squeeze removes
    marks = piece.translate(_ZERO_DIGIT)
    if b"-" in marks:
        if _NEGATIVE_19 in marks.translate(_ANY_DIGIT):
            return None  # below -2**63 orjson reads a float: left to the parser
        marks = (b"," + marks).replace(b",-", b",")[1:]
        if b"-" in marks:
            return None  # a sign that does not open an element
    if b"z" in marks:
        opened = b"," + marks
        if b",zd" in opened or b",zz" in opened:
            return None  # a leading zero
    digits = marks.translate(_ANY_DIGIT) if b"z" in marks else marks
    if _TWENTY_DIGITS in digits:
        return None  # left to the parser (orjson reads such an integer as a float)
    # Now `d+(,d+)*` exactly when only d and comma are left, no two commas touch and
    # none opens or closes the list: each a C pass, where collapsing the digit runs took
    # five rounds of replace over the whole slice.
    if (
        not digits
        or digits.translate(None, b"d,")
        or b",," in digits
        or digits.startswith(b",")
        or digits.endswith(b",")
    ):
        return None  # an empty element, a sign without digits, or not a number at all
    return digits.count(b",") + 1


async def _count(body: bytes, start: int, end: int) -> int | None:
    """Validate body[start:end] a slice at a time, pausing between slices."""
    total = 0
    at = start
    while at < end:
        cut = await scan.find(body, b",", at + _SLICE, end) if end - at > _SLICE else -1
        stop = end if cut < 0 else cut
        if stop - at > _SLICE + _LONGEST_LAST_ELEMENT:
            counted = await _long_slice(body, at, stop)
        else:
            counted = _valid_slice(body[at:stop])
        if counted is None:
            return None
        total += counted
        at = stop + 1
        if at < end:
            await scan.pause()
    return total


async def _long_slice(body: bytes, at: int, stop: int) -> int | None:
    """_valid_slice(body[at:stop]) for a slice with no comma past its first _SLICE bytes,
    without handing it the whole of a long one.

    _valid_slice strips the slice first, and then accepts no last element longer than
    _LONGEST_LAST_ELEMENT bytes. That element begins at the slice's last comma (before
    at + _SLICE) or, with no comma, where the stripped slice does; so a stripped slice
    reaching further than that past at + _SLICE is refused without being looked at, and
    any other is at most _SLICE + _LONGEST_LAST_ELEMENT bytes long.
    """
    first = min(await _skip_blanks(body, at), stop)
    last = await scan.rstrip_end(body, first, stop, _BLANKS)
    if last - max(first, at + _SLICE) > _LONGEST_LAST_ELEMENT:
        return None
    return _valid_slice(body[first:last])


async def skim(body: bytes, shape_only: frozenset[str]) -> Skimmed | None:
    """The reduced body, or None when nothing was skimmed (parse `body` itself)."""
    if len(body) < SKIM_MIN_BODY:
        return None
    scanner = _Scanner(body)
    try:
        members = await scanner.top_level()
    except _GiveUp:
        return None
    times = scanner.times
    pieces: list[bytes] = []
    last = 0
    reduced_at = 0  # length of the reduced body so far
    result = Skimmed(b"")
    for i, (key, start, end) in enumerate(members, 1):
        if i % _STEPS_PER_PAUSE == 0:
            await scan.pause()  # up to _MAX_STEPS members: 10 ms to go through
        if key not in shape_only or body[start : start + 1] != b"[":
            continue
        if times[key] > 1 or await scan.find(body, b'"', start, end) >= 0:
            continue
        depth = 0
        gap_from = start
        direct_runs = 0
        direct_elements = 0
        short = 0
        seen = 0
        for span in _stretches(body, start, end):
            if span is None:
                await scan.pause()
                continue
            seen += 1
            if seen % _STRETCHES_PER_YIELD == 0:
                await scan.pause()
            if span[1] - span[0] < _RUN_MIN:
                short += 1
                if short > _MAX_SHORT_STRETCHES:
                    break  # what was replaced so far stays replaced: each run is safe alone
                continue
            core = await _core(body, *span)
            if core is None:
                continue
            count = await _count(body, *core)
            if count is None:
                continue
            depth += await scan.count(body, b"[", gap_from, core[0])
            depth -= await scan.count(body, b"]", gap_from, core[0])
            gap_from = core[1]
            if depth == 1:
                direct_runs += 1
                direct_elements += count
            reduced_at += core[0] - last
            result.shifts.append((reduced_at, core[1] - core[0] - 1))
            reduced_at += 1
            await scan.copy(pieces, body, last, core[0])
            pieces.append(b"0")
            last = core[1]
            result.runs += 1
            result.skimmed_bytes += core[1] - core[0]
        if direct_runs:
            result.extra_elements[key] = direct_elements - direct_runs
    if not result.runs:
        return None
    await scan.copy(pieces, body, last, len(body))
    result.body = await scan.join(pieces)
    return result
