"""The stub's prefix cache: cached_tokens as SGLang reports them, a bounded LRU, a flush,
and prefill time that grows with the uncached part of the prompt."""

from __future__ import annotations

import time

import aiohttp
import orjson

from gateway.testing.stub import StubBackend
from gateway.testing.stub.cache import PrefixCache

JSON = {"Content-Type": "application/json"}


def prompt(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_cached_tokens_are_the_held_leading_blocks() -> None:
    cache = PrefixCache(1000, block_tokens=4)
    first = prompt(10).split()
    assert cache.admit(first) == 0
    assert cache.admit([*first, "x", "y"]) == 8  # the two whole blocks the first had
    assert cache.admit([*first, "x", "y"]) == 11  # never the whole prompt: the last token
    assert cache.admit(["other", *first]) == 0
    assert (cache.prompt_tokens_total, cache.cached_tokens_total) == (45, 19)


def test_the_cache_is_bounded_and_least_recently_used_goes_first() -> None:
    cache = PrefixCache(16, block_tokens=4)
    old, new = prompt(16, "a").split(), prompt(16, "b").split()
    cache.admit(old)
    cache.admit(new)
    assert cache.held_tokens == 16
    assert cache.admit([*old, "z"]) == 0
    cache.clear()
    assert cache.held_tokens == 0


async def test_the_stub_reports_cached_and_prompt_tokens(session: aiohttp.ClientSession) -> None:
    stub = StubBackend(prefix_cache=PrefixCache(10_000, 16))
    await stub.start()
    try:
        text = prompt(100)
        metas = []
        for extra in ("", " more words here"):
            body = {"text": text + extra, "sampling_params": {"max_new_tokens": 2}}
            async with session.post(stub.url + "/generate", data=orjson.dumps(body)) as r:
                metas.append(orjson.loads(await r.read())["meta_info"])
        assert [m["cached_tokens"] for m in metas] == [0, 96]
        assert [m["prompt_tokens"] for m in metas] == [100, 103]
        async with session.get(stub.url + "/metrics") as r:
            text_metrics = await r.text()
        assert 'sglang:cached_tokens_total{model_name="stub-model"} 96.0' in text_metrics
        async with session.post(stub.url + "/flush_cache") as r:
            assert r.status == 200
        body = {"text": text, "sampling_params": {"max_new_tokens": 2}, "stream": True}
        async with session.post(stub.url + "/generate", data=orjson.dumps(body)) as r:
            events = [
                orjson.loads(line[6:])
                for line in (await r.read()).split(b"\n")
                if line.startswith(b"data: {")
            ]
        assert events and all(e["meta_info"]["cached_tokens"] == 0 for e in events)
    finally:
        await stub.stop()


async def test_prefill_time_grows_with_the_uncached_prompt(session: aiohttp.ClientSession) -> None:
    stub = StubBackend(prefix_cache=PrefixCache(100_000, 16, prefill_s_per_token=0.0005))
    await stub.start()
    try:

        async def timed(text: str) -> float:
            t = time.monotonic()
            body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
            async with session.post(stub.url + "/generate", data=orjson.dumps(body)) as r:
                await r.read()
            return time.monotonic() - t

        long = prompt(2000)
        cold = await timed(long)  # 2000 uncached tokens: 1 s
        warm = await timed(long + " again")  # ~17 uncached: under 10 ms of prefill
        # A quarter of the cold time leaves a loaded machine 240 ms for one local request.
        assert cold >= 0.98 and warm < cold / 4
    finally:
        await stub.stop()


async def test_without_a_cache_nothing_changes(session: aiohttp.ClientSession) -> None:
    stub = StubBackend()
    await stub.start()
    try:
        body = {"text": prompt(100), "sampling_params": {"max_new_tokens": 1}}
        for _ in range(2):
            async with session.post(stub.url + "/generate", data=orjson.dumps(body)) as r:
                assert orjson.loads(await r.read())["meta_info"]["cached_tokens"] == 0
    finally:
        await stub.stop()
