"""`python -m gateway.testing.stub`: the stub as a process (compose, `sglang-gateway stub`)."""

from __future__ import annotations

import argparse
import contextlib
import os

from gateway import runtime
from gateway.testing.stub import app
from gateway.testing.stub.admin import start_admin
from gateway.testing.stub.app import StubBackend
from gateway.testing.stub.cache import PrefixCache
from gateway.testing.stub.pd import PdStub


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.testing.stub", description=app.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--admin-port",
        type=int,
        # A string default goes through type=int, so a bad variable fails like a bad flag.
        default=os.environ.get("GATEWAY_ADMIN_PORT") or None,
        help="also serve /livez and /readyz here, on --host (default: $GATEWAY_ADMIN_PORT, "
        "which the image sets; unset: no admin listener, as SGLang has none)",
    )
    parser.add_argument("--model", default="stub-model")
    parser.add_argument(
        "--release", default="0.5.19", help="the SGLang release whose admission it plays"
    )
    parser.add_argument(
        "--sampling-mask-max-tokens", type=int, default=4096, help="the cap (0.5.20 and later)"
    )
    parser.add_argument(
        "--speculative-algorithm", default=None, help="as if speculative decoding were on"
    )
    parser.add_argument("--delay-ms", type=int, default=0)
    parser.add_argument("--chunk-delay-ms", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=None)
    parser.add_argument("--drop", choices=("before-headers", "mid-body"), default=None)
    parser.add_argument(
        "--keep", type=int, default=1000, help="requests remembered (the newest; default 1000)"
    )
    parser.add_argument(
        "--keep-body-bytes",
        type=int,
        default=4096,
        help="bytes of each remembered body (default 4096); the sha256 is of the whole body",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="tokens the prefix cache holds (LRU; default 0: no cache, cached_tokens 0)",
    )
    parser.add_argument(
        "--prefix-block-tokens", type=int, default=16, help="tokens per cached block (16)"
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="prefill time per uncached prompt token, queued per engine (default 0: none)",
    )
    parser.add_argument(
        "--pd-role",
        choices=("prefill", "decode"),
        default=None,
        help="one half of a prefill/decode pair (default: a regular engine)",
    )
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=8998,
        help="a prefill stub's bootstrap port, where decode stubs fetch each room (8998)",
    )
    parser.add_argument(
        "--prefill-ms", type=int, default=0, help="a prefill stub's work per request (0)"
    )
    return parser.parse_args(argv)


def _prefix_cache(args: argparse.Namespace) -> PrefixCache | None:
    if args.prefix_cache_tokens <= 0 and args.prefill_us_per_token <= 0:
        return None
    try:
        return PrefixCache(
            max(args.prefix_cache_tokens, 0),
            args.prefix_block_tokens,
            args.prefill_us_per_token / 1e6,
        )
    except ValueError as exc:
        raise SystemExit(f"stub: {exc}") from exc


async def _serve(args: argparse.Namespace) -> None:
    stub = StubBackend(
        model=args.model,
        delay_s=args.delay_ms / 1000,
        chunk_delay_s=args.chunk_delay_ms / 1000,
        fail_status=args.fail_status,
        drop=args.drop,
        keep=args.keep,
        keep_body_bytes=args.keep_body_bytes,
        version=args.release,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        speculative_algorithm=args.speculative_algorithm,
        prefix_cache=_prefix_cache(args),
        pd=None
        if args.pd_role is None
        else PdStub(
            args.pd_role, bootstrap_port=args.bootstrap_port, prefill_s=args.prefill_ms / 1000
        ),
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    # Signals first: a SIGTERM right after the banner below must stop, not kill.
    async with runtime.Signals() as signals, contextlib.AsyncExitStack() as stack:
        port = await stub.start(args.host, args.port)
        stack.push_async_callback(stub.stop)
        if args.admin_port is not None:
            admin, admin_port = await start_admin(stub, args.host, args.admin_port)
            stack.push_async_callback(admin.cleanup)
            print(f"stub admin on http://{host}:{admin_port} (/livez, /readyz)", flush=True)
        if stub.pd is not None and stub.pd.role == "prefill":
            print(f"stub bootstrap on port {stub.pd.bootstrap_port}", flush=True)
        # Printed last: once it shows, every listener is up.
        print(f"stub listening on http://{host}:{port}", flush=True)
        await signals.wait()


def main(argv: list[str] | None = None) -> None:
    runtime.run(_serve(_parse_args(argv)))
