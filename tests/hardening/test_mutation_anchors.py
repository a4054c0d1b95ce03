"""Every mutation of tests/hardening/mutations.py still finds the code it removes.

A refactor that moves an anchor leaves its mutation unrun ("anchor moved"), so the
protection it stood for would go untested without anyone noticing; this keeps the harness
honest in every run of the suite, at the cost of reading a few files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hardening.mutations import MUTATIONS

ROOT = Path(__file__).resolve().parents[2]


# The pure build's run reads the sources; the compiled one runs from a copy of tests/ alone.
@pytest.mark.skipif(not (ROOT / "gateway").is_dir(), reason="the compiled run has no sources")
@pytest.mark.parametrize("index", range(len(MUTATIONS)))
def test_the_mutation_finds_its_anchor_and_its_tests(index: int) -> None:
    name, path, old, _new, tests = MUTATIONS[index]
    olds = old if isinstance(old, tuple) else (old,)
    paths = path if isinstance(path, tuple) else (path,) * len(olds)
    for file, anchor in zip(paths, olds, strict=True):
        assert anchor in (ROOT / file).read_text(), f"[{index}] {name}: anchor moved in {file}"
    assert tests, f"[{index}] {name}: no test named"
    for test in tests:
        assert (ROOT / test.split("::")[0]).is_file(), f"[{index}] {name}: no {test}"
