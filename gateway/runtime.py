"""glibc malloc settings for a process that moves multi-MB bodies.

Python asks malloc for each large body (a joined request body, simdjson's padded copy,
response chunks). glibc serves blocks above its mmap threshold (128 KiB to start) with a
fresh mmap, so every such block is page-faulted in as it is written and unmapped on free:
about a fifth of the gateway's CPU on 1 MB chat bodies. Serving blocks up to 32 MiB from
the heap, and keeping up to 64 MiB of freed heap before giving it back, lets those pages be
reused hot. The cost is RSS that stays up to that much above the live set after a burst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Final

log = logging.getLogger("gateway.runtime")

# mallopt parameter numbers, from glibc's malloc.h.
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD: Final = 32 << 20
TRIM_THRESHOLD: Final = 64 << 20
# Set to 0 to leave malloc as glibc configures it (e.g. when MALLOC_* tunables are set).
DISABLE_ENV: Final = "GATEWAY_MALLOC_TUNING"


def tune_malloc() -> bool:
    """Apply the settings above where the C library is glibc; True if they were applied."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present on glibc only (musl lacks it)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not applied:
        log.warning("mallopt refused the gateway's malloc settings; running with defaults")
    return applied
