"""`sglang-gateway demo`: the bundled stub backend and a gateway in front of it, in one process.

For a first look without a GPU: the stub answers like SGLang 0.5.19, the gateway listens
where clients would point, and the banner prints two requests to try (one refused at the
edge by the sampling-mask rule, one forwarded).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gateway import config as config_mod
from gateway import runtime
from gateway.app import Gateway
from gateway.edge.aio import check_runtime
from gateway.ops import logs
from gateway.testing.stub import StubBackend

_BANNER = """
sglang-gateway demo: gateway http://{host}:{port} -> stub SGLang backend {stub}
admin: http://{host}:{admin}/readyz  http://{host}:{admin}/metrics

Refused at the edge (mask requested, no finite top_k):
  curl -s http://{host}:{port}/generate -H 'Content-Type: application/json' \\
    -d '{{"text": "Hello", "sampling_params": {{"temperature": 1.0, "top_p": 0.99, \\
    "max_new_tokens": 4}}, "return_sampling_mask": true}}'

Forwarded (finite top_k):
  curl -s http://{host}:{port}/generate -H 'Content-Type: application/json' \\
    -d '{{"text": "Hello", "sampling_params": {{"temperature": 1.0, "top_k": 5, \\
    "max_new_tokens": 4}}, "return_sampling_mask": true}}'

Ctrl-C to stop.
"""


async def _run(host: str, port: int, admin_port: int, stub_port: int) -> None:
    stub = StubBackend()
    await stub.start("127.0.0.1", stub_port)
    cfg = config_mod.build(
        {
            "listen": {"host": host, "port": port},
            "admin": {"host": host, "port": admin_port},
            "backends": {"static": [stub.url]},
            # A terminal reads the demo: access lines in text, like the messages around them.
            "logging": {"format": "text"},
        }
    )
    gateway = Gateway(cfg)
    try:
        await gateway.start()
        print(
            _BANNER.format(host=host, port=gateway.port, admin=gateway.admin_port, stub=stub.url),
            flush=True,
        )
        await runtime.until_stopped()
    finally:
        await gateway.stop()
        await stub.stop()


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="sglang-gateway demo")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--admin-port", type=int, default=8081)
    p.add_argument("--stub-port", type=int, default=30000)
    args = p.parse_args(list(argv))
    problem = check_runtime()
    if problem:
        print(f"sglang-gateway: {problem}")
        return 1
    logs.setup("info", "text")
    runtime.run(_run(args.host, args.port, args.admin_port, args.stub_port))
    return 0
