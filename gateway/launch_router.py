"""`sglang-gateway launch-router`: the gateway started with sglang-router's launch flags.

A framework or a script that starts the router itself runs
`python -m sglang_router.launch_router --worker-urls ... --policy ... --port ...`
(SMG: bindings/python/src/smg/launch_router.py, flags in router_args.py; older
sglang-router: sgl-router/py_src/sglang_router/router_args.py). The same command line
with `sglang-gateway launch-router` (or `python -m gateway.launch_router`) starts the
gateway instead: the flags below become its config, over `--config FILE` when given. The
membership is the worker registry, seeded with `--worker-urls`, so engines may also
register themselves later (`POST /workers`), as they do with the router.

A flag of the router's that the gateway cannot honour is refused with exit status 2 and
the list of what is taken, never ignored: a policy with no equivalent, encode/prefill/decode
disaggregation, a per-worker credential, Kubernetes selectors (use backends.discovery:
kubernetes, with backends.kubernetes.prefill_selector and decode_selector for PD), ...
`--pd-disaggregation` with `--prefill URL [BOOTSTRAP_PORT]` and `--decode URL` (each
repeatable, as the router takes them) becomes backends.mode pd with backends.prefill and
backends.decode; `--prefill-policy` and `--decode-policy` become each role's balancer.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

from gateway.config import BALANCER_NAMES, SMG_POLICIES, SMG_UNSUPPORTED

EXIT_USAGE: Final = 2

# SMG's defaults where they differ from the gateway's (router_args.py RouterArgs).
DEFAULT_PORT: Final = 30000
DEFAULT_PROMETHEUS_PORT: Final = 29000

_LOG_LEVELS: Final = {
    "debug": "debug",
    "info": "info",
    "warn": "warning",
    "warning": "warning",
    "error": "error",
    "critical": "error",
}

# The router's flags that have no equivalent here, with what to do instead.
_REFUSED: Final = {
    "--epd-disaggregation": "encode/prefill/decode routing is not built yet",
    "--encode": "encode/prefill/decode routing is not built yet",
    "--prefill-selector": (
        "use backends.kubernetes.prefill_selector with --config (docs/fleet-control.md)"
    ),
    "--decode-selector": (
        "use backends.kubernetes.decode_selector with --config (docs/fleet-control.md)"
    ),
    "--mini-lb": "the gateway is the load balancer",
    "--api-key": "a credential on the command line shows in every process listing; put it "
    "in a file: auth.upstream_authorization_file (what backends get) with --config",
    "--service-discovery": "use backends.discovery: kubernetes with --config",
    "--selector": "use backends.kubernetes.label_selector with --config",
    "--dp-aware": "the gateway routes to engines, not to their data-parallel ranks",
    "--enable-igw": "the gateway serves one model's fleet",
}


class _Parser(argparse.ArgumentParser):
    """Errors exit 2 with the list of what is taken, like an unknown flag."""

    def error(self, message: str) -> NoReturn:
        _usage_error(message)


def _usage_error(message: str) -> NoReturn:
    print(f"sglang-gateway launch-router: {message}\n\n{_supported()}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _parser() -> _Parser:
    p = _Parser(
        prog="sglang-gateway launch-router",
        description="Start the gateway with sglang-router's launch flags (each maps to the "
        "config key named in its help).",
        add_help=True,
        allow_abbrev=False,  # --pol is not --policy: a typo must not pass as a flag
    )
    p.add_argument(
        "--worker-urls",
        nargs="*",
        action="extend",
        default=[],
        metavar="URL",
        help="backends.static (the registry's seed; engines may also POST /workers)",
    )
    p.add_argument("--host", help="listen.host (default 0.0.0.0)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="listen.port (default 30000, SMG's)"
    )
    names = sorted({*SMG_POLICIES, *BALANCER_NAMES, *SMG_UNSUPPORTED})
    p.add_argument(
        "--policy",
        metavar="NAME",
        help="backends.balancer: " + ", ".join(names) + " (default: cache_aware, SMG's "
        "default, unless --config names a balancer)",
    )
    p.add_argument(
        "--pd-disaggregation", action="store_true", help="backends.mode: pd (prefill/decode pairs)"
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar="URL [BOOTSTRAP_PORT]",
        help="backends.prefill: a prefill engine and its bootstrap port (a number or none)",
    )
    p.add_argument(
        "--decode",
        nargs=1,
        action="append",
        default=[],
        metavar="URL",
        help="backends.decode: a decode engine",
    )
    p.add_argument("--prefill-policy", metavar="NAME", help="backends.prefill_balancer")
    p.add_argument("--decode-policy", metavar="NAME", help="backends.decode_balancer")
    p.add_argument("--cache-threshold", type=float, help="backends.cache_aware.cache_threshold")
    p.add_argument("--balance-abs-threshold", type=int, help="backends.balance_abs_threshold")
    p.add_argument("--balance-rel-threshold", type=float, help="backends.balance_rel_threshold")
    p.add_argument(
        "--prometheus-port",
        type=int,
        default=DEFAULT_PROMETHEUS_PORT,
        help="admin.port: /metrics, /livez, /readyz (default 29000, SMG's)",
    )
    p.add_argument("--prometheus-host", help="admin.host (default 127.0.0.1)")
    p.add_argument(
        "--request-timeout-secs",
        type=int,
        metavar="S",
        help="timeouts.total_s, and ttfb_s and idle_s with it (no shorter bound cuts first)",
    )
    p.add_argument("--max-payload-size", type=int, metavar="BYTES", help="limits.max_body_bytes")
    p.add_argument("--log-level", choices=sorted(_LOG_LEVELS), help="logging.level")
    p.add_argument("--log-json", action="store_true", help="logging.format: json")
    p.add_argument("--health-check-interval-secs", type=int, help="backends.health.interval_s")
    p.add_argument("--health-check-timeout-secs", type=int, help="backends.health.timeout_s")
    p.add_argument(
        "--health-failure-threshold", type=int, help="backends.health.unhealthy_threshold"
    )
    p.add_argument("--health-success-threshold", type=int, help="backends.health.healthy_threshold")
    p.add_argument("--health-check-endpoint", help="backends.health.path")
    p.add_argument(
        "--disable-health-check", action="store_true", help="backends.health.enabled: false"
    )
    p.add_argument("--shutdown-grace-period-secs", type=int, help="timeouts.shutdown_grace_s")
    # The gateway's own.
    p.add_argument("--config", metavar="FILE", help="a gateway config under the flags")
    p.add_argument("--workers", type=int, help="listen.workers")
    p.add_argument(
        "--check-config", action="store_true", help="print the effective config and exit"
    )
    p.add_argument("--json", action="store_true", help="with --check-config: JSON")
    return p


def _supported() -> str:
    flags = [
        opt
        for action in _parser()._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    ]
    return "Supported flags: " + ", ".join(flags) + "."


# flag attribute -> (config key, conversion)
_SIMPLE: Final[dict[str, tuple[str, Callable[[Any], Any]]]] = {
    "host": ("listen.host", str),
    "prometheus_host": ("admin.host", str),
    "max_payload_size": ("limits.max_body_bytes", int),
    "health_check_interval_secs": ("backends.health.interval_s", float),
    "health_check_timeout_secs": ("backends.health.timeout_s", float),
    "health_failure_threshold": ("backends.health.unhealthy_threshold", int),
    "health_success_threshold": ("backends.health.healthy_threshold", int),
    "health_check_endpoint": ("backends.health.path", str),
    "shutdown_grace_period_secs": ("timeouts.shutdown_grace_s", float),
    "workers": ("listen.workers", int),
    "cache_threshold": ("backends.cache_aware.cache_threshold", float),
    "balance_abs_threshold": ("backends.balance_abs_threshold", int),
    "balance_rel_threshold": ("backends.balance_rel_threshold", float),
}


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys the router's flags set (dotted keys, over the file)."""
    out: dict[str, Any] = {
        "backends.discovery": "registry",
        "backends.static": list(args.worker_urls),
        "listen.port": args.port,
        "admin.port": args.prometheus_port,
    }
    if args.policy is None and args.config is None:
        out["backends.balancer"] = "cache_aware"  # SMG's default policy
    if args.policy is not None:
        # Checked by the config too (backends.balancer); said here in the flag's words.
        if args.policy in SMG_UNSUPPORTED:
            _usage_error(f"--policy {args.policy}: {SMG_UNSUPPORTED[args.policy]}.")
        if args.policy not in SMG_POLICIES and args.policy not in BALANCER_NAMES:
            _usage_error(f"--policy {args.policy}: not a policy the gateway knows.")
        out["backends.balancer"] = args.policy
    out.update(_pd(args))
    if args.request_timeout_secs is not None:
        seconds = float(args.request_timeout_secs)
        out["timeouts.total_s"] = seconds
        out["timeouts.ttfb_s"] = seconds
        out["timeouts.idle_s"] = seconds
    if args.log_level is not None:
        out["logging.level"] = _LOG_LEVELS[args.log_level]
    if args.log_json:
        out["logging.format"] = "json"
    if args.disable_health_check:
        out["backends.health.enabled"] = False
    for attr, (key, convert) in _SIMPLE.items():
        value = getattr(args, attr)
        if value is not None:
            out[key] = convert(value)
    return out


def _policy(flag: str, name: str) -> str:
    if name in SMG_UNSUPPORTED:
        _usage_error(f"{flag} {name}: {SMG_UNSUPPORTED[name]}.")
    if name not in SMG_POLICIES and name not in BALANCER_NAMES:
        _usage_error(f"{flag} {name}: not a policy the gateway knows.")
    return name


def _pd(args: argparse.Namespace) -> dict[str, Any]:
    """--pd-disaggregation and its workers and policies, as sglang-router's router_args.py
    reads them (--prefill URL [BOOTSTRAP_PORT], the port a number or `none`)."""
    pd_flags = [
        flag
        for flag, given in (
            ("--prefill", args.prefill),
            ("--decode", args.decode),
            ("--prefill-policy", args.prefill_policy),
            ("--decode-policy", args.decode_policy),
        )
        if given
    ]
    if not args.pd_disaggregation:
        if pd_flags:
            _usage_error(f"{pd_flags[0]} needs --pd-disaggregation.")
        return {}
    prefill: list[dict[str, Any]] = []
    for entry in args.prefill:
        if len(entry) > 2:
            _usage_error(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}.")
        port: int | None = None
        if len(entry) == 2 and entry[1].lower() != "none":
            try:
                port = int(entry[1])
            except ValueError:
                _usage_error(
                    f"--prefill {entry[0]} {entry[1]}: the bootstrap port must be a number or none."
                )
        prefill.append({"url": entry[0], "bootstrap_port": port})
    out: dict[str, Any] = {
        "backends.mode": "pd",
        "backends.prefill": prefill,
        "backends.decode": [entry[0] for entry in args.decode],
    }
    if args.prefill_policy is not None:
        out["backends.prefill_balancer"] = _policy("--prefill-policy", args.prefill_policy)
    if args.decode_policy is not None:
        out["backends.decode_balancer"] = _policy("--decode-policy", args.decode_policy)
    return out


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The router's flags, or exit 2 naming the first one the gateway does not take."""
    for arg in argv:
        flag = arg.partition("=")[0]
        if flag in _REFUSED:
            _usage_error(f"{flag} is not supported: {_REFUSED[flag]}.")
    args, unknown = _parser().parse_known_args(list(argv))
    if unknown:
        flags = [u.partition("=")[0] for u in unknown if u.startswith("-")] or unknown
        _usage_error("not supported: " + " ".join(flags))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from gateway import cli  # noqa: PLC0415 - cli imports this module for its subcommand

    args = parse(list(sys.argv[1:] if argv is None else argv))
    return cli.start(
        config_path=args.config,
        overrides=overrides(args),
        check_config=args.check_config,
        as_json=args.json,
        worker_index=None,
    )


if __name__ == "__main__":
    sys.exit(main())
