"""verl's calls, in the order a run makes them, against four stub engines behind the
gateway (docs/rl-frameworks.md, section verl).

verl: verl-project/verl (formerly volcengine/verl) at
1dda039b9c6311889a9c9a26040677e1254814f9; paths below are in that repository at that
commit. verl drives its SGLang servers as Ray actors: rollouts go to each server's
tokenizer manager in process (verl/workers/rollout/sglang_rollout/async_sglang_server.py),
weight and LoRA updates go over HTTP to each engine's own port
(verl/workers/rollout/sglang_rollout/http_server_engine.py, AsyncHttpServerAdapter). The
adapter registers with a router when it is given one (router_ip, router_port; verl's
rollout passes none at this commit, sglang_rollout.py:155-161), and its HTTP generate and
abort are the requests a verl agent loop sends when its address is the gateway's. The
request bodies are those verl builds (async_sglang_server.py:624-652), sent as /generate
JSON.

`X-Stub-*` headers script the stub engine (a slow generation), nothing verl sends.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from tests.rl.replay import (
    CLUSTER,
    ENGINES,
    OPERATOR,
    PROBE_S,
    QUEUE_S,
    Answer,
    Client,
    Cluster,
    all_healthy,
    cluster,
    direct_version_seen,
    loads_check,
    register,
    running,
)

pytestmark = pytest.mark.heavy

SLOW = {"X-Stub-Delay-Ms": "30000"}
ONE_PROBE_S = PROBE_S + 0.25
LORA_NAME = "verl_actor_lora_name"  # verl/workers/rollout/sglang_rollout/utils.py:26


def generate_request(prompt_ids: list[int], rid: str, lora: bool = False) -> dict[str, Any]:
    """async_sglang_server.py:624-652: rid, token ids, sampling params, return_logprob
    (from sampling_params["logprobs"]), and the actor's LoRA as lora_path."""
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": prompt_ids,
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8},
        "return_logprob": True,
    }
    if lora:
        body["lora_path"] = LORA_NAME
    return body


def parse_output(output: dict[str, Any]) -> tuple[list[int], list[float], str | None]:
    """async_sglang_server.py:656-678: log-probs are kept only when
    meta_info.output_token_logprobs holds one (logprob, token_id, text) triple per output
    id; otherwise verl logs an error and drops the sample's tokens."""
    meta_info = output.get("meta_info", {})
    finish_reason = meta_info.get("finish_reason")
    finish = finish_reason["type"] if finish_reason else None
    token_ids = list(output.get("output_ids", []))
    output_token_logprobs = meta_info.get("output_token_logprobs") or []
    if output_token_logprobs and len(output_token_logprobs) == len(token_ids):
        log_probs = [float(log_prob) for log_prob, _, _ in output_token_logprobs]
    else:
        token_ids, log_probs = [], []
    return token_ids, log_probs, finish


def check_outputs(c: Cluster, answers: list[Answer], what: str) -> None:
    # http_server_engine.py:94-108 (_read_async_response): the JSON, whatever its type.
    statuses = [r.status for r in answers]
    if not c.ledger.check(statuses == [200] * len(answers), "-", f"{what}: 200s", statuses):
        return
    kept = [len(parse_output(r.body)[0]) for r in answers]
    c.ledger.check(
        all(
            n == r.body["meta_info"].get("completion_tokens") and n > 0
            for n, r in zip(kept, answers, strict=True)
        ),
        9,
        f"{what}: verl's parse keeps every generated token (triples in output_token_logprobs)",
        kept[:4],
    )


async def test_verl_replay() -> None:
    async with (
        cluster("verl") as c,
        Client("engine", CLUSTER, c.ledger) as node,
        Client("agent", CLUSTER, c.ledger) as agent,
        Client("trainer", OPERATOR, c.ledger) as trainer,
    ):
        L, gw, engines = c.ledger, c.url, c.engines

        # 1. The adapter registers its engine when given a router
        # (http_server_engine.py:272-293): POST /add_worker with url as a query parameter,
        # from the engine's node, no header; errors are only logged.
        for e in engines:
            await register(c, node, trainer, "POST", "/add_worker", params={"url": e.url})
        await all_healthy(c, node, trainer, ENGINES)

        # 2. Rollouts with log-probs, parsed by verl's rule.
        outs = await asyncio.gather(
            *(
                agent.call(
                    "POST", gw + "/generate", json=generate_request([i, 2], uuid.uuid4().hex)
                )
                for i in range(8)
            )
        )
        check_outputs(c, list(outs), "8 rollouts")

        # 3. Abort of one request by its rid while it runs (http_server_engine.py:980-990:
        # {"rid", "abort_all": false}), from the agent's host, no header. The gateway knows
        # which engine runs that rid (owner routing, item 5, with the RL profile's
        # skip_parse_without_mask_key).
        rid = uuid.uuid4().hex
        turn = asyncio.ensure_future(
            agent.call("POST", gw + "/generate", json=generate_request([5], rid), headers=SLOW)
        )
        assert await running(engines, 1)
        r = await agent.call("POST", gw + "/abort_request", json={"rid": rid, "abort_all": False})
        if not L.check(r.status == 200, 1, f"an agent aborts its rid from {CLUSTER}", r.status):
            await trainer.call("POST", gw + "/abort_request", json={"rid": rid, "abort_all": False})
        reached = [c.proxied(e, "/abort_request") for e in engines]
        L.check(sorted(reached) == [0, 0, 0, 1], 5, "the abort reaches the owner alone", reached)
        done, _ = await asyncio.wait([turn], timeout=3)
        if L.check(bool(done), "-", "the aborted request ends"):
            out = turn.result()
            L.check(
                out.status == 200 and parse_output(out.body)[2] == "abort",
                "-",
                "it ends in finish_reason abort, and verl's parse takes it",
                out.status,
            )
        else:
            turn.cancel()

        # 4. The fleet's load while four rollouts run: verl balances by its own in-flight
        # counts (verl/workers/rollout/llm_server.py:46-195) and reads no /v1/loads, so
        # SGLang's own answer shape is the rule.
        long = [
            asyncio.ensure_future(
                agent.call(
                    "POST",
                    gw + "/generate",
                    json=generate_request([i], uuid.uuid4().hex),
                    headers=SLOW,
                )
            )
            for i in range(4)
        ]
        assert await running(engines, 4)
        await loads_check(c, trainer, 4, "four rollouts")

        # 5. verl's abort_all_requests / resume_generation (async_sglang_server.py:728-736)
        # pause with mode "abort" and continue; over HTTP at the gateway those are
        # /pause_generation {"mode": "abort"} and /continue_generation. Agents keep sending.
        r = await trainer.call("POST", gw + "/pause_generation", json={"mode": "abort"})
        L.check(r.status == 200, "-", "pause through the gateway", r.status)
        for f in await asyncio.gather(*long):
            L.check(parse_output(f.body)[2] == "abort", "-", "the pause ends running rollouts")
        held = asyncio.ensure_future(
            agent.call("POST", gw + "/generate", json=generate_request([6], uuid.uuid4().hex))
        )
        await asyncio.sleep(QUEUE_S * 3)
        L.check(
            not held.done(), 4, f"a rollout sent during the pause is held past {QUEUE_S * 3:.1f} s"
        )

        # 6. The weight sync while paused, engine-direct (sglang_rollout.py:319-380 over
        # http_server_engine.py:758-788, 815-846): tensor buckets to each engine's own
        # port, then a cache flush. verl sends no weight_version.
        update = {"serialized_named_tensors": ["AAAA"], "load_format": None, "flush_cache": False}
        for e in engines:
            r = await node.call("POST", e.url + "/update_weights_from_tensor", json=update)
            L.check(r.status == 200, "-", "an engine-direct tensor update", r.status)
        r = await trainer.call("POST", gw + "/continue_generation", json={})
        L.check(r.status == 200, "-", "continue through the gateway", r.status)
        r = await held
        L.check(r.status == 200, 4, "the held rollout is served after continue", r.status)
        for e in engines:
            await node.call("GET", e.url + "/flush_cache")
        # An update that carries a version, straight to one engine: the gateway follows.
        await trainer.call(
            "POST",
            engines[0].url + "/update_weights_from_disk",
            json={"model_path": "/ckpt/step-3", "weight_version": "step-3"},
        )
        await direct_version_seen(c, trainer, "step-3")

        # 7. LoRA as an adapter (sglang_rollout.py:337-356 over http_server_engine.py:790-813):
        # per engine, GET /v1/models to see whether the adapter is loaded, unload it if so,
        # load it from tensors; rollouts then carry lora_path (async_sglang_server.py:650-652).
        for e in engines:
            models = await node.call("GET", e.url + "/v1/models")
            if any(m.get("id") == LORA_NAME for m in models.get("data", [])):
                await node.call(
                    "POST", e.url + "/unload_lora_adapter", json={"lora_name": LORA_NAME}
                )
            load = {
                "lora_name": LORA_NAME,
                "config_dict": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},
                "serialized_named_tensors": ["AAAA"],
            }
            r = await node.call("POST", e.url + "/load_lora_adapter_from_tensors", json=load)
            L.check(
                r.status == 200,
                9,
                "the engine has /load_lora_adapter_from_tensors (not in item 9's list)",
                r.status,
            )
        await asyncio.sleep(ONE_PROBE_S)  # the gateway reads adapters off the engines
        r = await agent.call(
            "POST", gw + "/generate", json=generate_request([8], uuid.uuid4().hex, lora=True)
        )
        check_outputs(c, [r], "a rollout on the LoRA adapter")

        # 8. Shutdown (http_server_engine.py:411-419): POST /remove_worker?url=.
        for e in engines:
            await register(c, node, trainer, "POST", "/remove_worker", params={"url": e.url})
        r = await trainer.call("GET", gw + "/workers")
        L.check(r.get("workers") == [], "-", "no worker left after teardown")
        L.finish()
