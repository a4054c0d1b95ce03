"""Load drivers that wrk cannot be: run as `python -m bench.drivers {load,sse,slow} ...`.

load  a fallback closed-loop load generator (aiohttp) for machines without wrk; prints the
      same summary line as bench/wrk/post.lua. Slow: its numbers are not comparable.
sse   N concurrent slow SSE streams through the proxy; samples the proxy's RSS before,
      with all streams open, and after; checks every stream delivered every event.
slow  one large response read by a deliberately slow reader (small SO_RCVBUF, paced
      reads) over a raw socket; samples the proxy's peak RSS while it is buffered or not.

Each prints one `BENCH_JSON {...}` line. Proxy PIDs are passed with --pids; their whole
process trees are measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from bench import common

_JSON_HEADERS = {"Content-Type": "application/json"}


def _emit(obj: dict[str, object]) -> None:
    print("BENCH_JSON " + json.dumps(obj), flush=True)


def _pids(spec: str) -> list[int]:
    return [int(p) for p in spec.split(",") if p]


def _rss(pids: list[int]) -> int:
    return common.rss_bytes(common.tree(pids)) if pids else 0


# -- load: fallback load generator --------------------------------------------------------


async def load(url: str, body: bytes, conns: int, duration: float) -> None:
    latencies: list[float] = []
    errors = {"err_connect": 0, "err_read": 0, "err_status": 0}
    nbytes = 0
    stop_at = time.perf_counter() + duration
    connector = aiohttp.TCPConnector(limit=conns)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal nbytes
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=_JSON_HEADERS) as r:
                        data = await r.read()
                        if r.status >= 400:
                            errors["err_status"] += 1
                except aiohttp.ClientConnectorError:
                    errors["err_connect"] += 1
                    continue
                except aiohttp.ClientError:
                    errors["err_read"] += 1
                    continue
                latencies.append(time.perf_counter() - t0)
                nbytes += len(data)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conns)))
        elapsed = time.perf_counter() - t0
    lat = sorted(latencies) or [0.0]

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1e6

    _emit(
        {
            "requests": len(latencies),
            "duration_us": elapsed * 1e6,
            "bytes": nbytes,
            **errors,
            "err_write": 0,
            "err_timeout": 0,
            "p50_us": pct(50),
            "p90_us": pct(90),
            "p99_us": pct(99),
            "max_us": lat[-1] * 1e6,
            "mean_us": statistics.fmean(lat) * 1e6,
        }
    )


# -- sse: many slow streams ---------------------------------------------------------------


async def sse(
    url: str, body: bytes, streams: int, *, expect: int, pids: list[int], settle: float
) -> None:
    before = _rss(pids)
    samples: list[tuple[float, int]] = []
    opened = 0
    all_open = asyncio.Event()
    done_at: list[float] = []
    connect_gate = asyncio.Semaphore(64)  # a ramp, not a SYN flood
    t0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)

    async def sampler() -> None:
        while True:
            samples.append((time.perf_counter() - t0, _rss(pids)))
            await asyncio.sleep(0.1)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> tuple[int, int, str]:
            nonlocal opened
            try:
                async with connect_gate:
                    resp = await session.post(url, data=body, headers=_JSON_HEADERS)
                opened += 1
                if opened == streams:
                    all_open.set()
                events = 0
                async with resp:
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            events += 1
                done_at.append(time.perf_counter() - t0)
                return resp.status, events, ""
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return 0, 0, type(exc).__name__

        sample_task = asyncio.create_task(sampler())
        tasks = [asyncio.create_task(one()) for _ in range(streams)]
        plateau: list[int] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(120):
                await all_open.wait()
        all_open_s = time.perf_counter() - t0 if all_open.is_set() else None
        if all_open.is_set() and not done_at:
            await asyncio.sleep(min(0.5, settle))
            for _ in range(5):  # RSS with every stream open and trickling
                if done_at:
                    break
                plateau.append(_rss(pids))
                await asyncio.sleep(0.2)
        results = await asyncio.gather(*tasks)
        finished_s = time.perf_counter() - t0
        sample_task.cancel()
    await asyncio.sleep(settle)
    after = _rss(pids)
    ok = sum(1 for status, events, _ in results if status == 200 and events == expect)
    errors: dict[str, int] = {}
    for status, events, err in results:
        if err or status != 200 or events != expect:
            key = err or f"status {status}, {events}/{expect} events"
            errors[key] = errors.get(key, 0) + 1
    during = max(plateau) if plateau else None
    peak = max((rss for _, rss in samples), default=before)
    _emit(
        {
            "streams": streams,
            "ok": ok,
            "errors": errors,
            "all_open_s": all_open_s,
            "plateau_measured_before_first_finished": bool(plateau),
            "first_finished_s": min(done_at) if done_at else None,
            "finished_s": finished_s,
            "rss_before": before,
            "rss_during": during,
            "rss_peak": peak,
            "rss_after": after,
            "per_stream_bytes": None if during is None else (during - before) / streams,
        }
    )


# -- slow: one big response, read slowly --------------------------------------------------


def slow(url: str, body: bytes, *, rate: float, rcvbuf: int, expect: int, pids: list[int]) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    before = _rss(pids)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    sock.settimeout(60)
    sock.connect((host, port))
    request = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    sock.sendall(request)
    t0 = time.perf_counter()
    got = 0
    head = b""
    status = 0
    peak = before
    next_sample = 0.0
    chunk = 16384
    while True:
        try:
            data = sock.recv(chunk)
        except TimeoutError:
            break
        if not data:
            break
        if not status:
            head += data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                continue
            status = int(head.split(b" ", 2)[1])
            got = len(head) - end - 4
            head = head[: end + 4]
        else:
            got += len(data)
        now = time.perf_counter() - t0
        if now >= next_sample:
            peak = max(peak, _rss(pids))
            next_sample = now + 0.05
        delay = got / rate - now  # pace the reads to `rate` bytes per second
        if delay > 0:
            time.sleep(delay)
    elapsed = time.perf_counter() - t0
    sock.close()
    time.sleep(0.3)
    chunked = b"chunked" in head.lower()
    _emit(
        {
            "status": status,
            "body_bytes": got,
            "expected_bytes": expect,
            # A chunked reply carries framing bytes too: only check it is not short.
            "complete": got >= expect if chunked else got == expect,
            "seconds": elapsed,
            "read_rate": got / elapsed if elapsed else 0,
            "rss_before": before,
            "rss_peak": peak,
            "rss_after": _rss(pids),
            "peak_over_baseline": peak - before,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.drivers")
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("load")
    lp.add_argument("--url", required=True)
    lp.add_argument("--body", type=Path, required=True)
    lp.add_argument("--conns", type=int, default=16)
    lp.add_argument("--duration", type=float, default=5)
    sp = sub.add_parser("sse")
    sp.add_argument("--url", required=True)
    sp.add_argument("--body", type=Path, required=True)
    sp.add_argument("--streams", type=int, default=1000)
    sp.add_argument("--expect-events", type=int, required=True)
    sp.add_argument("--pids", default="")
    sp.add_argument("--settle", type=float, default=1.0, help="seconds before the last sample")
    wp = sub.add_parser("slow")
    wp.add_argument("--url", required=True)
    wp.add_argument("--body", type=Path, required=True)
    wp.add_argument("--rate", type=float, required=True, help="bytes per second")
    wp.add_argument("--rcvbuf", type=int, default=65536)
    wp.add_argument("--expect-bytes", type=int, required=True)
    wp.add_argument("--pids", default="")
    args = p.parse_args()
    common.raise_nofile()
    body = args.body.read_bytes()
    if args.cmd == "load":
        runner = _runner()
        runner(load(args.url, body, args.conns, args.duration))
    elif args.cmd == "sse":
        runner = _runner()
        runner(
            sse(
                args.url,
                body,
                args.streams,
                expect=args.expect_events,
                pids=_pids(args.pids),
                settle=args.settle,
            )
        )
    else:
        slow(
            args.url,
            body,
            rate=args.rate,
            rcvbuf=args.rcvbuf,
            expect=args.expect_bytes,
            pids=_pids(args.pids),
        )


def _runner():  # type: ignore[no-untyped-def]
    try:
        import uvloop  # noqa: PLC0415

        return uvloop.run
    except ImportError:  # pragma: no cover
        return asyncio.run


if __name__ == "__main__":
    main()
