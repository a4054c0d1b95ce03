"""Assertions and process readings shared by the hardening tests."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

# Type names the gateway's OpenAI-shaped bodies legitimately carry (SGLang's vocabulary).
_ALLOWED_NAMES = frozenset(
    {"BadRequestError", "AuthenticationError", "NotFoundError", "RateLimitError"}
    | {"InternalServerError"}
)
_EXCEPTION_NAME = re.compile(r"\b\w*(?:Error|Exception)\b")
_INTERNALS = re.compile(
    r"Traceback|File \"|\.py\b|aiohttp|orjson|uvloop|asyncio|yarl|multidict|Errno|errno|"
    r"b'|b\"|bytearray\(|line \d+ column|\(char \d+\)|0x[0-9a-f]{6,}|<[a-z_.]+ object at"
)


def assert_no_internals(body: bytes, *, addresses: Iterable[str] = ()) -> None:
    """A gateway-made body names no backend, carries no trace and no exception text."""
    text = body.decode("utf-8", "replace")
    match = _INTERNALS.search(text)
    assert match is None, f"internal detail {match.group(0)!r} in {text!r}"
    names = set(_EXCEPTION_NAME.findall(text)) - _ALLOWED_NAMES
    assert not names, f"exception names {names} in {text!r}"
    assert "127.0.0.1" not in text and "localhost" not in text, text
    for address in addresses:
        host_port = address.split("://", 1)[-1]
        port = host_port.rsplit(":", 1)[-1]
        assert host_port not in text, text
        assert not re.search(rf"\b{re.escape(port)}\b", text), f"port {port} in {text!r}"


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def vmrss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")
