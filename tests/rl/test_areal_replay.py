"""AReaL's calls, in the order a run makes them, with AREAL_LLM_SERVER_ADDRS naming the
gateway, against four stub engines behind it (docs/rl-frameworks.md, section AReaL).

AReaL: inclusionAI/AReaL at 4aef98d8d818af55b43621aaadba047ae10f4e77; paths below are in
that repository at that commit. AReaL treats each address as one engine: it sends every
call (health, generation, pause, weight updates, LoRA loads, continue) to every address
in the list, so with the gateway as its one address each call reaches the gateway once
and the gateway fans it out. AReaL registers nothing and aborts no rid: the cluster's
engine launcher registers the engines, and an agent of the same cluster aborts its own
request (the calls marked "not AReaL's" below), so the replay covers the whole cluster.

`X-Stub-*` headers script the stub engine (a slow generation), nothing a client sends.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.rl.replay import (
    CLUSTER,
    ENGINES,
    OPERATOR,
    QUEUE_S,
    Answer,
    Client,
    Cluster,
    all_healthy,
    cluster,
    direct_version_seen,
    list_workers,
    loads_check,
    register,
    running,
)

pytestmark = pytest.mark.heavy

SLOW = {"X-Stub-Delay-Ms": "30000"}
LORA_NAME = "lora"


def versioned_lora_name(name: str, version: int) -> str:
    """areal/api/io_struct.py:161-163, get_versioned_lora_name."""
    return f"{name}-v{version}"


def generation_request(input_ids: list[int], lora: str | None = None) -> dict[str, Any]:
    """areal/engine/sglang_remote.py:43-89, build_generation_request (greedy off, no stop)."""
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "image_data": None,
        "sampling_params": {
            "top_p": 1.0,
            "top_k": 100000000,
            "max_new_tokens": 8,
            "temperature": 1.0,
            "stop_token_ids": [],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
        },
        "return_logprob": True,
        "stream": False,
    }
    if lora is not None:
        payload["lora_path"] = lora
    return payload


def parse_generation(response: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """areal/engine/sglang_remote.py:91-127, parse_generation_response: a KeyError when
    meta_info has no output_token_logprobs, unless the abort came before prefill."""
    meta_info = response["meta_info"]
    finish_reason = meta_info["finish_reason"]
    stop_reason = finish_reason["type"]
    stop_message = finish_reason.get("message", "")
    if stop_reason == "abort" and stop_message.startswith("Abort before prefill"):
        return [], [], stop_reason
    tokens = [x[1] for x in meta_info["output_token_logprobs"]]
    logprobs = [x[0] for x in meta_info["output_token_logprobs"]]
    return tokens, logprobs, stop_reason


def check_generation(c: Cluster, r: Answer, what: str) -> None:
    # areal/infra/utils/http.py:178-193 (arequest_with_retry): raise_for_status, and JSON
    # only for application/json; remote_inf_engine.py:814-818 refuses anything else.
    if not c.ledger.check(
        r.status == 200 and r.headers.get("Content-Type", "").startswith("application/json"),
        "-",
        f"{what}: a JSON 200",
        r.status,
    ):
        return
    try:
        tokens, logprobs, _ = parse_generation(r.body)
    except (KeyError, TypeError) as exc:
        c.ledger.check(False, 9, f"{what}: AReaL's parse raises", repr(exc))
        return
    c.ledger.check(
        len(tokens) == len(logprobs) == r.body["meta_info"].get("completion_tokens"),
        9,
        f"{what}: as many tokens as completion_tokens",
    )


async def test_areal_replay() -> None:
    async with (
        cluster("AReaL") as c,
        Client("launcher", CLUSTER, c.ledger) as launcher,
        Client("agent", CLUSTER, c.ledger) as agent,
        Client("trainer", OPERATOR, c.ledger) as trainer,
    ):
        L, gw, engines = c.ledger, c.url, c.engines
        addr = gw  # AREAL_LLM_SERVER_ADDRS=<gateway host:port> (remote_inf_engine.py:442-446)

        # 0. Not AReaL's: each node's launcher registers its engine (POST /workers).
        for e in engines:
            await register(c, launcher, trainer, "POST", "/workers", json={"url": e.url})
        await all_healthy(c, launcher, trainer, ENGINES)

        # 1. initialize() waits for every address's health (remote_inf_engine.py:367-391,
        # 456-458): GET /health with an empty JSON body, 200 expected.
        r = await trainer.call("GET", addr + "/health", json={})
        L.check(r.status == 200, "-", "GET /health through the gateway", r.status)

        # 2. Rollouts: agenerate (remote_inf_engine.py:719-880) sends build_generation_request
        # round-robin over the addresses, parsed by parse_generation_response.
        outs = await asyncio.gather(
            *(
                trainer.call("POST", addr + "/generate", json=generation_request([i, 7]))
                for i in range(8)
            )
        )
        for r in outs:
            check_generation(c, r, "a rollout")

        # 3. Not AReaL's: an agent of the cluster aborts its own request by rid, no header.
        # Its aborted reply must still parse by AReaL's rule (an interrupted generation is
        # resumed: remote_inf_engine.py:787-852).
        turn = asyncio.ensure_future(
            agent.call(
                "POST",
                gw + "/generate",
                json=generation_request([1]) | {"rid": "agent-1"},
                headers=SLOW,
            )
        )
        assert await running(engines, 1)
        r = await agent.call("POST", gw + "/abort_request", json={"rid": "agent-1"})
        if not L.check(r.status == 200, 1, f"an agent aborts its rid from {CLUSTER}", r.status):
            await trainer.call("POST", gw + "/abort_request", json={"rid": "agent-1"})
        done, _ = await asyncio.wait([turn], timeout=3)
        if L.check(bool(done), "-", "the aborted request ends"):
            check_generation(c, turn.result(), "an aborted rollout")
        else:
            turn.cancel()

        # 4. The fleet's load while four rollouts run: AReaL reads none, so SGLang's own
        # answer shape is the rule (a top-level `loads` list).
        long = [
            asyncio.ensure_future(
                trainer.call("POST", addr + "/generate", json=generation_request([i]), headers=SLOW)
            )
            for i in range(4)
        ]
        assert await running(engines, 4)
        await loads_check(c, trainer, 4, "four rollouts")
        r = await trainer.call("POST", gw + "/abort_request", json={"abort_all": True})
        L.check(r.status == 200, "-", "abort_all from the trainer", r.status)
        await asyncio.gather(*long)

        # 5. A disk update (fsdp_engine.py:1599-1622): pause_generation on every address
        # (remote_inf_engine.py:1204-1212, sglang_remote.py:273-275: POST {} ), the update
        # (sglang_remote.py:147-159, remote_inf_engine.py:1311-1356), continue_generation
        # (remote_inf_engine.py:1214-1218). Agents of the cluster keep sending meanwhile.
        r = await trainer.call("POST", addr + "/pause_generation", json={})
        L.check(r.status == 200, "-", "pause through the gateway", r.status)
        held = asyncio.ensure_future(
            agent.call("POST", gw + "/generate", json=generation_request([3]))
        )
        await asyncio.sleep(QUEUE_S * 3)
        L.check(
            not held.done(), 4, f"a rollout sent during the pause is held past {QUEUE_S * 3:.1f} s"
        )
        update = {"model_path": "/ckpt/global_step_1", "abort_all_requests": True}
        r = await trainer.call("POST", addr + "/update_weights_from_disk", json=update)
        L.check(
            r.status == 200 and len(r.get("results", [])) == ENGINES,
            "-",
            "update_weights_from_disk reaches every engine",
            r.status,
        )
        r = await trainer.call("POST", addr + "/continue_generation", json={})
        L.check(r.status == 200, "-", "continue through the gateway", r.status)
        r = await held
        L.check(r.status == 200, 4, "the held rollout is served after continue", r.status)
        if r.status == 200:
            check_generation(c, r, "the held rollout")

        # 6. A LoRA update from disk (sglang_remote.py:129-146): the version is set first,
        # then POST /load_lora_adapter {"lora_name": "lora-v1", "lora_path"} to every address,
        # between a pause and a continue; rollouts then name "lora-v1" as their lora_path.
        await trainer.call("POST", addr + "/pause_generation", json={})
        lora = {
            "lora_name": versioned_lora_name(LORA_NAME, 1),
            "lora_path": "/ckpt/lora/global_step_1",
        }
        r = await trainer.call("POST", addr + "/load_lora_adapter", json=lora)
        L.check(
            r.status == 200 and len(r.get("results", [])) == ENGINES,
            6,
            "/load_lora_adapter through the gateway reaches every engine",
            r.status,
        )
        await trainer.call("POST", addr + "/continue_generation", json={})
        before = sum(c.proxied(e, "/generate") for e in engines)
        r = await trainer.call(
            "POST",
            addr + "/generate",
            json=generation_request([4], versioned_lora_name(LORA_NAME, 1)),
        )
        check_generation(c, r, "a rollout on lora-v1")
        r = await trainer.call(
            "POST",
            addr + "/generate",
            json=generation_request([4], versioned_lora_name(LORA_NAME, 9)),
        )
        forwarded = sum(c.proxied(e, "/generate") for e in engines) - before
        L.check(
            r.status in (400, 503) and forwarded == 1,
            6,
            "a lora_path no engine loaded: the gateway answers itself",
            r.status,
        )

        # 7. The xccl path (fsdp_engine.py:1506-1594): /init_weights_update_group carries a
        # rank_offset per address (sglang_remote.py:189-271, remote_inf_engine.py:1359-1418),
        # so the gateway refuses it unaddressed and says why; the update's body is the same
        # for every engine (sglang_remote.py:161-187), so it fans out.
        group = {
            "master_address": "127.0.0.1",
            "master_port": "29500",
            "rank_offset": 1,
            "world_size": 2,
            "backend": "nccl",
            "group_name": "update_weight_group",
        }
        r = await trainer.call("POST", addr + "/init_weights_update_group", json=group)
        detail = str(r.body)
        L.check(
            r.status == 400 and "one engine" in detail,
            6,
            "an unaddressed /init_weights_update_group gets a 400 that says it is per engine",
            r.status,
        )
        dist = {
            "names": ["w"],
            "dtypes": ["bfloat16"],
            "shapes": [[2, 2]],
            "group_name": "update_weight_group",
            "abort_all_requests": True,
        }
        r = await trainer.call("POST", addr + "/update_weights_from_distributed", json=dist)
        L.check(
            r.status == 200 and len(r.get("results", [])) == ENGINES,
            6,
            "/update_weights_from_distributed fans out to every engine",
            r.status,
        )

        # 8. One engine updated behind the gateway's back (AReaL pointed at the engines
        # themselves sends its update there; the version is what an engine-direct update
        # of SGLang's sets): the gateway follows within one probe interval.
        await trainer.call(
            "POST",
            engines[0].url + "/update_weights_from_disk",
            json={"model_path": "/ckpt/global_step_2", "weight_version": "step-2"},
        )
        await direct_version_seen(c, trainer, "step-2")

        # 9. Not AReaL's: the launcher unregisters the engines as the job ends.
        for w in await list_workers(c, launcher, trainer):
            await register(c, launcher, trainer, "DELETE", f"/workers/{w['id']}")
        r = await trainer.call("GET", gw + "/workers")
        L.check(r.get("workers") == [], "-", "no worker left after teardown")
        L.finish()
