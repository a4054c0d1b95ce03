"""Command line: thin on purpose. Parse flags -> build the frozen config -> serve.

sglang-gateway --backend http://127.0.0.1:30000 --port 8080
sglang-gateway --config config/gateway.yaml [--check-config [--json]]
SGLANG_GATEWAY_LISTEN__PORT=9000 sglang-gateway --config ...   # any key, from the environment
sglang-gateway demo          # the bundled stub backend and a gateway in front of it
sglang-gateway stub --port 30000
sglang-gateway launch-router --worker-urls http://a:30000 --policy round_robin  # as the router
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from gateway import build, runtime
from gateway import config as config_mod
from gateway.config import ConfigError, GatewayConfig
from gateway.edge.aio import check_runtime
from gateway.ops import logs
from gateway.runtime import tune_malloc

EXIT_CONFIG = 2
_MIN_AIOHTTP = (3, 14, 2)

log = logging.getLogger("gateway")


class _Version(argparse.Action):
    """build.describe() as one line: argparse's own version action wraps it to the terminal,
    and scripts grep it (scripts/image-check.sh)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(build.describe())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sglang-gateway",
        description="Request gateway for SGLang: enforces the sampling-mask contract and "
        "forwards everything else byte for byte. Subcommands: 'demo' (stub + gateway), "
        "'stub' (the bundled SGLang-compatible stub backend), 'launch-router' (the gateway "
        "started with sglang-router's launch flags).",
    )
    p.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    p.add_argument("--config", metavar="FILE", help="YAML config file (see config/)")
    p.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="SGLang server URL (repeatable); replaces backends.static from the file",
    )
    p.add_argument("--host", help="listen address (listen.host)")
    p.add_argument("--port", type=int, help="listen port (listen.port)")
    p.add_argument("--admin-port", type=int, help="admin listener port (admin.port)")
    p.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="logging.level"
    )
    p.add_argument("--workers", type=int, help="processes sharing the port (listen.workers)")
    p.add_argument(
        "--check-config",
        action="store_true",
        help="validate the config (file, then SGLANG_GATEWAY_* environment, then flags), "
        "print the result as YAML and exit",
    )
    p.add_argument(
        "--json", action="store_true", help="with --check-config: print JSON instead of YAML"
    )
    # Set by the --workers supervisor on the processes it starts.
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.backend:
        out["backends.discovery"] = "static"
        out["backends.static"] = list(args.backend)
    if args.host is not None:
        out["listen.host"] = args.host
    if args.port is not None:
        out["listen.port"] = args.port
    if args.admin_port is not None:
        out["admin.port"] = args.admin_port
    if args.log_level is not None:
        out["logging.level"] = args.log_level
    if args.workers is not None:
        out["listen.workers"] = args.workers
    if args.worker_index is not None:
        # A worker's own admin listener is private: the supervisor serves the real one.
        out["listen.workers"] = 1
        out["admin.host"] = "127.0.0.1"
        out["admin.port"] = 0
        out["reload.watch_interval_s"] = None  # the supervisor watches the file

    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "stub":
        from gateway.testing import stub  # noqa: PLC0415 - loaded only when asked for

        stub.main(argv[1:])
        return 0
    if argv and argv[0] == "demo":
        from gateway.testing import demo  # noqa: PLC0415

        return demo.main(argv[1:])
    if argv and argv[0] == "launch-router":
        from gateway import launch_router  # noqa: PLC0415

        return launch_router.main(argv[1:])

    args = _parser().parse_args(argv)
    return start(
        config_path=args.config,
        overrides=_overrides(args),
        check_config=args.check_config,
        as_json=args.json,
        worker_index=args.worker_index,
    )


def start(
    *,
    config_path: str | None,
    overrides: dict[str, Any],
    check_config: bool,
    as_json: bool,
    worker_index: int | None,
) -> int:
    """Build the config (the file, the environment, then `overrides`) and serve it, or
    print it (`check_config`); the exit status."""
    try:
        cfg: GatewayConfig = config_mod.load(config_path, overrides)
    except ConfigError as exc:
        print(f"sglang-gateway: invalid config:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    if check_config:
        if as_json:
            print(cfg.model_dump_json(indent=2))
        else:
            # The format it reads. Secrets show as the mask, which the config refuses: a
            # saved copy runs only once the real values are put back.
            print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    problem = check_runtime()
    logs.setup(cfg.logging.level, cfg.logging.format)
    if problem:
        log.error("%s", problem)
        return 1
    if worker_index is None:  # the supervisor, or the only process, says it once
        log.info("sglang-gateway %s: %s", build.VERSION, build.describe_build())
    tune_malloc()
    from gateway.app import serve  # noqa: PLC0415 - keeps --check-config light
    from gateway.edge.control import trust_warning  # noqa: PLC0415

    control = cfg.control
    if worker_index is None and (
        warning := trust_warning(
            control.trusted_cidrs,
            [*control.keys, *([control.keys_file] if control.keys_file else [])],
            cfg.forwarding.trusted_proxies,
        )
    ):
        log.warning("%s", warning)  # once, by the process the operator started

    if cfg.listen.workers > 1:
        from gateway.ops.supervisor import Supervisor  # noqa: PLC0415

        supervisor = Supervisor(cfg, config_path=config_path, overrides=overrides)
        result: list[int] = []

        async def supervise() -> None:
            result.append(await supervisor.run())

        try:
            runtime.run(supervise())
        except (OSError, ValueError) as exc:
            log.error("cannot start: %s", exc)
            return 1
        return result[0] if result else 1
    try:
        runtime.run(
            serve(
                cfg,
                config_path=config_path,
                overrides=overrides,
                worker_index=worker_index,
            )
        )
    except (OSError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0
