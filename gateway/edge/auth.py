"""Bearer API keys for clients of an ingress gateway, and the credentials it sends upstream.

Keys are compared in constant time: each presented token is hashed, and its digest is
compared with every configured key's digest without stopping at the first match, so the
time taken says nothing about which key, or how much of one, matched. Keys never reach a
log line or an error body.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def read_keys_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with # are ignored."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]


class ApiKeys:
    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    def check(self, authorization: str | None) -> str | None:
        """None if the header carries a valid key, else a short reason label."""
        if not authorization:
            return "missing_key"
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "malformed_key"
        presented = _digest(token)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return None if matched else "invalid_key"
