"""slime's and Miles' calls, in the order a run makes them, against four stub engines
behind the gateway (docs/rl-frameworks.md, sections slime and Miles).

slime: THUDM/slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515.
Miles: radixark/miles at 31f1ca961a94cb860cec3b2dea34ec332bfa8f76.
Paths below are in those repositories, at those commits. The two share most calls (Miles
is a fork of slime); the Miles replay covers where it differs: `/add_worker?url=`,
`/list_workers`, `/remove_worker?url=`, multi-LoRA (slot adapters, rids carrying the
adapter name, aborts by rid prefix), `/model_info` for the weight version, and the
dashboard's `/engine_metrics`.

`X-Stub-*` headers script the stub engine (a slow generation), nothing a framework sends.
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
    ROUTING_KEY,
    Answer,
    Client,
    Cluster,
    all_healthy,
    cluster,
    list_workers,
    running,
    within_probes,
)

pytestmark = pytest.mark.heavy

SLOW = {"X-Stub-Delay-Ms": "30000"}
# One probe interval for the change to be seen (it lands between two probes), plus the
# probe's own round trip and the read of the answer.
ONE_PROBE_S = PROBE_S + 0.25


# --- slime's own rules, rewritten ------------------------------------------------------------


def num_requests_from_load(load: Any) -> int:
    """slime/backends/sglang_utils/server_control.py:12-29, the rule slime reads an engine's
    /v1/loads answer with (and so the gateway's, when pointed at it)."""
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        value = load.get(key)
        if isinstance(value, int):
            return value
    running_ = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running_ if isinstance(running_, int) else 0) + (
        waiting if isinstance(waiting, int) else 0
    )


def parse_rollout(output: dict[str, Any]) -> tuple[list[int], list[float]]:
    """slime/rollout/sglang_rollout.py:206-210 (Miles: miles/rollout/sglang_rollout.py:235-239):
    tokens and log-probs from meta_info.output_token_logprobs, nothing when it is absent
    (slime then records a sample of 0 tokens, silently)."""
    meta = output["meta_info"]
    if "output_token_logprobs" in meta:
        return [item[1] for item in meta["output_token_logprobs"]], [
            item[0] for item in meta["output_token_logprobs"]
        ]
    return [], []


# slime/rollout/sglang_rollout.py:95-105: GenerateState's sampling params (defaults of the
# rollout arguments; max_new_tokens kept small).
SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 8,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}


def rollout_payload(prompt_ids: list[int], **extra: Any) -> dict[str, Any]:
    """slime/rollout/sglang_rollout.py:176-191: /generate's body for a token-id sample."""
    return {
        "sampling_params": dict(SAMPLING),
        "return_logprob": True,
        "input_ids": prompt_ids,
    } | extra


# --- steps both replays take -----------------------------------------------------------------


async def rollout(
    c: Cluster, who: Client, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> Answer:
    # slime/rollout/sglang_rollout.py:158,197-203: POST {router}/generate, with the
    # session's X-SMG-Routing-Key when --router-policy consistent_hashing.
    return await who.call("POST", c.url + "/generate", json=payload, headers=headers, timeout=60)


def check_rollouts(c: Cluster, answers: list[Answer], what: str) -> None:
    """Each answer parsed with slime's rule: as many tokens and log-probs as the engine
    generated, and the reply's X-Weight-Version the engine's own."""
    statuses = [r.status for r in answers]
    if not c.ledger.check(statuses == [200] * len(answers), "-", f"{what}: {statuses}"):
        return
    parsed = [(parse_rollout(r.body), r.body["meta_info"]) for r in answers]
    short = [
        f"{len(tokens)}/{meta.get('completion_tokens')}"
        for (tokens, logprobs), meta in parsed
        if not (len(tokens) == len(logprobs) == meta.get("completion_tokens") and tokens)
    ]
    c.ledger.check(
        not short,
        9,
        f"{what}: slime's parse of meta_info.output_token_logprobs finds too few tokens "
        f"in {len(short)} of {len(answers)} (tokens/completion_tokens: {short[:3]})",
    )
    stale = [
        (r.headers.get("X-Weight-Version"), r.body["meta_info"].get("weight_version"))
        for r in answers
        if r.headers.get("X-Weight-Version") != r.body["meta_info"].get("weight_version")
    ]
    c.ledger.check(
        not stale, 2, f"{what}: X-Weight-Version against meta_info.weight_version: {stale[:3]}"
    )


async def versions_follow(c: Cluster, driver: Client, version: str, what: str) -> None:
    """GET /workers and X-Weight-Version show an update made engine-direct within one probe
    interval (item 2)."""

    async def listed() -> bool:
        r = await driver.call("GET", c.url + "/workers")
        c.ledger.entries.pop()
        # The prefill engine is no rollout engine: slime updates it with its own group.
        workers = [w for w in r.get("workers", []) if w.get("worker_type") != "prefill"]
        return {w["weight_version"] for w in workers} == {version}

    c.ledger.check(
        await within_probes(c.engines, listed),
        2,
        f"{what}: GET /workers shows weight_version {version!r} within one probe interval",
    )
    r = await driver.call("POST", c.url + "/generate", json=rollout_payload([1, 2, 3]))
    c.ledger.check(
        r.status == 200 and r.headers.get("X-Weight-Version") == version,
        2,
        f"{what}: X-Weight-Version {r.headers.get('X-Weight-Version')!r} after the "
        f"engine-direct update to {version!r}",
    )


async def held_then_served(c: Cluster, task: asyncio.Task[Answer], what: str) -> None:
    # Held past the gateway's queue timeout: only a hold, never a 503, keeps it waiting.
    await asyncio.sleep(QUEUE_S * 3)
    c.ledger.check(not task.done(), 4, f"{what}: still held {QUEUE_S * 3:.1f} s into the pause")


# --- slime ------------------------------------------------------------------------------------


async def test_slime_replay() -> None:
    async with (
        cluster("slime", engines=ENGINES + 1) as c,
        Client("engine", CLUSTER, c.ledger) as node,
        Client("rollout", CLUSTER, c.ledger) as worker,
        Client("agent", CLUSTER, c.ledger) as agent,
        Client("driver", OPERATOR, c.ledger) as driver,
    ):
        L, gw = c.ledger, c.url
        engines, prefill = c.engines[:ENGINES], c.engines[ENGINES]

        # 1. Each engine registers itself from its node, once it is up:
        # slime/backends/sglang_utils/sglang_engine.py:177-199, POST /workers {"url",
        # "worker_type"[, "bootstrap_port"]} with no header; raise_for_status() makes a
        # refusal fail the engine's start.
        for e in engines:
            body = {"url": e.url, "worker_type": "regular"}
            r = await node.call("POST", gw + "/workers", json=body)
            if not L.check(r.status == 200, 1, f"an engine registers from {CLUSTER}", r.status):
                await driver.call("POST", gw + "/workers", json=body)
        # A prefill engine of a PD deployment (sglang_engine.py:187-194): bootstrap_port too.
        body = {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": 8998}
        r = await node.call("POST", gw + "/workers", json=body)
        if not L.check(
            r.status == 200, 1, f"the prefill engine registers from {CLUSTER}", r.status
        ):
            await driver.call("POST", gw + "/workers", json=body)
        await all_healthy(c, worker, driver, ENGINES + 1)

        # 2. Rollouts (slime/rollout/sglang_rollout.py:152-221): token ids, return_logprob,
        # the group's session id as X-SMG-Routing-Key; parsed with slime's rule.
        outs = await asyncio.gather(
            *(
                rollout(c, worker, rollout_payload([i, i + 1]), {ROUTING_KEY: str(uuid.uuid4())})
                for i in range(12)
            )
        )
        check_rollouts(c, list(outs), "12 rollouts")
        L.check(
            prefill.generations_seen == 0,
            8,
            f"the prefill engine got {prefill.generations_seen} of 12 plain rollouts",
        )

        # 3. An agent turn (slime/agent/adapters/common.py:470-511): /generate with its own
        # rid; when the agent cancels or times out it aborts that rid at the router, from
        # wherever it runs, with no header.
        rid = uuid.uuid4().hex
        turn = asyncio.ensure_future(
            agent.call(
                "POST",
                gw + "/generate",
                json={"rid": rid, "input_ids": [5, 6], "sampling_params": SAMPLING}
                | {"return_logprob": True},
                headers={ROUTING_KEY: "episode-1"} | SLOW,
            )
        )
        assert await running(c.engines, 1)
        turn.cancel()
        r = await agent.call("POST", gw + "/abort_request", json={"rid": rid})
        L.check(r.status == 200, 1, f"an agent aborts its rid from {CLUSTER}", r.status)

        # 4. Loads while four rollouts run: the gateway read as one engine is, with slime's
        # rule (server_control.py:12-40 reads GET {url}/v1/loads?include=core).
        long = [
            asyncio.ensure_future(
                rollout(c, worker, rollout_payload([9]), {ROUTING_KEY: f"long-{i}"} | SLOW)
            )
            for i in range(4)
        ]
        assert await running(c.engines, 4)
        r = await driver.call("GET", gw + "/v1/loads", params={"include": "core"})
        seen = num_requests_from_load(r.body)
        L.check(seen == 4, 3, f"slime's rule reads {seen} requests in the gateway's /v1/loads")

        # 5. The rollout's abort (slime/rollout/sglang_rollout.py:339-371): the workers'
        # urls from GET /workers, then every engine directly: abort_all, and its loads until
        # idle (server_control.py:32-67).
        urls = [w["url"] for w in await list_workers(c, worker, driver)]
        L.check(len(urls) == ENGINES + 1, 1, f"GET /workers lists {len(urls)} engines")

        async def until_idle(url: str) -> int:
            for _ in range(50):
                await worker.call("POST", url + "/abort_request", json={"abort_all": True})
                load = await worker.call("GET", url + "/v1/loads", params={"include": "core"})
                if num_requests_from_load(load.body) <= 0:
                    return 0
                await asyncio.sleep(0.05)
            return num_requests_from_load(load.body)

        left = await asyncio.gather(*(until_idle(u) for u in urls))
        L.check(left == [0] * len(urls), "-", f"engines idle after abort_all: {left}")
        for r in await asyncio.gather(*long):
            L.check(
                r.status == 200 and r.body["meta_info"]["finish_reason"]["type"] == "abort",
                "-",
                f"an aborted rollout ends in finish_reason abort: {r.status}",
            )

        # 6. A weight update from disk, engine-direct (slime/ray/actor_group.py:227-269 over
        # sglang_engine.py:423-435, 270-292, 358-371): pause, flush, load, continue, each
        # POSTed by the Ray actor straight to its engine. Rollouts keep coming meanwhile.
        for e in engines:
            await node.call("POST", e.url + "/pause_generation", json={})
        for e in engines:
            await node.call("GET", e.url + "/flush_cache")
        held = asyncio.ensure_future(rollout(c, worker, rollout_payload([7]), {ROUTING_KEY: "x"}))
        await held_then_served(c, held, "a rollout during an engine-direct pause")
        update = {"model_path": "/ckpt/weight_v000001", "weight_version": "1"}
        for e in engines:
            r = await node.call("POST", e.url + "/update_weights_from_disk", json=update)
            L.check(r.status == 200, "-", "an engine-direct update", r.status)
        # With --ci-test the driver reads each engine's version back (actor_group.py:255-266,
        # sglang_engine.py:320-326: GET /get_weight_version, ["weight_version"]).
        for e in engines:
            r = await node.call("GET", e.url + "/get_weight_version")
            L.check(
                r.status == 200 and r.get("weight_version") == "1",
                9,
                "the engine answers GET /get_weight_version",
                r.status,
            )
        for e in engines:
            await node.call("POST", e.url + "/continue_generation", json={})
        r = await held
        L.check(
            r.status == 200 and r.body["meta_info"]["weight_version"] == "1",
            4,
            f"the held rollout is served after continue, by the new weights: {r.status}",
        )
        await versions_follow(c, driver, "1", "slime's disk update")

        # 7. Teardown (sglang_engine.py:296-316): each engine finds its id in GET /workers
        # by url and DELETEs it, from its own node.
        for e in [*engines, prefill]:
            listed = await list_workers(c, node, driver)
            wid = next(w["id"] for w in listed if w["url"] == e.url)
            r = await node.call("DELETE", f"{gw}/workers/{wid}")
            if not L.check(r.status == 200, 1, f"an engine unregisters from {CLUSTER}", r.status):
                await driver.call("DELETE", f"{gw}/workers/{wid}")
        r = await driver.call("GET", gw + "/workers")
        L.check(r.get("workers") == [], "-", "no worker left after teardown")
        L.finish()


# --- Miles ------------------------------------------------------------------------------------

LORA_SLOT = "__miles_slot_0"  # miles/utils/multi_lora.py:191-194, slot_lora_name(0)


def make_rid(adapter: str) -> str:
    """miles/utils/multi_lora.py:183-184 (RID_SEPARATOR "::", line 27)."""
    return f"{adapter}::{uuid.uuid4().hex}"


def worker_base_urls(urls: list[str]) -> list[str]:
    """miles/utils/http_utils.py:142-151, router_worker_base_urls: `@rank` suffixes off."""
    bases: list[str] = []
    for url in urls:
        base, sep, rank = url.rpartition("@")
        bare = base if sep and rank.isdigit() else url
        if bare not in bases:
            bases.append(bare)
    return bases


async def test_miles_replay() -> None:
    async with (
        cluster("Miles") as c,
        Client("engine", CLUSTER, c.ledger) as node,
        Client("rollout", CLUSTER, c.ledger) as worker,
        Client("lora-ctl", CLUSTER, c.ledger) as controller,
        Client("driver", OPERATOR, c.ledger) as driver,
    ):
        L, gw, engines = c.ledger, c.url, c.engines

        # 1. With the Miles router or sglang-router <= 0.2.1 the engine registers by query
        # (miles/backends/sglang_utils/sglang_engine.py:250-269): POST /add_worker?url=.
        for e in engines:
            r = await node.call("POST", gw + "/add_worker", params={"url": e.url})
            if not L.check(r.status == 200, 1, f"POST /add_worker?url= from {CLUSTER}", r.status):
                await driver.call("POST", gw + "/add_worker", params={"url": e.url})
        await all_healthy(c, worker, driver, ENGINES)

        # 2. Multi-LoRA: the weight sync puts adapter slot 0 on every engine, engine-direct
        # (miles/backends/megatron_utils/update_weight/update_weight_from_tensor.py:505-530
        # over sglang_engine.py:370-411, 510-515): unload the slot, load it from tensors.
        for e in engines:
            r = await node.call(
                "POST", e.url + "/unload_lora_adapter", json={"lora_name": LORA_SLOT}
            )
            L.check(r.status in (200, 400), 9, "the engine has /unload_lora_adapter", r.status)
            load = {
                "lora_name": LORA_SLOT,
                "config_dict": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},
                "serialized_tensors": "AAAA",
                "pinned": False,
            }
            r = await node.call("POST", e.url + "/load_lora_adapter_from_tensors", json=load)
            L.check(
                r.status == 200,
                9,
                "the engine has /load_lora_adapter_from_tensors (not in item 9's list)",
                r.status,
            )
        await asyncio.sleep(ONE_PROBE_S)  # the gateway learns adapters from the engines

        # 3. A rollout of adapter "math" (miles/rollout/sglang_rollout.py:184-228): the slot as
        # lora_path, a rid carrying the adapter, its version as extra_key, the routing key.
        def lora_rollout(adapter: str, slot: str, **headers: str) -> dict[str, Any]:
            return rollout_payload([3, 4]) | {
                "lora_path": slot,
                "rid": make_rid(adapter),
                "extra_key": f"{adapter}:v1",
            }

        r = await rollout(c, worker, lora_rollout("math", LORA_SLOT), {ROUTING_KEY: "m-1"})
        check_rollouts(c, [r], "a rollout on the LoRA slot")
        r = await rollout(c, worker, lora_rollout("math", "__miles_slot_7"), {ROUTING_KEY: "m-2"})
        L.check(
            r.status in (400, 503) and sum(c.proxied(e, "/generate") for e in engines) == 1,
            6,
            f"an adapter no engine loaded: the gateway answers itself ({r.status})",
        )

        # 4. Retiring adapter "math" aborts its requests by rid prefix on every engine
        # (miles/ray/multi_lora/backend.py:164-189): the urls from GET /list_workers, then
        # POST {url}/abort_request {"rid": "math::", "prefix": true}, engine-direct.
        flights = [
            asyncio.ensure_future(
                rollout(c, worker, lora_rollout("math", LORA_SLOT), {ROUTING_KEY: f"f-{i}"} | SLOW)
            )
            for i in range(3)
        ]
        assert await running(c.engines, 3)
        r = await controller.call("GET", gw + "/list_workers")
        if not L.check(r.status == 200, 1, f"GET /list_workers from {CLUSTER}", r.status):
            r = await driver.call("GET", gw + "/list_workers")
        urls = worker_base_urls(r.get("urls", []))
        L.check(sorted(urls) == sorted(e.url for e in engines), "-", "/list_workers: every url")
        for url in urls:
            await controller.call(
                "POST", url + "/abort_request", json={"rid": "math::", "prefix": True}
            )
        done, _ = await asyncio.wait(flights, timeout=2)
        L.check(
            len(done) == 3
            and all(f.result().body["meta_info"]["finish_reason"]["type"] == "abort" for f in done),
            9,
            f"the engines end requests by rid prefix: {len(done)} of 3 ended",
        )
        # The same abort sent to the gateway reaches every engine (item 6).
        r = await driver.call("POST", gw + "/abort_request", json={"rid": "math::", "prefix": True})
        L.check(
            r.status == 200 and len(r.get("results", [])) == ENGINES,
            6,
            f"a prefix abort at the gateway goes to every engine: {r.status}",
        )
        for f in flights:
            f.cancel()

        # 5. The rollout's abort (miles/rollout/sglang_rollout.py:392-412): GET /list_workers,
        # then abort_all on each engine directly.
        r = await worker.call("GET", gw + "/list_workers")
        for url in worker_base_urls(r.get("urls", [])):
            await worker.call("POST", url + "/abort_request", json={"abort_all": True})

        # 6. An engine-direct tensor update with a version (sglang_engine.py:316-341), and the
        # version read back from /model_info first (sglang_engine.py:499-508).
        update = {
            "serialized_named_tensors": ["AAAA"],
            "load_format": None,
            "flush_cache": False,
            "selector": "all",
            "weight_version": "2",
        }
        for e in engines:
            await node.call("POST", e.url + "/update_weights_from_tensor", json=update)
            r = await node.call("GET", e.url + "/model_info")
            L.check(
                r.get("weight_version") == "2", "-", "/model_info reads the new version", r.body
            )
        await versions_follow(c, driver, "2", "Miles' tensor update")

        # 7. The dashboard's router mode (miles/dashboard/sglang_scraper.py:150-187): one GET
        # {router}/engine_metrics a tick; every sample must carry worker_addr or is dropped.
        r = await driver.call("GET", gw + "/engine_metrics")
        text = r.body if isinstance(r.body, str) else ""
        samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        L.check(
            r.status == 200 and bool(samples) and all("worker_addr=" in s for s in samples),
            7,
            f"/engine_metrics answers every engine's samples with worker_addr: {r.status}",
        )

        # 8. Teardown (sglang_engine.py:465-497, old router or Miles router): POST
        # /remove_worker?url= from the engine's node.
        for e in engines:
            r = await node.call("POST", gw + "/remove_worker", params={"url": e.url})
            if not L.check(
                r.status == 200, 1, f"POST /remove_worker?url= from {CLUSTER}", r.status
            ):
                await driver.call("POST", gw + "/remove_worker", params={"url": e.url})
        r = await driver.call("GET", gw + "/workers")
        L.check(r.get("workers") == [], "-", "no worker left after teardown")
        L.finish()
