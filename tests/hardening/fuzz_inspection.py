"""Coverage-guided fuzzing of the request inspection, checked against the SGLang model.

Run it through `scripts/fuzz.sh [seconds]`. Invariants, for every input:
1. `gateway.contract.inspection.inspect_body` (headers: `check_headers`) never raises;
2. it never returns "forward" (None) for a body that SGLang, per tests/sglang_model.py,
   would run with the mask on and an unbounded top_k.

With atheris (libFuzzer) the inputs are raw bytes, structured JSON built from the fuzzer's
data (every field that decides the rule, keys that may repeat or be \\u-escaped, numbers no
serializer writes), and byte-level mutations of those. Without atheris, `--hypothesis SECONDS`
runs the same checks on hypothesis-generated bodies for that long.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import atheris
except ImportError:  # the hypothesis fallback needs no atheris
    atheris = None

if atheris is not None:
    # The model is instrumented too: reaching its deeper states (items that run with the
    # mask on) counts as new coverage, which steers the fuzzer there.
    with atheris.instrument_imports(include=["gateway", "tests.sglang_model"]):
        from gateway.contract.inspection import check_headers, inspect_body
        from gateway.contract.policy import BodyRules, resolve
        from gateway.contract.routes import Kind
        from tests import sglang_model  # noqa: F401
else:
    from gateway.contract.inspection import check_headers, inspect_body
    from gateway.contract.policy import BodyRules
    from gateway.contract.routes import Kind

from tests import sglang_model as sglang  # noqa: E402 - after the instrumented imports
from tests.hardening.bodies import (  # noqa: E402
    MASK_VALUES,
    TEMPERATURES,
    TOP_K_VALUES,
    Obj,
    Raw,
    Style,
    dump,
)

POLICY = BodyRules()
KINDS = [Kind.GENERATE, Kind.VERTEX, Kind.CHAT, Kind.COMPLETIONS, Kind.RESPONSES]
PATH = {
    Kind.GENERATE: "/generate",
    Kind.VERTEX: "/vertex_generate",
    Kind.CHAT: "/v1/chat/completions",
    Kind.COMPLETIONS: "/v1/completions",
    Kind.RESPONSES: "/v1/responses",
}
TOP_KEYS = [
    "text",
    "input_ids",
    "input_embeds",
    "sampling_params",
    "return_sampling_mask",
    "stream",
    "top_k",
    "temperature",
    "top_p",
    "messages",
    "return_meta_info",
    "instances",
    "parameters",
    "n",
    "rid",
    "prompt",
    "input",
    "extra_body",
    "is_normalized",
    "beam_width",
    "max_new_tokens",
    "image_data",
]
STRINGS = ["yes", "no", "on", "off", "t", "f", "y", "n", "1", "0", "true", "false", "TRUE"]
STRINGS += ["", " 5 ", "5", "5.0", "-1", "abc", "Hi", "\u00e9", "\ud7ff"]
INTS = [0, 1, -1, 2, 5, 40, -2, 4096, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, 1 << 31]
INTS += [(1 << 63) - 1, -(1 << 63)]
RAWS = [b"18446744073709551616", b"1e300", b"-0.0", b"1073741824.0", b"1e-7", b"0.0", b"5.5"]

# Typed pools per field: most values are ones the field is meant to hold, in every spelling.
POOLS: dict[str, list[Any]] = {
    "return_sampling_mask": [*MASK_VALUES, [False], [True, False], ["no"], [0, "yes"], []],
    "top_k": TOP_K_VALUES,
    "temperature": TEMPERATURES,
    "top_p": [0.5, 0.9, 1.0, None],
    "n": [1, 2, 3, 2.0, True, 0, "2", None],
    "is_normalized": [True, False, 1, "yes"],
    "beam_width": [None, 1, 2],
    "max_new_tokens": [1, 8],
    "stream": [True, False, "yes", "off", None],
    "return_meta_info": [True, False, "yes", 1, "no", None],
    "text": ["Hi", "a b", "Hi", ["a", "b"], ["a"], ["a", "b", "c"], [], "", [""]],
    "prompt": ["Hi", ["a", "b"]],
    "input": ["Hi"],
    "input_ids": [[1, 2], [[1], [2]], [[1, 2]], [], [[]], [1]],
    "input_embeds": [[[0.1, 0.2]], [[[0.1]], [[0.2]]], [0.1], [[1, 2]], [[[1]]]],
    "messages": [[{"role": "user", "content": "Hi"}], []],
    "rid": ["r", ["r1", "r2"]],
    "image_data": [None],
}
GENERATE_KEYS = ["text", "input_ids", "input_embeds", "sampling_params", "return_sampling_mask"]
GENERATE_KEYS += ["stream", "rid", "top_k"]
PARAM_KEYS = ["top_k", "temperature", "top_p", "n", "is_normalized", "max_new_tokens"]
PARAM_KEYS += ["beam_width"]
KIND_KEYS = {
    Kind.GENERATE: GENERATE_KEYS,
    Kind.VERTEX: ["instances", "parameters"],
    Kind.CHAT: [
        *["messages", "top_k", "temperature", "top_p", "n", "return_sampling_mask"],
        *["return_meta_info", "stream", "sampling_params", "extra_body"],
    ],
    Kind.COMPLETIONS: ["prompt", "top_k", "temperature", "return_sampling_mask"],
    Kind.RESPONSES: ["input", "top_k", "temperature", "return_sampling_mask"],
}


def _value(fdp: Any, depth: int) -> Any:
    """Any JSON value (a random one, for keys outside their pools)."""
    choice = fdp.ConsumeIntInRange(0, 11 if depth < 4 else 7)
    if choice == 0:
        return None
    if choice == 1:
        return fdp.ConsumeBool()
    if choice == 2:
        return INTS[fdp.ConsumeIntInRange(0, len(INTS) - 1)]
    if choice == 3:
        return fdp.ConsumeIntInRange(-3, 70)
    if choice == 4:
        return fdp.ConsumeRegularFloat()
    if choice == 5:
        return STRINGS[fdp.ConsumeIntInRange(0, len(STRINGS) - 1)]
    if choice == 6:
        return Raw(RAWS[fdp.ConsumeIntInRange(0, len(RAWS) - 1)])
    if choice == 7:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 6))
    if choice in (8, 9):
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return _object(fdp, TOP_KEYS, depth + 1)


def _field(fdp: Any, key: str, depth: int) -> Any:
    if fdp.ConsumeIntInRange(0, 15) == 0 or depth > 3:
        return _value(fdp, depth)  # off-type, on purpose
    if key in ("sampling_params", "extra_body"):
        if fdp.ConsumeIntInRange(0, 3) == 0:
            return [_object(fdp, PARAM_KEYS, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        return _object(fdp, PARAM_KEYS, depth + 1)
    if key == "parameters":
        return _object(fdp, GENERATE_KEYS, depth + 1)
    if key == "instances":
        return [
            _object(fdp, ["text", "input_ids", "input_embeds"], depth + 1)
            for _ in range(fdp.ConsumeIntInRange(0, 3))
        ]
    pool = POOLS.get(key)
    if pool is None:
        return _value(fdp, depth)
    return pool[fdp.ConsumeIntInRange(0, len(pool) - 1)]


# Keys present in most inputs, so that most bodies get deep into both readings.
CORE = frozenset(
    {"text", "sampling_params", "return_sampling_mask", "top_k", "messages", "instances"}
    | {"parameters", "return_meta_info", "prompt", "input"}
)


def _object(fdp: Any, keys: list[str], depth: int) -> Obj:
    pairs = []
    for key in keys:
        present = fdp.ConsumeIntInRange(0, 9) < (8 if key in CORE else 3)
        repeat = (2 if fdp.ConsumeIntInRange(0, 7) == 0 else 1) if present else 0
        pairs.extend((key, _field(fdp, key, depth)) for _ in range(repeat))  # the last one wins
    if fdp.ConsumeIntInRange(0, 15) == 0:
        key = TOP_KEYS[fdp.ConsumeIntInRange(0, len(TOP_KEYS) - 1)]
        pairs.insert(fdp.ConsumeIntInRange(0, len(pairs)), (key, _field(fdp, key, depth)))
    return Obj(tuple(pairs))


def _dump(value: Any, style: Style) -> bytes:
    try:
        return dump(value, style)
    except (TypeError, ValueError):  # a float orjson cannot write (inf/nan)
        return b"{}"


def check(kind: Kind, body: bytes) -> None:
    """The invariants, for one body."""
    rejection = resolve(inspect_body(kind, body, POLICY))
    if rejection is not None:
        return
    reading = sglang.read("POST", PATH[kind], body)
    if reading.runs_unbounded_mask:
        raise AssertionError(f"BYPASS on {PATH[kind]}: {body!r} -> {reading}")


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    kind = KINDS[fdp.ConsumeIntInRange(0, len(KINDS) - 1)]
    mode = fdp.ConsumeIntInRange(0, 3)
    if mode == 0:
        check_headers(
            fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 60)) or None,
            fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 20)) or None,
        )
        check(kind, fdp.ConsumeBytes(fdp.remaining_bytes()))
        return
    style = Style(escape_keys=fdp.ConsumeIntInRange(0, 3) == 0, spaced=fdp.ConsumeBool())
    body = _dump(_object(fdp, KIND_KEYS[kind], 0), style)
    if mode == 3 and body:
        # A byte-level mutation of a well-formed body.
        at = fdp.ConsumeIntInRange(0, len(body) - 1)
        body = body[:at] + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 3)) + body[at + 1 :]
    check(kind, body)


def seeds(directory: Path) -> None:
    """A seed corpus: the hand-written adversarial cases."""
    from tests.hardening.corpus import CASES

    directory.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(CASES):
        # mode 0 (raw bytes) for the route of the case
        path = case.path.split("?")[0].rstrip("/") or "/"
        kind = next((k for k, p in PATH.items() if p == path), Kind.GENERATE)
        prefix = bytes([KINDS.index(kind), 0, 0, 0])
        (directory / f"case-{i:03d}").write_bytes(prefix + case.body)


def hypothesis_run(seconds: float) -> int:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.hardening.bodies import requests

    kinds = {p: k for k, p in PATH.items()}
    total = 0

    @settings(
        max_examples=2_000,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(requests(), st.tuples(st.sampled_from(list(kinds)), st.binary())))
    def fuzz(case: tuple[str, bytes]) -> None:
        nonlocal total
        path, body = case
        check(kinds.get(path.split("?")[0].rstrip("/"), Kind.GENERATE), body)
        total += 1

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        fuzz()
    print(f"hypothesis fuzzing: {total} inputs in {seconds:.0f}s, no failure")
    return 0


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--hypothesis":
        return hypothesis_run(float(sys.argv[2]) if len(sys.argv) > 2 else 600)
    if len(sys.argv) >= 3 and sys.argv[1] == "--seeds":
        seeds(Path(sys.argv[2]))
        return 0
    if atheris is None:
        print("atheris is not installed; use --hypothesis SECONDS", file=sys.stderr)
        return 2
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
