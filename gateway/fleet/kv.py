"""What the fleet asks of a distributed key-value store (etcd): the protocol the shared
fleet state (gateway/fleet/etcd_state.py) is written against, and its values and errors.
gateway/edge/etcd.py implements it over etcd's HTTP/JSON gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


class EtcdError(Exception):
    """etcd answered, and refused or failed the call."""


class EtcdUnavailable(EtcdError, ConnectionError):
    """No endpoint answered in time."""


class Compacted(EtcdError):
    """A watch asked for history that compaction removed: relist, then watch anew."""

    def __init__(self, endpoint: str, revision: int) -> None:
        super().__init__(f"etcd at {endpoint}: history compacted up to revision {revision}")
        self.revision = revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Event:
    kv: KeyValue
    deleted: bool


def range_end(prefix: bytes) -> bytes:
    """The range_end that makes a range or watch cover every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class Store(Protocol):
    """etcd's KV, lease and watch calls, as gateway/edge/etcd.py makes them."""

    def describe(self) -> str: ...

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]: ...

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]: ...

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int: ...

    async def delete(self, key: bytes) -> int: ...

    async def replace(
        self, key: bytes, value: bytes, *, mod_revision: int, lease: int = 0
    ) -> int | None: ...

    async def delete_if(self, key: bytes, *, mod_revision: int) -> bool: ...

    async def write_many(
        self, puts: list[tuple[bytes, bytes]], deletes: list[bytes], *, lease: int = 0
    ) -> int: ...

    async def grant(self, ttl_s: int) -> int: ...

    async def keepalive(self, lease: int) -> int: ...

    async def revoke(self, lease: int) -> None: ...

    def watch(
        self, key: bytes, *, start_revision: int, prefix: bool = False
    ) -> AsyncIterator[list[Event]]: ...

    async def close(self) -> None: ...
