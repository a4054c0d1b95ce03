"""An abort of one rid reaches its owner alone, also when bodies are forwarded unparsed.

With policy.skip_parse_without_mask_key (the RL filter's setting) a body without the mask
key is never parsed; its rid is read by a walk of its structure (gateway/contract/rids.py)
so that /abort_request {"rid"} still goes to the one engine serving it. Three real stubs,
a generation held open on one of them, then the abort: only that stub receives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
import pytest

from gateway.edge.etcd import EtcdClient
from gateway.edge.fleet_control import RidOwners
from gateway.fleet.kv import range_end
from gateway.fleet.rid_owners import RidPublisher
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, free_port, gw_url, wait_for
from tests.etcd import EtcdServer, b64, etcd  # noqa: F401 - the fixture

SLOW = {"X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "100", "Content-Type": "application/json"}
IDS_100K = list(range(1000, 101_000))


def _abort_bodies(stub: StubBackend) -> list[bytes]:
    return [
        r.body
        for r in stub.received
        if r.path == "/abort_request" and "X-Forwarded-For" in r.headers
    ]


@pytest.mark.parametrize(
    "size",
    [
        "small",  # parsed for its rid: cheaper than a walk
        "100k ids",  # walked (the RL body)
        "2 MiB",  # walked a slice at a time
    ],
)
async def test_an_abort_reaches_only_the_owner_without_a_parse(
    stubs: list[StubBackend], make_gateway: GatewayFactory, size: str
) -> None:
    gw = await make_gateway(*(s.url for s in stubs), policy={"skip_parse_without_mask_key": True})
    request: dict[str, object] = {"stream": True, "sampling_params": {"max_new_tokens": 100}}
    if size == "small":
        request["text"] = "x"
    else:
        request["input_ids"] = IDS_100K if size == "100k ids" else IDS_100K * 4
    request["rid"] = "rollout-7"  # after the ids, as a dict built in that order sends it
    body = orjson.dumps(request)
    assert b"return_sampling_mask" not in body  # the kind of body that is not parsed
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw_url(gw, "/generate"), data=io.BytesIO(body), headers=SLOW) as r,
    ):
        assert r.status == 200
        await r.content.readline()  # under way on one engine
        (owner,) = [b for b in stubs if b.generation_requests()]
        assert gw.proxy is not None and gw.proxy.owners.owner("rollout-7") == owner.url
        abort = b'{"rid": "rollout-7"}'
        async with s.post(gw_url(gw, "/abort_request"), data=abort) as a:
            assert a.status == 200
            assert [x["url"] for x in (await a.json())["results"]] == [owner.url]
        for stub in stubs:
            assert _abort_bodies(stub) == ([abort] if stub is owner else [])
    await wait_for(lambda: not gw.proxy.owners if gw.proxy else False)


# -- shared through etcd (state.backend: etcd; gateway/fleet/rid_owners.py) ----------------

OWNER = "http://127.0.0.1:30001"
PREFIX = "/rids-test/"


async def _until(probe: Callable[[], Awaitable[object]], want: object) -> None:
    async with asyncio.timeout(30):  # bounds the wait only
        while await probe() != want:
            await asyncio.sleep(0.01)


async def _count(server: EtcdServer) -> int:
    prefix = (PREFIX + "rids/").encode()
    found = await server.call(
        "/v3/kv/range",
        {"key": b64(prefix), "range_end": b64(range_end(prefix)), "count_only": True},
    )
    return int(found.get("count", 0))


@contextlib.asynccontextmanager
async def publishing(
    server: EtcdServer, owners: RidOwners
) -> AsyncIterator[tuple[RidPublisher, EtcdClient]]:
    """A publisher under a lease of its own here, as EtcdState holds one for a replica;
    revoked at the end, which takes every key written under it."""
    client = EtcdClient([server.url], timeout_s=1)
    lease = await client.grant(30)
    publisher = RidPublisher(owners, client, PREFIX, lambda: lease)
    publisher.start()
    try:
        yield publisher, client
    finally:
        await publisher.close()
        await client.revoke(lease)
        await client.close()


async def _written(publisher: RidPublisher) -> int:
    return publisher.writes


async def test_a_request_that_ends_before_its_flush_never_reaches_etcd(
    etcd: EtcdServer,  # noqa: F811
) -> None:
    owners = RidOwners()
    async with publishing(etcd, owners) as (publisher, _):
        owners.claim(["short"], OWNER)
        owners.release(["short"], OWNER)  # before any flush: nothing is left to write
        assert owners.unwritten == 0
        owners.claim(["long"], OWNER)
        await _until(lambda: etcd.get(PREFIX + "rids/long"), OWNER.encode())
        assert await etcd.get(PREFIX + "rids/short") is None
        owners.release(["long"], OWNER)
        await _until(lambda: etcd.get(PREFIX + "rids/long"), None)
        await _until(lambda: _written(publisher), 2)  # long's put and delete; short never
        assert publisher.flushes["failed"] == publisher.flushes["refused"] == 0


async def test_owners_are_written_in_transactions_of_at_most_128_keys(
    etcd: EtcdServer,  # noqa: F811
) -> None:
    owners = RidOwners()
    owners.claim([f"r-{i}" for i in range(300)], OWNER)  # in flight before sharing began
    async with publishing(etcd, owners) as (publisher, client):
        # The publisher's own count, not etcd's: a key is in etcd as soon as its
        # transaction commits, before the publisher has heard back and counted it.
        await _until(lambda: _written(publisher), 300)
        assert await _count(etcd) == 300
        assert publisher.flushes["ok"] == 3  # 128 + 128 + 44
        # Another replica, which routed none of them, finds the owner in etcd.
        other = RidPublisher(RidOwners(), client, PREFIX, lambda: 0)
        assert await other.lookup("r-299") == OWNER
        assert await other.lookup("r-300") is None
        assert other.lookups == {"local": 0, "found": 1, "unknown": 1, "failed": 0}
    # The lease was revoked: every key under it went with it.
    assert await _count(etcd) == 0


# etcd answers 400 before it has read the whole request and closes the connection, which
# aiohttp reports as a ResourceWarning: the suite's "error" filter would make that the
# failure instead of etcd's refusal.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_batch_etcd_refuses_is_dropped_and_the_rest_written(
    etcd: EtcdServer,  # noqa: F811
) -> None:
    """etcd refuses a transaction over its request limit (1.5 MiB by default): retried, it
    would be refused every time and hold up every rid behind it."""
    owners = RidOwners()
    owners.claim(["x" * 2_000_000], OWNER)  # one rid the size of a large body
    async with publishing(etcd, owners) as (publisher, _):
        await _until(lambda: _refused(publisher), 1)
        owners.claim(["after"], OWNER)
        await _until(lambda: etcd.get(PREFIX + "rids/after"), OWNER.encode())
        assert owners.unwritten == 0


async def _refused(publisher: RidPublisher) -> int:
    return publisher.flushes["refused"]


async def test_an_owner_lookup_with_etcd_away_answers_unknown() -> None:
    owners = RidOwners()
    client = EtcdClient([f"http://127.0.0.1:{free_port()}"], timeout_s=1)
    publisher = RidPublisher(owners, client, PREFIX, lambda: 0)
    try:
        assert await publisher.lookup("anything") is None
        assert publisher.lookups["failed"] == 1
        owners.claim(["mine"], OWNER)
        assert await publisher.lookup("mine") == OWNER  # routed here: no etcd read
        assert publisher.lookups["local"] == 1
    finally:
        await client.close()


async def test_an_owner_lookup_while_etcd_is_known_away_asks_nothing(
    etcd: EtcdServer,  # noqa: F811
) -> None:
    """While the replica knows etcd is away, an abort goes to every engine at once instead of
    waiting out the lookup's bound for each rid."""
    client = EtcdClient([etcd.url], timeout_s=1)
    up = False
    publisher = RidPublisher(RidOwners(), client, PREFIX, lambda: 0, store_up=lambda: up)
    try:
        await etcd.call("/v3/kv/put", {"key": b64(f"{PREFIX}rids/r".encode()), "value": b64(b"u")})
        assert await publisher.lookup("r") is None  # etcd holds it, but is not asked
        assert publisher.lookups["failed"] == 1
        up = True
        assert await publisher.lookup("r") == "u"
    finally:
        await client.close()
