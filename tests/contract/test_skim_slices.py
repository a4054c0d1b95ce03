"""The sliced scans of large bodies (gateway/contract/scan.py) answer exactly as one call
over the whole body did.

Hardening III cut every scan of the skim into slices with a pause between them, so that no step
holds the event loop for long. The rule must stay exactly as strict: `_reference_skim`
below is the skim as it was before (one bytes.find, count, regex search or finditer per
scan, no pauses), and the sliced skim must return the same reduced body, lengths and
shifts for every body. Slices, windows and thresholds are shrunk to a few bytes here so
that seams fall everywhere, inside numbers, signs, blanks and escapes.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator

import orjson
import pytest

from gateway.contract import scan
from gateway.contract import skim as sk
from gateway.contract.keyscan import MASK, keys_for, may_name, may_name_sliced
from gateway.contract.routes import Kind
from gateway.edge import budget

SHAPE = frozenset({"input_ids", "input_embeds"})
_STRING_STOP = re.compile(rb'["\\]')


# -- the skim before Hardening III, kept as the oracle ---------------------------------------------


class _GiveUp(Exception):
    pass


def _skip_blanks(body: bytes, pos: int) -> int:
    end = len(body)
    while pos < end and body[pos] in sk._BLANKS:
        pos += 1
    return pos


def _string_end(body: bytes, pos: int) -> int:
    at = pos + 1
    while True:
        m = _STRING_STOP.search(body, at)
        if m is None:
            raise _GiveUp
        if body[m.start()] == 0x22:
            return m.start() + 1
        at = m.start() + 2


class _Scanner:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > sk._MAX_STEPS:
            raise _GiveUp

    def value_end(self, pos: int) -> int:
        body = self.body
        if pos >= len(body):
            raise _GiveUp
        first = body[pos]
        if first == 0x22:
            return _string_end(body, pos)
        if first not in b"[{":
            m = sk._SCALAR_END.search(body, pos)
            return m.start() if m is not None else len(body)
        ahead = {char: body.find(char, pos) for char in sk._STRUCTURAL_BYTES}
        depth = 0
        at = pos
        while True:
            self.step()
            for needle, where in ahead.items():
                if 0 <= where < at:
                    ahead[needle] = body.find(needle, at)
            found = [where for where in ahead.values() if where >= 0]
            if not found:
                raise _GiveUp
            where = min(found)
            char = body[where]
            if char == 0x22:
                at = _string_end(body, where)
                continue
            at = where + 1
            depth += 1 if char in b"[{" else -1
            if depth == 0:
                return at

    def top_level(self) -> list[tuple[str, int, int]]:
        body = self.body
        pos = _skip_blanks(body, 0)
        if body[pos : pos + 1] != b"{":
            raise _GiveUp
        pos = _skip_blanks(body, pos + 1)
        members: list[tuple[str, int, int]] = []
        if body[pos : pos + 1] == b"}":
            return members
        while True:
            self.step()
            if body[pos : pos + 1] != b'"':
                raise _GiveUp
            key_end = _string_end(body, pos)
            try:
                key = orjson.loads(body[pos:key_end])
            except orjson.JSONDecodeError:
                raise _GiveUp from None
            pos = _skip_blanks(body, key_end)
            if body[pos : pos + 1] != b":":
                raise _GiveUp
            start = _skip_blanks(body, pos + 1)
            end = self.value_end(start)
            members.append((key, start, end))
            pos = _skip_blanks(body, end)
            sep = body[pos : pos + 1]
            if sep == b"}":
                return members
            if sep != b",":
                raise _GiveUp
            pos = _skip_blanks(body, pos + 1)


def _core(body: bytes, start: int, end: int) -> tuple[int, int] | None:
    while end > start and body[end - 1] not in b"0123456789":
        end -= 1
    if end - start < sk._RUN_MIN:
        return None
    before = start - 1
    while before >= 0 and body[before] in sk._BLANKS:
        before -= 1
    if before < 0 or body[before] not in b"[,":
        return None
    after = _skip_blanks(body, end)
    if after >= len(body) or body[after] not in b"],":
        return None
    return start, end


def _count(body: bytes, start: int, end: int) -> int | None:
    total = 0
    at = start
    while at < end:
        cut = body.find(b",", min(at + sk._SLICE, end), end) if end - at > sk._SLICE else -1
        stop = end if cut < 0 else cut
        counted = sk._valid_slice(body[at:stop])
        if counted is None:
            return None
        total += counted
        at = stop + 1
    return total


def _reference_skim(body: bytes, shape_only: frozenset[str]) -> sk.Skimmed | None:
    if len(body) < sk.SKIM_MIN_BODY:
        return None
    try:
        members = _Scanner(body).top_level()
    except _GiveUp:
        return None
    names = [key for key, _, _ in members]
    pieces: list[bytes] = []
    last = 0
    reduced_at = 0
    result = sk.Skimmed(b"")
    for key, start, end in members:
        if key not in shape_only or body[start : start + 1] != b"[":
            continue
        if names.count(key) > 1 or body.find(b'"', start, end) >= 0:
            continue
        depth = 0
        gap_from = start
        direct_runs = 0
        direct_elements = 0
        short = 0
        for m in sk._RUN.finditer(body, start, end):
            if m.end() - m.start() < sk._RUN_MIN:
                short += 1
                if short > sk._MAX_SHORT_STRETCHES:
                    break
                continue
            core = _core(body, m.start(), m.end())
            if core is None:
                continue
            count = _count(body, *core)
            if count is None:
                continue
            depth += body.count(b"[", gap_from, core[0]) - body.count(b"]", gap_from, core[0])
            gap_from = core[1]
            if depth == 1:
                direct_runs += 1
                direct_elements += count
            reduced_at += core[0] - last
            result.shifts.append((reduced_at, core[1] - core[0] - 1))
            reduced_at += 1
            pieces += (body[last : core[0]], b"0")
            last = core[1]
            result.runs += 1
            result.skimmed_bytes += core[1] - core[0]
        if direct_runs:
            result.extra_elements[key] = direct_elements - direct_runs
    if not result.runs:
        return None
    pieces.append(body[last:])
    result.body = b"".join(pieces)
    return result


# -- bodies with seams everywhere ---------------------------------------------------------------


def _blanks(rng: random.Random) -> bytes:
    width = rng.choice([0, 0, 0, 1, 1, 2, 5, 9, 12, 40])
    return bytes(rng.choice(b"    \t\r\n") for _ in range(width))


_ELEMENTS = [b"1", b"7", b"0", b"-3", b"42", b"-0", b"05", b"-", b"--1", b"1-", b"9" * 19]
_ELEMENTS += [b"9" * 20, b"-" + b"9" * 19, b"1.5", b"1e3", b"", b"12 3", b"true", b"[1,2]"]


def _element(rng: random.Random) -> bytes:
    if rng.random() < 0.05:
        return b"1" * rng.randrange(20, 90)
    return rng.choice(_ELEMENTS)


def _array(rng: random.Random, depth: int = 0) -> bytes:
    items: list[bytes] = []
    for _ in range(rng.randrange(0, 30)):
        if depth < 2 and rng.random() < 0.08:
            items.append(_array(rng, depth + 1))
        elif rng.random() < 0.85:
            items.append(rng.choice([b"1", b"2", b"34", b"-5", b"0", b"123456"]))
        else:
            items.append(_element(rng))
    parts = [_blanks(rng) + item + _blanks(rng) for item in items]
    sep = rng.choice([b",", b",", b", ", b" , ", b",\n  "])
    return b"[" + _blanks(rng) + sep.join(parts) + _blanks(rng) + b"]"


def _value(rng: random.Random) -> bytes:
    return rng.choice(
        [
            b'"plain"',
            b'"esc\\\\aped \\"quote\\" \\u00e9 \\n"',
            b'"' + b"\\n" * rng.randrange(1, 40) + b'"',
            b"{" + _blanks(rng) + b'"top_k"' + _blanks(rng) + b":" + _blanks(rng) + b"2}",
            b"true",
            b"12" + _blanks(rng),
            b"-0.5e3",
            b'[{}, [[]], {"a": [1, 2]}]',
            b"null",
        ]
    )


def _body(rng: random.Random) -> bytes:
    members: list[bytes] = []
    keys = ["input_ids", "input_embeds", "text", "sampling_params", "rid", "x"]
    for _ in range(rng.randrange(1, 6)):
        key = rng.choice(keys)
        value = _array(rng) if key in SHAPE and rng.random() < 0.9 else _value(rng)
        if key in SHAPE and rng.random() < 0.1:
            value = value[:-1] + b', "s"]'  # a string inside the field
        name = b'"' + key.encode() + b'"'
        members.append(name + _blanks(rng) + b":" + _blanks(rng) + value)
    body = b"{" + _blanks(rng) + (b"," + _blanks(rng)).join(members) + _blanks(rng) + b"}"
    if rng.random() < 0.1:
        body = body[: rng.randrange(1, len(body))]  # cut short
    elif rng.random() < 0.1:
        body = _blanks(rng) + body + _blanks(rng)
    return body


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> Iterator[random.Random]:
    """Thresholds and slices of a few bytes, in the skim and in both copies of its rules."""
    rng = random.Random(26)
    monkeypatch.setattr(sk, "SKIM_MIN_BODY", 16)
    monkeypatch.setattr(sk, "_RUN_MIN", 6)
    monkeypatch.setattr(sk, "_SLICE", 7)
    monkeypatch.setattr(sk, "_MAX_STEPS", 60)
    monkeypatch.setattr(sk, "_STEPS_PER_PAUSE", 3)
    monkeypatch.setattr(sk, "_ESCAPES_PER_PAUSE", 2)
    monkeypatch.setattr(sk, "_STRETCHES_PER_YIELD", 2)
    monkeypatch.setattr(sk, "_MAX_SHORT_STRETCHES", 12)
    yield rng


def _shrink_slices(monkeypatch: pytest.MonkeyPatch, rng: random.Random) -> None:
    for name in ("CLASS_SLICE", "SUBSTRING_SLICE", "COPY_SLICE"):
        monkeypatch.setattr(scan, name, rng.randrange(2, 12))
    # One-byte finds and counts are cut anywhere alike; wider, they pause less often.
    for name in ("FIND_SLICE", "COUNT_SLICE"):
        monkeypatch.setattr(scan, name, rng.randrange(2, 64))
    monkeypatch.setattr(scan, "_STEPPED", rng.randrange(0, 4))
    monkeypatch.setattr(scan, "JOIN_IN_THREAD", rng.choice([1, 1 << 30]))
    monkeypatch.setattr(sk, "_RUN_WINDOW", rng.randrange(2, 12))


def _same(got: sk.Skimmed | None, want: sk.Skimmed | None) -> bool:
    if got is None or want is None:
        return got is want
    return (got.body, got.extra_elements, got.runs, got.skimmed_bytes, got.shifts) == (
        want.body,
        want.extra_elements,
        want.runs,
        want.skimmed_bytes,
        want.shifts,
    )


@pytest.mark.property
async def test_the_sliced_skim_answers_as_the_skim_before_it(
    tiny: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = tiny
    skimmed = refused = 0
    for i in range(1200):
        if i % 20 == 0:
            _shrink_slices(monkeypatch, rng)
        body = _body(rng)
        want = _reference_skim(body, SHAPE)
        got = await sk.skim(body, SHAPE)
        assert _same(got, want), body
        skimmed += want is not None
        refused += want is None and len(body) >= sk.SKIM_MIN_BODY
    # Both answers were common: the comparison was not between two Nones.
    assert skimmed > 200 and refused > 300, (skimmed, refused)


async def test_long_slices_are_judged_as_whole_ones(
    tiny: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice with no comma past its first _SLICE bytes (blanks, a long number) is judged
    without being handed whole to _valid_slice, and exactly as it would have been."""
    rng = tiny
    for i in range(3000):
        if i % 20 == 0:
            _shrink_slices(monkeypatch, rng)
        head = b",".join(rng.choice([b"1", b"23", b"-4"]) for _ in range(rng.randrange(1, 4)))
        middle = rng.choice(
            [b" " * rng.randrange(1, 60), b"9" * rng.randrange(1, 60), b"5" + b" " * 30 + b"6"]
        )
        piece = _blanks(rng) + head + rng.choice([b"", b",", b", "]) + middle + _blanks(rng)
        piece += rng.choice([b"", b"7", b" 7", b"         7"])
        body = b"[" + piece + b",1]"
        got = await sk._count(body, 1, 1 + len(piece))
        assert got == _count(body, 1, 1 + len(piece)), piece


def _pieces(rng: random.Random) -> bytes:
    return bytes(rng.choice(b'ab,:-"\\ \t1[]') for _ in range(rng.randrange(0, 80)))


async def test_each_sliced_scan_returns_what_one_call_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(9)
    one_byte = re.compile(rb'["\\]')
    for i in range(4000):
        if i % 25 == 0:
            _shrink_slices(monkeypatch, rng)
        body = _pieces(rng)
        start = rng.randrange(0, len(body) + 2)
        end = rng.choice([None, rng.randrange(0, len(body) + 3)])
        byte = rng.choice([b"a", b",", b'"', b"z"])
        assert await scan.find(body, byte, start, end) == body.find(byte, start, end)
        assert await scan.count(body, byte, start, end) == body.count(byte, start, end)
        m = one_byte.search(body, start, len(body) if end is None else end)
        assert await scan.search(one_byte, body, start, end) == (-1 if m is None else m.start())
        needle = rng.choice([b"a", b"ab", b'\\"', b"a,:", b"1[]1"])
        assert await scan.contains(body, needle) == (needle in body)
        lo = min(start, len(body))
        hi = max(lo, min(len(body), end if end is not None else len(body)))
        chars = rng.choice([b" \t", b"a,", b"1"])
        assert await scan.rstrip_end(body, lo, hi, chars) == lo + len(body[lo:hi].rstrip(chars))
        out: list[bytes] = [b"<"]
        await scan.copy(out, body, lo, hi)
        assert b"".join(out) == b"<" + body[lo:hi]
        assert await scan.join(out) == b"<" + body[lo:hi]


async def test_a_long_find_pauses_between_slices() -> None:
    body = b"a" * (3 * scan.FIND_SLICE) + b"b"
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    ticker = asyncio.create_task(count_turns())
    await asyncio.sleep(0)
    assert await scan.find(body, b"b", 0) == len(body) - 1
    ticker.cancel()
    assert turns >= 3


async def test_the_sliced_key_search_and_cost_answer_as_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """inspect_large's own scans of a large body: the mask-key search and the budget's
    count, each against the one-call function it stands for."""
    rng = random.Random(11)
    monkeypatch.setattr(budget, "_FLAT_BELOW", 8)
    spellings = [b"return_sampling_mask", b"return_sampling_mas", b"\\u0072eturn", b"\\\\u"]
    spellings += [b'"lora_path"', b'"model": "b:A"', b'"model": "b"', b'"model"']
    keysets = [MASK, keys_for(Kind.GENERATE, adapters=True), keys_for(Kind.CHAT, adapters=True)]
    for i in range(3000):
        if i % 25 == 0:
            _shrink_slices(monkeypatch, rng)
        parts = [_pieces(rng) for _ in range(rng.randrange(1, 4))]
        for _ in range(rng.randrange(0, 3)):
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(spellings))
        if rng.random() < 0.3:
            parts.insert(0, b"\\n" * rng.randrange(60, 70))  # about the walk's 64 escapes
        body = b"".join(parts)
        keys = rng.choice(keysets)
        assert await may_name_sliced(body, keys) is may_name(body, keys), body
        assert await budget.parse_cost_sliced(body) == budget.parse_cost(body), body
