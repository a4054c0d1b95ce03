"""Build hook: the hot path compiled with mypyc where this machine can build C extensions,
the same modules as plain Python otherwise. Everything else is in pyproject.toml.

SGLANG_GATEWAY_COMPILE picks the build of a wheel (`pip install .`, `pip wheel .`, the
image):
    auto (default)  compiled when a C compiler can build a Python extension here, else pure
    1               compiled; an error where it cannot be
    0               pure
An editable install (`pip install -e .`, scripts/bootstrap.sh) is always pure: compiled
modules in the source tree would shadow the sources beside them, and every edit made after
the build would silently not run. The compiled build exists only as a wheel.

Which modules, and why those: gateway/build.py, HOT_MODULES. The wheel carries a record of
the build (gateway/_build.json: the mode, why, the SHA-256 of each compiled module's
source), which gateway/build.py checks at import against what is on disk.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import tempfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

from setuptools import Distribution, Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
RECORD = "_build.json"  # gateway.build.RECORD
GROUP = "gateway"  # the shared library mypyc makes: gateway__mypyc.<suffix>, top level
# -O3 is mypyc's default; its build time on a 2-core machine is in docs/bench.md.
OPT_LEVEL = "3"
# The build type-checks only what it compiles; scripts/check.sh runs mypy --strict on all
# of gateway/. Imports followed from the compiled modules (config, tracing, ...) are still
# read for their types, but an optional dependency missing here (opentelemetry: no build
# requirement) does not fail the build.
MYPY_FLAGS = ["--follow-imports=silent"]


def hot_modules() -> tuple[str, ...]:
    """gateway.build.HOT_MODULES, read without importing the package (its dependencies
    are the build's only for type checking, and gateway/build.py inspects the install)."""
    tree = ast.parse((ROOT / "gateway" / "build.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "HOT_MODULES"
            and node.value is not None
        ):
            modules = ast.literal_eval(node.value)
            assert isinstance(modules, tuple) and all(isinstance(m, str) for m in modules)
            return modules
    raise SystemExit("setup.py: gateway/build.py has no HOT_MODULES tuple")


def compiler_problem() -> str | None:
    """Why no C extension can be built here (no compiler, no Python headers), or None.

    The probe is the build's own: a one-function extension through setuptools' build_ext,
    with the compiler and flags the real build would use.
    """
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "probe.c")
        source.write_text(
            "#include <Python.h>\nint gateway_probe(void) { return Py_IsInitialized(); }\n"
        )
        dist = Distribution({"name": "probe", "ext_modules": [Extension("probe", [str(source)])]})
        cmd = build_ext(dist)
        cmd.build_lib = cmd.build_temp = tmp
        try:
            cmd.ensure_finalized()
            cmd.run()
        except Exception as exc:  # any failure means the same: build pure
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def decide() -> tuple[bool, str]:
    """(compile?, why) for this setup.py invocation."""
    choice = os.environ.get("SGLANG_GATEWAY_COMPILE", "auto").strip().lower() or "auto"
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"setup.py: SGLANG_GATEWAY_COMPILE must be auto, 0 or 1, not {choice!r}")
    commands = set(sys.argv[1:])
    if commands & {"editable_wheel", "develop"}:
        if choice == "1":
            raise SystemExit(
                "setup.py: SGLANG_GATEWAY_COMPILE=1 with an editable install: compiled "
                "modules would shadow the sources you edit; build a wheel instead "
                "(pip wheel ., or pip install . into another venv)"
            )
        return False, "editable install"
    if not commands & {"bdist_wheel", "build", "build_ext", "install"}:
        return False, "metadata only"  # egg_info, dist_info, sdist: nothing is built
    if choice == "0":
        return False, "SGLANG_GATEWAY_COMPILE=0"
    problem = compiler_problem()
    if problem is None:
        # mypy is a build requirement of the compiled build only: imported when compiling.
        from mypy.version import __version__ as mypy_version  # noqa: PLC0415

        return True, f"mypyc {mypy_version}, -O{OPT_LEVEL}"
    if choice == "1":
        raise SystemExit(
            f"setup.py: SGLANG_GATEWAY_COMPILE=1, but no C extension builds: {problem}"
        )
    print(f"setup.py: no C extension builds here ({problem}): building pure", file=sys.stderr)
    return False, f"no C compiler at build time: {problem}"


# What decide() said, when setuptools runs this file (below).
COMPILE = False
WHY = ""


def _extension_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.name.endswith(tuple(EXTENSION_SUFFIXES))]


class BuildPy(build_py):
    """Copies the sources and writes the build record beside them (never in the tree)."""

    def run(self) -> None:
        lib = Path(self.build_lib)
        # build/ outlives a build: a compiled module left there by an earlier one would be
        # packaged into this wheel.
        for stale in [*_extension_files(lib / "gateway"), *lib.glob(f"{GROUP}__mypyc.*")]:
            stale.unlink()
        super().run()
        if self.editable_mode:
            return
        record: dict[str, Any] = {"build": "compiled" if COMPILE else "pure", "why": WHY}
        if COMPILE:
            record["sources"] = {
                module: hashlib.sha256(
                    lib.joinpath(*module.split(".")).with_suffix(".py").read_bytes()
                ).hexdigest()
                for module in hot_modules()
            }
        (lib / "gateway" / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


class BuildExt(build_ext):
    """Generates the C for HOT_MODULES with mypyc, then builds it as build_ext would."""

    def finalize_options(self) -> None:
        if COMPILE and not self.distribution.ext_modules:
            if self.inplace:
                raise SystemExit(
                    "setup.py: no in-place compiled build: the modules would shadow the "
                    "sources beside them (build a wheel instead)"
                )
            from mypyc.build import mypycify  # noqa: PLC0415 - only when compiling

            self.set_undefined_options("build", ("build_temp", "build_temp"))
            temp = Path(self.build_temp)
            paths = [str(Path(*m.split("."))) + ".py" for m in hot_modules()]
            self.distribution.ext_modules = mypycify(
                [*MYPY_FLAGS, "--cache-dir", str(temp / "mypy-cache"), *paths],
                opt_level=OPT_LEVEL,
                target_dir=str(temp / "mypyc"),
                group_name=GROUP,
            )
        super().finalize_options()


class GatewayDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        # Decided before build_ext generates the extensions: the wheel is tagged for this
        # platform and Python when it will hold compiled modules.
        return COMPILE or super().has_ext_modules()


# setuptools runs this file as __main__; tests/test_build.py imports it for hot_modules().
if __name__ == "__main__":
    COMPILE, WHY = decide()
    setup(
        distclass=GatewayDistribution,
        cmdclass={"build_py": BuildPy, "build_ext": BuildExt},
    )
