"""gateway/fleet/etcd_state.py with a real etcd (tests/etcd.py): processes' views of one
fleet document, without gateways around them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.edge.etcd import EtcdClient
from gateway.fleet.etcd_state import EtcdState, LockBusy, StoreDown
from gateway.fleet.shared import Change, Document
from tests.conftest import free_port
from tests.etcd import EtcdServer, etcd  # noqa: F401 - the fixture

PREFIX = "/test/"


class View:
    """One process: its EtcdState and the documents it adopted."""

    def __init__(self, url: str, **kw: float) -> None:
        self.state = EtcdState(
            EtcdClient([url], timeout_s=1),
            PREFIX,
            seed=["http://127.0.0.1:1"],
            lease_ttl_s=int(kw.pop("ttl", 10)),
            lock_wait_s=kw.pop("lock_wait_s", 1.0),
        )
        self.docs: list[Document] = []
        self.state.attach(self.docs.append)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.state.take(await self.state.snapshot())
        self.follow()

    def follow(self) -> None:
        self.task = asyncio.create_task(self.state.follow())

    async def halt(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def close(self) -> None:
        await self.halt()
        await self.state.close()

    @property
    def doc(self) -> Document:
        return self.docs[-1]


@contextlib.asynccontextmanager
async def views(url: str, n: int, **kw: float) -> AsyncIterator[list[View]]:
    made = [View(url, **kw) for _ in range(n)]
    try:
        for v in made:
            await v.start()
        yield made
    finally:
        for v in made:
            await v.close()


async def test_changes_serialise_and_reach_every_view(etcd: EtcdServer) -> None:  # noqa: F811
    async with views(etcd.url, 3) as (a, b, c):
        # The first one wrote the seed; every one adopted it.
        assert all(v.doc["members"] == {"http://127.0.0.1:1": {}} for v in (a, b, c))
        # Concurrent changes from every view all land (compare-and-swap, merged again).
        await asyncio.gather(
            *(
                v.state.record(Change(added={f"http://127.0.0.1:{10 + i}": {}}))
                for i, v in enumerate((a, b, c))
                for _ in range(3)
            )
        )
        members = {"http://127.0.0.1:1", *(f"http://127.0.0.1:{10 + i}" for i in range(3))}
        # A change returns once every live view acknowledged it: no waiting here.
        await a.state.record(Change(states={"http://127.0.0.1:1": {"paused": True}}))
        for v in (a, b, c):
            assert set(v.doc["members"]) == members
            assert v.doc["backends"]["http://127.0.0.1:1"]["paused"] is True
        assert a.doc["generation"] == b.doc["generation"] == c.doc["generation"]


async def test_watch_after_compaction_relists(etcd: EtcdServer) -> None:  # noqa: F811
    async with views(etcd.url, 2, ttl=10) as (a, b):
        # b's watch stops (a dropped connection), a writes on, history is compacted.
        await b.halt()
        for i in range(5):
            await a.state.record(Change(latest_version=f"v{i}"))
        await etcd.compact()
        assert b.doc["latest_version"] is None
        b.follow()  # watches from the last revision it saw: compacted away, so relisted
        async with asyncio.timeout(5):
            while b.doc["latest_version"] != "v4":
                await asyncio.sleep(0.01)
        assert b.state.relists == 1
        # And it follows on from there.
        await a.state.record(Change(latest_version="v5"))
        assert b.doc["latest_version"] == "v5"


async def test_lock_serialises_and_a_dead_holder_expires(etcd: EtcdServer) -> None:  # noqa: F811
    async with views(etcd.url, 2, ttl=2, lock_wait_s=0.5) as (a, b):
        async with a.state.exclusive("/pause_generation"):
            with pytest.raises(LockBusy) as busy:
                async with b.state.exclusive("/continue_generation"):
                    pytest.fail("two holders")
            assert "/pause_generation" in busy.value.reason
            assert "state.etcd.lock_wait_s" in busy.value.reason
        async with b.state.exclusive("/continue_generation"):
            pass  # free again once a's call ended
        # A holder that dies mid-call (its lease no longer renewed) blocks no one for long.
        await a.halt()
        lease = a.state._lease
        await a.state.store.replace(
            b"/test/lock/control", b'{"replica": "a", "call": "x"}', mod_revision=0, lease=lease
        )
        b.state.lock_wait_s = 5
        async with asyncio.timeout(5), b.state.exclusive("/pause_generation"):
            pass


async def test_start_refused_and_store_lost_while_running(etcd: EtcdServer) -> None:  # noqa: F811
    dead = f"http://127.0.0.1:{free_port()}"
    lonely = View(dead)
    with pytest.raises(StoreDown) as refused:
        await lonely.state.snapshot()
    assert dead in str(refused.value) and "state.etcd.endpoints" in str(refused.value)
    await lonely.state.close()

    async with views(etcd.url, 2, ttl=3) as (a, b):
        await etcd.stop()
        async with asyncio.timeout(5):
            while a.state.store_up:
                await asyncio.sleep(0.02)
        assert etcd.url in (a.state.problem() or "")
        with pytest.raises(StoreDown, match="refused"):
            async with a.state.exclusive("/pause_generation"):
                pytest.fail("locked without a store")
        await etcd.start()
        async with asyncio.timeout(10):
            while not (a.state.store_up and b.state.store_up):
                await asyncio.sleep(0.05)
        await a.state.record(Change(latest_version="after"))
        assert b.doc["latest_version"] == "after"
