"""The rid of a body forwarded unparsed (policy.skip_parse_without_mask_key).

The walk may decline (None: the body is parsed after all), but what it answers must be
what SGLang's parser reads: the ids of the top-level `rid`, never one from a nested key, a
prompt or a value, never the first of a duplicated key, never a miss of an escaped one.
"""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contract import rids as rids_mod
from gateway.contract.inspection import inspect_body
from gateway.contract.policy import BodyRules, request_ids
from gateway.contract.rids import top_level_rids, top_level_rids_sliced
from gateway.contract.routes import Kind
from tests.property_scale import examples

# Long enough that the walk runs (below _WALK_FROM the body is parsed).
IDS = b"[" + b",".join(str(100 + i).encode() for i in range(2000)) + b"]"
assert len(IDS) > rids_mod._WALK_FROM


def truth(body: bytes) -> list[str]:
    """What the full inspection records: orjson's reading."""
    parsed = orjson.loads(body)
    return request_ids(parsed) if isinstance(parsed, dict) else []


def both(body: bytes) -> list[str] | None:
    """The walk's answer, checked to be the sliced walk's too."""
    found = top_level_rids(body)
    assert asyncio.run(top_level_rids_sliced(body)) == found
    return found


@pytest.mark.parametrize(
    ("body", "rids"),
    [
        (b'{"input_ids": ' + IDS + b', "sampling_params": {"top_k": 2}}', []),
        (b'{"rid": "r-1", "input_ids": ' + IDS + b"}", ["r-1"]),
        (b'{"input_ids": ' + IDS + b', "return_logprob": true, "rid": "r-1"}', ["r-1"]),
        (b'{"text": "x", "rid": "r-1", "input_ids": ' + IDS + b', "stream": false}', ["r-1"]),
        (b'{"input_ids": [' + IDS + b", " + IDS + b'], "rid": ["a", "b"]}', ["a", "b"]),
        (b'{"input_ids": ' + IDS + b', "rid": null}', []),
        (b'{"input_ids": ' + IDS + b', "rid": []}', []),
        # Other "rid"s are walked past as what they are.
        (b'{"sampling_params": {"rid": "nested"}, "input_ids": ' + IDS + b"}", []),
        (b'{"x": [{"rid": "in a list"}], "input_ids": ' + IDS + b', "rid": "t"}', ["t"]),
        (b'{"text": "say \\"rid\\": \\"no\\"", "input_ids": ' + IDS + b"}", []),
        (b'{"text": "ends with \\"rid", "input_ids": ' + IDS + b', "rid": "t"}', ["t"]),
        (b'{"text": "rid", "input_ids": ' + IDS + b"}", []),
        (b'{"text": "\\\\", "rid": "after an escaped backslash", "x": ' + IDS + b"}", None),
        (b'{\n  "input_ids": ' + IDS + b',\n  "rid" :\t"spaced"\n}\n', ["spaced"]),
        # A key spelled with an escape is rid to SGLang.
        (b'{"input_ids": ' + IDS + b', "r\\u0069d": "escaped"}', ["escaped"]),
        (
            b'{"input_ids": ' + IDS + b', "ri\\u0064": "escaped", "x": {"r\\u0069d": 1}}',
            ["escaped"],
        ),
        (b'{"input_ids": ' + IDS + b', "x": {"r\\u0069d": "nested"}}', []),
    ],
)
def test_the_walk_reads_the_top_level_rid(body: bytes, rids: list[str] | None) -> None:
    expected = truth(body)
    found = both(body)
    if rids is None:  # the walk may go either way; what it says must be right
        assert found is None or found == expected
        return
    assert rids == expected
    assert found == expected


@pytest.mark.parametrize(
    "body",
    [
        # A value with escapes, or of a type request_ids reads otherwise.
        b'{"input_ids": ' + IDS + b', "rid": "a\\"b"}',
        b'{"input_ids": ' + IDS + b', "rid": 7}',
        b'{"input_ids": ' + IDS + b', "rid": ["a", 7]}',
        b'{"input_ids": ' + IDS + b', "rid": {"a": "b"}}',
        # A duplicated key: the parser keeps the last.
        b'{"rid": "first", "input_ids": ' + IDS + b', "rid": "last"}',
        # Past the walk's budget, with the key in the rest.
        b'{"texts": [' + b", ".join([b'"t"'] * 600) + b'], "rid": "late", "x": ' + IDS + b"}",
        b'{"text": "' + b'\\"' * 600 + b'", "rid": "late", "x": ' + IDS + b"}",
        b'{"texts": [' + b", ".join([b'"t"'] * 600) + b'], "r\\u0069d": "late", "x": ' + IDS + b"}",
    ],
)
def test_what_the_walk_cannot_vouch_for_is_left_to_a_parse(body: bytes) -> None:
    assert both(body) is None
    # The inspection then parses it: the ids are those the parse reads.
    got: list[str] = []
    assert (
        inspect_body(Kind.GENERATE, body, BodyRules(), skip_parse_without_key=True, rids=got)
        is None
    )
    assert got == truth(body)


def test_past_the_budget_a_body_without_the_key_needs_no_parse() -> None:
    body = b'{"texts": [' + b", ".join([b'"t"'] * 600) + b'], "x": ' + IDS + b"}"
    assert both(body) == []


def test_a_small_body_is_parsed_for_its_rid() -> None:
    assert both(b'{"text": "x", "rid": "r-9"}') == ["r-9"]
    assert both(b'{"text": "x", "r\\u0069d": "r-9"}') == ["r-9"]
    assert both(b'{"text": "x"}') == []
    assert both(b'{"rid": "r-9", "text": ') == []  # not JSON: SGLang refuses it


# -- generated bodies -------------------------------------------------------------------

TEXTS = st.text(alphabet='rid"\\{}[]:, \n\u00e9x', max_size=10) | st.sampled_from(
    ["rid", '"rid"', '"rid": "x"', "r\\id"]
)
KEYS = st.sampled_from(["rid", "text", "x", 'r"id', "rid ", "ri", "\\"])
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | TEXTS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(KEYS, children, max_size=3),
    max_leaves=12,
)


def encode(value: object, rnd: random.Random) -> bytes:
    """JSON text of `value`, each string character literal or \\u-escaped at random, and
    blanks between tokens at random: the spellings a client's encoder may choose."""

    def blank() -> bytes:
        return rnd.choice([b"", b"", b" ", b"\n  ", b"\t"])

    def string(text: str) -> bytes:
        out = bytearray(b'"')
        for ch in text:
            if ch in '"\\' or ch < " " or rnd.random() < 0.15:
                if ch in '"\\' and rnd.random() < 0.5:
                    out += b"\\" + ch.encode()
                else:
                    out += b"\\u%04x" % ord(ch)
            else:
                out += ch.encode()
        return bytes(out + b'"')

    if isinstance(value, dict):
        items = [
            blank() + string(k) + blank() + b":" + blank() + encode(v, rnd)
            for k, v in value.items()
        ]
        return b"{" + b",".join(items) + blank() + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(blank() + encode(v, rnd) for v in value) + blank() + b"]"
    if isinstance(value, str):
        return string(value)
    return orjson.dumps(value)


@pytest.mark.property
@settings(max_examples=examples(500), deadline=None)
@given(
    st.dictionaries(KEYS, VALUES, max_size=5), st.integers(0, 5), st.randoms(use_true_random=False)
)
def test_the_walk_never_answers_other_than_the_parser(
    top: dict[str, object], at: int, rnd: random.Random
) -> None:
    items = list(top.items())
    items.insert(min(at, len(items)), ("input_ids", "IDS"))
    body = encode(dict(items), rnd).replace(b'"IDS"', IDS, 1)
    found = both(body)
    assert found is None or found == truth(body)


@pytest.mark.property
@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.text(alphabet="abc-0", max_size=6), max_size=4), st.integers(0, 3))
def test_plain_rids_are_read_without_a_parse(rids: list[str], where: int) -> None:
    """The layouts RL frameworks send (plain string ids, anywhere at the top level) never
    need the parse."""
    items: list[tuple[str, object]] = [
        ("text", "x"),
        ("sampling_params", {"top_k": 2}),
        ("stream", False),
    ]
    value: object = rids[0] if len(rids) == 1 else rids
    items.insert(min(where, len(items)), ("rid", value))
    items.append(("input_ids", "IDS"))
    body = orjson.dumps(dict(items)).replace(b'"IDS"', IDS, 1)
    assert both(body) == truth(body)
