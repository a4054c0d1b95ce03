"""Prefill/decode comparison: the same requests through the gateway (backends.mode: pd) and
sglang-router --pd-disaggregation, in front of the same 2 prefill and 2 decode stub engines.

    python bench/pd.py            # writes bench/results/pd-*.json and .md

Engines: `python -m gateway.testing.stub --pd-role prefill|decode`: a prefill stub serves a
bootstrap port, a decode stub answers only once the prefill side of each of its rooms
handed its KV cache over, and both refuse a request without bootstrap keys
(gateway/testing/stub/pd.py). Per router and request: the status, the shape of the answer
(items, stream events, whether it ended with [DONE], the input logprobs' count), and
whether every room met both sides exactly once. sglang-router is skipped when
bench/.venv-router (bench/install-anchors.sh) or $BENCH_ROUTER_PYTHON has none.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.routing import router_python, start, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# (name, path, body): plain, streamed, batched and chat requests, and a logprob merge.
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("generate", "/generate", {"text": "Hello there", "sampling_params": {"max_new_tokens": 4}}),
    (
        "generate stream",
        "/generate",
        {"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 5}},
    ),
    (
        "generate batch of 2",
        "/generate",
        {"text": ["a batch", "of two"], "sampling_params": {"max_new_tokens": 3}},
    ),
    (
        "generate input_ids batch of 2, n=2",
        "/generate",
        {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2, "n": 2}},
    ),
    (
        "generate logprob",
        "/generate",
        {
            "text": "a b c d",
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2},
        },
    ),
    (
        "generate logprob, input_ids batch of 2",
        "/generate",
        {
            "input_ids": [[1, 2, 3, 4], [5, 6]],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2},
        },
    ),
    (
        "generate logprob stream",
        "/generate",
        {
            "text": "a b c d",
            "stream": True,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2},
        },
    ),
    (
        "generate logprob stream, batch of 2",
        "/generate",
        {
            "text": ["a b c d", "e f"],
            "stream": True,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2},
        },
    ),
    (
        "chat",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    ),
    (
        "chat stream",
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "s"}],
            "stream": True,
            "max_tokens": 3,
        },
    ),
    (
        "chat n=3",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "n"}], "n": 3, "max_tokens": 2},
    ),
    (
        "completions batch of 2",
        "/v1/completions",
        {"model": "m", "prompt": ["one", "two"], "max_tokens": 2},
    ),
]


def shape(raw: bytes, streamed: bool) -> dict[str, Any]:
    """What an answer is, router aside: its items, events, and input logprobs."""
    if streamed:
        events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
        out = {
            "events": len([e for e in events if e != b"data: [DONE]"]),
            "done": bool(events) and events[-1] == b"data: [DONE]",
        }
        # Per event that reports them: how many input logprobs it carries (the decode
        # engine's own are none; a merge puts the prefill's in front).
        counts = []
        for e in events:
            if b"input_token_logprobs" in e:
                meta = json.loads(e[len(b"data: ") :]).get("meta_info", {})
                counts.append(len(meta.get("input_token_logprobs") or []))
        if counts:
            out["input_logprobs"] = counts
        return out
    try:
        obj = json.loads(raw)
    except ValueError:
        return {"body": raw[:80].decode(errors="replace")}
    out: dict[str, Any] = {"items": len(obj) if isinstance(obj, list) else 1}
    first = obj[0] if isinstance(obj, list) and obj else obj
    if isinstance(first, dict):
        meta = first.get("meta_info")
        if isinstance(meta, dict) and "input_token_logprobs" in meta:
            out["input_logprobs"] = len(meta["input_token_logprobs"])
        if "choices" in first:
            out["choices"] = len(first["choices"])
    return out


def gateway_argv(
    tmp: Path, prefill: list[tuple[int, int]], decode: list[int], port: int
) -> list[str]:
    cfg = tmp / "gateway-pd.yaml"
    p = "".join(f"    - {{url: http://127.0.0.1:{w}, bootstrap_port: {b}}}\n" for w, b in prefill)
    d = "".join(f"    - http://127.0.0.1:{w}\n" for w in decode)
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"admin: {{host: 127.0.0.1, port: {common.free_port()}}}\n"
        f"backends:\n  mode: pd\n  prefill:\n{p}  decode:\n{d}"
        "logging: {access_log: false}\n"
    )
    return [sys.executable, "-m", "gateway", "--config", str(cfg)]


def router_argv(
    py: Path, prefill: list[tuple[int, int]], decode: list[int], port: int
) -> list[str]:
    argv = [str(py), "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for w, b in prefill:
        argv += ["--prefill", f"http://127.0.0.1:{w}", str(b)]
    for w in decode:
        argv += ["--decode", f"http://127.0.0.1:{w}"]
    return [
        *argv,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(common.free_port()),
        "--log-level",
        "warn",
    ]


async def rooms(session: aiohttp.ClientSession, ports: list[int]) -> Counter[int]:
    seen: Counter[int] = Counter()
    for p in ports:
        async with session.get(f"http://127.0.0.1:{p}/stub/pd") as r:
            seen.update((await r.json())["rooms"])
    return seen


async def one_router(
    session: aiohttp.ClientSession,
    tmp: Path,
    router: str,
    prefill: list[tuple[int, int]],
    decode: list[int],
) -> dict[str, Any]:
    port = common.free_port()
    if router == "gateway":
        argv = gateway_argv(tmp, prefill, decode, port)
    else:
        py = router_python()
        if py is None:
            return {"status": "skipped: sglang-router not installed (bench/.venv-router)"}
        argv = router_argv(py, prefill, decode, port)
    proc = start(argv, tmp / f"{router}.log")
    try:
        if not await wait_ready(session, port):
            return {"status": f"failed: {router} did not start"}
        p_ports, d_ports = [w for w, _ in prefill], decode
        p0, d0 = await rooms(session, p_ports), await rooms(session, d_ports)
        answers = {}
        for name, path, body in REQUESTS:
            async with session.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                raw = await r.read()
                answers[name] = {"status": r.status, **shape(raw, bool(body.get("stream")))}
        p1, d1 = await rooms(session, p_ports), await rooms(session, d_ports)
        p_new, d_new = p1 - p0, d1 - d0
        paired = p_new == d_new and set(p_new.values()) <= {1}
        return {
            "status": "ok",
            "answers": answers,
            "rooms": sum(p_new.values()),
            "all_paired": paired,
            # A room two requests of one side shared: SGLang would hand one KV cache to two.
            "rooms_reused": sum(1 for n in p_new.values() if n > 1),
            "rooms_on_one_side_only": len(set(p_new) ^ set(d_new)),
        }
    finally:
        stop(proc)


async def main_async() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        engines = []
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        for i in range(4):
            port = common.free_port()
            argv = [sys.executable, "-m", "gateway.testing.stub", "--port", str(port)]
            if i < 2:
                boot = common.free_port()
                argv += ["--pd-role", "prefill", "--bootstrap-port", str(boot), "--prefill-ms", "5"]
                prefill.append((port, boot))
            else:
                argv += ["--pd-role", "decode"]
                decode.append(port)
            engines.append(start(argv, tmp / f"stub-{i}.log"))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                for port in [w for w, _ in prefill] + decode:
                    for _ in range(100):
                        try:
                            async with session.get(f"http://127.0.0.1:{port}/health") as r:
                                if r.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        await asyncio.sleep(0.1)
                runs = {
                    router: await one_router(session, tmp, router, prefill, decode)
                    for router in ("gateway", "sglang-router")
                }
        finally:
            for proc in engines:
                stop(proc)
    return {"when": datetime.datetime.now(datetime.UTC).isoformat(), "runs": runs}


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = ["| request | gateway | sglang-router |", "|---|---|---|"]
    for name, _, _ in REQUESTS:
        cells = []
        for router in ("gateway", "sglang-router"):
            run = runs[router]
            cells.append(
                json.dumps(run["answers"][name], sort_keys=True)
                if "answers" in run
                else run["status"]
            )
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    for router in ("gateway", "sglang-router"):
        run = runs[router]
        if "rooms" in run:
            lines.append(
                f"| rooms ({router}) | {run['rooms']} requests of each side, all paired: "
                f"{run['all_paired']}, rooms reused: {run['rooms_reused']}, on one side "
                f"only: {run['rooms_on_one_side_only']} | |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    result = asyncio.run(main_async())
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = result["when"][:19].replace(":", "").replace("-", "")
    (RESULTS / f"pd-{stamp}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    md = table(result)
    (RESULTS / f"pd-{stamp}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
