"""One contract for every balancer, plus what consistent hashing promises on its own."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway import config as config_mod
from gateway.fleet.balancers import BALANCERS, ConsistentHash
from gateway.fleet.pool import Backend, BackendPool, EjectionRules, Health, PoolRules

URLS = [f"http://10.0.0.{i}:30000" for i in range(1, 6)]


def fleet(n: int = 5) -> list[Backend]:
    return [Backend(u) for u in URLS[:n]]


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_always_returns_one_of_the_candidates(name: str) -> None:
    balancer = BALANCERS[name](7)
    backends = fleet()
    balancer.set_members([b.url for b in backends])
    for n in range(1, 6):
        candidates = backends[:n]
        for i in range(200):
            assert balancer.choose(candidates, f"session-{i}") in candidates
            assert balancer.choose(candidates, None) in candidates


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_deterministic_with_a_seed(name: str) -> None:
    def run() -> list[str]:
        balancer = BALANCERS[name](42)
        backends = fleet()
        balancer.set_members([b.url for b in backends])
        out = []
        for i in range(300):
            b = balancer.choose(backends, f"k{i % 37}" if i % 3 else None)
            b.inflight += i % 2
            out.append(b.url)
        return out

    assert run() == run()


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_fair_on_an_idle_fleet(name: str) -> None:
    balancer = BALANCERS[name](1)
    backends = fleet()
    balancer.set_members([b.url for b in backends])
    counts = Counter(balancer.choose(backends, f"session-{i}").url for i in range(5000))
    assert set(counts) == set(URLS)
    for url in URLS:
        # Exactly even for the rotating ones; within a third of even for the random/hashed.
        assert 1000 * 0.65 <= counts[url] <= 1000 * 1.35, counts


@pytest.mark.parametrize("name", ["least_inflight", "power_of_two"])
def test_load_aware_balancers_avoid_the_busy_backend(name: str) -> None:
    balancer = BALANCERS[name](3)
    backends = fleet(3)
    backends[0].inflight = 50
    counts = Counter(balancer.choose(backends, None).url for _ in range(900))
    assert counts[URLS[0]] < 900 * 0.2


def test_consistent_hash_is_sticky_and_moves_only_the_lost_keys() -> None:
    ring = ConsistentHash()
    backends = fleet()
    ring.set_members([b.url for b in backends])
    keys = [f"rollout-{i}" for i in range(2000)]
    before = {k: ring.choose(backends, k).url for k in keys}
    assert before == {k: ring.choose(backends, k).url for k in keys}  # sticky
    lost = backends[2]
    survivors = [b for b in backends if b is not lost]
    after = {k: ring.choose(survivors, k).url for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == lost.url}
    # And a second gateway process agrees: the hash is stable, not Python's hash().
    other = ConsistentHash()
    other.set_members([b.url for b in backends])
    assert before == {k: other.choose(backends, k).url for k in keys}


def test_pool_membership_update_keeps_state_of_unchanged_backends() -> None:
    pool = BackendPool(URLS[:3], BALANCERS["round_robin"](None))
    kept = pool.backends[1]
    kept.health = Health.HEALTHY
    kept.inflight = 4
    removed = pool.backends[0]
    added, gone = pool.update([URLS[1], URLS[2], URLS[3]])
    assert [b.url for b in added] == [URLS[3]]
    assert gone == [removed]
    assert removed.removed
    assert pool.backends[0] is kept
    assert kept.health is Health.HEALTHY
    assert kept.inflight == 4


def test_passive_ejection_backs_off_and_4xx_never_counts() -> None:
    now = [100.0]
    pool = BackendPool(
        URLS[:2],
        BALANCERS["round_robin"](None),
        PoolRules(passive=EjectionRules(consecutive_5xx=3, base_eject_s=2, max_eject_s=10)),
        clock=lambda: now[0],
    )
    a, b = pool.backends
    for _ in range(50):
        pool.response(a, 400)  # a refusal of the request, not a broken backend
    assert pool.pick([b]) is a
    for _ in range(3):
        pool.response(a, 503)
    assert pool.pick([b]) is None  # ejected
    now[0] += 2.01
    assert pool.pick([b]) is a  # back after the first period
    for _ in range(3):
        pool.response(a, 500)
    now[0] += 2.01
    assert pool.pick([b]) is None  # second ejection lasts twice as long
    now[0] += 2.0
    assert pool.pick([b]) is a
    pool.connect_failed(b, "refused")
    assert pool.pick([a]) is None


def test_concurrency_cap_and_saturation() -> None:
    pool = BackendPool(URLS[:2], BALANCERS["least_inflight"](None), PoolRules(max_inflight=2))
    for b in pool.backends:
        b.inflight = 2
    assert pool.pick() is None
    assert pool.saturated()
    pool.backends[0].health = Health.UNHEALTHY
    pool.backends[1].health = Health.UNHEALTHY
    assert not pool.saturated()  # nothing routable: waiting would not help


def test_random_spreads_over_every_candidate() -> None:
    balancer = BALANCERS["random"](3)
    backends = fleet()
    picks = Counter(balancer.choose(backends, None).url for _ in range(5000))
    assert set(picks) == set(URLS)
    assert min(picks.values()) > 800  # about 1000 each


@pytest.mark.parametrize(
    ("policy", "balancer", "header"),
    [
        ("consistent_hashing", "consistent_hash", "X-SMG-Routing-Key"),
        ("manual", "consistent_hash", "X-SMG-Routing-Key"),
        ("round_robin", "round_robin", "X-Session-Id"),
        ("power_of_two", "power_of_two", "X-Session-Id"),
        ("random", "random", "X-Session-Id"),
        ("least_load", "least_inflight", "X-Session-Id"),
    ],
)
def test_sglang_router_policy_names_are_taken_as_the_closest_balancer(
    policy: str, balancer: str, header: str
) -> None:
    cfg = config_mod.build({"backends": {"static": URLS[:1], "balancer": policy}})
    assert (cfg.backends.balancer, cfg.backends.hash_header) == (balancer, header)
    # What --check-config prints runs the same balancer when read back.
    again = config_mod.build(cfg.model_dump(mode="json"))
    assert again.backends.balancer == balancer


def test_a_hash_header_set_beside_an_smg_policy_is_kept() -> None:
    cfg = config_mod.build(
        {"backends": {"static": URLS[:1], "balancer": "manual", "hash_header": "X-Episode"}}
    )
    assert cfg.backends.hash_header == "X-Episode"


@pytest.mark.parametrize("policy", ["prefix_hash", "passthrough", "bucket"])
def test_an_smg_policy_with_no_equivalent_is_refused_saying_so(policy: str) -> None:
    with pytest.raises(config_mod.ConfigError) as exc:
        config_mod.build({"backends": {"static": URLS[:1], "balancer": policy}})
    message = str(exc.value)
    assert f"balancer '{policy}'" in message and "no equivalent" in message


def test_the_config_names_every_balancer_there_is() -> None:
    # cache_aware is built apart (gateway/fleet/membership.py make_balancer): it reads the
    # pool's prefix index.
    assert set(config_mod.BALANCER_NAMES) == set(BALANCERS) | {"cache_aware"}
    assert all(b in config_mod.BALANCER_NAMES for b, _ in config_mod.SMG_POLICIES.values())
