"""gateway/runtime.py: the malloc settings apply on glibc and can be switched off.

Each check runs in a fresh interpreter: mallopt changes the process it runs in, and the
test process must keep glibc's defaults.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from gateway import runtime
from tests.conftest import ROOT


def _tune(**env: str) -> str:
    code = "from gateway import runtime; print(runtime.tune_malloc())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applies_on_glibc() -> None:
    assert _tune() == "True"


def test_switched_off_by_the_environment() -> None:
    assert _tune(**{runtime.DISABLE_ENV: "0"}) == "False"
