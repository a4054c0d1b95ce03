"""A replayable trace for the routing benchmark: the same seed, the same requests.

A trace is a list of jobs; a job is a list of steps, each step the prompts sent at once
(a GRPO group's n samples), the next step sent when all of them are answered (an agent's
next turn). No routing keys: the router has only the prompts to go by.

Workloads (the shapes the routing bar names):
- agents: multi-turn sessions, each turn resending the whole conversation so far
  (system prompt, earlier turns and answers) plus a new user message;
- grpo: groups of n samples of one prompt, sent together;
- shared: many one-shot clients whose prompts open with one long system prompt;
- mix: all three, interleaved.
Prompts are words (`t123`), the stub's tokens (gateway/testing/stub/cache.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.testing.stub.cache import PrefixCache

Job = list[list[str]]


@dataclass(frozen=True)
class Shape:
    sessions: int = 32
    turns: int = 10
    agent_system: int = 100
    user: tuple[int, int] = (60, 120)
    answer: tuple[int, int] = (40, 100)
    groups: int = 40
    group_n: int = 8
    grpo_prompt: tuple[int, int] = (150, 400)
    shared_clients: int = 300
    shared_system: int = 1200
    question: tuple[int, int] = (20, 50)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(50_000)}" for _ in range(n))


def agents(rng: random.Random, s: Shape) -> list[Job]:
    systems = [_words(rng, s.agent_system) for _ in range(2)]  # two agent frameworks
    jobs = []
    for i in range(s.sessions):
        convo = systems[i % 2]
        steps = []
        for _ in range(s.turns):
            convo += " user: " + _words(rng, rng.randint(*s.user))
            steps.append([convo])
            convo += " assistant: " + _words(rng, rng.randint(*s.answer))
        jobs.append(steps)
    return jobs


def grpo(rng: random.Random, s: Shape) -> list[Job]:
    jobs = []
    for _ in range(s.groups):
        prompt = _words(rng, rng.randint(*s.grpo_prompt))
        jobs.append([[prompt] * s.group_n])
    return jobs


def shared(rng: random.Random, s: Shape) -> list[Job]:
    system = _words(rng, s.shared_system)
    return [
        [[system + " question: " + _words(rng, rng.randint(*s.question))]]
        for _ in range(s.shared_clients)
    ]


def mix(rng: random.Random, s: Shape) -> list[Job]:
    # Agent sessions carry most of the tokens, as in agentic RL; a fifth of the shared clients.
    jobs = agents(rng, s) + grpo(rng, s) + shared(rng, Shape(shared_clients=s.shared_clients // 5))
    rng.shuffle(jobs)
    return jobs


WORKLOADS: dict[str, Callable[[random.Random, Shape], list[Job]]] = {
    "agents": agents,
    "grpo": grpo,
    "shared": shared,
    "mix": mix,
}


def make(workload: str, seed: int = 22, shape: Shape = Shape()) -> list[Job]:
    return WORKLOADS[workload](random.Random(seed), shape)


def requests_in(jobs: list[Job]) -> int:
    return sum(len(step) for job in jobs for step in job)


def shape_of(job: Job) -> str:
    """Which workload a job of the mix came from, by its form."""
    if len(job) > 1:
        return "agents"
    return "grpo" if len(job[0]) > 1 else "shared"


def working_set(jobs: list[Job], block_tokens: int = 16) -> int:
    """The trace's distinct prompt tokens, counted as the stub caches them (whole blocks of
    `block_tokens`, a shared prefix once): what one engine would hold to serve it all from
    cache."""
    cache = PrefixCache(1 << 40, block_tokens)
    for job in jobs:
        for step in job:
            for prompt in step:
                cache.admit(prompt.split())
    return cache.held_tokens


def ceiling(jobs: list[Job], block_tokens: int = 16) -> float:
    """The best hit rate any router could reach: one engine with an unbounded cache serving
    the trace one job at a time (a prompt hits all that any earlier one shared with it)."""
    cache = PrefixCache(1 << 40, block_tokens)
    for job in jobs:
        for step in job:
            for prompt in step:
                cache.admit(prompt.split())
    return cache.cached_tokens_total / cache.prompt_tokens_total if cache.prompt_tokens_total else 0


def write(jobs: list[Job], path: Path) -> None:
    """One job per line, for replay by another client."""
    path.write_text("".join(json.dumps(job) + "\n" for job in jobs))
