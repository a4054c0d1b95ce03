"""The workloads: what is sent, to which upstream kind, how many connections, which driver."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    kind: str  # upstream kind (servers.KINDS): what POST /generate answers
    path: str
    body: str  # attribute of bodies.Files
    conns: int = 16
    driver: str = "wrk"  # wrk (throughput), sse (many slow streams), slow (slow reader)
    smoke: bool = False


WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "small", "small /generate (317 B), 16 conns", "canned", "/generate", "small", 16, smoke=True
    ),
    Workload(
        "small-c1", "small /generate, 1 conn (added latency)", "canned", "/generate", "small", 1
    ),
    Workload(
        "chat-1mb", "chat body 1 MB, 16 conns", "canned", "/v1/chat/completions", "chat_1mb", 16
    ),
    Workload(
        "ids-100k",
        "/generate 100k input_ids (627 KB), 16 conns",
        "canned",
        "/generate",
        "ids_100k",
        16,
    ),
    Workload(
        "ids-100k-mask",
        "same + return_sampling_mask, top_k 20, 16 conns",
        "canned",
        "/generate",
        "ids_100k_mask",
        16,
        smoke=True,
    ),
    Workload("resp-4mb", "4 MB response, 16 conns", "resp4m", "/generate", "small", 16, smoke=True),
    Workload(
        "sse-200",
        "SSE, 200 events back to back, 16 conns",
        "sse200",
        "/generate",
        "stream",
        16,
        smoke=True,
    ),
    Workload(
        "sse-slow",
        "slow SSE streams, all open at once",
        "sseslow",
        "/generate",
        "stream",
        driver="sse",
        smoke=True,
    ),
    Workload(
        "resp-big-slow",
        "big response to a slow reader",
        "respbig",
        "/generate",
        "small",
        1,
        driver="slow",
        smoke=True,
    ),
)

BY_NAME = {w.name: w for w in WORKLOADS}
SCALING_WORKLOADS = ("small", "ids-100k")
