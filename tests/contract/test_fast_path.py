"""The parse-skipping shortcut: it may only skip a body that provably has no mask key."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contract import keyscan, scan
from gateway.contract.inspection import inspect_body
from gateway.contract.keyscan import keys_for, may_name, may_name_sliced
from gateway.contract.policy import MASK_MESSAGE, BodyRules, resolve
from gateway.contract.routes import Kind
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url
from tests.property_scale import examples

KEY = "return_sampling_mask"


def may_hold_mask_key(body: bytes) -> bool:
    return may_name(body, keyscan.MASK)


async def may_hold_mask_key_sliced(body: bytes) -> bool:
    return await may_name_sliced(body, keyscan.MASK)


def spell(key: str, escaped: list[bool], upper_hex: bool) -> bytes:
    """The key as JSON string bytes, each character literal or \\u-escaped."""
    out = b'"'
    for ch, esc in zip(key, escaped, strict=True):
        code = f"{ord(ch):04X}" if upper_hex else f"{ord(ch):04x}"
        out += b"\\u" + code.encode() if esc else ch.encode()
    return out + b'"'


def has_key(obj: object) -> bool:
    if isinstance(obj, dict):
        return KEY in obj or any(has_key(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_key(v) for v in obj)
    return False


@pytest.mark.property
@settings(max_examples=examples(100))
@given(st.lists(st.booleans(), min_size=len(KEY), max_size=len(KEY)), st.booleans())
def test_every_escaped_spelling_of_the_key_is_caught(escaped: list[bool], upper: bool) -> None:
    key = spell(KEY, escaped, upper)
    body = b'{"text": "x", ' + key + b": true}"
    assert has_key(orjson.loads(body))
    assert may_hold_mask_key(body)
    rejection = resolve(inspect_body(Kind.GENERATE, body, BodyRules(), skip_parse_without_key=True))
    assert rejection is not None and rejection.message == MASK_MESSAGE


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["a", KEY, "top_k", "r\u00e9", "\\"]), children, max_size=4
        )
    ),
    max_leaves=20,
)


@pytest.mark.property
@settings(max_examples=examples(400))
@given(json_values)
def test_scan_never_misses_a_key_orjson_would_see(value: object) -> None:
    body = orjson.dumps({"v": value})
    if has_key(orjson.loads(body)):
        assert may_hold_mask_key(body)


@pytest.mark.property
@settings(max_examples=examples(300))
@given(
    st.text(alphabet='\\"\nu/\x01a\u00e9', max_size=40),
    st.lists(st.booleans(), min_size=len(KEY), max_size=len(KEY)),
)
def test_escapes_before_the_key_never_hide_it(prefix: str, escaped: list[bool]) -> None:
    """The walk from backslash to backslash stays aligned whatever escapes come first."""
    body = b'{"text": ' + orjson.dumps(prefix) + b", " + spell(KEY, escaped, False) + b": 1}"
    assert has_key(orjson.loads(body))
    assert may_hold_mask_key(body)


def test_keyless_bodies_skip_the_parse_only_when_enabled() -> None:
    broken = b'{"input_ids": [1, 2, 3'
    assert not may_hold_mask_key(broken)
    assert resolve(inspect_body(Kind.GENERATE, broken, BodyRules())) is not None  # strict default
    assert (
        resolve(inspect_body(Kind.GENERATE, broken, BodyRules(), skip_parse_without_key=True))
        is None
    )
    # A prompt that merely mentions \u in its text is an escaped backslash then "u": no
    # escape, so no key; a real \u escape anywhere still costs a read.
    mentions = orjson.dumps({"text": "escape \\u0041 here", "sampling_params": {}})
    assert not may_hold_mask_key(mentions)
    assert may_hold_mask_key(b'{"text": "caf\\u00e9", "sampling_params": {}}')


@pytest.mark.parametrize("skip", [False, True])
async def test_large_token_bodies_through_the_gateway(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession, skip: bool
) -> None:
    gw = await make_gateway(stub.url, policy={"skip_parse_without_mask_key": skip})
    ids = list(range(100_000))
    plain = orjson.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    masked = orjson.dumps(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "return_sampling_mask": True}
    )
    headers = {"Content-Type": "application/json"}
    async with session.post(gw_url(gw, "/generate"), data=plain, headers=headers) as r:
        assert r.status == 200
    async with session.post(gw_url(gw, "/generate"), data=masked, headers=headers) as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"] == MASK_MESSAGE
    assert [x.body for x in stub.generation_requests()] == [plain]


@pytest.mark.parametrize(
    ("body", "may_hold"),
    [
        (b'{"input_ids":[1,2,3]}', False),
        (b'{"text":"a\\nb\\"c"}', False),  # backslashes, but no \u escape
        (b'{"text":"\\u0041"}', True),
        (b'{"return_sampling_mask":true}', True),
        (b'{"return_sampling_mas\\u006b":true}', True),
        (b'{"text":"\\\\u"}', False),  # an escaped backslash, then a plain "u"
        (b'{"text":"\\\\\\u0041"}', True),  # an escaped backslash, then an escape
        (b'{"text":"' + b"\\n" * 63 + b'","input_ids":[1]}', False),
        (b'{"text":"' + b"\\n" * 64 + b'\\u0041"}', True),
        (b'{"text":"' + b"\\n" * 65 + b'"}', True),  # too many to walk: read it
        (b'{"text":"a\\', False),  # a trailing backslash; the body is refused anyway
    ],
)
def test_mask_key_scan(body: bytes, may_hold: bool) -> None:
    assert may_hold_mask_key(body) is may_hold


# -- bodies large enough for the quote walk ------------------------------------------------

IDS = b"[" + b",".join(str(100 + i).encode() for i in range(2000)) + b"]"
assert len(IDS) > keyscan._QUOTE_WALK_FROM


def both_scans(body: bytes) -> bool:
    """may_hold_mask_key, checked to be the sliced scan's answer too."""
    found = may_hold_mask_key(body)
    assert asyncio.run(may_hold_mask_key_sliced(body)) is found
    return found


MANY = b", ".join([b'"t"'] * 40)  # more quotes than the walk takes before the key search


@pytest.mark.parametrize(
    ("body", "may_hold"),
    [
        (b'{"input_ids": ' + IDS + b', "sampling_params": {"top_k": 2}}', False),
        (b'{"input_ids": ' + IDS + b', "return_sampling_mask": true}', True),
        (b'{"return_sampling_mask": true, "input_ids": ' + IDS + b"}", True),
        (b'{"input_ids": ' + IDS + b', "sampling_params": {"return_sampling_mask": 1}}', True),
        (b'{"x": [{"return_sampling_mask": 1}], "input_ids": ' + IDS + b"}", True),
        (b'{"input_ids": ' + IDS + b', "return_sampling_mask" \n\t: true}', True),
        (b'{"input_ids": ' + IDS + b', "return_sampling_mask"' + b" " * 80 + b": 1}", True),
        # The name as a value, or inside a value, is no key.
        (b'{"text": "return_sampling_mask", "input_ids": ' + IDS + b"}", False),
        (b'{"texts": ["return_sampling_mask"], "input_ids": ' + IDS + b"}", False),
        (b'{"text": "say \\"return_sampling_mask\\": true", "input_ids": ' + IDS + b"}", False),
        (b'{"text": "xreturn_sampling_mask", "input_ids": ' + IDS + b"}", False),
        (b'{"input_ids": ' + IDS + b', "return_sampling_masks": true}', False),
        # A key that ends with the name (after an escaped quote) is read rather than judged.
        (b'{"input_ids": ' + IDS + b', "a\\"return_sampling_mask": true}', True),
        # Past the walk's quotes: the rest is searched for the quoted name.
        (b'{"texts": [' + MANY + b'], "input_ids": ' + IDS + b"}", False),
        (b'{"texts": [' + MANY + b'], "return_sampling_mask": 1, "x": ' + IDS + b"}", True),
        (b'{"texts": [' + MANY + b'], "x": ' + IDS + b', "return_sampling_mask": 1}', True),
        (b'{"texts": [' + MANY + b'], "x": "return_sampling_mask", "y": ' + IDS + b"}", True),
        (b'{"input_ids": ' + IDS + b', "return_sampling_mask"', False),  # no colon: not JSON
    ],
)
def test_mask_key_scan_of_a_large_body(body: bytes, may_hold: bool) -> None:
    assert len(body) >= keyscan._QUOTE_WALK_FROM
    assert both_scans(body) is may_hold
    if may_hold is False and body.endswith(b"}"):
        assert not has_key(orjson.loads(body))


@pytest.mark.property
@settings(max_examples=examples(300), deadline=None)
@given(json_values, st.integers(0, 3), st.sampled_from([b"", b" ", b"\n  ", b"\t"]))
def test_the_quote_walk_never_misses_a_key_orjson_would_see(
    value: object, where: int, blank: bytes
) -> None:
    items: list[tuple[str, object]] = [("v", value), ("text", KEY), ("w", [KEY])]
    items.insert(min(where, len(items)), ("input_ids", "IDS"))
    body = orjson.dumps(dict(items)).replace(b'"IDS"', IDS, 1).replace(b'":', b'"' + blank + b":")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:  # the blank went inside a string that held `":`
        parsed = orjson.loads(body := body.replace(b'"' + blank + b":", b'":'))
    if has_key(parsed):
        assert both_scans(body)


def _strings(n: int) -> bytes:
    """n string values: 2n quotes before whatever follows."""
    return b", ".join([b'"t"'] * n)


# The key's opening quote is the 31st (the walk judges it) or the 33rd (past the walk's 32).
@pytest.mark.parametrize("before", [14, 15])
def test_the_key_at_the_edge_of_the_quote_walk(before: int) -> None:
    """At the walk's last quote the key is judged with its colon; one past it the rest is
    searched for the name: both must find it, and a value past the edge must not hide it."""
    key = b'"return_sampling_mask": 1'
    body = b'{"a": [' + _strings(before) + b"], " + key + b', "x": ' + IDS + b"}"
    quote = body.count(b'"', 0, body.index(key)) + 1
    assert quote == 3 + 2 * before
    assert (quote <= keyscan._MAX_QUOTES_WALKED) is (before == 14)
    assert both_scans(body) is True


@pytest.mark.parametrize(("blanks", "may_hold"), [(63, True), (64, True), (65, True)])
def test_blanks_before_the_colon_at_the_walks_limit(blanks: int, may_hold: bool) -> None:
    body = b'{"input_ids": ' + IDS + b', "return_sampling_mask"' + b" " * blanks + b": 1}"
    assert both_scans(body) is may_hold
    # The same blanks after a value are no key; from the walk's limit on they are not walked
    # and the body is read instead (a parse decides): never a miss, at worst a parse.
    value = b'{"text": "return_sampling_mask"' + b" " * blanks + b', "input_ids": ' + IDS + b"}"
    assert both_scans(value) is (blanks >= keyscan._BLANKS_BEFORE_COLON)


def test_the_key_across_a_slice_boundary_of_the_sliced_scan() -> None:
    """Over more than one slice (scan.FIND_SLICE, SUBSTRING_SLICE), a key that starts in one
    slice and ends in the next is found, past the quote walk's quotes too."""
    key = b'"return_sampling_mask": 1'
    for slice_at in (scan.FIND_SLICE, scan.SUBSTRING_SLICE):
        for into in (1, len(key) // 2, len(key) - 1):
            head = b'{"texts": [' + _strings(40) + b'], "pad": "'
            pad = b"p" * (slice_at - into - len(head) - len(b'", '))
            body = head + pad + b'", ' + key + b"}"
            start = body.index(key)
            assert start + into == slice_at, (slice_at, into)
            assert both_scans(body) is True
            assert both_scans(body.replace(key, b'"return_sampling_masks": 1')) is False


# -- the adapter keys, asked in the same walk -----------------------------------------------

ADAPTERS = keys_for(Kind.GENERATE, adapters=True)
MODELS = keys_for(Kind.CHAT, adapters=True)


def scans_with(body: bytes, keys: keyscan.Keys) -> bool:
    found = may_name(body, keys)
    assert asyncio.run(may_name_sliced(body, keys)) is found
    return found


@pytest.mark.parametrize("pad", [b"", b', "x": ' + IDS, b', "texts": [' + MANY + b'], "x": ' + IDS])
@pytest.mark.parametrize(
    ("fields", "generate", "chat"),
    [
        (b'"lora_path": "A"', True, True),
        (b'"lora_path" : ["A", null]', True, True),
        (b'"model": "base:A"', False, True),
        (b'"model" :\n "base"', False, False),
        (b'"model": "base"', False, False),
        (b'"model": null', False, True),  # not a plain string: read it
        (b'"model": "' + b"m" * 600 + b'"', False, True),  # too long to judge here
        (b'"text": "model", "n": 1', False, False),  # the word as a value is no key
        (b'"return_sampling_mask": 1', True, True),
        (b'"top_k": 5', False, False),
    ],
)
def test_adapter_keys_share_the_walk(fields: bytes, generate: bool, chat: bool, pad: bytes) -> None:
    body = b"{" + fields + pad + b"}"
    assert scans_with(body, ADAPTERS) is generate, body
    assert scans_with(body, MODELS) is chat, body
    if not chat and pad:
        assert may_name(body, keyscan.MASK) is False


def test_the_mask_alone_ignores_adapter_keys() -> None:
    body = b'{"lora_path": "A", "model": "b:A", "input_ids": ' + IDS + b"}"
    assert scans_with(body, keyscan.MASK) is False
    assert keys_for(Kind.COMPLETIONS, adapters=False) is keyscan.MASK


def test_model_said_too_often_past_the_walk_is_read() -> None:
    """Past the walk each `"model"` string is judged; past eight of them the body is read."""
    said = b", ".join([b'"model"'] * 8)
    body = (
        b'{"texts": [' + MANY + b"], " + b'"w": [' + said + b'], "model": "b", "x": ' + IDS + b"}"
    )
    assert scans_with(body, MODELS) is True
    fewer = body.replace(said, b", ".join([b'"model"'] * 6), 1)
    assert scans_with(fewer, MODELS) is False
