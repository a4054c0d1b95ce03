#!/usr/bin/env python3
"""One command for the whole benchmark: `python3 bench/run.py [--smoke]` (docs/bench.md).

Creates .venv (scripts/bootstrap.sh) on first use and re-runs itself inside it.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"

if __name__ == "__main__":
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve() and not os.environ.get(
        "BENCH_NO_VENV"
    ):
        if not VENV_PY.exists():
            subprocess.run([str(ROOT / "scripts" / "bootstrap.sh")], check=True)
        os.execv(str(VENV_PY), [str(VENV_PY), __file__, *sys.argv[1:]])
    sys.path.insert(0, str(ROOT))
    from bench.main import main

    sys.exit(main())
