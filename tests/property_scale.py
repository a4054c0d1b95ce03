"""How hard the property tests search (marked `property`).

GATEWAY_PROPERTY_SCALE multiplies each one's example count: 1 (the default) is the bounded
suite's size, 0.1 a quick look while editing, 10 or more a long hunt before a release. A
threshold a test asserts on a count scales with it, so any scale can fail only on a real
disagreement.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("GATEWAY_PROPERTY_SCALE", "1"))
if SCALE <= 0:
    raise ValueError(f"GATEWAY_PROPERTY_SCALE must be above 0, got {SCALE}")


def examples(n: int) -> int:
    """`n` examples at the configured scale, and never fewer than one."""
    return max(1, round(n * SCALE))
