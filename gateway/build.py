"""What this gateway is: its version, the source revision it was built from, its runtime,
and whether its hot path runs compiled (mypyc) or as plain Python.

The version comes from the installed package's metadata; the revision from
SGLANG_GATEWAY_REVISION, which the image build sets (docker/Dockerfile), else "unknown".
The build mode comes from what is on disk: the extension modules beside the sources and the
record the wheel build wrote (setup.py). Read once at import: `--version`, the start-up log
line, the build_info metric and the image labels agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Final

# The modules a wheel build compiles with mypyc (setup.py reads this tuple: keep it a
# literal). Chosen by a py-spy profile of the small-request path (docs/bench.md, "The
# compiled build"): every module with a measurable share of the gateway's own time per
# request, and nothing else. Left out on purpose, and why:
#   - contract/jsonview.py: its time is in simdjson's C++ parser, and it keeps the shared
#     parser reusable by dropping its last proxy of a document at a known point (`del doc`),
#     which compiled code's temporaries need not honour.
#   - edge/failures.py: a compiled exception class breaks `except A as exc: ...  except B
#     as exc:` in compiled code (mypyc/mypyc#620: the variable gets A's type, and a B raises
#     TypeError), which Proxy._forward does; none of its code runs per request.
#     tests/test_build.py holds the compiled modules' own exception classes to that rule.
#   - everything else (config, app, cli, admin, probes, discovery, tracing, the large-body
#     skim, ...): no measurable time per request. Compiling it would add build time, and
#     annotations that must hold of the real objects at run time (mypyc checks them), for
#     nothing.
HOT_MODULES: Final = (
    "gateway.contract.adapters",
    "gateway.contract.inspection",
    "gateway.contract.lax",
    "gateway.contract.policy",
    "gateway.contract.routes",
    "gateway.contract.shapes",
    "gateway.edge.budget",
    "gateway.edge.fleet_control",
    "gateway.edge.headers",
    "gateway.edge.proxy",
    "gateway.edge.relay",
    "gateway.edge.server",
    "gateway.edge.upstream",
    "gateway.fleet.balancers",
    "gateway.fleet.capability",
    "gateway.fleet.pool",
    "gateway.ops.logs",
    "gateway.ops.metrics",
    "gateway.ops.observe",
)

# Written by setup.py into the wheel (never into the source tree): the mode, why, and for a
# compiled build the SHA-256 of each compiled module's source.
RECORD: Final = "_build.json"


class StaleBuild(ImportError):
    """Compiled modules that do not match the sources beside them: the gateway would run
    code other than what the .py files say. Rebuild, or remove the extension modules."""


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0.0.0+unknown"


def _source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _extension_modules(package: Path) -> list[str]:
    found = []
    for path in package.rglob("*"):
        for suffix in EXTENSION_SUFFIXES:
            if path.name.endswith(suffix):
                parts = path.relative_to(package.parent).parts
                found.append(".".join((*parts[:-1], path.name[: -len(suffix)])))
                break
    return sorted(found)


def inspect_install(package: Path) -> tuple[str, str, tuple[str, ...]]:
    """(mode, why, compiled modules), or StaleBuild when the files disagree."""
    found = _extension_modules(package)
    record_path = package / RECORD
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    rebuild = (
        "reinstall the package (pip install .), or, to run the sources, delete the "
        f"extension modules and any {RECORD} from {package}"
    )
    if record is None:
        if found:
            raise StaleBuild(
                f"{package} holds compiled modules ({', '.join(found)}) but no build record: "
                f"an in-place mypyc build, whose modules shadow the sources beside them; "
                f"{rebuild}"
            )
        return "pure", "source tree", ()
    if record["build"] == "pure":
        if found:
            raise StaleBuild(f"a pure build with compiled modules ({', '.join(found)}); {rebuild}")
        return "pure", str(record["why"]), ()
    built: dict[str, str] = record["sources"]
    if sorted(built) != found:
        raise StaleBuild(
            f"the compiled modules on disk ({', '.join(found) or 'none'}) are not those the "
            f"build made ({', '.join(sorted(built))}); {rebuild}"
        )
    for module, digest in built.items():
        source = package.parent.joinpath(*module.split(".")).with_suffix(".py")
        if not source.exists() or _source_hash(source) != digest:
            raise StaleBuild(
                f"{source} changed after {module} was compiled from it: the compiled module "
                f"would run instead of the edited source; {rebuild}"
            )
    return "compiled", str(record["why"]), tuple(built)


NAME: Final = "sglang-gateway"  # also the Server header of both listeners
VERSION: Final = _version(NAME)
REVISION: Final = os.environ.get("SGLANG_GATEWAY_REVISION") or "unknown"
PYTHON: Final = platform.python_version()
AIOHTTP: Final = _version("aiohttp")
# BUILD: "compiled" or "pure" (the build_info metric's `build` label); COMPILED: the
# modules running compiled; BUILD_WHY: how the build came to be what it is.
BUILD, BUILD_WHY, COMPILED = inspect_install(Path(__file__).resolve().parent)


def describe() -> str:
    """One line for `sglang-gateway --version`."""
    return (
        f"sglang-gateway {VERSION} (revision {REVISION}; Python {PYTHON}, aiohttp {AIOHTTP}; "
        f"{BUILD} build)"
    )


def describe_build() -> str:
    """The start-up log line's account of the build: which modules run compiled, or why none."""
    if not COMPILED:
        return f"pure Python build ({BUILD_WHY})"
    names = ", ".join(m.removeprefix("gateway.") for m in COMPILED)
    return f"compiled build ({BUILD_WHY}): {len(COMPILED)} modules compiled: {names}"
