"""Truth tables for SGLang's lax readings of JSON values (docs/sglang-contract.md sections 2 and 5).

`lax_bool` must agree with pydantic's lax bool exactly: pydantic is what SGLang uses, and it is
installed here, so every row is also checked against it. `lax_int` may only ever be stricter.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from gateway.contract.lax import Invalid, is_greedy, lax_bool, lax_int, plain_int

PYDANTIC_BOOL: TypeAdapter[bool] = TypeAdapter(bool)
PYDANTIC_INT: TypeAdapter[int] = TypeAdapter(int)

TRUE_SPELLINGS = [True, 1, 1.0, "true", "t", "y", "yes", "on", "1"]
FALSE_SPELLINGS = [False, 0, 0.0, -0.0, "false", "f", "n", "no", "off", "0"]
# pydantic's string table is case-insensitive.
TRUE_CASES = ["TRUE", "True", "T", "Y", "YES", "Yes", "yEs", "ON", "On", "oN"]
FALSE_CASES = ["FALSE", "False", "F", "N", "NO", "No", "OFF", "Off", "oFf"]
NOT_BOOLS = [2, -1, 0.5, 1.5, "maybe", "", " yes", "yes ", "1.0", "tru", "none", "null", [], {}]


def _ids(values: list[Any]) -> list[str]:
    return [f"{type(v).__name__}:{v!r}" for v in values]


# --- lax_bool ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", TRUE_SPELLINGS + TRUE_CASES, ids=_ids(TRUE_SPELLINGS + TRUE_CASES)
)
def test_lax_bool_true(value: object) -> None:
    assert lax_bool(value, "flag") is True


@pytest.mark.parametrize(
    "value", FALSE_SPELLINGS + FALSE_CASES, ids=_ids(FALSE_SPELLINGS + FALSE_CASES)
)
def test_lax_bool_false(value: object) -> None:
    assert lax_bool(value, "flag") is False


@pytest.mark.parametrize("value", NOT_BOOLS, ids=_ids(NOT_BOOLS))
def test_lax_bool_invalid(value: object) -> None:
    with pytest.raises(Invalid) as info:
        lax_bool(value, "return_sampling_mask")
    assert info.value.field == "return_sampling_mask"
    assert str(info.value).startswith("return_sampling_mask: ")


def test_lax_bool_none_passes_through() -> None:
    assert lax_bool(None, "flag") is None


ALL_BOOL_ROWS = TRUE_SPELLINGS + TRUE_CASES + FALSE_SPELLINGS + FALSE_CASES + NOT_BOOLS


@pytest.mark.parametrize("value", ALL_BOOL_ROWS, ids=_ids(ALL_BOOL_ROWS))
def test_lax_bool_matches_pydantic(value: object) -> None:
    """SGLang validates the orjson-parsed object with pydantic: the readings must be equal."""
    try:
        expected: bool | None = PYDANTIC_BOOL.validate_python(value)
    except ValidationError:
        expected = None
    if expected is None:
        with pytest.raises(Invalid):
            lax_bool(value, "flag")
    else:
        assert lax_bool(value, "flag") is expected


# --- lax_int (OpenAI routes) ---------------------------------------------------------------------

LAX_INT_OK = [
    pytest.param("5", 5, id="str-5"),
    pytest.param("-1", -1, id="str-minus-1"),
    pytest.param("+7", 7, id="str-plus-7"),
    pytest.param(5, 5, id="int-5"),
    pytest.param(-1, -1, id="int-minus-1"),
    pytest.param(0, 0, id="int-0"),
    pytest.param(5.0, 5, id="float-5.0"),
    pytest.param(-1.0, -1, id="float-minus-1.0"),
    pytest.param(True, 1, id="true"),
    pytest.param(False, 0, id="false"),
    pytest.param(1 << 30, 1 << 30, id="top-k-all"),
    pytest.param(2**70, 2**70, id="beyond-64-bits"),
]
LAX_INT_BAD = [5.5, -0.5, "5.5", "abc", "", "5a", [], [5], {}, {"a": 1}]


@pytest.mark.parametrize(("value", "expected"), LAX_INT_OK)
def test_lax_int_accepts(value: object, expected: int) -> None:
    result = lax_int(value, "top_k")
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(("value", "expected"), LAX_INT_OK)
def test_lax_int_never_looser_than_pydantic(value: object, expected: int) -> None:
    assert PYDANTIC_INT.validate_python(value) == expected


@pytest.mark.parametrize("value", LAX_INT_BAD, ids=_ids(LAX_INT_BAD))
def test_lax_int_invalid(value: object) -> None:
    with pytest.raises(Invalid) as info:
        lax_int(value, "top_k")
    assert info.value.field == "top_k"


def test_lax_int_none_passes_through() -> None:
    assert lax_int(None, "top_k") is None


# --- plain_int (/generate sampling_params: no coercion in SGLang) --------------------------------

PLAIN_INT_OK = [
    pytest.param(5, 5, id="int-5"),
    pytest.param(-1, -1, id="int-minus-1"),
    pytest.param(0, 0, id="int-0"),
    pytest.param(-2, -2, id="int-minus-2"),
    pytest.param(5.0, 5, id="float-5.0"),
    pytest.param(-1.0, -1, id="float-minus-1.0"),
    pytest.param(True, 1, id="true"),
    pytest.param(False, 0, id="false"),
    pytest.param(2**40, 2**40, id="2**40"),
    pytest.param(1e300, int(1e300), id="1e300"),
]
PLAIN_INT_BAD = ["5", "-1", "abc", "", 5.5, -0.5, [], [5], {}, {"a": 1}]


@pytest.mark.parametrize(("value", "expected"), PLAIN_INT_OK)
def test_plain_int_accepts(value: object, expected: int) -> None:
    result = plain_int(value, "top_k")
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize("value", PLAIN_INT_BAD, ids=_ids(PLAIN_INT_BAD))
def test_plain_int_invalid(value: object) -> None:
    """A string would crash SGLang (500); the gateway refuses it, and fractions too."""
    with pytest.raises(Invalid) as info:
        plain_int(value, "top_k")
    assert info.value.field == "top_k"


def test_plain_int_none_passes_through() -> None:
    assert plain_int(None, "top_k") is None


# --- is_greedy (0 <= temperature < 1e-6; a bool is its number, as SGLang compares it) -------------

GREEDY = [0, 0.0, -0.0, 5e-7, 1e-7, 9.99e-7, False]
NOT_GREEDY = [1e-6, 2e-6, -0.1, -1e-9, 1, 0.7, True, "0", "0.0", None, [], [0], {}]
LAX_GREEDY = ["0", "0.0", " 0 ", "5e-7", "-0"]
LAX_NOT_GREEDY = ["1e-6", "0.5", "zero", "", "0x0"]


@pytest.mark.parametrize("temperature", GREEDY, ids=_ids(GREEDY))
def test_is_greedy(temperature: object) -> None:
    assert is_greedy(temperature) is True
    assert is_greedy(temperature, lax=True) is True


@pytest.mark.parametrize("temperature", NOT_GREEDY, ids=_ids(NOT_GREEDY))
def test_is_not_greedy(temperature: object) -> None:
    assert is_greedy(temperature) is False


@pytest.mark.parametrize("temperature", LAX_GREEDY, ids=_ids(LAX_GREEDY))
def test_pydantic_reads_numeric_strings_as_numbers(temperature: str) -> None:
    assert is_greedy(temperature, lax=True) is True


@pytest.mark.parametrize("temperature", LAX_NOT_GREEDY, ids=_ids(LAX_NOT_GREEDY))
def test_lax_non_greedy_strings(temperature: str) -> None:
    assert is_greedy(temperature, lax=True) is False
