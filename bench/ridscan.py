"""What reading a rid costs on a body forwarded unparsed: `python -m bench.ridscan`.

With policy.skip_parse_without_mask_key a body is scanned for the mask key and, if it has
none, forwarded without a parse; its rid is then read by gateway/contract/rids.py for the
abort routing. This times that read on the bench's 100k-id /generate body (627 KB, the
ids-100k workload's), with no rid, with one before and after the ids, and a batch's list,
beside the key scan it follows and the orjson parse it spares. Each figure is the
best of --repeat runs of --number calls (best, not mean: the machine may be shared).
"""

from __future__ import annotations

import argparse
import random

import orjson

from bench import bodies
from bench.common import best_us
from gateway.contract.keyscan import MASK, keys_for, may_name
from gateway.contract.rids import top_level_rids
from gateway.contract.routes import Kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    plain = bodies.input_ids(random.Random(0), mask=False)
    obj = orjson.loads(plain)
    cases = {
        "no rid": plain,
        "rid after the ids": orjson.dumps({**obj, "return_logprob": True, "rid": "r-17-3"}),
        "rid before the ids": orjson.dumps({"rid": "r-17-3", **obj}),
        "batch of 64 rids": orjson.dumps({**obj, "rid": [f"r-17-{i}" for i in range(64)]}),
    }
    print(f"body: /generate, {bodies.INPUT_IDS} input_ids, {len(plain)} bytes")
    scan = best_us(lambda: may_name(plain, MASK), args.number, args.repeat)
    print(f"mask-key scan (keyscan.may_name): {scan:.1f} us")
    # What the gateway runs by default: adapters route requests, so lora_path is asked too,
    # in the same walk (a search of its own over the body cost about ten times the walk).
    both = keys_for(Kind.GENERATE, adapters=True)
    keys = best_us(lambda: may_name(plain, both), args.number, args.repeat)
    print(f"mask and lora_path keys, one walk: {keys:.1f} us")
    alone = best_us(lambda: b"lora_path" in plain, args.number, args.repeat)
    print(f"a search of the body for lora_path alone: {alone:.1f} us")
    for name, body in cases.items():
        found = top_level_rids(body)
        assert found is not None, name  # the walk vouches for these without a parse
        cost = best_us(lambda b=body: top_level_rids(b), args.number, args.repeat)  # type: ignore[misc]
        print(f"rid walk, {name}: {cost:.1f} us ({len(found)} rid)")
    parse = best_us(lambda: orjson.loads(plain), max(1, args.number // 10), args.repeat)
    print(f"orjson parse it spares: {parse:.0f} us")


if __name__ == "__main__":
    main()
