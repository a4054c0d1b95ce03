"""The gateway's benchmark suite: `python3 bench/run.py` (see docs/bench.md)."""
