"""The body reader (gateway/contract/jsonview.py) must read every body exactly as orjson does.

Three things would let a body past the filter: the reader accepting what orjson refuses, the
reader seeing a different value for a field the policy reads, or the policy reading a field
the reader left out. Each has a test here; the policy truth tables
(tests/contract/test_policy.py) go through the reader as well, and check the third on every
case.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, seed, settings

from gateway.contract.inspection import inspect_body
from gateway.contract.jsonview import read_view
from gateway.contract.policy import READS, SHAPE_ONLY, BodyRules, ParallelSampleCap, resolve
from gateway.contract.routes import Kind, RouteTable
from gateway.contract.shapes import Head, first_of, length_of
from tests.hardening.bodies import requests
from tests.hardening.corpus import CASES
from tests.property_scale import examples

POLICY = BodyRules(samples=ParallelSampleCap(1024))
KINDS = [Kind.GENERATE, Kind.VERTEX, Kind.CHAT, Kind.COMPLETIONS, Kind.RESPONSES]


def _orjson(body: bytes) -> tuple[bool, Any]:
    try:
        return True, orjson.loads(body)
    except orjson.JSONDecodeError:
        return False, None


def _view(body: bytes, kind: Kind) -> tuple[bool, Any]:
    try:
        return True, read_view(body, READS[kind], SHAPE_ONLY)
    except orjson.JSONDecodeError:
        return False, None


def assert_same_reading(body: bytes) -> None:
    """Accepted by both or by neither; where accepted, the policy decides alike."""
    full_ok, full = _orjson(body)
    for kind in KINDS:
        view_ok, view = _view(body, kind)
        assert view_ok == full_ok, (kind, body[:80])
        if not full_ok or not isinstance(full, dict):
            assert view == full
            continue
        assert POLICY.check(kind, view) == POLICY.check(kind, full), (kind, body[:200])
        for key, value in view.items():
            if isinstance(value, Head):
                assert value.length == len(full[key])
            else:
                assert _equal(value, full[key]), key


def _equal(a: Any, b: Any) -> bool:
    # == recurses once per nesting level; the deep edge cases nest past the default limit.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        return bool(a == b)
    finally:
        sys.setrecursionlimit(limit)


DEEP = 1030
EDGE_CASES = [
    # What simdjson reads and orjson does not: a UTF-8 byte-order mark.
    b'\xef\xbb\xbf{"text":"a"}',
    b' \xef\xbb\xbf{"text":"a"}',
    # Numbers: out of range, big integers (orjson reads them, simdjson does not), odd forms.
    b'{"top_k":1e400}',
    b'{"top_k":-1e400}',
    b'{"top_k":1E400}',
    b'{"top_k":1e-400}',
    b'{"top_k":1.7976931348623159e308}',
    b'{"top_k":18446744073709551615}',
    b'{"top_k":18446744073709551616}',
    b'{"top_k":-9223372036854775809}',
    b'{"top_k":123456789012345678901234567890}',
    b'{"top_k":' + b"1" * 400 + b"}",
    b'{"top_k":01}',
    b'{"top_k":-01}',
    b'{"top_k":1.}',
    b'{"top_k":.5}',
    b'{"top_k":+1}',
    b'{"top_k":-0}',
    b'{"top_k":1e}',
    b'{"top_k":NaN}',
    b'{"top_k":Infinity}',
    b'{"top_k":-Infinity}',
    b'{"n":9007199254740993}',
    # Strings: lone surrogates, bad escapes, control characters, invalid UTF-8.
    b'{"text":"\\ud800"}',
    b'{"text":"\\udc00"}',
    b'{"text":"\\ud800\\u0041"}',
    b'{"text":"\\ud83d\\ude00"}',
    b'{"text":"\\u00"}',
    b'{"text":"\\u004G"}',
    b'{"text":"\\x41"}',
    b'{"text":"\\U0041"}',
    b'{"text":"\x01"}',
    b'{"text":"\t"}',
    b'{"text":"\xff"}',
    b'{"\xff":1}',
    b'{"text":"\xc0\x80"}',
    b'{"text":"\xed\xa0\x80"}',
    b'{"text":"\xf4\x90\x80\x80"}',
    b'{"text":"\\u0000"}',
    # Structure: trailing data, commas, blanks JSON does not allow, truncation, other tops.
    b'{"text":"a"} x',
    b'{"text":"a"}{}',
    b'{"text":"a"},',
    b'{"input_ids":[1,]}',
    b'{"text":"a",}',
    b"{'text':1}",
    b'\x0c{"text":"a"}',
    b'{"text":"a"}\x0c',
    b'{"text":"a"}\x00',
    b'\x00{"text":"a"}',
    b'{"text"\x0b:1}',
    b'{"text":"a"}\xc2\xa0',
    b'{"stream":tru}',
    b'{"stream":TRUE}',
    b'{"text":"abc',
    b'{"input_ids":[}',
    b"",
    b" ",
    b"null",
    b"[]",
    b'[{"text":"a"}]',
    b'"x"',
    b" \t\r\n{} \t\r\n",
    '{"text":"é"}'.encode("utf-16"),
    '{"text":"a"}'.encode("utf-32-le"),
    # Nesting around both parsers' limits.
    *(b'{"input_ids":' + b"[" * d + b"]" * d + b"}" for d in (1, 2, 3, 4, 1022, 1023, 1024)),
    *(b'{"sampling_params":' + b'{"a":' * d + b"1" + b"}" * d + b"}" for d in (1022, 1023)),
    b"[" * DEEP + b"]" * DEEP,
    # Duplicates: orjson keeps the last value, at any depth.
    b'{"return_sampling_mask":false,"text":"a","return_sampling_mask":true}',
    b'{"return_sampling_mask":true,"sampling_params":{"top_k":5,"top_k":-1}}',
    b'{"return_sampling_mask":true,"sampling_params":{"top_k":-1},"sampling_params":{"top_k":5}}',
    b'{"input_ids":[[1]],"input_ids":[1,2],"return_sampling_mask":[true,false]}',
    b'{"top_k":5,"return_sampling_mask":true,"return_meta_info":true,"top_k":null}',
    # Shapes the batch rules read through Heads.
    b'{"input_ids":[],"return_sampling_mask":[false]}',
    b'{"input_ids":[[]],"return_sampling_mask":[false]}',
    b'{"input_ids":[[1,2],[3]],"return_sampling_mask":[true,false],'
    b'"sampling_params":[{"top_k":5},{}]}',
    b'{"input_embeds":[[0.5,1.0]],"return_sampling_mask":[false]}',
    b'{"input_embeds":[[[0.5]],[[1.0]]],"return_sampling_mask":[true,false]}',
    b'{"input_embeds":[[]],"return_sampling_mask":[false]}',
    b'{"input_embeds":[{"a":1}],"return_sampling_mask":true}',
    b'{"input_ids":[{"a":1}],"return_sampling_mask":[false]}',
    b'{"input_ids":"abc","return_sampling_mask":[false]}',
    b'{"text":null,"input_ids":[[1],[2]],"return_sampling_mask":[true,false]}',
]


@pytest.mark.parametrize("body", EDGE_CASES, ids=lambda b: repr(b[:40]))
def test_edge_cases_read_like_orjson(body: bytes) -> None:
    assert_same_reading(body)


def test_the_bom_case_is_one_simdjson_alone_would_accept() -> None:
    """Guards the guard: if simdjson stopped reading a BOM, the first-byte check would be
    untested; if orjson started, the expectation here would need revisiting."""
    import simdjson

    simdjson.Parser().parse(b'\xef\xbb\xbf{"text":"a"}')
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(b'\xef\xbb\xbf{"text":"a"}')
    with pytest.raises(orjson.JSONDecodeError):
        read_view(b'\xef\xbb\xbf{"text":"a"}', READS[Kind.GENERATE], SHAPE_ONLY)


_SEEDS = [
    b'{"text":"Hello","sampling_params":{"top_k":5,"temperature":1.0},"return_sampling_mask":true}',
    b'{"input_ids":[[1,2,3],[4,5]],"sampling_params":[{"top_k":5},{"n":2}],'
    b'"return_sampling_mask":[true,false]}',
    b'{"model":"m","messages":[{"role":"user","content":"Hi \\u00e9"}],"top_k":-1,'
    b'"return_sampling_mask":true,"return_meta_info":true,"stream":false,"n":1}',
    b'{"instances":[{"text":"a"},{"text":"b"}],"parameters":{"return_sampling_mask":1}}',
    b'{"input_embeds":[[[0.5,-1e-3]],[[2E2]]],"return_sampling_mask":[1,0]}',
]
_INTERESTING = [
    *b'{}[]",:\\/ \t\r\n0123456789-+.eEtrufalsn',
    0x00,
    0x7F,
    0x80,
    0xC0,
    0xED,
    0xEF,
    0xFF,
]


def _mutate(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(4)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:
            del data[min(at, len(data) - 1)]
        elif op == 1:
            data.insert(at, rng.choice(_INTERESTING))
        elif op == 2 and data:
            data[min(at, len(data) - 1)] = rng.choice(_INTERESTING)
        else:
            end = min(len(data), at + rng.randint(1, 8))
            data[at:at] = data[at:end]  # duplicate a run of bytes
    return bytes(data)


def test_byte_mutations_read_like_orjson() -> None:
    """Thousands of near-miss bodies; a fixed seed, so a failure replays."""
    rng = random.Random(20261130)
    accepted = refused = 0
    for _ in range(4000):
        body = _mutate(rng, rng.choice(_SEEDS))
        ok, _ = _orjson(body)
        accepted += ok
        refused += not ok
        assert_same_reading(body)
    # The mutations must exercise both sides, or the test proves little.
    assert accepted > 300 and refused > 2000, (accepted, refused)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_adversarial_corpus_reads_like_orjson(case: Any) -> None:
    assert_same_reading(case.body)


@pytest.mark.property
@seed(6)
@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_generated_requests_decide_like_a_full_parse(request: tuple[str, bytes]) -> None:
    path, body = request
    route = RouteTable().match(path)
    assert route is not None
    full_ok, full = _orjson(body)
    view_ok, view = _view(body, route.kind)
    assert view_ok == full_ok
    if full_ok and isinstance(full, dict):
        assert POLICY.check(route.kind, view) == POLICY.check(route.kind, full)


def test_large_input_ids_become_a_head() -> None:
    ids = list(range(100_000))
    body = orjson.dumps({"input_ids": ids, "sampling_params": {"top_k": 5}, "extra": [1] * 9})
    view = read_view(body, READS[Kind.GENERATE], SHAPE_ONLY)
    head = view["input_ids"]
    assert isinstance(head, Head) and head.length == 100_000 and head.first == 0
    assert "extra" not in view  # validated, but no policy check reads it
    assert view["sampling_params"] == {"top_k": 5}
    with pytest.raises(TypeError):
        list(iter(head))


def test_nested_heads_keep_each_length() -> None:
    body = b'{"input_embeds":[[[0.5,1.5],[2.5]],[[3.5]],[]]}'
    view = read_view(body, READS[Kind.GENERATE], SHAPE_ONLY)
    embeds = view["input_embeds"]
    assert length_of(embeds) == 3 and length_of(first_of(embeds)) == 2
    assert length_of(first_of(first_of(embeds))) == 2
    assert first_of(first_of(first_of(embeds))) == 0.5
    with pytest.raises(TypeError):
        len(embeds)  # a Head has no length of its own to be misread


def test_parser_is_reused_and_a_huge_body_gets_its_own() -> None:
    for i in range(3):
        assert read_view(b'{"n":%d}' % i, READS[Kind.CHAT], SHAPE_ONLY) == {"n": i}
    huge = b'{"n":3,"pad":"' + b"x" * (9 * 1024 * 1024) + b'"}'
    assert read_view(huge, READS[Kind.CHAT], SHAPE_ONLY) == {"n": 3}
    assert read_view(b'{"n":4}', READS[Kind.CHAT], SHAPE_ONLY) == {"n": 4}


def test_vertex_reads_everything() -> None:
    body = b'{"instances":[{"input_ids":[1,2]}],"parameters":{"top_k":5},"x":1}'
    assert read_view(body, READS[Kind.VERTEX], SHAPE_ONLY) == orjson.loads(body)


PAD = b'{"pad":"' + b"x" * 5000 + b'",'


@pytest.mark.parametrize(
    "body",
    [b for b in EDGE_CASES if b.startswith(b"{") and not b.startswith(b"{}")],
    ids=lambda b: repr(b[:40]),
)
def test_large_bodies_through_inspection_are_refused_exactly_when_orjson_refuses(
    body: bytes,
) -> None:
    """Contract rule 1 on the path bodies of 4 KB and more take (the view, not orjson):
    padded past the threshold, each edge case is a 400 exactly when orjson cannot read it."""
    padded = PAD + body[1:]
    assert len(padded) >= 4096
    readable, _ = _orjson(padded)
    for kind in KINDS:
        rejection = resolve(inspect_body(kind, padded, POLICY))
        if not readable:
            assert rejection is not None and rejection.reason == "invalid_json", kind
        else:
            assert rejection is None or rejection.reason != "invalid_json", kind


@pytest.mark.parametrize("n", [1000, 1300, 2000, 3000, 5000])
@pytest.mark.parametrize("opening", [b"{  ", b"{\n  ", b"{\t\t", b"{   ", b"{ "])
def test_bodies_orjson_cannot_allocate_for_are_refused_like_orjson(opening: bytes, n: int) -> None:
    """Hardening II, item 6: orjson 3.13 refuses some valid indented bodies with dense arrays
    ("failed to allocate memory"); simdjson reads them. Whatever orjson says is the answer,
    on both sides of the 4 KB threshold."""
    body = opening + b'"input_ids": [' + b",".join([b"1"] * n) + b'], "text": null}'
    readable, _ = _orjson(body)
    for kind in KINDS:
        rejection = resolve(inspect_body(kind, body, POLICY))
        if readable:
            assert rejection is None or rejection.reason != "invalid_json"
        else:
            assert rejection is not None and rejection.reason == "invalid_json"
