"""The parse floor: what reading a body as JSON costs on its own, with no proxy around it.

A gateway that validates a 627 KB body of 100k input_ids must at least parse it once; the
figure it cannot go under is the parse of that body by the parser it uses (simdjson, for
bodies of 4 KB and more: gateway/contract/jsonview.py) and, for comparison, by orjson
(SGLang's parser, which sglang-router does not run). The report puts the gateway's proxy
CPU per request beside it: the difference is what forwarding and the rest of the request
path cost.

Run as `python -m bench.floor FILE...` (bench/main.py pins it to the proxy's CPU); prints
one JSON object: file name -> {"simdjson_us", "orjson_us"}, the best of timed repeats
(a floor is the least a parse costs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import orjson
import simdjson

from bench.common import best_us

REPEATS = 15
# Calls per timed repeat: enough that one repeat takes a few milliseconds or more.
CALLS = 10


def measure(body: bytes) -> dict[str, float]:
    parser = simdjson.Parser()

    def with_simdjson() -> None:
        doc = parser.parse(body)
        del doc  # the parser is reused only once its last document is gone

    return {
        "simdjson_us": round(best_us(with_simdjson, CALLS, REPEATS), 1),
        "orjson_us": round(best_us(lambda: orjson.loads(body), CALLS, REPEATS), 1),
    }


def main(paths: list[str]) -> int:
    out = {Path(p).name: measure(Path(p).read_bytes()) for p in paths}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
