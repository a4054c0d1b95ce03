"""cache_aware: the prefix index (bounded, prefix-closed, forgetful), the balancer's
decisions, the prompt locator, and session affinity that spills."""

from __future__ import annotations

import itertools
import random

import pytest
import yaml

from gateway.config import BackendsConfig, CacheAwareConfig
from gateway.contract.prompt import SEARCH_BYTES, prompt_start
from gateway.contract.routes import Kind
from gateway.fleet.balancers import BalanceRule, ConsistentHash
from gateway.fleet.cache_aware import (
    BALANCED,
    MATCHED,
    MIN_CACHE_BYTES,
    NO_PROMPT,
    UNMATCHED,
    CacheAware,
    CacheAwareRules,
    prompt_tokens,
)
from gateway.fleet.membership import make_balancer
from gateway.fleet.pool import Backend, BackendPool, Health
from gateway.fleet.prefix_index import FIRST_BLOCK, PrefixIndex, Prompt, block_names

URLS = [f"http://10.0.0.{i}:30000" for i in range(1, 5)]


def words(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return b" ".join(b"w%d" % rng.randrange(10**6) for _ in range(n))


def names(prompt: bytes) -> list[int]:
    return block_names(prompt, 0, 1 << 20)[0]


def record(index: PrefixIndex, url: str, prompt: bytes) -> None:
    index.record(url, *block_names(prompt, 0, 1 << 20))


# -- the index -----------------------------------------------------------------------------


def test_blocks_grow_with_the_offset_and_stop_at_the_limit() -> None:
    prompt = words(20000, 1)
    hashes, ends = block_names(prompt, 0, len(prompt))
    sizes = [b - a for a, b in zip([0, *ends], ends, strict=False)]
    assert sizes[:8] == [FIRST_BLOCK] * 8
    assert all(later >= earlier for earlier, later in itertools.pairwise(sizes))
    assert len(hashes) < 60 < len(prompt) // FIRST_BLOCK  # logarithmic, not linear
    assert ends[-1] > len(prompt) * 7 // 8
    limited, limited_ends = block_names(prompt, 0, 4096)
    assert limited_ends[-1] <= 4096 and limited == hashes[: len(limited)]
    # A prompt further into a body has the same names: they depend on its bytes only.
    assert block_names(b'{"text": ' + prompt, 9, len(prompt))[0] == hashes


def test_a_backend_matches_the_longest_prefix_it_served() -> None:
    index = PrefixIndex(10_000)
    system = words(400, 2)
    turn1 = system + words(300, 3)
    record(index, URLS[0], turn1)
    turn2 = turn1 + words(300, 4)
    assert index.matched(URLS[0], names(turn2)) == len(names(turn1))
    other = system + words(300, 5)
    shared = index.matched(URLS[0], names(other))
    assert 0 < shared < len(names(turn1))
    assert index.matched(URLS[1], names(turn2)) == 0


def test_memory_is_bounded_and_the_deepest_oldest_blocks_go_first() -> None:
    index = PrefixIndex(64)
    system = words(200, 6)
    for i in range(200):
        record(index, URLS[0], system + words(400, 100 + i))
        assert index.blocks(URLS[0]) <= 64
    # The shared prefix, touched by every prompt, survived; old conversations did not.
    assert index.matched(URLS[0], names(system + words(400, 100))) >= len(names(system)) - 1
    assert index.matched(URLS[0], names(system + words(400, 299))) == len(
        names(system + words(400, 299))
    )


def test_eviction_keeps_every_backend_prefix_closed() -> None:
    rng = random.Random(7)
    index = PrefixIndex(40)
    prompts = [words(rng.randrange(50, 800), rng.randrange(5)) for _ in range(300)]
    for p in prompts:
        record(index, URLS[0], p)
    served = index._served[URLS[0]]
    for p in prompts:
        ns = names(p)
        held = [n in served for n in ns]
        # Once a block is missing, every block after it is missing too.
        assert held == sorted(held, reverse=True)


def test_a_byte_bound_holds_what_the_engine_can_and_stays_prefix_closed() -> None:
    limit = 20_000
    index = PrefixIndex(1 << 20)
    index.limit(URLS[0], limit)
    rng = random.Random(9)
    prompts = [words(rng.randrange(100, 2000), rng.randrange(1 << 30)) for _ in range(80)]
    for p in prompts:
        record(index, URLS[0], p)
        # The bytes held are the sum of the blocks held, and never above the bound.
        assert index.held_bytes(URLS[0]) == sum(index._served[URLS[0]].values()) <= limit
    served = index._served[URLS[0]]
    for p in prompts:
        held = [n in served for n in names(p)]
        assert held == sorted(held, reverse=True)
    # The latest prompt is held whole; the first ones, 80 prompts ago, are gone.
    assert index.matched(URLS[0], names(prompts[-1])) == len(names(prompts[-1]))
    assert index.matched(URLS[0], names(prompts[0])) == 0
    # Without the bound the same traffic would have been remembered whole.
    unbounded = PrefixIndex(1 << 20)
    for p in prompts:
        record(unbounded, URLS[0], p)
    assert unbounded.matched(URLS[0], names(prompts[0])) == len(names(prompts[0]))
    index.forget(URLS[0])
    assert index.held_bytes(URLS[0]) == 0
    # A limit set later trims at once, least recent first; another backend keeps its own.
    for p in prompts:
        record(unbounded, URLS[1], p)
    unbounded.limit(URLS[0], limit)
    assert unbounded.held_bytes(URLS[0]) <= limit < unbounded.held_bytes(URLS[1])
    assert unbounded.matched(URLS[0], names(prompts[-1])) == len(names(prompts[-1]))
    unbounded.keep_only(URLS[1:])
    assert unbounded.limit_of(URLS[0]) is None


def test_forget_and_keep_only_drop_what_a_backend_served() -> None:
    index = PrefixIndex(1000)
    prompt = words(500, 8)
    for url in URLS:
        record(index, url, prompt)
    index.forget(URLS[0])
    assert index.matched(URLS[0], names(prompt)) == 0
    index.keep_only(URLS[2:])
    assert index.urls() == URLS[2:]
    assert index.matched(URLS[2], names(prompt)) == len(names(prompt))


# -- the balancer --------------------------------------------------------------------------


def fleet(n: int = 4) -> list[Backend]:
    return [Backend(u) for u in URLS[:n]]


def balancer(**kw: object) -> CacheAware:
    rules = CacheAwareRules(**kw)  # type: ignore[arg-type]
    b = CacheAware(rules, seed=0)
    b.set_members(URLS)
    return b


def test_a_conversation_stays_where_its_prefix_is() -> None:
    ca = balancer()
    backends = fleet()
    convo = b'"' + words(300, 9)
    first = ca.choose_prompt(backends, convo, 0)
    for turn in range(10):
        convo += words(100, 10 + turn)
        assert ca.choose_prompt(backends, convo, 0) is first
    assert ca.stats[first.url].decisions[MATCHED] == 10
    assert ca.stats[first.url].matched_bytes > 0


def test_an_overloaded_owner_is_balanced_away_then_both_share_the_prefix() -> None:
    ca = balancer(balance=BalanceRule(abs_threshold=2, rel_threshold=1.5))
    backends = fleet(2)
    system = words(600, 11)
    owner = ca.choose_prompt(backends, system + words(20, 12), 0)
    other = backends[1] if owner is backends[0] else backends[0]
    owner.inflight = 3  # 3 - 0 > 2 and 3 > 0 * 1.5
    assert ca.choose_prompt(backends, system + words(20, 13), 0) is other
    assert ca.stats[other.url].decisions[BALANCED] == 1
    # Both now hold the system prompt: the less loaded of them takes the next one.
    owner.inflight, other.inflight = 1, 0
    assert ca.choose_prompt(backends, system + words(20, 14), 0) is other
    owner.inflight, other.inflight = 0, 1
    assert ca.choose_prompt(backends, system + words(20, 15), 0) is owner


def test_a_load_within_the_rule_keeps_the_match() -> None:
    ca = balancer(balance=BalanceRule(abs_threshold=2, rel_threshold=1.5))
    backends = fleet(2)
    prompt = words(600, 16)
    owner = ca.choose_prompt(backends, prompt, 0)
    owner.inflight = 2  # not more than 2 above the other
    assert ca.choose_prompt(backends, prompt + b" more", 0) is owner
    owner.inflight = 5
    for b in backends:
        if b is not owner:
            b.inflight = 4  # 5 > 4 + 2 fails: not overloaded
    assert ca.choose_prompt(backends, prompt + b" again", 0) is owner


def test_a_short_match_goes_to_the_least_loaded() -> None:
    ca = balancer(cache_threshold=0.5)
    backends = fleet(2)
    shared = words(100, 17)
    owner = ca.choose_prompt(backends, shared + words(20, 18), 0)
    owner.inflight = 1
    # The shared part is well under half of this prompt.
    chosen = ca.choose_prompt(backends, shared + words(900, 19), 0)
    assert chosen is not owner
    assert ca.stats[chosen.url].decisions[UNMATCHED] == 1


def test_a_new_conversation_is_not_pulled_onto_a_short_shared_prefix() -> None:
    # Agents share a short system prompt; a new conversation's first message is longer.
    # Its backend is a little busier, within the balance rule: the defaults still place the
    # conversation by load, so new sessions do not pile onto the prompt's one holder.
    ca = balancer()
    backends = fleet(2)
    system = words(100, 20)
    holder = ca.choose_prompt(backends, system + words(120, 21), 0)
    holder.inflight = 3
    chosen = ca.choose_prompt(backends, system + words(120, 22), 0)
    assert chosen is not holder
    assert ca.stats[chosen.url].decisions[UNMATCHED] == 1
    # A prompt that reuses most of what it holds stays (the next turn of that conversation).
    assert ca.choose_prompt(backends, system + words(120, 21) + words(60, 23), 0) is holder
    assert CacheAwareConfig().cache_threshold == CacheAwareRules().cache_threshold


def test_without_a_prompt_it_is_least_loaded() -> None:
    ca = balancer()
    backends = fleet()
    for i, b in enumerate(backends):
        b.inflight = 4 - i
    assert ca.choose(backends, None) is backends[3]
    assert ca.choose_prompt(backends, b"short", 0) is backends[3]  # no whole block
    assert ca.stats[backends[3].url].decisions[NO_PROMPT] == 2


def test_only_candidates_are_chosen_and_departed_backends_are_forgotten() -> None:
    ca = balancer()
    backends = fleet()
    prompt = words(500, 20)
    owner = ca.choose_prompt(backends[:1], prompt, 0)
    assert owner is backends[0]
    # The owner is not a candidate (paused, wrong weights, cannot serve the mask).
    assert ca.choose_prompt(backends[1:], prompt, 0) in backends[1:]
    ca.set_members(URLS[1:])
    assert ca.held_blocks(URLS[0]) == 0 and URLS[0] not in ca.stats


def test_a_reload_keeps_what_was_learnt() -> None:
    old = balancer()
    backends = fleet()
    prompt = words(500, 21)
    owner = old.choose_prompt(backends, prompt, 0)
    # Shrunk, but still holding most of the prompt (the deepest blocks went first).
    new = balancer(max_blocks_per_backend=24)
    new.inherit(old)
    assert new.choose_prompt(backends, prompt + b" x", 0) is owner
    assert new.held_blocks(owner.url) <= 24 < len(names(prompt))
    assert new.stats[owner.url].decisions[MATCHED] == 1


def test_a_prefix_the_engine_has_evicted_stops_drawing_requests() -> None:
    # engine_cache_tokens x bytes_per_token: what the gateway keeps of each backend.
    cfg = BackendsConfig(
        static=URLS[:2],
        balancer="cache_aware",
        cache_aware=CacheAwareConfig(engine_cache_tokens=2000, bytes_per_token=4.0),
    )
    ca = make_balancer(cfg)
    assert isinstance(ca, CacheAware)
    ca.set_members(URLS[:2])
    assert ca.cache_limit(URLS[0]) == 8000
    backends = fleet(2)
    first = words(600, 30)
    owner = ca.choose_prompt(backends, first, 0)
    # The owner then serves more than its cache holds: the first prompt was evicted there.
    for i in range(6):
        assert ca.choose_prompt([owner], words(600, 40 + i), 0) is owner
    assert ca.held_blocks(owner.url) > 0
    other = next(b for b in backends if b is not owner)
    other.inflight, owner.inflight = 0, 1
    # Nothing holds it now: placed by load, not drawn to where it used to be.
    assert ca.choose_prompt(backends, first + words(50, 31), 0) is other
    # With no bound the gateway still believes the owner holds it.
    plain = balancer()
    owner = plain.choose_prompt(backends, first, 0)
    for i in range(6):
        plain.choose_prompt([owner], words(600, 40 + i), 0)
    other = next(b for b in backends if b is not owner)
    other.inflight, owner.inflight = 0, 1
    assert plain.choose_prompt(backends, first + words(50, 31), 0) is owner


def test_an_engine_size_too_small_to_hold_a_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="engine_cache_tokens x bytes_per_token is 2400 bytes"):
        CacheAwareConfig(engine_cache_tokens=600, bytes_per_token=4.0)
    assert CacheAwareConfig(engine_cache_tokens=1024, bytes_per_token=4.0)
    with pytest.raises(ValueError, match="greater than or equal to 512"):
        CacheAwareConfig(engine_cache_tokens=100)
    with pytest.raises(ValueError):
        CacheAwareConfig(engine_cache_tokens="auto")  # type: ignore[arg-type]
    # A bare `off` in YAML is false; `on`, or a flag for bytes, is no size.
    assert CacheAwareConfig(**yaml.safe_load("engine_cache_tokens: off")).engine_cache_tokens == (
        "off"
    )
    for flag in ("engine_cache_tokens: on", "bytes_per_token: true"):
        with pytest.raises(ValueError):
            CacheAwareConfig(**yaml.safe_load(flag))
    # What an engine reports, or a learnt figure, never bounds a backend under a prompt.
    ca = balancer(bytes_per_token=0.5)
    ca.report(URLS[0], 1000)
    assert ca.cache_limit(URLS[0]) == MIN_CACHE_BYTES


def test_each_engine_is_bounded_by_the_size_it_reports() -> None:
    """engine_cache_tokens "reported" (the default): each engine's own max_total_num_tokens
    (gateway/contract/profiles.py reads it from /server_info), times the bytes a token
    takes, learnt from the prompts when not configured."""
    ca = make_balancer(BackendsConfig(static=URLS, balancer="cache_aware"))
    assert isinstance(ca, CacheAware)
    ca.set_members(URLS)
    backends = fleet()
    assert ca.cache_limit(URLS[0]) is None  # nothing said: bounded by blocks only
    ca.report(URLS[0], 1000)
    ca.report(URLS[1], 4000)
    # `w123456 ` words: about 8 bytes a token, learnt from the first prompt.
    for i in range(40):
        ca.choose_prompt(backends, words(300, 100 + i), 0)
    assert 7.0 < ca.bytes_per_token < 8.5
    small, large = ca.cache_limit(URLS[0]), ca.cache_limit(URLS[1])
    assert small == int(1000 * ca.bytes_per_token) and large == int(4000 * ca.bytes_per_token)
    for i in range(30):
        ca.choose_prompt([backends[0]], words(300, 200 + i), 0)
        ca.choose_prompt([backends[1]], words(300, 200 + i), 0)
    assert ca._index.held_bytes(URLS[0]) <= small < ca._index.held_bytes(URLS[1]) <= large
    assert ca.cache_limit(URLS[2]) is None
    ca.report(URLS[0], None)  # it no longer says
    assert ca.cache_limit(URLS[0]) is None
    # A fixed figure wins over what engines report; "off" hears none.
    fixed = make_balancer(
        BackendsConfig(
            static=URLS,
            balancer="cache_aware",
            cache_aware=CacheAwareConfig(engine_cache_tokens=2000, bytes_per_token=5.0),
        )
    )
    off = make_balancer(
        BackendsConfig(
            static=URLS,
            balancer="cache_aware",
            cache_aware=CacheAwareConfig(engine_cache_tokens="off"),
        )
    )
    for b in (fixed, off):
        assert isinstance(b, CacheAware)
        b.set_members(URLS)
        b.report(URLS[0], 1000)
    assert isinstance(fixed, CacheAware) and fixed.cache_limit(URLS[0]) == 10_000
    assert isinstance(off, CacheAware) and off.cache_limit(URLS[0]) is None


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        (b"one two three four", 3),  # words (spaces between them)
        (b"[1, 2, 3, 4, 5]", 4),  # ids as json.dumps writes them
        (b"[1,2,3,4,5]", 4),  # and as orjson does
        (rb"\u4f60\u597d" * 8, 6),  # no spaces (escaped CJK): one per 16 bytes
        (b"x", 1),
    ],
)
def test_a_prompts_tokens_are_estimated_without_a_tokenizer(prompt: bytes, tokens: int) -> None:
    assert prompt_tokens(prompt, 0, len(prompt)) == tokens


def test_the_learnt_bytes_per_token_follow_the_traffic() -> None:
    ca = balancer()
    backends = fleet()
    ids = b"[" + b", ".join(b"%d" % (10_000 + i) for i in range(400)) + b"]"
    for _ in range(16 * 4):
        ca.choose_prompt(backends, ids, 0)
    assert 6.9 < ca.bytes_per_token < 7.1  # "10000, " is 7 bytes an id
    ca.report(URLS[0], 1000)
    before = ca.cache_limit(URLS[0])
    text = b'"' + words(400, 5)
    for _ in range(16 * 200):
        ca.choose_prompt(backends, text, 0)
    assert ca.bytes_per_token > 7.5  # "w123456 " words: 8 bytes
    after = ca.cache_limit(URLS[0])
    assert before is not None and after is not None and after > before


def test_the_pool_routes_by_prompt_and_forgets_a_restarted_backend() -> None:
    cfg = BackendsConfig(static=URLS, balancer="cache_aware")
    pool = BackendPool(URLS, make_balancer(cfg))
    assert pool.prefix is not None
    body = b'{"text": "' + words(500, 22) + b'"}'
    owner = pool.pick(prompt=Prompt(body, 9))
    assert owner is not None
    assert pool.pick(prompt=Prompt(body, 9)) is owner
    owner.health = Health.UNHEALTHY
    pool.forget(owner)  # what the prober does when it comes back
    assert pool.prefix.held_blocks(owner.url) == 0
    # A mask request that only another backend admits goes there, prompt or not.
    assert pool.pick(prompt=Prompt(body, 9), fits=lambda b: b is not owner) is not owner


def test_a_requests_prompt_is_cut_into_blocks_once_for_all_its_picks() -> None:
    # A retry's pick, a queued request's look at a freed slot, a pair's prefill pick: each
    # matched the same prompt again, and cutting a 160 KB one is the pick's main cost.
    cfg = BackendsConfig(static=URLS, balancer="cache_aware")
    pool = BackendPool(URLS, make_balancer(cfg))
    body = b'{"text": "' + words(20_000, 23) + b'"}'
    assert len(body) > 100_000
    prompt = Prompt(body, 9)
    tried: list[Backend] = []
    for _ in range(5):
        chosen = pool.pick(tried, prompt=prompt)
        assert chosen is not None
        tried = [chosen] if len(tried) >= len(URLS) - 1 else [*tried, chosen]
    assert prompt.cuts == 1
    # The names it kept are the ones a fresh cut gives.
    assert prompt.blocks(CacheAwareRules().max_prompt_bytes) == block_names(
        body, 9, CacheAwareRules().max_prompt_bytes
    )


def test_the_config_builds_the_balancers_with_the_balance_rule() -> None:
    cfg = BackendsConfig(
        static=URLS, balancer="cache_aware", balance_abs_threshold=3, balance_rel_threshold=2.0
    )
    ca = make_balancer(cfg)
    assert isinstance(ca, CacheAware) and ca.rules.balance == BalanceRule(3, 2.0)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        BackendsConfig(static=URLS, balance_rel_threshold=0.5)


# -- session affinity that spills --------------------------------------------------------


def test_consistent_hash_spills_an_overloaded_session_owner() -> None:
    ring = ConsistentHash(1, spill=BalanceRule(abs_threshold=4, rel_threshold=1.5))
    backends = fleet()
    ring.set_members(URLS)
    owner = ring.choose(backends, "session-1")
    owner.inflight = 4
    assert ring.choose(backends, "session-1") is owner  # 4 - 0 is not over 4
    owner.inflight = 5
    spilled = ring.choose(backends, "session-1")
    assert spilled is not owner and spilled.inflight == 0
    # Without a rule it piles on, as before.
    plain = ConsistentHash(1)
    plain.set_members(URLS)
    assert plain.choose(backends, "session-1") is owner


# -- the prompt locator ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "body", "value"),
    [
        (Kind.GENERATE, b'{"rid": "x", "text": "hello"}', b'"hello"'),
        (Kind.GENERATE, b'{"input_ids" :\n [1, 2, 3]}', b"[1, 2, 3]"),
        (Kind.GENERATE, b'{"stop": ["text"], "text":"p"}', b'"p"'),  # a value, then the key
        (Kind.CHAT, b'{"model": "m", "messages": [{"role": "user"}]}', b'[{"role": "user"}]'),
        (Kind.COMPLETIONS, b'{"prompt": "a b"}', b'"a b"'),
    ],
)
def test_the_prompt_is_found_where_its_value_starts(kind: Kind, body: bytes, value: bytes) -> None:
    start = prompt_start(kind, body)
    assert start is not None and body[start:].startswith(value)


def test_no_prompt_where_none_can_be_found_cheaply() -> None:
    assert prompt_start(Kind.PASSTHROUGH, b'{"text": "x"}') is None
    assert prompt_start(Kind.GENERATE, b'{"\\u0074ext": "x"}') is None
    far = b'{"image_data": "' + b"a" * SEARCH_BYTES + b'", "text": "x"}'
    assert prompt_start(Kind.GENERATE, far) is None


def test_among_equal_matches_the_least_loaded_wins() -> None:
    ca = balancer()
    a, b, c = fleet(3)
    prompt = words(600, 23)
    for holder in (a, b):
        ca.choose_prompt([holder], prompt, 0)
    a.inflight, b.inflight, c.inflight = 2, 1, 0  # c is idle but holds nothing
    assert ca.choose_prompt([a, b, c], prompt + b" q1", 0) is b
    a.inflight, b.inflight = 1, 2
    assert ca.choose_prompt([a, b, c], prompt + b" q2", 0) is a


def test_new_work_goes_where_the_cache_is_least_pressed() -> None:
    """A request no backend holds goes to the least loaded, unless its cache and those of
    the backends near it in load have all turned over lately: then to the least pressed
    (prompt bytes sent lately over the bytes its cache holds), within 3 in flight."""
    ca = balancer(bytes_per_token=1.0)
    a, b, c = backends = fleet(3)
    ca.set_members(URLS[:3])
    fresh = (words(200, 900 + i) for i in range(10**6))  # ~1.6 KB each
    for _ in range(20):
        ca.choose_prompt([a], next(fresh), 0)
    for _ in range(6):
        ca.choose_prompt([b], next(fresh), 0)
    # a and b report 1,000 tokens (4,096 bytes, the floor); c says nothing. a was sent
    # the most lately, b less, both more than their caches hold.
    ca.report(a.url, 1000)
    ca.report(b.url, 1000)
    b.inflight, c.inflight = 1, 2
    # c's size is unknown and it is near in load: load alone decides.
    assert ca.choose_prompt(backends, next(fresh), 0) is a
    c.inflight = 5  # past the slack: c is out of the question
    for b.inflight in (1, 3):
        assert ca.choose_prompt(backends, next(fresh), 0) is b  # b is least pressed
        for _ in range(3):
            ca.choose_prompt([a], next(fresh), 0)  # a stays the more pressed
    b.inflight = 4  # past the slack: the least loaded after all
    assert ca.choose_prompt(backends, next(fresh), 0) is a
    # The balance rule is still asked against the least loaded, not the placement: a
    # holds this prompt, is 9 over c (the least loaded), and loses it to c's load.
    held = next(fresh)
    ca.choose_prompt([a], held, 0)
    a.inflight, b.inflight, c.inflight = 9, 4, 0
    assert ca.choose_prompt(backends, held + b" more", 0) is c
    # A prefix one of them holds still goes there: pressure only places new work.
    mine = next(fresh)
    ca.choose_prompt([a], mine, 0)
    a.inflight = 1
    assert ca.choose_prompt(backends, mine + b" more", 0) is a
    # Pressure fades: after many prompts to b alone, a's turnover is under its cache and
    # load decides again (c, the least loaded, is back in the slack but a is lighter).
    assert ca._pressure[a.url] / ca._scale > 4096
    for _ in range(300):
        ca.choose_prompt([b], next(fresh), 0)
    assert ca._pressure[a.url] / ca._scale < 4096
    a.inflight, b.inflight, c.inflight = 1, 0, 5
    assert ca.choose_prompt(backends, next(fresh), 0) is b
    # Off: load alone, however pressed.
    off = balancer(bytes_per_token=1.0, place_by_pressure=False)
    off.set_members(URLS[:2])
    for u in URLS[:2]:
        off.report(u, 1000)
    for _ in range(20):
        off.choose_prompt([a], next(fresh), 0)
    for _ in range(6):
        off.choose_prompt([b], next(fresh), 0)
    a.inflight, b.inflight = 0, 1
    assert off.choose_prompt(backends[:2], next(fresh), 0) is a


def test_caches_not_pressed_are_placed_by_load() -> None:
    ca = balancer(bytes_per_token=1.0)
    a, b = backends = fleet(2)
    ca.set_members(URLS[:2])
    ca.report(a.url, 1 << 20)
    ca.report(b.url, 1 << 20)  # a MB each: a few KB sent is no pressure
    for i in range(10):
        ca.choose_prompt([a], words(200, 50 + i), 0)
    b.inflight = 1
    assert ca.choose_prompt(backends, words(200, 99), 0) is a
    # A restart forgets the pressure with the cache.
    ca.forget(a.url)
    assert a.url not in ca._pressure
    # Kept scaled up and rescaled now and then, it stays the decayed sum: for one prompt
    # size sent again and again, 24 of them with 2 members (d / (1 - d), d = 1 - 1 / 25).
    prompt = words(200, 7)
    for _ in range(3000):
        ca.choose_prompt([b], prompt, 0)
    assert 1 <= ca._scale < 1e12
    assert ca._pressure[b.url] / ca._scale == pytest.approx(24 * len(prompt), rel=1e-6)


def test_the_balance_rule_is_asked_against_the_least_loaded_not_the_placement() -> None:
    ca = balancer(bytes_per_token=1.0)
    a, b, c = backends = fleet(3)
    ca.set_members(URLS[:3])
    for u in URLS[:3]:
        ca.report(u, 1000)
    fresh = (words(200, 5000 + i) for i in range(10**6))
    for target, n in ((a, 20), (c, 12), (b, 6)):  # every cache pressed, b the least
        for _ in range(n):
            ca.choose_prompt([target], next(fresh), 0)
    held = next(fresh)
    ca.choose_prompt([a], held, 0)
    a.inflight, b.inflight, c.inflight = 9, 3, 0
    # a holds it but is 9 over c, the least loaded: balanced away, and placed on b, the
    # least pressed within the slack (a rule asked against b, 6 under a, would keep a).
    assert ca.choose_prompt(backends, held + b" more", 0) is b
    assert ca.stats[b.url].decisions[BALANCED] == 1
