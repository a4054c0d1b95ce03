"""gateway/edge/etcd.py against a real etcd (tests/etcd.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.edge.etcd import EtcdClient
from gateway.fleet.kv import Compacted, EtcdError, EtcdUnavailable, range_end
from tests.conftest import free_port
from tests.etcd import EtcdServer, etcd  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("etcd")


async def test_kv_transactions_and_prefixes(etcd: EtcdServer) -> None:  # noqa: F811
    client = EtcdClient([etcd.url])
    try:
        assert await client.get(b"/t/doc") == (None, await etcd.revision())
        first = await client.replace(b"/t/doc", b"one", mod_revision=0)
        assert first is not None
        # A second creator loses: the key exists.
        assert await client.replace(b"/t/doc", b"two", mod_revision=0) is None
        kv, _ = await client.get(b"/t/doc")
        assert kv is not None and kv.value == b"one" and kv.mod_revision == first
        # Compare-and-swap on the revision read: the stale writer loses.
        second = await client.replace(b"/t/doc", b"two", mod_revision=first)
        assert second is not None and second > first
        assert await client.replace(b"/t/doc", b"three", mod_revision=first) is None
        await client.put(b"/t/r/a", b"1")
        await client.put(b"/t/r/b", b"2")
        await client.put(b"/t/s", b"3")
        kvs, _ = await client.get_prefix(b"/t/r/")
        assert [(kv.key, kv.value) for kv in kvs] == [(b"/t/r/a", b"1"), (b"/t/r/b", b"2")]
        await client.delete(b"/t/r/a")
        assert (await client.get(b"/t/r/a"))[0] is None
    finally:
        await client.close()


def test_range_end() -> None:
    assert range_end(b"/a/") == b"/a0"
    assert range_end(b"a\xff") == b"b"
    assert range_end(b"\xff") == b"\0"


async def test_leases_expire_with_their_keys(etcd: EtcdServer) -> None:  # noqa: F811
    client = EtcdClient([etcd.url])
    try:
        lease = await client.grant(2)
        await client.put(b"/t/live", b"x", lease=lease)
        assert await client.keepalive(lease) > 0
        kv, _ = await client.get(b"/t/live")
        assert kv is not None and kv.lease == lease
        await client.revoke(lease)
        assert (await client.get(b"/t/live"))[0] is None
        assert await client.keepalive(lease) == 0
    finally:
        await client.close()


async def test_watch_sees_changes_and_compaction_ends_it(etcd: EtcdServer) -> None:  # noqa: F811
    client = EtcdClient([etcd.url])
    try:
        start = await client.put(b"/t/w", b"0")
        seen: list[tuple[bytes, bool]] = []
        created = asyncio.Event()

        async def follow() -> None:
            async for events in client.watch(b"/t/", start_revision=start + 1, prefix=True):
                if not events:
                    created.set()
                seen.extend((e.kv.value, e.deleted) for e in events)

        task = asyncio.create_task(follow())
        await asyncio.wait_for(created.wait(), 5)
        await client.put(b"/t/w", b"1")
        await client.delete(b"/t/w")
        async with asyncio.timeout(5):
            while len(seen) < 2:
                await asyncio.sleep(0.01)
        assert seen == [(b"1", False), (b"", True)]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        # Watching from history that compaction removed: Compacted, with the revision.
        compacted = await etcd.compact()
        with pytest.raises(Compacted) as info:
            async for _ in client.watch(b"/t/", start_revision=start, prefix=True):
                pass
        assert info.value.revision == compacted
    finally:
        await client.close()


async def test_unreachable_names_every_endpoint_and_fails_over(etcd: EtcdServer) -> None:  # noqa: F811
    dead = f"http://127.0.0.1:{free_port()}"
    client = EtcdClient([dead], timeout_s=1)
    try:
        with pytest.raises(EtcdUnavailable) as info:
            await client.get(b"/t")
        assert dead in str(info.value)
    finally:
        await client.close()
    # The dead one first: the live one answers, and is tried first from then on.
    client = EtcdClient([dead, etcd.url], timeout_s=1)
    try:
        await client.put(b"/t/k", b"v")
        assert client.endpoint == etcd.url
    finally:
        await client.close()
    # etcd stopped while a watch runs: the watch ends with EtcdUnavailable.
    client = EtcdClient([etcd.url])
    try:
        rev = await etcd.revision()
        events = client.watch(b"/t/", start_revision=rev + 1, prefix=True)
        assert await anext(events) == []
        await etcd.stop()
        with pytest.raises(EtcdUnavailable, match=etcd.url):
            await asyncio.wait_for(anext(events), 10)
    finally:
        await client.close()


async def test_credentials_authenticate_and_are_never_shown(
    etcd: EtcdServer,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "s3cret-Pass-9"
    await etcd.call("/v3/auth/user/add", {"name": "root", "password": secret})
    await etcd.call("/v3/auth/role/add", {"name": "root"})
    await etcd.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
    await etcd.call("/v3/auth/enable", {})
    caplog.set_level(logging.DEBUG)
    client = EtcdClient([etcd.url], username="root", password=secret)
    try:
        await client.put(b"/t/a", b"1")
        assert (await client.get(b"/t/a"))[0] is not None
        rev = await client.put(b"/t/a", b"2")
        events = client.watch(b"/t/a", start_revision=rev)
        assert [e.kv.value for e in await anext(events)] in ([], [b"2"])
        await events.aclose()
    finally:
        await client.close()
    anonymous = EtcdClient([etcd.url])
    try:
        with pytest.raises(EtcdError, match=r"state\.etcd\.username") as refused:
            await anonymous.get(b"/t/a")
    finally:
        await anonymous.close()
    wrong = EtcdClient([etcd.url], username="root", password=secret + "x")
    try:
        with pytest.raises(EtcdError, match="refused the credentials") as bad:
            await wrong.get(b"/t/a")
    finally:
        await wrong.close()
    shown = str(refused.value) + str(bad.value) + caplog.text
    assert secret not in shown
