"""Fallback upstream for machines without nginx (CI smoke runs): asyncio + uvloop, canned bytes.

It answers the same ports and shapes as the nginx upstream in `servers.py`, but it is a
Python process: fine for checking that every workload flows end to end, not fast enough
for its throughput numbers to mean anything. Run as `python -m bench.pyupstream`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import cast

from bench import bodies

_OPS = b'{"model_path":"bench","tokenizer_path":null,"is_generation":true,"status":"ok"}'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def _head(status: int, ctype: bytes, length: int, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
        status,
        ctype,
        length,
        extra,
    )


class Upstream(asyncio.Protocol):
    def __init__(self, kind: str, files: Path, sse_slow_s: float) -> None:
        self.kind = kind
        self.files = files
        self.sse_slow_s = sse_slow_s
        self.buf = bytearray()
        self.discard = 0
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.discard:
            take = min(self.discard, len(data))
            self.discard -= take
            data = data[take:]
        self.buf += data
        while not self.discard and not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            del self.buf[: end + 4]
            method, path, _ = head[0].split(" ", 2)
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            take = min(length, len(self.buf))
            del self.buf[:take]
            self.discard = length - take
            self.respond(method, path.partition("?")[0])

    def respond(self, method: str, path: str) -> None:
        t = self.transport
        assert t is not None
        if method != "POST" or path not in ("/generate", "/v1/chat/completions"):
            t.write(_head(200, b"application/json", len(_OPS)) + _OPS)
        elif self.kind == "canned":
            body = bodies.canned_chat() if path.startswith("/v1") else bodies.canned_generate()
            t.write(_head(200, b"application/json", len(body)) + body)
        elif self.kind in ("resp4m", "respbig"):
            name = "resp-4m.json" if self.kind == "resp4m" else "resp-big.json"
            data = (self.files / name).read_bytes()
            t.write(_head(200, b"application/json", len(data)) + data)
        elif self.kind == "sse200":  # chunked, as SGLang streams: one chunk per event
            events = (self.files / "sse-200.txt").read_bytes().split(b"\n\n")[:-1]
            t.write(_SSE_HEAD + b"".join(_chunk(ev + b"\n\n") for ev in events) + b"0\r\n\r\n")
        else:
            self.busy = True
            asyncio.get_running_loop().create_task(self.slow_sse())

    async def slow_sse(self) -> None:
        t = self.transport
        assert t is not None
        data = (self.files / "sse-slow.txt").read_bytes()
        events = data.split(b"\n\n")[:-1]
        t.write(_SSE_HEAD)
        pause = self.sse_slow_s / max(1, len(events))
        for ev in events:
            if t.is_closing():
                return
            t.write(_chunk(ev + b"\n\n"))
            await asyncio.sleep(pause)
        t.write(b"0\r\n\r\n")
        self.busy = False
        if self.buf:
            self.data_received(b"")


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ports", required=True, help="kind=port,kind=port,...")
    p.add_argument("--files", required=True, type=Path)
    p.add_argument("--sse-slow-s", type=float, default=10.0)
    args = p.parse_args()
    loop = asyncio.get_running_loop()
    servers = []
    for spec in args.ports.split(","):
        kind, _, port = spec.partition("=")
        servers.append(
            await loop.create_server(
                lambda kind=kind: Upstream(kind, args.files, args.sse_slow_s),
                "127.0.0.1",
                int(port),
                backlog=4096,
            )
        )
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(main())
