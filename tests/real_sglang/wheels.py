"""SGLang's released wheels, fetched once from PyPI and unpacked (only the `sglang/` tree)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "sglang-wheels"


class Unavailable(Exception):
    """The wheel could not be fetched (no network to PyPI)."""


def unpacked(version: str) -> Path:
    """A directory whose `sglang/` is the release's package."""
    target = CACHE / version
    if (target / "sglang" / "srt" / "managers" / "scheduler.py").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                tmp,
                f"sglang=={version}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        wheels = list(Path(tmp).glob("sglang-*.whl"))
        if fetched.returncode != 0 or not wheels:
            raise Unavailable(f"sglang=={version}: {fetched.stderr.strip()[-300:]}")
        partial = target.with_name(version + ".partial")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith("sglang/")]
            wheel.extractall(partial, members)
        partial.rename(target)  # a killed unpack never looks complete
    return target
