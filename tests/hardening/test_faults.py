"""Reliability checklist, "Faults" (shared/reliability-checklist.md), one test (or more) per row."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.app import Gateway
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, gw_url, wait_for
from tests.hardening.checks import assert_no_internals, fd_count, vmrss_kib
from tests.hardening.rawnet import FaultBackend, ScriptedBackend

ROOT = Path(__file__).resolve().parents[2]
JSON = {"Content-Type": "application/json"}
OK = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
STREAM = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 2}})


async def settle(predicate: object, timeout: float = 30.0) -> None:
    await wait_for(predicate, timeout)  # type: ignore[arg-type]


# -- backend dies mid-stream ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_backend_process_dying_mid_stream_breaks_the_transfer(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession, stream: bool
) -> None:
    """The stub is stopped (its process would have died) while a reply is half sent."""
    stub = StubBackend()
    await stub.start()
    spare = StubBackend()
    await spare.start()
    gw = await make_gateway(stub.url, spare.url, backends={"health": {"enabled": False}})
    hdrs = {**JSON, "X-Stub-Chunk-Delay-Ms": "50", "X-Stub-Events": "200"}
    body = STREAM
    if not stream:
        body = OK
        hdrs["X-Stub-Response-Bytes"] = str(32 << 20)
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(gw_url(gw, "/generate"), data=body, headers=hdrs) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                got += chunk
                if len(got) > 300 and stub.received:
                    await stub.stop()  # the backend goes away mid-body
    assert not got.endswith(b"data: [DONE]\n\n")
    # The gateway keeps serving (on whichever backend is still there).
    for _ in range(3):
        async with session.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r:
            assert r.status == 200
    await spare.stop()


async def test_backend_short_body_is_a_broken_transfer(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    backend = FaultBackend(mode="short_body")
    await backend.start()
    try:
        gw = await make_gateway(backend.url, backends={"health": {"enabled": False}})
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r:
                assert r.status == 200
                await r.read()
        assert backend.requests == 1
    finally:
        await backend.stop()


class _BadChunkAfterHead(ScriptedBackend):
    """A streamed answer whose second chunk has a size that is not hex, sent after the
    first chunk has been relayed: the parser fails mid-body."""

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n8\r\ndata: 1\n\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"zz\r\ndata: 2\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)  # keeps the connection open: only the parse can end it
        return False


async def test_a_bad_chunk_mid_body_aborts_the_client_transfer_at_once(
    make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    """No idle or total timeout configured: the parse error alone must end the relay,
    visibly to the client (no terminal chunk), instead of holding it until the backend
    closes."""
    backend = _BadChunkAfterHead()
    url = await backend.start()
    try:
        gw = await make_gateway(url, backends={"health": {"enabled": False}})
        started = asyncio.get_running_loop().time()
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r:
                assert r.status == 200
                await r.read()
        assert asyncio.get_running_loop().time() - started < 2
        await settle(lambda: gw.proxy is not None and gw.proxy.inflight == 0)
    finally:
        await backend.stop()


# -- client disconnects ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_closes_upstream_and_leaks_nothing(
    stub: StubBackend, gateway: Gateway, stream: bool
) -> None:
    hdrs = {**JSON, "X-Stub-Delay-Ms": "0" if stream else "10000"}
    if stream:
        hdrs.update({"X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "1000"})
    async with (
        aiohttp.ClientSession() as warm,  # warm up pools and lazily created state
        warm.post(gw_url(gateway, "/generate"), data=OK, headers=JSON) as r,
    ):
        await r.read()
    await asyncio.sleep(0.1)
    fds, tasks = fd_count(), len(asyncio.all_tasks())
    loop = asyncio.get_running_loop()
    for i in range(3):
        stub.disconnect_event.clear()
        async with aiohttp.ClientSession() as s:

            async def call(s: aiohttp.ClientSession = s) -> None:
                async with s.post(
                    gw_url(gateway, "/generate"), data=STREAM if stream else OK, headers=hdrs
                ) as r:
                    await r.read()

            task = asyncio.create_task(call())
            await wait_for(lambda i=i: len(stub.generation_requests()) == 2 + i)  # type: ignore[misc]
            await asyncio.sleep(0.2)  # streaming, or waiting for the (delayed) reply
            gone = loop.time()
            task.cancel()  # the client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.wait_for(stub.disconnect_event.wait(), timeout=30)
        assert loop.time() - gone < 1.0
    assert stub.cancelled == 3
    await settle(lambda: gateway.proxy is not None and gateway.proxy.inflight == 0)
    await settle(lambda: fd_count() <= fds and len(asyncio.all_tasks()) <= tasks)
    assert all(b.inflight == 0 for b in gateway.pool.backends)


async def test_client_leaving_a_silent_stream_closes_the_upstream_at_once(
    stub: StubBackend, gateway: Gateway
) -> None:
    """Mid-stream, between two events far apart: the upstream is closed when the client
    leaves, not when the next event finds no one to take it."""
    hdrs = {**JSON, "X-Stub-Chunk-Delay-Ms": "5000", "X-Stub-Events": "3"}
    loop = asyncio.get_running_loop()
    stub.disconnect_event.clear()
    async with aiohttp.ClientSession() as s:

        async def call() -> None:
            async with s.post(gw_url(gateway, "/generate"), data=STREAM, headers=hdrs) as r:
                await r.content.readline()  # the first event; the next is 5 s away
                await asyncio.sleep(60)

        task = asyncio.create_task(call())
        await wait_for(lambda: len(stub.generation_requests()) == 1)
        await asyncio.sleep(0.5)
        gone = loop.time()
        task.cancel()  # the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await asyncio.wait_for(stub.disconnect_event.wait(), timeout=30)
    assert loop.time() - gone < 1.0
    await settle(lambda: gateway.proxy is not None and gateway.proxy.inflight == 0)


# -- refused, reset, garbage, hung backends -------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "status"),
    [
        ("refused", 503),
        ("garbage", 502),
        ("bad_status", 502),
        ("close", 502),
        ("reset", 502),
        ("reset_on_accept", 502),
        ("hang", 504),
        ("half_headers", 504),
    ],
)
async def test_bad_backends_get_a_bounded_generic_answer(
    make_gateway: GatewayFactory,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    status: int,
) -> None:
    backend = FaultBackend(mode="ok" if mode == "refused" else mode)
    await backend.start()
    url = backend.url
    if mode == "refused":
        await backend.stop()  # nothing listens there any more
    ttfb_s = 0.5
    gw = await make_gateway(
        url, backends={"health": {"enabled": False}}, timeouts={"ttfb_s": ttfb_s}
    )
    caplog.set_level("INFO", logger="gateway.access")
    loop = asyncio.get_running_loop()
    try:
        for path, body in (("/generate", OK), ("/v1/chat/completions", b'{"messages": []}')):
            started = loop.time()
            async with session.post(gw_url(gw, path), data=body, headers=JSON) as r:
                data = await r.read()
                assert r.status == status, data
                if status == 503:
                    assert r.headers["Retry-After"]
            elapsed = loop.time() - started
            assert elapsed < ttfb_s + 1.0, elapsed
            assert_no_internals(data, addresses=[url])
            assert orjson.loads(data)
        # Sent at most once each: a request that may have reached SGLang is never replayed.
        assert backend.requests <= 2
        if mode in ("garbage", "bad_status", "close", "reset", "hang", "half_headers"):
            assert backend.requests == 2
        # The detail is logged under the request id.
        details = [
            orjson.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"
        ]
        assert all(d["status"] == status for d in details)
        if status == 502:
            assert all(d.get("detail") for d in details)
    finally:
        await backend.stop()


async def test_reset_after_send_is_never_replayed_even_with_spare_backends(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    resetter = FaultBackend(mode="reset")
    await resetter.start()
    try:
        gw = await make_gateway(
            resetter.url,
            stub.url,
            backends={"balancer": "round_robin", "health": {"enabled": False}},
        )
        statuses = []
        for i in range(6):
            hdrs = {**JSON, "X-Request-Id": f"once-{i}"}
            async with session.post(gw_url(gw, "/generate"), data=OK, headers=hdrs) as r:
                statuses.append(r.status)
        assert sorted(statuses) == [200, 200, 200, 502, 502, 502]
        assert resetter.requests == 3
        seen = [r.headers["X-Request-Id"] for r in stub.generation_requests()]
        reset_ids = {
            line.split(b":", 1)[1].strip().decode()
            for req in resetter.received
            for line in req.split(b"\r\n")
            if line.lower().startswith(b"x-request-id:")
        }
        assert len(reset_ids) == 3 and not reset_ids & set(seen)  # none of them re-sent
    finally:
        await resetter.stop()


# -- SIGTERM with streams in flight ---------------------------------------------------------------


@pytest.fixture
async def gateway_process(
    stub: StubBackend, tmp_path: Path
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, int]]:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        f"backends: {{static: ['{stub.url}'], health: {{interval_s: 0.2}}}}\n"
        "timeouts: {shutdown_grace_s: 2}\nlogging: {access_log: false}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "--config",
        str(cfg),
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    port = admin = 0
    async with asyncio.timeout(20):
        while not port:
            line = (await proc.stderr.readline()).decode()
            assert line, "gateway exited before listening"
            m = re.search(r"listening on 127\.0\.0\.1:(\d+) \(admin 127\.0\.0\.1:(\d+)\)", line)
            if m:
                port, admin = int(m.group(1)), int(m.group(2))
    yield proc, port, admin
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


@pytest.mark.heavy
async def test_sigterm_drains_streams_within_grace_then_exits_0(
    stub: StubBackend, gateway_process: tuple[asyncio.subprocess.Process, int, int]
) -> None:
    proc, port, admin = gateway_process
    short = {**JSON, "X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "8"}  # ~0.8 s
    long = {**JSON, "X-Stub-Chunk-Delay-Ms": "100", "X-Stub-Events": "600"}  # 60 s
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
            pass
        await asyncio.sleep(0.3)  # a probe has marked the backend healthy

        async def stream(headers: dict[str, str]) -> bytes:
            async with s.post(
                f"http://127.0.0.1:{port}/generate", data=STREAM, headers=headers
            ) as r:
                assert r.status == 200
                return await r.read()

        streams = [asyncio.create_task(stream(short)) for _ in range(5)]
        cut = asyncio.create_task(stream(long))
        await wait_for(lambda: len(stub.generation_requests()) == 6)
        loop = asyncio.get_running_loop()
        term = loop.time()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
            assert r.status == 503  # readiness fails at once
            assert (await r.json())["reason"] == "draining"
        with pytest.raises(aiohttp.ClientConnectorError):
            async with s.get(f"http://127.0.0.1:{port}/health"):
                pass
        for done in await asyncio.gather(*streams):
            assert done.endswith(b"data: [DONE]\n\n")  # streams within the grace complete
        with pytest.raises(aiohttp.ClientPayloadError):
            await cut  # a stream longer than the grace period is cut, visibly
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
        assert loop.time() - term < 2 + 3


# -- keep-alive race with a backend that closes idle connections ----------------------------------


async def keepalive_race(
    make_gateway: GatewayFactory, idle_close_s: float, upstream_keepalive_s: float, rounds: int
) -> list[int]:
    stub = StubBackend(idle_close_s=idle_close_s)
    await stub.start()
    try:
        gw = await make_gateway(
            stub.url,
            backends={"health": {"enabled": False}},
            timeouts={"upstream_keepalive_s": upstream_keepalive_s},
        )
        statuses: list[int] = []
        async with aiohttp.ClientSession() as s:

            async def one() -> None:
                async with s.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r:
                    await r.read()
                    statuses.append(r.status)

            # Idle gaps around the backend's idle timeout, with several pooled connections.
            for i in range(rounds):
                gap = idle_close_s * (0.5 + (i % 7) * 0.12)
                await asyncio.gather(*(one() for _ in range(1 + i % 3)))
                await asyncio.sleep(gap)
        return statuses
    finally:
        await stub.stop()


@pytest.mark.heavy
async def test_keepalive_race_with_a_backend_closing_idle_connections(
    make_gateway: GatewayFactory,
) -> None:
    """Scaled down from uvicorn's 5 s: the backend closes after 0.3 s, the pool after 0.2 s."""
    statuses = await keepalive_race(make_gateway, 0.3, 0.2, rounds=8)
    assert statuses and set(statuses) == {200}


@pytest.mark.heavy
async def test_keepalive_race_worst_case_never_reaches_a_client(
    make_gateway: GatewayFactory,
) -> None:
    """The race made deterministic: a request on a connection the backend considers idle
    for longer than its timeout is reset unanswered (it crossed the close in flight). The
    gateway's pool must retire idle connections before the backend does."""
    backend = FaultBackend(mode="idle_close", idle_close_s=0.3)
    await backend.start()
    try:
        gw = await make_gateway(
            backend.url,
            backends={"health": {"enabled": False}},
            timeouts={"upstream_keepalive_s": 0.2},
        )
        statuses: list[int] = []
        async with aiohttp.ClientSession() as s:
            for i in range(9):
                for _ in range(1 + i % 2):
                    async with s.post(gw_url(gw, "/generate"), data=OK, headers=JSON) as r:
                        await r.read()
                        statuses.append(r.status)
                await asyncio.sleep(0.3 * (0.4 + (i % 6) * 0.25))  # 0.12 s .. 0.495 s idle
        assert set(statuses) == {200}, statuses
        assert backend.lost == 0
    finally:
        await backend.stop()


@pytest.mark.slow
# 14 rounds of waiting out a 5 s idle close: over a minute of sleeps before any load.
@pytest.mark.timeout(300)
async def test_keepalive_race_at_uvicorn_timings(make_gateway: GatewayFactory) -> None:
    """The real numbers: uvicorn closes idle connections after 5 s; the default pool after 4 s."""
    statuses = await keepalive_race(make_gateway, 5.0, 4.0, rounds=14)
    assert statuses and set(statuses) == {200}


# -- slowloris, slow bodies, a client that stops reading ------------------------------------------


async def test_slowloris_headers_are_cut_at_the_deadline(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url, timeouts={"client_keepalive_s": 1})
    loop = asyncio.get_running_loop()

    async def drip(idle_first: bool) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        started = loop.time()
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with contextlib.suppress(ConnectionError):
            if not idle_first:
                for i in range(len(head)):
                    writer.write(head[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    if reader.at_eof():
                        break
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing sent
        writer.close()
        return loop.time() - started

    # Idle, and one byte every 50 ms: both closed at the 1 s deadline, not kept alive.
    for took in await asyncio.gather(drip(True), drip(False), drip(False)):
        assert 0.8 < took < 2.0, took
    assert stub.generation_requests() == []


async def test_slow_body_is_408_at_the_deadline(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(stub.url, timeouts={"body_read_s": 1})
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    loop = asyncio.get_running_loop()
    started = loop.time()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    await writer.drain()

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                await asyncio.sleep(0.2)
                writer.write(b" ")
                await writer.drain()

    trickling = asyncio.create_task(trickle())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    took = loop.time() - started
    trickling.cancel()
    writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert 0.9 < took < 2.0
    assert stub.generation_requests() == []


@pytest.mark.heavy
async def test_client_that_stops_reading_a_64mb_response_pauses_the_upstream(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    gateway = await make_gateway(stub.url, backends={"health": {"enabled": False}})
    size = 64 << 20
    request = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Stub-Response-Bytes: %d\r\nContent-Length: %d\r\n\r\n%s" % (size, len(OK), OK)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port, limit=1 << 16)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_RCVBUF, 1 << 16)
    rss_before = vmrss_kib()
    writer.write(request)
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(1 << 16)
    writer.transport.pause_reading()  # the client stops reading
    completed = stub.completed
    await asyncio.sleep(2.0)
    grown_mib = (vmrss_kib() - rss_before) / 1024
    assert stub.completed == completed  # the stub is still blocked writing: backpressure
    assert grown_mib < 24, f"RSS grew {grown_mib:.1f} MiB with a 64 MiB reply unread"
    stub.disconnect_event.clear()
    writer.transport.abort()  # the client goes away: the upstream is closed too
    await asyncio.wait_for(stub.disconnect_event.wait(), 30)
    await settle(lambda: gateway.proxy is not None and gateway.proxy.inflight == 0)


async def test_a_client_that_pauses_reading_gets_the_whole_response(
    stub: StubBackend, make_gateway: GatewayFactory
) -> None:
    """The other half of backpressure: once a slow client drains its buffer, reading from
    the paused backend resumes, and every byte arrives."""
    gateway = await make_gateway(stub.url, backends={"health": {"enabled": False}})
    size = 16 << 20
    request = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Stub-Response-Bytes: %d\r\nContent-Length: %d\r\n\r\n%s" % (size, len(OK), OK)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port, limit=1 << 16)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_RCVBUF, 1 << 16)
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    got = 0
    async with asyncio.timeout(20):
        while got < length:
            got += len(await reader.readexactly(min(1 << 20, length - got)))
            writer.transport.pause_reading()  # a reader that stops now and then
            await asyncio.sleep(0.05)
            writer.transport.resume_reading()
    writer.close()
    assert got == length >= size


# -- connection pool exhausted --------------------------------------------------------------------


@pytest.mark.heavy
async def test_pool_exhaustion_is_a_quick_503_and_does_not_eject_the_backend(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession
) -> None:
    gw = await make_gateway(
        stub.url,
        backends={
            "max_inflight_per_backend": 2,
            "queue_timeout_s": 0,  # no waiting for a slot: answer at once
            "health": {"enabled": False},
        },
    )
    # Long enough that an answer which waited for a slot could only come after these end.
    slow = {**JSON, "X-Stub-Delay-Ms": "4000"}

    async def one(headers: dict[str, str]) -> tuple[int, float, str | None]:
        started = time.monotonic()
        async with session.post(gw_url(gw, "/generate"), data=OK, headers=headers) as r:
            await r.read()
            return r.status, time.monotonic() - started, r.headers.get("Retry-After")

    busy = [asyncio.create_task(one(slow)) for _ in range(2)]
    await wait_for(lambda: len(stub.generation_requests()) == 2)
    status, _, retry_after = await one(JSON)
    assert status == 503 and retry_after, status
    # Answered while both slots were still taken: it did not wait for one to free.
    assert not any(t.done() for t in busy), "waited for a pooled connection"
    assert [s for s, _, _ in await asyncio.gather(*busy)] == [200, 200]
    # Capacity is back: the backend was not ejected for being busy.
    status, _, _ = await one(JSON)
    assert status == 200
    async with session.get(admin_url(gw, "/metrics")) as r:
        assert r.status == 200
