"""Request bodies and upstream responses, made deterministically (seeded) in a temp dir.

Shapes follow SGLang 0.5.19: /generate with text or input_ids and sampling_params, OpenAI
chat completions, /generate responses with meta_info (logprobs for the big ones), and SSE
streams of `data: {...}` events ending in `data: [DONE]`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

SMALL_BODY_BYTES = 317
CHAT_BODY_BYTES = 1 << 20
INPUT_IDS = 100_000
VOCAB = 151_936  # Qwen's vocabulary: ids of 1 to 6 digits, ~6.3 bytes each with commas
SSE_EVENTS = 200
SSE_SLOW_EVENTS = 60

_PROSE = (
    "the model reads a long prompt and answers with a short completion while the router "
    "forwards every byte of it unchanged to the inference server behind the gateway"
)
_WORDS = _PROSE.split(" ")


def _words(rng: random.Random, size: int) -> str:
    out: list[str] = []
    n = 0
    while n < size:
        w = rng.choice(_WORDS)
        if rng.random() < 0.02:
            w += ".\n"
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:size]


def _pad_to(obj: dict[str, object], key: str, size: int) -> bytes:
    """Serialise `obj`, growing the string at `key` so the result is exactly `size` bytes."""
    obj[key] = ""
    base = len(orjson.dumps(obj))
    obj[key] = "x" * max(0, size - base)
    body = orjson.dumps(obj)
    assert len(body) == size, (len(body), size)
    return body


def small_generate() -> bytes:
    """A 317-byte /generate request: a short prompt, a few sampling params."""
    obj: dict[str, object] = {
        "text": "",
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 16},
        "stream": False,
        "rid": "bench-0001",
    }
    obj["text"] = "Summarise in one sentence: " + "the quick brown fox " * 8
    body = _pad_to(obj, "rid", SMALL_BODY_BYTES)
    return body


def stream_generate() -> bytes:
    """A small streaming /generate request (the SSE workloads)."""
    return orjson.dumps(
        {
            "text": "Write a story about a fox.",
            "sampling_params": {"temperature": 0.7, "max_new_tokens": SSE_EVENTS},
            "stream": True,
        }
    )


def chat_1mb(rng: random.Random) -> bytes:
    """A 1 MiB chat completion request: one very long user message (prose with newlines)."""
    text = _words(rng, CHAT_BODY_BYTES)
    user = {"role": "user", "content": text}
    obj: dict[str, object] = {
        "model": "default",
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, user],
        "max_tokens": 16,
        "temperature": 0.7,
    }
    while (over := len(orjson.dumps(obj)) - CHAT_BODY_BYTES) > 0:
        text = text[: len(text) - over]  # each character is at least one byte of JSON
        user["content"] = text
    user["content"] = text + " " * -over
    body = orjson.dumps(obj)
    assert len(body) == CHAT_BODY_BYTES
    return body


def input_ids(rng: random.Random, *, mask: bool) -> bytes:
    """/generate with 100k input_ids (~627 KB); optionally asking for the sampling mask.

    The masked variant carries a finite top_k, so the gateway must forward it, not refuse it.
    """
    ids = [rng.randrange(VOCAB) for _ in range(INPUT_IDS)]
    params: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 512}
    obj: dict[str, object] = {"input_ids": ids, "sampling_params": params}
    if mask:
        params["top_k"] = 20
        obj["return_sampling_mask"] = True
        obj["return_logprob"] = True
    return orjson.dumps(obj)


_OUTPUT_IDS = [578, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 323, 13912, 389, 4401]
_OUTPUT_IDS += [13, 128009, 128001]


def canned_generate() -> bytes:
    """What the upstream answers to a small /generate (< 4 KB: it is inlined in nginx.conf)."""
    return orjson.dumps(
        {
            "text": " The quick brown fox jumps over the lazy dog and keeps on running.",
            "output_ids": _OUTPUT_IDS,
            "meta_info": {
                "id": "6f1c2b9e0d3a4c5f8e7b6a5d4c3b2a19",
                "finish_reason": {"type": "length", "length": 16},
                "prompt_tokens": 64,
                "weight_version": "default",
                "completion_tokens": 16,
                "cached_tokens": 0,
                "e2e_latency": 0.0421,
            },
        }
    )


def canned_chat() -> bytes:
    return orjson.dumps(
        {
            "id": "6f1c2b9e0d3a4c5f8e7b6a5d4c3b2a19",
            "object": "chat.completion",
            "created": 1767225600,
            "model": "default",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "A short answer.",
                        "tool_calls": None,
                    },
                    "logprobs": None,
                    "finish_reason": "length",
                    "matched_stop": None,
                }
            ],
            "usage": {"prompt_tokens": 262144, "completion_tokens": 16, "total_tokens": 262160},
        }
    )


def big_generate_response(path: Path, size: int, rng: random.Random) -> int:
    """A /generate response of `size` bytes: output ids, logprobs and sampling masks.

    Written in pieces so a 64 MB file never exists in memory at once.
    """
    head = orjson.dumps({"text": " ok", "output_ids": [13] * 8})[:-1] + b',"meta_info":{'
    head += b'"id":"6f1c2b9e","finish_reason":{"type":"length","length":4096},'
    head += b'"output_token_sampling_mask":['
    tail = b'],"completion_tokens":4096,"cached_tokens":0,"e2e_latency":12.5}}'
    rows = [
        orjson.dumps(sorted(rng.sample(range(VOCAB), 20))),
        orjson.dumps([round(-rng.random() * 8, 5) for _ in range(20)]),
    ]
    unit = b",".join(rows)
    with path.open("wb") as f:
        f.write(head)
        written = len(head)
        budget = size - len(tail)
        first = True
        block = b"," + unit
        while written + len(block) <= budget:
            piece = unit if first else block
            f.write(piece)
            written += len(piece)
            first = False
        f.write(b" " * (budget - written))  # JSON whitespace up to the exact size
        f.write(tail)
    return size


def sse_stream(path: Path, events: int) -> int:
    """`events` SGLang /generate stream events then `data: [DONE]`; returns the data lines."""
    with path.open("wb") as f:
        for i in range(events):
            last = i == events - 1
            ev = {
                "text": " w" * (i + 1) if i < 8 else " w" * 8,
                "output_ids": [1000 + i],
                "meta_info": {
                    "id": "6f1c2b9e0d3a4c5f",
                    "finish_reason": {"type": "length", "length": i + 1} if last else None,
                    "prompt_tokens": 7,
                    "completion_tokens": i + 1,
                    "cached_tokens": 0,
                },
            }
            f.write(b"data: " + orjson.dumps(ev) + b"\n\n")
        f.write(b"data: [DONE]\n\n")
    return events + 1


@dataclass(frozen=True)
class Files:
    small: Path
    stream: Path
    chat_1mb: Path
    ids_100k: Path
    ids_100k_mask: Path
    resp_4m: Path
    resp_64m: Path
    sse_200: Path
    sse_slow: Path
    sse_200_lines: int
    sse_slow_lines: int


def make_all(outdir: Path, *, big_response_bytes: int) -> Files:
    outdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20260101)

    def put(name: str, data: bytes) -> Path:
        p = outdir / name
        p.write_bytes(data)
        return p

    files = Files(
        small=put("small.json", small_generate()),
        stream=put("stream.json", stream_generate()),
        chat_1mb=put("chat-1mb.json", chat_1mb(rng)),
        ids_100k=put("ids-100k.json", input_ids(rng, mask=False)),
        ids_100k_mask=put("ids-100k-mask.json", input_ids(rng, mask=True)),
        resp_4m=outdir / "resp-4m.json",
        resp_64m=outdir / "resp-big.json",
        sse_200=outdir / "sse-200.txt",
        sse_slow=outdir / "sse-slow.txt",
        sse_200_lines=0,
        sse_slow_lines=0,
    )
    big_generate_response(files.resp_4m, 4 << 20, rng)
    big_generate_response(files.resp_64m, big_response_bytes, rng)
    n200 = sse_stream(files.sse_200, SSE_EVENTS)
    nslow = sse_stream(files.sse_slow, SSE_SLOW_EVENTS)
    return Files(**{**files.__dict__, "sse_200_lines": n200, "sse_slow_lines": nslow})
