"""What each backend recently served, as prompt-prefix blocks: the memory of cache_aware.

SGLang keeps a radix cache of the prompts it ran: a request whose prompt starts with a
cached prefix skips that much prefill. The gateway has no tokenizer, but equal prefixes of
request bytes are equal prefixes of prompts, so it remembers prompt *bytes* per backend.

A prompt is cut into blocks whose size grows with their offset (64 bytes up to 512, then
an eighth of the offset: a match is known to within 12.5%, which is all a routing choice
needs), and block i is named by a hash chained over blocks 0..i, so one name stands for a
whole prefix. Each backend keeps the names it served in an LRU of bounded length. A prompt
is touched last block first, so a prefix is always at least as recent as anything that
extends it: eviction takes the deepest blocks first, every backend's set stays closed under
prefixes, and its longest match is found by a binary search over the prompt's names.

Measured against a byte radix tree (shared nodes, per-backend owners; a prototype of the
same interface) on 2,000 requests of 32 growing conversations over 8 backends, on the 2-core
development VM, per request (match against all 8 + insert into the chosen one):

    average prompt      fixed 64-byte blocks   growing blocks (this)   radix tree
    2.4 KB              30 us                  28 us                   52 us
    19 KB               176 us                 37 us                   59 us
    156 KB              1,500 us               107 us                  64 us

Growing blocks keep the number of Python steps logarithmic in the prompt; what stays linear
is hashing its bytes (in C). The radix tree wins only past ~100 KB, costs splits, stores the
bytes themselves and needs subtree eviction to stay prefix-closed; the prompt considered is
capped (`max_prompt_bytes`) anyway, so the blocks were kept.

Memory: a block costs about 100-130 bytes (an OrderedDict entry, its name and its size),
so the default 32,768 blocks per backend are ~3.5-4 MB and stand for far more prompt than
an engine caches (~4 bytes a token). A backend that leaves or restarts is forgotten whole
(its cache is gone).

A backend may also be given a byte limit (`limit`: the engine's cache size in request bytes,
gateway/fleet/cache_aware.py): its blocks are then bounded by the prompt bytes they stand
for too, evicted least recently used first as the engine's own cache evicts, so the index
holds what the engine can still hold and a prefix it has evicted stops drawing requests to
it. In a replay of the routing trace (bench/routing_replay.py, 8 seeds) with each engine
caching 1/16 of the working set, the true size took the hit rate from 0.727 to 0.769 and
the uncached imbalance from 1.31 to 1.07; 0.6x the true size lost hits (0.696), 1.5x changed
nothing (0.735); with caches of 1/8 and more nothing changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

# The first blocks' size, and the offset up to which blocks keep it.
FIRST_BLOCK: Final = 64
_GROWTH_SHIFT: Final = 3  # past FIRST_BLOCK << 3 a block is 1/8 of its offset


def block_names(body: bytes, start: int, limit: int) -> tuple[list[int], list[int]]:
    """The chained names of the whole blocks of the prompt `body[start:]` within its first
    `limit` bytes, and the prompt offset each block ends at. A partial last block is left
    out (nothing to match)."""
    names: list[int] = []
    ends: list[int] = []
    stop = start + min(len(body) - start, limit)
    h = 0
    i = start
    while True:
        size = (i - start) >> _GROWTH_SHIFT
        j = i + (size if size > FIRST_BLOCK else FIRST_BLOCK)
        if j > stop:
            return names, ends
        # hash() of bytes is SipHash in C, salted per process: the names never leave it.
        h = hash((h, body[i:j]))
        names.append(h)
        ends.append(j - start)
        i = j


class Prompt:
    """A request's prompt: its body and the offset the prompt starts at
    (gateway/contract/prompt.py). Its block names are cut once, however often the request is
    matched (a retry's pick, a queued request's look at a freed slot, a pair's picks): on a
    160 KB prompt a cut is ~90 us of CPU, and five picks paid it five times."""

    __slots__ = ("_blocks", "_limit", "body", "cuts", "start")

    def __init__(self, body: bytes, start: int) -> None:
        self.body = body
        self.start = start
        self._blocks: tuple[list[int], list[int]] | None = None
        self._limit = -1
        self.cuts = 0  # how often the names were computed (tests, bench)

    def blocks(self, limit: int) -> tuple[list[int], list[int]]:
        """block_names of the prompt within `limit` bytes, computed on first use."""
        cut = self._blocks
        if cut is None or limit != self._limit:
            cut = self._blocks = block_names(self.body, self.start, limit)
            self._limit = limit
            self.cuts += 1
        return cut


class PrefixIndex:
    """Per backend URL, the prompt-prefix blocks it recently served: at most `max_blocks`,
    and with a `limit` set for it at most that many prompt bytes (the engine's cache, in the
    bytes of the requests that filled it), so what the index holds is what the engine can
    still hold. Each gateway worker keeps its own index of its own traffic: with --workers N
    each sees about 1/N of what filled the engine, so its bound errs on the generous side."""

    __slots__ = ("_bytes", "_limits", "_max_blocks", "_served")

    def __init__(self, max_blocks: int) -> None:
        self._max_blocks = max_blocks
        # name -> the bytes of its block
        self._served: dict[str, OrderedDict[int, int]] = {}
        self._bytes: dict[str, int] = {}
        self._limits: dict[str, int] = {}

    def matched(self, url: str, names: Sequence[int]) -> int:
        """How many of the leading `names` `url` holds (its longest prefix match, in blocks)."""
        served = self._served.get(url)
        if not served:
            return 0
        lo, hi = 0, len(names)
        # Prefix-closed: if block k is held, so is every block before it.
        while lo < hi:
            mid = (lo + hi) >> 1
            if names[mid] in served:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def record(self, url: str, names: Sequence[int], ends: Sequence[int]) -> None:
        """`url` was sent a prompt with these block names (and the prompt offsets they end
        at, block_names' second list): they become its most recent."""
        if not names:
            return
        served = self._served.get(url)
        if served is None:
            served = self._served[url] = OrderedDict()
        move = served.move_to_end
        added = 0
        for i in range(len(names) - 1, -1, -1):
            name = names[i]
            if name in served:
                move(name)
            else:
                size = ends[i] - (ends[i - 1] if i else 0)
                served[name] = size
                added += size
        self._bytes[url] = self._bytes.get(url, 0) + added
        self._trim(url, served)

    def _trim(self, url: str, served: OrderedDict[int, int]) -> None:
        held = self._bytes.get(url, 0)
        limit = self._limits.get(url)
        while served and (len(served) > self._max_blocks or (limit is not None and held > limit)):
            held -= served.popitem(last=False)[1]
        self._bytes[url] = held

    def resize(self, max_blocks: int) -> None:
        self._max_blocks = max_blocks
        for url, served in self._served.items():
            self._trim(url, served)

    def limit(self, url: str, max_bytes: int | None) -> None:
        """Bound what `url` is remembered to hold to `max_bytes` prompt bytes (None: by
        blocks only), evicting its least recent blocks now if it holds more."""
        if max_bytes is None:
            self._limits.pop(url, None)
            return
        self._limits[url] = max_bytes
        served = self._served.get(url)
        if served is not None:
            self._trim(url, served)

    def limit_of(self, url: str) -> int | None:
        return self._limits.get(url)

    def forget(self, url: str) -> None:
        """`url` left or restarted: what it cached is gone."""
        self._served.pop(url, None)
        self._bytes.pop(url, None)

    def keep_only(self, urls: Sequence[str]) -> None:
        """Membership is now `urls`: forget every other backend."""
        keep = set(urls)
        for url in [u for u in self._served if u not in keep]:
            del self._served[url]
            self._bytes.pop(url, None)
        for url in [u for u in self._limits if u not in keep]:
            del self._limits[url]

    def held_bytes(self, url: str) -> int:
        return self._bytes.get(url, 0)

    def blocks(self, url: str) -> int:
        served = self._served.get(url)
        return len(served) if served is not None else 0

    def urls(self) -> list[str]:
        return list(self._served)
