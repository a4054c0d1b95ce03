"""What noting a rid's owner costs a request: `python -m bench.rid_owners`.

Every routed request with a rid claims it before its attempt and releases it after
(gateway/edge/fleet_control.py, RidOwners). With state.backend: etcd the claim also notes
the change for gateway/fleet/rid_owners.py to write in a batch; this times claim+release of
one rid without that sharing and with it, both for a request that ends before its batch
is written (it never reaches etcd) and for one whose owner was written (its deletion is
noted). Each figure is the best of --repeat runs of --number pairs (best, not mean: the
machine may be shared).
"""

from __future__ import annotations

import argparse
import timeit

from gateway.edge.fleet_control import RidOwners

_URL = "http://10.0.0.7:30000"


def _pair_ns(owners: RidOwners, rids: list[list[str]], number: int, repeat: int) -> float:
    def run() -> None:
        claim, release = owners.claim, owners.release
        for one in rids:
            claim(one, _URL)
            release(one, _URL)

    return min(timeit.repeat(run, number=1, repeat=repeat)) / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    rids = [[f"rollout-{i}"] for i in range(args.number)]
    local = RidOwners()
    plain = _pair_ns(local, rids, args.number, args.repeat)
    shared = RidOwners()
    shared.share()
    unwritten = _pair_ns(shared, rids, args.number, args.repeat)
    assert shared.unwritten == 0  # ended before a flush: nothing left to write
    written = RidOwners()
    written.share()
    for one in rids:
        written.claim(one, _URL)
    written.take(len(rids))  # as a flush does: every owner is now in the store
    shared_written = _pair_ns(written, rids, args.number, args.repeat)
    print(f"claim+release, not shared (state.backend: local): {plain:.0f} ns")
    print(f"claim+release, shared, ended before its flush: {unwritten:.0f} ns")
    print(f"claim+release, shared, owner already written: {shared_written:.0f} ns")


if __name__ == "__main__":
    main()
