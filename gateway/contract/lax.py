"""SGLang's lax readings of JSON values (pydantic v2 lax mode, docs/sglang-contract.md section 5).

The gateway decides "mask requested" and "top_k" by reading a value the way SGLang will,
never more charitably: a spelling SGLang reads as on must read as on here too.
Each reader raises `Invalid` where SGLang would refuse the value, so the gateway can answer
400 itself instead of forwarding a body whose meaning it cannot pin down.

Values come from orjson, so the only types are dict, list, str, int, float, bool and None;
bool is tested before int because it is a subclass of it.
"""

from __future__ import annotations

import re
from typing import Final

TOP_K_ALL: Final = 1 << 30  # SGLang's "no top-k" sentinel (docs/sglang-contract.md s.2)

# pydantic's str -> bool table (case-insensitive, no stripping).
_TRUE_STRINGS: Final = frozenset({"true", "t", "y", "yes", "on", "1"})
_FALSE_STRINGS: Final = frozenset({"false", "f", "n", "no", "off", "0"})
# pydantic's integer strings: ASCII digits, single underscores between them, a fraction of
# zeros only, surrounding whitespace stripped.
_INT_STRING: Final = re.compile(r"[ \t\n\r\f\v]*([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?[ \t\n\r\f\v]*\Z")


class Invalid(ValueError):
    """A value SGLang's request model would refuse (or crash on)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def lax_bool(value: object, field: str) -> bool | None:
    """pydantic's lax bool; None stays None (field absent or null: off)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        if value == 0:
            return False
        if value == 1:
            return True
    elif isinstance(value, str):
        low = value.lower()
        if low in _TRUE_STRINGS:
            return True
        if low in _FALSE_STRINGS:
            return False
    raise Invalid(field, "Input should be a valid boolean")


def lax_int(value: object, field: str) -> int | None:
    """pydantic's lax int (OpenAI routes): "5" -> 5, 5.0 -> 5, true -> 1, 5.5 refused.

    Only plain decimal strings are taken; pydantic accepts a few more spellings, and
    refusing them is stricter, never looser.
    """
    if value is None:
        return None
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise Invalid(
                field, "Input should be a valid integer, got a number with a fractional part"
            )
        if abs(value) >= 2.0**63:
            raise Invalid(field, "Input should be a valid integer, unable to parse as int64")
        return int(value)
    if isinstance(value, str) and (m := _INT_STRING.match(value)):
        return int(m[1])
    raise Invalid(field, "Input should be a valid integer")


def plain_int(value: object, field: str) -> int | None:
    """`/generate` sampling params: a plain dict handed to SamplingParams(**d), no coercion.

    SGLang compares the raw value (`top_k == -1`, `top_k < 1`): bools act as 0/1 and
    integral floats as ints. A string or a container crashes SGLang (HTTP 500); the gateway
    refuses it instead, and refuses non-integral floats too (stricter than SGLang).
    """
    if value is None:
        return None
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise Invalid(field, "must be an integer")


def is_greedy(temperature: object, *, lax: bool = False) -> bool:
    """SGLang forces top_k = 1 when 0 <= temperature < 1e-6.

    A bool is its number on every route: SGLang compares `0 <= false < 1e-6` (true on
    /generate, where no pydantic runs) and pydantic reads false as 0.0. lax (OpenAI
    routes): a numeric string counts as its number too, as pydantic reads "0" as 0.0.
    Whenever this says greedy, SGLang either reads the same number or refuses the value.
    """
    if lax and isinstance(temperature, str):
        try:
            temperature = float(temperature.strip(" \t\n\r\f\v"))
        except ValueError:
            return False
    if not isinstance(temperature, int | float):
        return False
    return 0 <= temperature < 1e-6
