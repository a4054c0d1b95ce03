"""The benchmark suite's smoke run works end to end: no speed is asserted, only that it runs.

`bench/run.py --smoke` uses nginx, wrk and sglang-router where installed and falls back to
Python stand-ins (with a "skipped: ..." note) where not, so this passes on a bare CI machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # starts the whole benchmark harness: run by scripts/check.sh --slow
# The harness may take its own bound on a loaded 2-core machine; the test's is above it.
@pytest.mark.timeout(300)
def test_bench_smoke_runs_and_writes_results(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "BENCH_NO_VENV": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = list(tmp_path.glob("*-smoke.json"))
    tables = list(tmp_path.glob("*-smoke.md"))
    assert len(results) == 1, proc.stdout[-3000:]
    assert len(tables) == 1
    data = json.loads(results[0].read_text())
    assert data["meta"]["mode"] == "smoke"
    assert "# Gateway benchmark" in tables[0].read_text()
    # The smoke set holds a 100k-id body: its parse floor is measured and reported.
    floor = data["parse_floor"]["ids-100k-mask"]
    assert floor["simdjson_us"] > 0 and floor["orjson_us"] > 0
    assert "## The parse floor" in tables[0].read_text()
