"""The token logprobs the stub reports, in SGLang 0.5.19's shapes (docs/sglang-contract.md s.7).

SGLang's tokenizer manager (`detokenize_logprob_tokens`) turns each logprob into a
`(logprob, token_id, text)` triple, `text` None unless `return_text_in_logprobs`; the top
logprobs of a position are a list of such triples, or None. The scheduler reports prompt
positions from `logprob_start_len` on (-1, the default, reports none) and gives the first
of them no logprob (`[None] + logprobs[:-1]`, logprob_result_processor.py).

The values are made up but fixed: a function of the prompt's token ids and the position,
so a test can ask twice and assert equality, and two prompts differ. Each reported token
has a probability of at most one half and its alternatives fall off by a constant ratio,
so the top list is sorted and its mass stays below one, as a real distribution's would.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any

import orjson

OUTPUT_ID_BASE = 100  # output token i is id 100 + i (rules.ids) and reads " w{i}"

_MASK64 = (1 << 64) - 1

# Pseudo-tokenised words and top-list alternatives fall in [5000, 32000), clear of every
# output id (rules.MAX_NEW_TOKENS_CAP of them from 100) and inside rules.VOCAB_SIZE.
_TEXT_ID_BASE = 5000

_TEXT_IDS = 27000

_STEP = 0.7  # each alternative in a top list: this much lower than the one before

_Triple = list[Any]


def token_text(token_id: int) -> str:
    """What a token id decodes to: the output pieces of rules.token_pieces, else ` t{id}`."""
    if OUTPUT_ID_BASE <= token_id < _TEXT_ID_BASE:
        return f" w{token_id - OUTPUT_ID_BASE}"
    return f" t{token_id}"


def prompt_ids(prompt: object) -> list[int]:
    """The token ids of a prompt: the ids themselves, else one pseudo id per word, so that
    there are exactly as many as rules.words counts."""
    if isinstance(prompt, list) and prompt and all(isinstance(v, int) for v in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        pieces = prompt.split() or [""]
        return [_TEXT_ID_BASE + zlib.crc32(w.encode()) % _TEXT_IDS for w in pieces]
    if isinstance(prompt, list):
        return [i for part in prompt for i in prompt_ids(part)]
    if isinstance(prompt, dict):
        return prompt_ids(prompt.get("content"))
    return [0]


def seed_of(ids: list[int]) -> int:
    try:
        raw = orjson.dumps(ids)
    except TypeError:  # an id beyond 64 bits
        raw = repr(ids).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def _unit(seed: int, *salt: int) -> float:
    """A number in [0, 1) fixed by the seed and the salt (splitmix64's finaliser)."""
    x = seed
    for s in salt:
        x = (x ^ ((s + 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x / (1 << 64)


_IN, _OUT, _ALT, _IDS = 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class Ask:
    """What one item asked for: SGLang's return_logprob fields, normalised."""

    start: int  # the first prompt position reported; len(prompt) reports none
    top: int  # top_logprobs_num
    token_ids: tuple[int, ...] | None  # token_ids_logprob
    text: bool  # return_text_in_logprobs


@dataclass(slots=True)
class Logprobs:
    """One item's logprobs. The prompt side is built once and the output side grows, so a
    stream (whose every event carries the lists so far) costs no more than one answer."""

    ask: Ask
    prompt: list[int]
    seed: int = 0
    _input: dict[str, Any] | None = None
    _out: list[_Triple] = field(default_factory=list)
    _out_top: list[list[_Triple]] = field(default_factory=list)
    _out_ids: list[list[_Triple]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seed = seed_of(self.prompt)

    def logprob(self, kind: int, pos: int) -> float:
        return round(-0.7 - 2.3 * _unit(self.seed, kind, pos), 4)

    def triple(self, logprob: float | None, token_id: int) -> _Triple:
        return [logprob, token_id, token_text(token_id) if self.ask.text else None]

    def top(self, kind: int, pos: int, token_id: int) -> list[_Triple]:
        """The `ask.top` most likely tokens at a position, led by the one reported there."""
        first = self.logprob(kind, pos)
        rows = [self.triple(first, token_id)]
        for j in range(1, self.ask.top):
            alt = _TEXT_ID_BASE + int(_unit(self.seed, _ALT, kind, pos, j) * _TEXT_IDS)
            rows.append(self.triple(round(first - _STEP * j, 4), alt))
        return rows

    def of_ids(self, kind: int, pos: int) -> list[_Triple]:
        ids = self.ask.token_ids or ()
        return [
            self.triple(round(-0.7 - 9.3 * _unit(self.seed, _IDS, kind, pos, t), 4), t) for t in ids
        ]

    def _prompt_side(self) -> dict[str, Any]:
        if self._input is None:
            shown = range(self.ask.start, len(self.prompt))
            side: dict[str, Any] = {
                "input_token_logprobs": [
                    self.triple(
                        None if p == self.ask.start else self.logprob(_IN, p), self.prompt[p]
                    )
                    for p in shown
                ]
            }
            if self.ask.top > 0:
                side["input_top_logprobs"] = [
                    None if p == self.ask.start else self.top(_IN, p, self.prompt[p]) for p in shown
                ]
            if self.ask.token_ids is not None:
                side["input_token_ids_logprobs"] = [
                    None if p == self.ask.start else self.of_ids(_IN, p) for p in shown
                ]
            self._input = side
        return self._input

    def meta(self, n: int) -> dict[str, Any]:
        """The meta_info keys after `n` output tokens, in SGLang's key order."""
        for i in range(len(self._out), n):
            token_id = OUTPUT_ID_BASE + i
            self._out.append(self.triple(self.logprob(_OUT, i), token_id))
            if self.ask.top > 0:
                self._out_top.append(self.top(_OUT, i, token_id))
            if self.ask.token_ids is not None:
                self._out_ids.append(self.of_ids(_OUT, i))
        side = self._prompt_side()
        meta: dict[str, Any] = {
            "input_token_logprobs": side["input_token_logprobs"],
            "output_token_logprobs": self._out[:n],
            "output_token_logprobs_length": n,
        }
        if self.ask.top > 0:
            meta["input_top_logprobs"] = side["input_top_logprobs"]
            meta["output_top_logprobs"] = self._out_top[:n]
        if self.ask.token_ids is not None:
            meta["input_token_ids_logprobs"] = side["input_token_ids_logprobs"]
            meta["output_token_ids_logprobs"] = self._out_ids[:n]
        return meta


def openai_chat(lp: Logprobs, first: int, n: int) -> dict[str, Any]:
    """Chat's `choice.logprobs` for output tokens first..n-1 (serving_chat.py
    `_process_logprobs_tokens`: token, its UTF-8 bytes, logprob, top_logprobs)."""
    meta = lp.meta(n)
    tops = meta.get("output_top_logprobs")

    def entry(row: _Triple) -> dict[str, Any]:
        return {"token": row[2], "bytes": list(row[2].encode()), "logprob": row[0]}

    content = []
    for i in range(first, n):
        alts = [entry(r) for r in tops[i]] if tops is not None else []
        content.append(entry(meta["output_token_logprobs"][i]) | {"top_logprobs": alts})
    return {"content": content}


def openai_completion(lp: Logprobs, first: int, n: int) -> dict[str, Any]:
    """Completions' `choice.logprobs` (openai/utils.py `to_openai_style_logprobs`)."""
    meta = lp.meta(n)
    rows = meta["output_token_logprobs"][first:n]
    tops = meta.get("output_top_logprobs")
    return {
        "text_offset": [-1] * len(rows),
        "token_logprobs": [r[0] for r in rows],
        "tokens": [r[2] for r in rows],
        "top_logprobs": [{t[2]: t[0] for t in tops[i]} for i in range(first, n)]
        if tops is not None
        else [],
    }
