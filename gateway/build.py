"""What this gateway is: its version, the source revision it was built from, its runtime.

The version comes from the installed package's metadata; the revision from
SGLANG_GATEWAY_REVISION, which the image build sets (docker/Dockerfile), else "unknown".
Read once at import: `--version`, the build_info metric and the image labels agree.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Final


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0.0.0+unknown"


NAME: Final = "sglang-gateway"  # also the Server header of both listeners
VERSION: Final = _version(NAME)
REVISION: Final = os.environ.get("SGLANG_GATEWAY_REVISION") or "unknown"
PYTHON: Final = platform.python_version()
AIOHTTP: Final = _version("aiohttp")


def describe() -> str:
    """One line for `sglang-gateway --version`."""
    return f"sglang-gateway {VERSION} (revision {REVISION}; Python {PYTHON}, aiohttp {AIOHTTP})"
