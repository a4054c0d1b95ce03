"""Two 64 MiB token-id bodies sent at once to a gateway, with a ticker on its loop.

    python -m tests.hardening.loop_probe    # prints the loop's longest turn as JSON

The gateway runs as `python -m gateway` runs it (gateway/runtime.py: uvloop, glibc's
malloc settings), in a process of its own, on the loop the ticker measures; the stub is
another process and the clients write from threads (the GIL is released while they send),
so the only work on this loop is the gateway's. The turns are measured in CPU time of the
loop's thread (tests/hardening/checks.py): under load the wall clock also counts the time
the thread waited for a core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading

from gateway import config as config_mod
from gateway import runtime
from gateway.app import Gateway
from tests.conftest import start_stub_process
from tests.hardening.checks import LoopTurns, loop_turns

MIB = 1 << 20


def dense_body(size: int) -> bytes:
    head, tail = b'{"input_ids": [', b'1], "sampling_params": {"top_k": 2}}'
    return head + b"1," * ((size - len(head) - len(tail)) // 2) + tail


async def two_large_bodies_at_once() -> LoopTurns:
    stub, stub_url = await start_stub_process()
    gw = Gateway(
        config_mod.build(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "admin": {"host": "127.0.0.1", "port": 0},
                "backends": {"static": [stub_url], "health": {"enabled": False}},
                "logging": {"access_log": True},
            }
        )
    )
    try:
        await gw.start()
        body = dense_body(64 * MIB - 4096)  # under limits.max_body_bytes (64 MiB)
        request = (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        replies: list[list[bytes]] = [[], []]

        def client(reply: list[bytes]) -> None:
            with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
                sock.sendall(request)
                sock.sendall(body)
                while chunk := sock.recv(65536):
                    reply.append(chunk)

        threads = [threading.Thread(target=client, args=(reply,)) for reply in replies]
        async with loop_turns(0.001) as turns:
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):
                await asyncio.sleep(0.01)
        for thread in threads:
            thread.join()
        for reply in replies:
            status = b"".join(reply)[:12]
            assert status == b"HTTP/1.1 200", status
        return turns
    finally:
        await gw.stop()
        stub.kill()
        await stub.wait()


def main() -> None:
    runtime.tune_malloc()
    turns = runtime.run(two_large_bodies_at_once())
    print(json.dumps(dataclasses.asdict(turns)))


if __name__ == "__main__":
    main()
