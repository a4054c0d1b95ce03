"""The parse-skipping shortcut: it may only skip a body that provably has no mask key."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.inspection import inspect_body, may_hold_mask_key
from gateway.policy import MASK_MESSAGE, MaskPolicy
from gateway.routes import Kind
from gateway.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url

KEY = "return_sampling_mask"


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


@given(st.lists(st.booleans(), min_size=len(KEY), max_size=len(KEY)), st.booleans())
def test_every_escaped_spelling_of_the_key_is_caught(escaped: list[bool], upper: bool) -> None:
    key = spell(KEY, escaped, upper)
    body = b'{"text": "x", ' + key + b": true}"
    assert has_key(orjson.loads(body))
    assert may_hold_mask_key(body)
    rejection = inspect_body(Kind.GENERATE, body, MaskPolicy(), skip_parse_without_key=True)
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


@settings(max_examples=400)
@given(json_values)
def test_scan_never_misses_a_key_orjson_would_see(value: object) -> None:
    body = orjson.dumps({"v": value})
    if has_key(orjson.loads(body)):
        assert may_hold_mask_key(body)


def test_keyless_bodies_skip_the_parse_only_when_enabled() -> None:
    broken = b'{"input_ids": [1, 2, 3'
    assert not may_hold_mask_key(broken)
    assert inspect_body(Kind.GENERATE, broken, MaskPolicy()) is not None  # strict default
    assert inspect_body(Kind.GENERATE, broken, MaskPolicy(), skip_parse_without_key=True) is None
    # A prompt that merely mentions \u in text costs a parse, never a miss.
    mentions = orjson.dumps({"text": "escape \\u0041 here", "sampling_params": {}})
    assert may_hold_mask_key(mentions)


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
