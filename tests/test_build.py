"""The build that runs is the one declared, compiled modules never run stale, and the
compiled build keeps to what mypyc compiles faithfully (setup.py, gateway/build.py)."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib
import importlib.util
import json
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway import build
from tests.conftest import EXPECT_BUILD, ROOT, spawn


def _compiled(module: ModuleType) -> bool:
    return str(module.__file__).endswith(tuple(EXTENSION_SUFFIXES))


def test_the_hot_modules_run_as_the_declared_build() -> None:
    modules = [importlib.import_module(name) for name in build.HOT_MODULES]
    compiled = [m.__name__ for m in modules if _compiled(m)]
    if build.BUILD == "compiled":
        assert compiled == list(build.HOT_MODULES) == list(build.COMPILED)
    else:
        assert compiled == [] and build.COMPILED == ()
    if EXPECT_BUILD is not None:
        assert build.BUILD == EXPECT_BUILD, build.describe_build()
    else:
        assert not os.environ.get("CI"), "CI declares each run's build"


def test_everything_else_runs_as_python() -> None:
    package = Path(build.__file__).parent
    compiled = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*")
        if p.name.endswith(tuple(EXTENSION_SUFFIXES))
    ]
    expected = [m.removeprefix("gateway.").replace(".", "/") for m in build.COMPILED]
    assert sorted(c.split(".")[0] for c in compiled) == sorted(expected)


async def test_a_process_the_tests_start_runs_the_same_build() -> None:
    proc = await spawn("gateway", "--version", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert out.decode().strip().endswith(f"; {build.BUILD} build)")


# -- what the compiled build must not hold (gateway/build.py, HOT_MODULES) ----------------


def test_the_modules_mypyc_would_miscompile_stay_out() -> None:
    # See gateway/build.py for why each stays out.
    kept_pure = {"gateway.contract.jsonview", "gateway.edge.failures"}
    assert not kept_pure & set(build.HOT_MODULES)


def _handlers(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.ExceptHandler]:
    """The named except clauses of one function's own scope, in source order."""
    found = []
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda h: (h.lineno, h.col_offset))


def _classes(value: Any) -> list[type]:
    return list(value) if isinstance(value, tuple) else [value]


@pytest.mark.parametrize("name", build.HOT_MODULES)
def test_no_except_variable_is_first_bound_to_a_compiled_class_then_to_another(
    name: str,
) -> None:
    """mypyc gives a variable one type, its first binding's: `except A as exc` then
    `except B as exc` in one function raises TypeError on a B when A is a class compiled
    with mypyc (mypyc/mypyc#620), i.e. on the failure paths tests rarely reach. Classes
    that are not compiled (builtins, failures.py) are plain objects to mypyc and safe."""
    module = importlib.import_module(name)
    # Compiled, the module's file is the extension; its source is installed beside it.
    source = Path(str(module.__file__)).parent / (name.rsplit(".", 1)[1] + ".py")
    tree = ast.parse(source.read_text())
    namespace = vars(module)
    bad = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first: dict[str, str] = {}
        for handler in _handlers(fn):
            assert handler.name is not None and handler.type is not None
            spelled = ast.unparse(handler.type)
            if handler.name not in first:
                first[handler.name] = spelled
                continue
            if spelled == first[handler.name]:
                continue
            bound = eval(first[handler.name], namespace)  # names the module itself imports
            if any(c.__module__ in build.HOT_MODULES for c in _classes(bound)):
                bad.append(f"{fn.name}:{handler.lineno}: {handler.name} ({spelled})")
    assert not bad, f"rename the except variable (mypyc/mypyc#620): {bad}"


# -- stale compiled modules are refused (gateway/build.py, inspect_install) ---------------


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_compiled_modules_that_differ_from_their_sources_refuse_to_import(
    tmp_path: Path,
) -> None:
    package = tmp_path / "gateway"
    (package / "edge").mkdir(parents=True)
    source = package / "edge" / "proxy.py"
    source.write_text("x = 1\n")
    assert build.inspect_install(package) == ("pure", "source tree", ())
    extension = package / "edge" / f"proxy{EXTENSION_SUFFIXES[0]}"
    extension.write_bytes(b"")
    # An in-place build (no record): its module would shadow every later edit of proxy.py.
    with pytest.raises(build.StaleBuild, match="no build record"):
        build.inspect_install(package)
    record = {
        "build": "compiled",
        "why": "test",
        "sources": {"gateway.edge.proxy": _sha("x = 1\n")},
    }
    (package / build.RECORD).write_text(json.dumps(record))
    assert build.inspect_install(package) == ("compiled", "test", ("gateway.edge.proxy",))
    source.write_text("x = 2\n")
    with pytest.raises(build.StaleBuild, match=r"changed after gateway\.edge\.proxy was compiled"):
        build.inspect_install(package)
    source.write_text("x = 1\n")
    extension.unlink()
    with pytest.raises(build.StaleBuild, match="not those the build made"):
        build.inspect_install(package)
    (package / build.RECORD).write_text(json.dumps({"build": "pure", "why": "no compiler"}))
    assert build.inspect_install(package) == ("pure", "no compiler", ())
    extension.write_bytes(b"")
    with pytest.raises(build.StaleBuild, match="a pure build with compiled modules"):
        build.inspect_install(package)


# -- setup.py: how a build is chosen ---------------------------------------------------------

needs_tree = pytest.mark.skipif(
    not (ROOT / "setup.py").exists(), reason="the compiled run has no source tree"
)


def _setup_module() -> Any:
    spec = importlib.util.spec_from_file_location("gateway_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines, builds nothing
    return module


@needs_tree
def test_setup_compiles_the_modules_build_names() -> None:
    setup = _setup_module()
    assert setup.hot_modules() == build.HOT_MODULES
    for name in build.HOT_MODULES:
        assert (ROOT / Path(*name.split("."))).with_suffix(".py").is_file(), name


@needs_tree
@pytest.mark.parametrize(
    ("choice", "argv", "expected"),
    [
        ("auto", ["editable_wheel"], (False, "editable install")),
        ("0", ["bdist_wheel"], (False, "SGLANG_GATEWAY_COMPILE=0")),
        ("1", ["dist_info"], (False, "metadata only")),
        ("1", ["editable_wheel"], SystemExit),
        ("yes", ["bdist_wheel"], SystemExit),
    ],
)
def test_setup_picks_the_build(
    monkeypatch: pytest.MonkeyPatch, choice: str, argv: list[str], expected: object
) -> None:
    setup = _setup_module()
    monkeypatch.setenv("SGLANG_GATEWAY_COMPILE", choice)
    monkeypatch.setattr(sys, "argv", ["setup.py", *argv])
    if expected is SystemExit:
        with pytest.raises(SystemExit):
            setup.decide()
    else:
        assert setup.decide() == expected


@needs_tree
def test_without_a_compiler_the_build_is_pure(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a machine with no C compiler gets, through the same probe."""
    setup = _setup_module()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(sys, "argv", ["setup.py", "bdist_wheel"])
    monkeypatch.setenv("SGLANG_GATEWAY_COMPILE", "auto")
    compile_, why = setup.decide()
    assert not compile_ and why.startswith("no C compiler at build time")
    monkeypatch.setenv("SGLANG_GATEWAY_COMPILE", "1")
    with pytest.raises(SystemExit, match="no C extension builds"):
        setup.decide()
