"""The stub's prefix cache: what SGLang's radix cache does to a prompt, in miniature.

Per engine, an LRU of prompt-prefix blocks (`block_tokens` tokens each, chained hashes, so
a block stands for the whole prefix up to it), `capacity_tokens` in all. A request's
`cached_tokens` is how much of its prompt's leading blocks the engine held (never the whole
prompt: SGLang always computes the last token), reported in `meta_info` as SGLang does; its
blocks then become the most recent. Tokens are the stub's own: a text's words, a list's
ids, a chat's message contents' words (the same count as its `prompt_tokens`).

With `prefill_s_per_token`, prefill takes time: each request's uncached tokens queue behind
the engine's earlier prefills (one prefill at a time, as an engine's scheduler runs them),
so routing that loses the cache or piles onto one engine shows in latency. Off by default,
so the stub's timing is what it was.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


def tokens_of(value: object) -> list[Any]:
    """The stub's tokens of one prompt (a text, token ids, or chat messages)."""
    if isinstance(value, str):
        return list(value.split())
    if isinstance(value, list):
        if all(isinstance(v, int) for v in value):
            return list(value)
        out: list[Any] = []
        for v in value:
            out += tokens_of(v.get("content") if isinstance(v, dict) else v)
        return out
    return []


def generate_prompts(body: dict[str, Any]) -> list[object]:
    """The prompts of a /generate body, one per item, as rules.generate_items reads them."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return list(text)
    if isinstance(text, str):
        return [text]
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return list(ids)
    if isinstance(ids, list):
        return [ids]
    return []


class PrefixCache:
    __slots__ = (
        "_blocks",
        "_busy_until",
        "block_tokens",
        "cached_tokens_total",
        "capacity_tokens",
        "prefill_s_per_token",
        "prompt_tokens_total",
    )

    def __init__(
        self, capacity_tokens: int, block_tokens: int = 16, prefill_s_per_token: float = 0.0
    ) -> None:
        if capacity_tokens < 0 or block_tokens < 1 or prefill_s_per_token < 0:
            raise ValueError("capacity_tokens >= 0, block_tokens >= 1, prefill_s_per_token >= 0")
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self.prefill_s_per_token = prefill_s_per_token
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._busy_until = 0.0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    def clear(self) -> None:
        """/flush_cache: everything is recomputed from now on."""
        self._blocks.clear()

    @property
    def held_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def admit(self, tokens: Sequence[Any]) -> int:
        """The cached tokens of a prompt the engine is about to run; it is cached after."""
        size = self.block_tokens
        names = []
        h = 0
        for i in range(0, len(tokens) - size + 1, size):
            h = hash((h, tuple(tokens[i : i + size])))
            names.append(h)
        blocks = self._blocks
        held = 0
        for name in names:
            if name not in blocks:
                break
            held += 1
        cached = min(held * size, max(len(tokens) - 1, 0))
        if self.capacity_tokens >= size:
            for name in reversed(names):  # a prefix stays more recent than its extensions
                if name in blocks:
                    blocks.move_to_end(name)
                else:
                    blocks[name] = None
            for _ in range(len(blocks) - self.capacity_tokens // size):
                blocks.popitem(last=False)
        self.prompt_tokens_total += len(tokens)
        self.cached_tokens_total += cached
        return cached

    async def serve(self, prompts: Iterable[object]) -> list[int]:
        """Admit a request's prompts and wait out their prefill: the cached tokens of each."""
        cached = []
        uncached = 0
        for prompt in prompts:
            tokens = tokens_of(prompt)
            hit = self.admit(tokens)
            cached.append(hit)
            uncached += len(tokens) - hit
        if self.prefill_s_per_token > 0 and uncached:
            now = time.monotonic()
            self._busy_until = max(now, self._busy_until) + uncached * self.prefill_s_per_token
            await asyncio.sleep(self._busy_until - now)
        return cached


def stamp(outs: Iterable[dict[str, Any]], cached: Sequence[int]) -> None:
    """Write each item's cached_tokens into its meta_info (the i-th out is the i-th item,
    or carries its `index` in a batch's stream)."""
    for i, out in enumerate(outs):
        meta = out.get("meta_info")
        if isinstance(meta, dict) and cached:
            at = out.get("index", i)
            meta["cached_tokens"] = cached[at if isinstance(at, int) and at < len(cached) else -1]


def stamped(events: Iterable[dict[str, Any]], cached: Sequence[int]) -> Iterator[dict[str, Any]]:
    """A stream's events with their cached_tokens written in."""
    for event in events:
        meta = event.get("meta_info")
        if isinstance(meta, dict) and cached:
            at = event.get("index", 0)
            meta["cached_tokens"] = cached[at if isinstance(at, int) and at < len(cached) else -1]
        yield event
