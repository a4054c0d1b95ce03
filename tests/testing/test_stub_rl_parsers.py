"""The stub read the way RL frameworks read an SGLang engine, over real sockets.

Each parser below restates, in this project's code, what the framework's own code does with
the answer; the comment above it names the file and lines it follows, read at these commits:
THUDM/slime 624b824a, inclusionAI/AReaL 4aef98d8, volcengine/verl b178a3cd. The shapes are
SGLang 0.5.19's (tokenizer_manager.py `_handle_batch_output`, `detokenize_logprob_tokens`;
entrypoints/v1_loads.py; docs/sglang-contract.md s.7 and s.9).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.testing.stub import StubBackend

Json = dict[str, Any]


async def post(
    session: aiohttp.ClientSession, url: str, body: object, **kw: Any
) -> tuple[int, Any]:
    async with session.post(url, data=orjson.dumps(body), **kw) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw else None


async def stream(session: aiohttp.ClientSession, url: str, body: object, **kw: Any) -> list[Any]:
    """The JSON events of an SSE answer, [DONE] checked and dropped."""
    async with session.post(url, data=orjson.dumps(body), **kw) as resp:
        assert resp.status == 200
        data = [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


async def until(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# --- the frameworks' parsing rules ---------------------------------------------------------


def slime_tokens_and_logprobs(output: Json) -> tuple[list[int], list[float]]:
    # slime/rollout/sglang_rollout.py:206-210: item[1] is the token id, item[0] its logprob;
    # without the key slime silently records no tokens.
    meta = output["meta_info"]
    if "output_token_logprobs" in meta:
        return [i[1] for i in meta["output_token_logprobs"]], [
            i[0] for i in meta["output_token_logprobs"]
        ]
    return [], []


def slime_status(meta: Json) -> str:
    # slime/utils/types.py:410-416 (Sample._apply_meta_info): the finish_reason's type.
    return {"length": "TRUNCATED", "abort": "ABORTED", "stop": "COMPLETED"}[
        meta["finish_reason"]["type"]
    ]


def slime_prefix_cache(meta: Json) -> tuple[int, int]:
    # slime/utils/types.py:202-205 (PrefixCacheInfo.add).
    return meta.get("cached_tokens", 0), meta.get("prompt_tokens", 0)


def slime_num_requests(load: Any) -> int:
    # slime/backends/sglang_utils/server_control.py:12-28 (num_requests_from_load), applied
    # to GET {url}/v1/loads?include=core (line 40) while slime waits for an idle engine.
    if isinstance(load, list):
        return sum(slime_num_requests(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return slime_num_requests(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return int(load[key])
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (
        waiting if isinstance(waiting, int) else 0
    )


def areal_parse(response: Json) -> tuple[list[int], list[float], str]:
    # areal/engine/sglang_remote.py:95-125 (SGLangBackend.parse_generation_response): a
    # KeyError unless output_token_logprobs is there, aborted replies included.
    meta = response["meta_info"]
    reason = meta["finish_reason"]
    if reason["type"] == "abort" and reason.get("message", "").startswith("Abort before prefill"):
        return [], [], reason["type"]
    tokens = [x[1] for x in meta["output_token_logprobs"]]
    logprobs = [x[0] for x in meta["output_token_logprobs"]]
    return tokens, logprobs, reason["type"]


def verl_parse(output: Json) -> tuple[tuple[int, ...], tuple[float, ...]]:
    # verl/workers/rollout/sglang_rollout/async_sglang_server.py:452-456: every item
    # unpacks as exactly (log_prob, token_id, _).
    pairs = [
        (log_prob, token_id)
        for log_prob, token_id, _ in output["meta_info"]["output_token_logprobs"]
    ]
    log_probs, token_ids = zip(*pairs, strict=True)
    return token_ids, log_probs


# --- /generate with return_logprob ---------------------------------------------------------


async def test_slime_areal_and_verl_read_the_same_tokens_and_logprobs(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    # The request body slime (sglang_rollout.py:176-190) and AReaL (sglang_remote.py:68-75)
    # send: token ids in, return_logprob, no stream.
    body = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": 5},
        "return_logprob": True,
    }
    status, out = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    tokens, logprobs = slime_tokens_and_logprobs(out)
    assert tokens == out["output_ids"] == [100, 101, 102, 103, 104]
    assert len(logprobs) == out["meta_info"]["completion_tokens"] == 5
    assert all(isinstance(lp, float) and -3.0 <= lp <= -0.7 for lp in logprobs)
    assert areal_parse(out) == (tokens, logprobs, "length")
    assert verl_parse(out) == (tuple(tokens), tuple(logprobs))
    meta = out["meta_info"]
    assert slime_status(meta) == "TRUNCATED" and slime_prefix_cache(meta) == (0, 3)
    assert meta["output_token_logprobs_length"] == 5
    # The default logprob_start_len (-1) reports no prompt position; no text unless asked.
    assert meta["input_token_logprobs"] == []
    assert {row[2] for row in meta["output_token_logprobs"]} == {None}
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta
    assert meta["weight_version"] == "default" and isinstance(meta["e2e_latency"], float)


async def test_logprobs_are_fixed_by_the_prompt(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    def ask(prompt: Json) -> Json:
        return prompt | {"sampling_params": {"max_new_tokens": 4}, "return_logprob": True}

    _, first = await post(session, f"{stub.url}/generate", ask({"input_ids": [1, 2, 3]}))
    _, again = await post(session, f"{stub.url}/generate", ask({"input_ids": [1, 2, 3]}))
    _, other = await post(session, f"{stub.url}/generate", ask({"input_ids": [1, 2, 4]}))
    _, text = await post(session, f"{stub.url}/generate", ask({"text": "one two three"}))
    _, same_text = await post(session, f"{stub.url}/generate", ask({"text": "one  two three"}))
    lps = [slime_tokens_and_logprobs(o)[1] for o in (first, again, other, text, same_text)]
    assert lps[0] == lps[1] and lps[3] == lps[4]
    assert len({tuple(lp) for lp in lps}) == 3


async def test_prompt_logprobs_top_logprobs_and_text_as_sglang_lays_them_out(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    status, out = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    meta = out["meta_info"]
    # Positions 1..3 of the prompt; the first reported one has no logprob ([None] + ...).
    rows = meta["input_token_logprobs"]
    assert [r[1] for r in rows] == [6, 7, 8] and [r[2] for r in rows] == [" t6", " t7", " t8"]
    assert rows[0][0] is None and all(isinstance(r[0], float) for r in rows[1:])
    assert len(meta["input_top_logprobs"]) == 3 and meta["input_top_logprobs"][0] is None
    for row, top in zip(rows[1:], meta["input_top_logprobs"][1:], strict=True):
        assert top[0] == row and len(top) == 3
    # One top list per output token, led by the token reported, most likely first.
    assert [r[2] for r in meta["output_token_logprobs"]] == [" w0", " w1", " w2"]
    assert len(meta["output_top_logprobs"]) == 3
    for row, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert top[0] == row and len(top) == 3
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert sum(2.718281828 ** t[0] for t in top) < 1
    # logprob_start_len 0 reports the whole prompt, the first position without a logprob.
    status, whole = await post(session, f"{stub.url}/generate", body | {"logprob_start_len": 0})
    assert [r[1] for r in whole["meta_info"]["input_token_logprobs"]] == [5, 6, 7, 8]
    assert whole["meta_info"]["input_token_logprobs"][2:] == rows[1:]
    assert isinstance(whole["meta_info"]["input_token_logprobs"][1][0], float)


async def test_token_ids_logprob_reports_the_named_tokens(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {"text": "a b", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    status, out = await post(session, f"{stub.url}/generate", body | {"token_ids_logprob": [7, 9]})
    assert status == 200
    meta = out["meta_info"]
    assert [[r[1] for r in pos] for pos in meta["output_token_ids_logprobs"]] == [[7, 9], [7, 9]]
    # With token_ids_logprob SGLang keeps logprob_start_len -1: the prompt's last position.
    assert len(meta["input_token_logprobs"]) == 1 and meta["input_token_ids_logprobs"] == [None]


async def test_a_logprob_start_past_the_prompt_is_refused_as_sglang_does(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4}
    message = (
        "req.logprob_start_len=4 is higher than the number of input tokens "
        "len(req.origin_input_ids)=3. Please use a smaller logprob_start_len."
    )
    status, out = await post(session, f"{stub.url}/generate", body)
    assert (status, out) == (400, {"error": {"message": message}})
    (event,) = await stream(session, f"{stub.url}/generate", body | {"stream": True})
    reason = event["meta_info"]["finish_reason"]
    assert (reason["type"], reason["message"], reason["status_code"]) == ("abort", message, 400)
    # Without return_logprob SGLang ignores logprob_start_len.
    status, _ = await post(session, f"{stub.url}/generate", body | {"return_logprob": False})
    assert status == 200


async def test_a_batch_asks_per_item(stub: StubBackend, session: aiohttp.ClientSession) -> None:
    body = {
        "input_ids": [[1, 2], [3, 4, 5]],
        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}],
        "return_logprob": [True, False],
        "top_logprobs_num": [2, 0],
        "rid": ["b-0", "b-1"],
    }
    status, outs = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    assert [o["meta_info"]["id"] for o in outs] == ["b-0", "b-1"]
    tokens, _ = slime_tokens_and_logprobs(outs[0])
    assert tokens == [100, 101] and len(outs[0]["meta_info"]["output_top_logprobs"]) == 2
    assert slime_tokens_and_logprobs(outs[1]) == ([], [])
    # A scalar is shared by every item.
    status, outs = await post(
        session, f"{stub.url}/generate", {"text": ["x", "y z"], "return_logprob": True}
    )
    assert [len(areal_parse(o)[0]) for o in outs] == [16, 16]


async def test_a_stream_carries_the_logprobs_so_far(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    status, whole = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    events = await stream(session, f"{stub.url}/generate", body | {"stream": True})
    # SGLang's default (non-incremental) stream: every event holds everything so far.
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [1, 2, 3, 4]
    assert [e["output_ids"] for e in events][-1] == whole["output_ids"]
    assert (
        events[-1]["meta_info"]["output_token_logprobs"]
        == whole["meta_info"]["output_token_logprobs"]
    )
    assert verl_parse(events[-1]) == verl_parse(whole)
    # The latency is stamped when the request finishes, as SGLang does.
    assert ["e2e_latency" in e["meta_info"] for e in events] == [False, False, False, True]
    assert [e["meta_info"]["finish_reason"] for e in events][-1] == {"type": "length", "length": 4}


async def test_a_stop_token_ends_the_output_with_a_stop_reason(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    params = {"max_new_tokens": 8, "stop_token_ids": [2, 103]}
    body = {"text": "q", "sampling_params": params, "return_logprob": True}
    status, out = await post(session, f"{stub.url}/generate", body)
    assert status == 200
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 103}
    assert slime_status(meta) == "COMPLETED"
    # The stop token stays in the ids and leaves the text (detokenizer `trim_matched_stop`).
    assert out["output_ids"] == [100, 101, 102, 103] and out["text"] == " w0 w1 w2"
    assert slime_tokens_and_logprobs(out)[0] == out["output_ids"] and meta["completion_tokens"] == 4


# --- aborted replies -----------------------------------------------------------------------


async def test_an_aborted_generation_still_parses_for_areal_and_slime(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {"input_ids": [1, 2, 3, 4], "return_logprob": True, "rid": "agent-7"}
    held = asyncio.ensure_future(
        post(session, f"{stub.url}/generate", body, headers={"X-Stub-Delay-Ms": "5000"})
    )
    await until(lambda: stub.generations_seen == 1)
    async with session.post(f"{stub.url}/abort_request", json={"rid": "agent-7"}) as r:
        assert r.status == 200
    status, out = await held
    assert status == 200
    meta = out["meta_info"]
    assert meta["id"] == "agent-7" and meta["finish_reason"]["type"] == "abort"
    assert areal_parse(out) == ([], [], "abort") and slime_status(meta) == "ABORTED"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (4, 0, 0)
    assert meta["weight_version"] == "default" and meta["input_token_logprobs"] == []


async def test_an_aborted_stream_reports_the_tokens_it_sent(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {
        "input_ids": [[1, 2], [3]],
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 200},
    }
    headers = {"X-Stub-Chunk-Delay-Ms": "30"}
    async with session.post(f"{stub.url}/generate", json=body, headers=headers) as resp:
        for _ in range(6):  # three steps of two items
            await resp.content.readuntil(b"\n\n")
        async with session.post(f"{stub.url}/abort_request", json={"abort_all": True}) as r:
            assert r.status == 200
        rest = [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]
    assert rest[-1] == b"[DONE]"
    aborted = [orjson.loads(e) for e in rest[:-1] if b'"abort"' in e]
    assert sorted(e["index"] for e in aborted) == [0, 1]
    for event in aborted:
        tokens, _, reason = areal_parse(event)
        assert reason == "abort" and 3 <= len(tokens) < 200
        assert (
            tokens == event["output_ids"] and len(tokens) == event["meta_info"]["completion_tokens"]
        )


# --- weight version and loads --------------------------------------------------------------


async def test_get_weight_version_follows_updates(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    async def slime_engine_version() -> str:
        # slime/backends/sglang_utils/sglang_engine.py:320-326 (SGLangEngine.get_weight_version).
        async with session.get(f"{stub.url}/get_weight_version") as r:
            assert r.status == 200
            version: str = (await r.json())["weight_version"]
            return version

    assert await slime_engine_version() == "default"
    update = {"model_path": "/ckpt/iter-1", "weight_version": "iter-1"}
    async with session.post(f"{stub.url}/update_weights_from_disk", json=update) as r:
        assert r.status == 200
    assert await slime_engine_version() == "iter-1"
    async with session.get(f"{stub.url}/weight_version") as r:
        assert (await r.json()) == {"weight_version": "iter-1"}
    async with session.get(f"{stub.url}/model_info") as r:
        assert (await r.json())["weight_version"] == "iter-1"


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
async def test_upstream_sglang_has_no_get_weight_version(release: str) -> None:
    stub = StubBackend(version=release, weight_version_route=False)
    await stub.start()
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{stub.url}/get_weight_version") as r:
            assert r.status == 404
            body = await r.json()
    finally:
        await stub.stop()
    if release == "0.5.23":
        assert body == {"detail": "Not Found"}
    else:
        assert "deprecated. Please use '/model_info' instead." in body["message"]


async def test_loads_count_the_generations_running_now(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    async def loads(query: str = "?include=core") -> Json:
        async with session.get(f"{stub.url}/v1/loads{query}") as r:
            assert r.status == 200
            answer: Json = await r.json()
            return answer

    assert slime_num_requests(await loads()) == 0
    slow = {"X-Stub-Delay-Ms": "5000"}
    held = [
        asyncio.ensure_future(post(session, f"{stub.url}/generate", {"text": "x"}, headers=slow))
        for _ in range(3)
    ]
    held.append(
        asyncio.ensure_future(
            post(session, f"{stub.url}/generate", {"text": ["a", "b"]}, headers=slow)
        )
    )
    await until(lambda: stub.generations_seen == 4)
    answer = await loads()
    assert set(answer) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    (load,) = answer["loads"]
    # A batch of two counts as two requests, as SGLang's scheduler counts them.
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (5, 0)
    assert slime_num_requests(answer) == 5
    assert "memory" not in load and "queues" not in load  # include=core: the core keys only
    full = (await loads(""))["loads"][0]
    assert {"memory", "disaggregation", "queues"} <= set(full)
    assert (await loads("?include=core&dp_rank=1"))["loads"] == []
    async with session.get(f"{stub.url}/get_load") as r:
        (legacy,) = await r.json()
    assert legacy["num_reqs"] == 5 and slime_num_requests([legacy]) == 5
    async with session.post(f"{stub.url}/abort_request", json={"abort_all": True}) as r:
        assert r.status == 200
    await asyncio.gather(*held)
    assert slime_num_requests(await loads()) == 0


async def test_loads_refuse_an_unknown_section(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    async with session.get(f"{stub.url}/v1/loads?include=core,bogus") as r:
        assert r.status == 400
        body = await r.json()
    assert body["message"].startswith("Invalid include sections: {'bogus'}. Valid options: [")
    assert (body["object"], body["code"]) == ("error", 400)


# --- the OpenAI routes ---------------------------------------------------------------------


async def test_chat_logprobs_in_openai_shape(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, out = await post(session, f"{stub.url}/v1/chat/completions", body)
    assert status == 200
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [" w0", " w1", " w2"]
    assert content[0]["bytes"] == list(b" w0") and isinstance(content[0]["logprob"], float)
    assert [len(c["top_logprobs"]) for c in content] == [2, 2, 2]
    assert content[1]["top_logprobs"][0]["token"] == " w1"
    events = await stream(session, f"{stub.url}/v1/chat/completions", body | {"stream": True})
    streamed = [e["choices"][0]["logprobs"]["content"] for e in events]
    assert [c for part in streamed for c in part] == content
    status, plain = await post(
        session, f"{stub.url}/v1/chat/completions", body | {"logprobs": False}
    )
    assert plain["choices"][0]["logprobs"] is None


async def test_completion_logprobs_in_openai_shape(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "logprobs": 2}
    status, out = await post(session, f"{stub.url}/v1/completions", body)
    assert status == 200
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [" w0", " w1"] and lp["text_offset"] == [-1, -1]
    assert [len(t) for t in lp["top_logprobs"]] == [2, 2] and lp["top_logprobs"][0][" w0"] == lp[
        "token_logprobs"
    ][0]
    status, out = await post(session, f"{stub.url}/v1/completions", body | {"logprobs": 0})
    assert out["choices"][0]["logprobs"]["top_logprobs"] == []


async def test_an_adapter_loaded_from_tensors_serves_generations(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    """Miles and verl load adapters engine-direct from tensors (SGLang 0.5.19's
    LoadLoRAAdapterFromTensorsReqInput: lora_name, config_dict, serialized_named_tensors),
    then name the adapter as lora_path."""
    s = session
    gen = {"input_ids": [1, 2], "lora_path": "slot0", "sampling_params": {"max_new_tokens": 2}}
    status, _ = await post(s, stub.url + "/generate", gen)
    assert status == 400  # not loaded yet
    bare = {"lora_name": "slot0", "config_dict": {"r": 8}}
    status, _ = await post(s, stub.url + "/load_lora_adapter_from_tensors", bare)
    assert status == 400  # no tensors
    load = bare | {"serialized_named_tensors": ["AAAA"]}
    status, body = await post(s, stub.url + "/load_lora_adapter_from_tensors", load)
    assert status == 200 and body["loaded_adapters"] == {"slot0": "__tensor__"}
    status, _ = await post(s, stub.url + "/generate", gen)
    assert status == 200


async def test_a_prefix_abort_ends_every_request_whose_rid_starts_with_it(
    stub: StubBackend, session: aiohttp.ClientSession
) -> None:
    """Miles retires an adapter with {"rid": "<adapter>::", "prefix": true}
    (radixark/miles miles/ray/multi_lora/backend.py:164-189); a plain rid is exact."""
    s = session
    slow = {"X-Stub-Delay-Ms": "30000"}

    def gen(rid: str) -> Json:
        return {"input_ids": [1], "rid": rid, "sampling_params": {"max_new_tokens": 1}}

    flights = [
        asyncio.ensure_future(post(s, stub.url + "/generate", gen(rid), headers=slow))
        for rid in ("math::1", "math::2", "code::1")
    ]
    for _ in range(100):
        if len(stub._runs) == 3:
            break
        await asyncio.sleep(0.02)
    await post(s, stub.url + "/abort_request", {"rid": "math::"})  # exact: no such rid
    await asyncio.sleep(0.1)
    assert not any(f.done() for f in flights)
    await post(s, stub.url + "/abort_request", {"rid": "math::", "prefix": True})
    done = [await f for f in flights[:2]]
    assert [b["meta_info"]["finish_reason"]["type"] for _, b in done] == ["abort"] * 2
    assert not flights[2].done()
    await post(s, stub.url + "/abort_request", {"abort_all": True})
    await flights[2]
