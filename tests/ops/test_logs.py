"""The process's log output: JSON on both streams, the access log's fields, and its
batched writer (real pipes, real processes)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.ops.logs import AccessWriter
from gateway.testing.stub import StubBackend
from tests.conftest import cli_gateway

ROOT = Path(__file__).resolve().parents[2]

JSON = {"Content-Type": "application/json"}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


async def test_json_format_makes_every_line_json(stub: StubBackend, tmp_path: Path) -> None:
    """Operational lines (stderr) and access lines (stdout) alike, each with a level."""
    async with (
        cli_gateway(tmp_path, "--backend", stub.url, "--log-level", "debug") as (
            port,
            out_path,
            err_path,
        ),
        aiohttp.ClientSession() as s,
    ):
        base = f"http://127.0.0.1:{port}"
        headers = {**JSON, "User-Agent": "rollout-worker/7", "traceparent": TRACEPARENT}
        plain = orjson.dumps({"text": "x", "sampling_params": {"top_k": 2}})
        async with s.post(f"{base}/generate?x=1", data=plain, headers=headers) as r:
            assert r.status == 200
            await r.read()
        streamed = orjson.dumps({"text": "x", "stream": True})
        async with s.post(f"{base}/generate", data=streamed, headers=JSON) as r:
            assert r.status == 200
            await r.read()
        async with s.get(f"{base}/no/such/path") as r:
            assert r.status == 404
        async with s.post(f"{base}/generate", data=b"{", headers=JSON) as r:
            assert r.status == 400
    out, err = out_path.read_text(), err_path.read_text()
    for stream, text in (("stdout", out), ("stderr", err)):
        lines = text.splitlines()
        assert lines, stream
        for line in lines:
            record = orjson.loads(line)  # raises on a plain-text line
            assert record["level"] in {"debug", "info", "warning", "error", "critical"}, line
            assert record["ts"].endswith("Z")
    access = [orjson.loads(line) for line in out.splitlines()]
    assert [a["status"] for a in access] == [200, 200, 404, 400]
    first, stream_line, unknown, bad = access
    assert first["client"] == "127.0.0.1"
    assert first["path"] == "/generate"  # the query string is never logged
    assert first["http"] == "1.1"
    assert first["user_agent"] == "rollout-worker/7"
    assert first["trace_id"] == TRACE
    assert first["streamed"] is False
    assert stream_line["streamed"] is True
    assert "trace_id" not in stream_line
    assert unknown["path"] is None and unknown["route"] == "unmatched"
    assert bad["outcome"] == "rejected:request_body"
    messages = [orjson.loads(line)["message"] for line in err.splitlines()]
    assert any("listening on" in m for m in messages)
    assert any("stopped" in m for m in messages)


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("header", "logged"),
    [
        (TRACEPARENT, TRACE),
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),  # all-zero id: invalid
        (f"ff-{TRACE}-00f067aa0ba902b7-01", None),  # version ff: invalid
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", None),  # upper-case hex: invalid
        ("garbage", None),
    ],
)
async def test_trace_id_only_from_a_valid_traceparent(
    stub: StubBackend, tmp_path: Path, header: str, logged: str | None
) -> None:
    async with (
        cli_gateway(tmp_path, "--backend", stub.url) as (port, out_path, _),
        aiohttp.ClientSession() as s,
    ):
        body = orjson.dumps({"text": "x"})
        async with s.post(
            f"http://127.0.0.1:{port}/generate", data=body, headers={**JSON, "traceparent": header}
        ) as r:
            assert r.status == 200
    (line,) = out_path.read_text().splitlines()
    assert orjson.loads(line).get("trace_id") == logged
    # The header reaches the backend untouched either way (SGLang reads it).
    assert stub.received[-1].headers.get("traceparent") == header


@pytest.mark.heavy
async def test_no_line_lost_at_sigterm(stub: StubBackend, tmp_path: Path) -> None:
    """Lines still in the batch when SIGTERM arrives are written before the exit."""
    n = 300
    async with (
        cli_gateway(tmp_path, "--backend", stub.url) as (port, out_path, _),
        aiohttp.ClientSession() as s,
    ):
        body = orjson.dumps({"text": "x"})
        url = f"http://127.0.0.1:{port}/generate"

        async def one(i: int) -> None:
            async with s.post(url, data=body, headers={**JSON, "X-Request-Id": f"r-{i}"}) as r:
                assert r.status == 200
                await r.read()

        await asyncio.gather(*(one(i) for i in range(n)))
    ids = [orjson.loads(line)["request_id"] for line in out_path.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r-{i}" for i in range(n))


# -- the writer on its own, on real pipes --------------------------------------------------


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w


def _read_all(fd: int) -> bytes:
    out = bytearray()
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


async def test_lines_wait_for_the_timer() -> None:
    r, w = _pipe()
    try:
        writer = AccessWriter(w, delay_s=0.05)
        writer.write(b'{"a":1}')
        writer.write(b'{"a":2}')
        assert _read_all(r) == b""  # buffered, not one write per line
        await asyncio.sleep(0.2)
        assert _read_all(r) == b'{"a":1}\n{"a":2}\n'
        assert writer.written_lines == 2
    finally:
        os.close(r)
        os.close(w)


async def test_a_full_batch_goes_out_at_once() -> None:
    r, w = _pipe()
    try:
        writer = AccessWriter(w, batch_bytes=1000, delay_s=60)
        line = b"x" * 99
        for _ in range(9):
            writer.write(line)
        assert _read_all(r) == b""
        writer.write(line)  # 10 lines of 100 bytes: the batch is full
        assert _read_all(r) == (line + b"\n") * 10
    finally:
        os.close(r)
        os.close(w)


async def test_a_stalled_reader_costs_bounded_memory() -> None:
    """stdout non-blocking and full: lines wait, then the oldest are dropped and counted."""
    r, w = _pipe()
    os.set_blocking(w, False)
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # a one-page pipe fills fast
    try:
        writer = AccessWriter(w, batch_bytes=1024, delay_s=60, max_pending=8192)
        total = 400
        for i in range(total):
            writer.write(b"%05d" % i + b"y" * 94)
        assert writer.dropped_lines > 0
        assert len(writer._buf) <= 8192 + 100
        got = _read_all(r)
        writer.flush()  # the reader made room: what waited goes out now
        got += _read_all(r)
        indices = [int(line[:5]) for line in got.splitlines()]
        # Whole lines, in order, none twice; every line was written, dropped or still waits.
        assert indices == sorted(set(indices))
        assert all(line.endswith(b"y" * 94) for line in got.splitlines())
        assert len(indices) == writer.written_lines
        assert writer.written_lines + writer.dropped_lines + writer._pending_lines == total
    finally:
        os.close(r)
        os.close(w)


async def test_a_closed_stdout_drops_lines_without_failing() -> None:
    r, w = os.pipe()
    os.close(r)
    try:
        writer = AccessWriter(w, delay_s=60)
        writer.write(b"one")
        writer.flush()  # EPIPE (SIGPIPE is ignored by Python)
        writer.write(b"two")
        writer.flush()
        assert writer.dropped_lines == 2
        assert writer.written_lines == 0
    finally:
        os.close(w)


_WRITER = """
import os, sys
from gateway.ops.logs import AccessWriter
fd, tag = int(sys.argv[1]), sys.argv[2].encode()
writer = AccessWriter(fd, batch_bytes=1 << 16, delay_s=60)
for i in range(3000):
    writer.write(tag * 40 + b"-%d" % i)
writer.drain()
"""


async def test_workers_sharing_a_pipe_never_interleave_mid_line(tmp_path: Path) -> None:
    """--workers N: several processes write large batches to one stdout pipe at once."""
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    r, w = os.pipe()
    writers = [
        await asyncio.create_subprocess_exec(
            sys.executable, str(script), str(w), tag, pass_fds=(w,), cwd=ROOT
        )
        for tag in ("a", "b", "c")
    ]
    os.close(w)
    data = bytearray()
    loop = asyncio.get_running_loop()
    while chunk := await loop.run_in_executor(None, os.read, r, 1 << 16):
        data += chunk
    os.close(r)
    for proc in writers:
        assert await proc.wait() == 0
    lines = data.decode().splitlines()
    assert len(lines) == 9000
    for line in lines:
        body, _, index = line.partition("-")
        assert body in {"a" * 40, "b" * 40, "c" * 40}, line[:80]
        assert index.isdigit()


async def test_a_reader_that_stops_reading_never_blocks_the_loop() -> None:
    """stdout as it usually is, a blocking pipe, and a reader that stopped: the loop keeps
    running, lines wait, then the oldest are dropped; once the reader reads again, what
    arrives is whole lines in order."""
    r, w = os.pipe()  # both ends blocking
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    try:
        writer = AccessWriter(w, batch_bytes=2048, delay_s=0.01, max_pending=16384)
        total = 2000
        async with asyncio.timeout(5):  # a blocking write would hang here for good
            for i in range(total):
                writer.write(b"%05d" % i + b"z" * 295)
                if i % 50 == 0:
                    await asyncio.sleep(0)
        assert writer.dropped_lines > 0
        assert len(writer._buf) <= 16384 + 300
        os.set_blocking(r, False)
        got = _read_all(r)
        writer.flush()
        got += _read_all(r)
        lines = got.splitlines()
        indices = [int(line[:5]) for line in lines]
        assert indices == sorted(set(indices))
        assert all(len(line) == 300 for line in lines)
    finally:
        os.close(r)
        os.close(w)


async def test_an_overlong_line_written_in_part_is_never_merged_with_another() -> None:
    r, w = _pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    try:
        writer = AccessWriter(w, batch_bytes=1 << 20, delay_s=60, max_pending=7000)
        writer.write(b"A" * 6000)  # longer than a pipe page: goes out in pieces
        writer.flush()  # the first 4096 bytes fit; the rest waits
        for _ in range(3):
            writer.write(b"B" * 3000)
        writer.flush()  # over max_pending: B lines are dropped, never A's rest
        got = _read_all(r)
        writer.drain(timeout_s=0.2)
        got += _read_all(r)
        writer.drain(timeout_s=0.2)
        got += _read_all(r)
        lines = got.splitlines()
        assert lines[0] == b"A" * 6000
        assert all(line == b"B" * 3000 for line in lines[1:])
    finally:
        os.close(r)
        os.close(w)


def test_a_second_event_loop_still_gets_its_lines_flushed() -> None:
    r, w = _pipe()
    try:
        writer = AccessWriter(w, delay_s=0.02)

        async def one(tag: bytes) -> bytes:
            writer.write(tag)
            await asyncio.sleep(0.1)
            return _read_all(r)

        assert asyncio.run(one(b"first")) == b"first\n"
        writer.write(b"between")  # outside any loop: written at once
        assert _read_all(r) == b"between\n"
        assert asyncio.run(one(b"second")) == b"second\n"
    finally:
        os.close(r)
        os.close(w)


def test_a_full_disk_loses_the_batch_but_not_the_writer() -> None:
    fd = os.open("/dev/full", os.O_WRONLY)  # every write fails with ENOSPC
    try:
        writer = AccessWriter(fd, delay_s=60)
        writer.write(b"one")
        writer.write(b"two")
        assert writer.dropped_lines == 2
        assert not writer._broken  # unlike EPIPE: a later write may succeed again
        assert writer._buf == bytearray()
    finally:
        os.close(fd)


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    return head


async def test_undecodable_user_agent_and_templated_paths_are_logged_safely(
    stub: StubBackend, tmp_path: Path
) -> None:
    """A User-Agent byte that is not UTF-8 cannot reach the JSON encoder (it once turned a
    415 into a bare 500 and lost the line), and what fills /workers/{id} is client text."""
    async with cli_gateway(tmp_path, "--backend", stub.url) as (port, out_path, _):
        head = await _raw(
            port,
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            b"User-Agent: bad\xff agent\r\nX-Request-Id: ua-1\r\nContent-Length: 2\r\n\r\n{}",
        )
        assert head.startswith(b"HTTP/1.1 415 "), head
        assert b"X-Request-Id: ua-1" in head
        head = await _raw(
            port, b"GET /workers/sk-live-SECRET-123?api_key=QQQ HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert head.startswith(b"HTTP/1.1 404 "), head  # no registry in this config
    out = out_path.read_text()
    assert "SECRET" not in out and "QQQ" not in out
    first, second = (orjson.loads(line) for line in out.splitlines())
    assert first["request_id"] == "ua-1"
    assert first["user_agent"] == "bad\ufffd agent"
    assert second["path"] == "/workers/{id}"


async def test_the_drain_waits_for_a_slow_reader_without_holding_the_loop() -> None:
    """Gateway.stop flushes the last lines: the loop keeps running while it waits, and what
    a reader that never reads leaves behind is dropped and counted at the deadline."""
    r, w = os.pipe()  # blocking, like stdout
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    try:
        writer = AccessWriter(w, delay_s=60)
        for i in range(100):
            writer.write(b"%03d" % i + b"q" * 96)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        async with asyncio.timeout(30):
            await writer.settle(timeout_s=0.3)
        ticker.cancel()
        assert ticks >= 10  # the loop ran all along
        assert writer.written_lines + writer.dropped_lines == 100
        assert writer.dropped_lines > 0 and writer._buf == bytearray()
    finally:
        os.close(r)
        os.close(w)
