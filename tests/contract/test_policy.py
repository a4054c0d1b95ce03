"""Truth tables for the gateway's sampling-mask policy (docs/sglang-contract.md section 8).

Every expectation here is read from the contract, not from the implementation:
  rule 1: a body orjson cannot read, a non-object top level, a request Content-Encoding or a
          non-JSON media type is answered 400/415 by the gateway;
  rule 2: "mask requested" uses pydantic's lax truthiness; a non-empty list turns a single
          /generate request on;
  rule 3: the effective top_k per item: greedy -> 1; omitted/null/-1/>= TOP_K_ALL -> unbounded;
  rule 4: mask requested and top_k unbounded -> 400 with PR #35205's message;
  rule 5: what SGLang itself would fail (top_k < 1, strings, chat without return_meta_info,
          streamed chat masks, list masks with n > 1) -> 400;
  rule 6: everything else is forwarded (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from gateway.contract.inspection import check_headers, inspect_body
from gateway.contract.jsonview import read_view
from gateway.contract.policy import (
    MASK_MESSAGE,
    META_INFO_MESSAGE,
    PARALLEL_LIST_MESSAGE,
    READS,
    SHAPE_ONLY,
    STREAM_META_INFO_MESSAGE,
    TOP_K_ALL,
    BodyRules,
    Rejection,
    SamplingMaskRule,
    resolve,
)
from gateway.contract.routes import Kind

# --- expected outcomes ---------------------------------------------------------------------------

MASK = Rejection(400, "sampling_mask", "unbounded_top_k", MASK_MESSAGE)
META = Rejection(400, "sampling_mask", "missing_meta_info", META_INFO_MESSAGE)
STREAM = Rejection(400, "sampling_mask", "stream_meta_info", STREAM_META_INFO_MESSAGE)
PARALLEL = Rejection(400, "sampling_mask", "parallel_mask_list", PARALLEL_LIST_MESSAGE)


def bad_top_k(k: int) -> Rejection:
    """SGLang's SamplingParams.verify() message (docs/sglang-contract.md section 2)."""
    return Rejection(
        400, "sampling_mask", "invalid_top_k", f"top_k must be -1 (disable) or at least 1, got {k}."
    )


@dataclass(frozen=True)
class BadField:
    """A body-validation 400 (OpenAI error shape) whose own message names the field."""

    field: str


@dataclass(frozen=True)
class Refused:
    """Any 400: the contract fixes that the request is refused, not which message is used."""


REFUSED = Refused()
Expected = Rejection | BadField | Refused | None


def assert_outcome(actual: Rejection | None, expected: Expected) -> None:
    if isinstance(expected, BadField):
        assert actual is not None, "expected a validation 400, got forwarded"
        assert (actual.status, actual.rule, actual.validation) == (400, "request_body", True)
        assert expected.field in actual.message, actual.message
    elif isinstance(expected, Refused):
        assert actual is not None, "expected a 400, got forwarded"
        assert actual.status == 400
    else:
        assert actual == expected


POLICY = BodyRules()


class Recording(dict[str, Any]):
    """A body that notes which top-level fields a check looks at."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def both(kind: Kind, body: dict[str, Any], policy: BodyRules = POLICY) -> Rejection | None:
    """check() on the parsed body, asserting resolve(inspect_body()) on its bytes decides the same,
    and that the check read no top-level field the body reader leaves out (policy.READS)."""
    recording = Recording(body)
    direct = policy.check(kind, recording)
    fields = READS.get(kind)
    if fields is not None:
        assert recording.read <= fields, recording.read - fields
    raw = orjson.dumps(body)
    assert resolve(inspect_body(kind, raw, policy)) == direct
    # The reader large bodies go through (gateway/contract/jsonview.py) must decide the same too.
    if kind in READS:
        assert policy.check(kind, read_view(raw, READS[kind], SHAPE_ONLY)) == direct
    return direct


# --- builders ------------------------------------------------------------------------------------

_ABSENT: Any = object()


def gen(mask: Any = _ABSENT, params: Any = _ABSENT, **extra: Any) -> dict[str, Any]:
    """A /generate body: a single text unless `text` or `input_ids` is given in extra."""
    body: dict[str, Any] = {} if "input_ids" in extra else {"text": "hello"}
    if mask is not _ABSENT:
        body["return_sampling_mask"] = mask
    if params is not _ABSENT:
        body["sampling_params"] = params
    body.update(extra)
    return body


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def chat_mask(**fields: Any) -> dict[str, Any]:
    """A chat body with the mask on and return_meta_info as SGLang requires it."""
    return chat(return_sampling_mask=True, return_meta_info=True, **fields)


# --- /generate, single request: rule 2 (mask spellings) ------------------------------------------

MASK_ON = [True, 1, 1.0, "yes", "ON", "t", "True", "y", "1", "On", [False], [True], [0], ["no"]]
MASK_OFF = [False, 0, 0.0, "no", "OFF", "f", "false", "0", None, _ABSENT, []]


def _ids(values: list[Any]) -> list[str]:
    return ["absent" if v is _ABSENT else f"{type(v).__name__}:{v!r}" for v in values]


@pytest.mark.parametrize("mask", MASK_ON, ids=_ids(MASK_ON))
def test_generate_mask_on_spellings(mask: object) -> None:
    assert_outcome(both(Kind.GENERATE, gen(mask)), MASK)
    assert_outcome(both(Kind.GENERATE, gen(mask, {"top_k": 5})), None)


@pytest.mark.parametrize("mask", MASK_OFF, ids=_ids(MASK_OFF))
def test_generate_mask_off_spellings(mask: object) -> None:
    assert_outcome(both(Kind.GENERATE, gen(mask)), None)
    assert_outcome(both(Kind.GENERATE, gen(mask, {"temperature": 0.7, "top_p": 0.9})), None)


MASK_UNREADABLE = [2, -1, 0.5, "maybe", "", " yes", {}, ["maybe"], [2]]


@pytest.mark.parametrize("mask", MASK_UNREADABLE, ids=_ids(MASK_UNREADABLE))
def test_generate_mask_unreadable(mask: object) -> None:
    assert_outcome(both(Kind.GENERATE, gen(mask, {"top_k": 5})), BadField("return_sampling_mask"))


# --- /generate, single request: rules 3-5 (top_k), mask on ---------------------------------------

TOP_K_MASK_ON = [
    # rule 3: omitted, null, -1 and anything >= TOP_K_ALL are unbounded -> rule 4
    pytest.param(_ABSENT, MASK, id="absent"),
    pytest.param(None, MASK, id="null"),
    pytest.param(-1, MASK, id="minus-1"),
    pytest.param(-1.0, MASK, id="minus-1.0"),
    pytest.param(TOP_K_ALL, MASK, id="TOP_K_ALL"),
    pytest.param(TOP_K_ALL + 1, MASK, id="TOP_K_ALL+1"),
    pytest.param(2**40, MASK, id="2**40"),
    pytest.param(1e300, MASK, id="1e300"),
    pytest.param(float(TOP_K_ALL), MASK, id="TOP_K_ALL-float"),
    # finite
    pytest.param(1, None, id="1"),
    pytest.param(5, None, id="5"),
    pytest.param(5.0, None, id="5.0"),
    pytest.param(True, None, id="true"),
    pytest.param(4096, None, id="4096"),
    pytest.param(TOP_K_ALL - 1, None, id="TOP_K_ALL-1"),
    # rule 5: SGLang's verify() refuses top_k < 1 other than -1
    pytest.param(0, bad_top_k(0), id="0"),
    pytest.param(0.0, bad_top_k(0), id="0.0"),
    pytest.param(False, bad_top_k(0), id="false"),
    pytest.param(-2, bad_top_k(-2), id="minus-2"),
    pytest.param(-100, bad_top_k(-100), id="minus-100"),
    # rule 5: SGLang crashes (500) on these; the gateway answers 400 itself
    pytest.param("5", BadField("top_k"), id="str-5"),
    pytest.param("-1", BadField("top_k"), id="str-minus-1"),
    pytest.param([5], BadField("top_k"), id="list"),
    pytest.param({"a": 1}, BadField("top_k"), id="dict"),
    pytest.param(5.5, BadField("top_k"), id="5.5"),
]


@pytest.mark.parametrize(("top_k", "expected"), TOP_K_MASK_ON)
def test_generate_top_k_with_mask(top_k: object, expected: Expected) -> None:
    params = {"top_p": 0.9} if top_k is _ABSENT else {"top_p": 0.9, "top_k": top_k}
    assert_outcome(both(Kind.GENERATE, gen(True, params)), expected)


TOP_K_MASK_OFF = [
    pytest.param(_ABSENT, None, id="absent"),
    pytest.param(None, None, id="null"),
    pytest.param(-1, None, id="minus-1"),
    pytest.param(TOP_K_ALL, None, id="TOP_K_ALL"),
    pytest.param(5, None, id="5"),
    pytest.param(0, bad_top_k(0), id="0"),
    pytest.param(False, bad_top_k(0), id="false"),
    pytest.param(-2, bad_top_k(-2), id="minus-2"),
    pytest.param("5", BadField("top_k"), id="str-5"),
    pytest.param(5.5, BadField("top_k"), id="5.5"),
]


@pytest.mark.parametrize(("top_k", "expected"), TOP_K_MASK_OFF)
def test_generate_top_k_without_mask(top_k: object, expected: Expected) -> None:
    """Rule 5 holds whether or not the mask is on: SGLang would fail these requests anyway."""
    params = {} if top_k is _ABSENT else {"top_k": top_k}
    assert_outcome(both(Kind.GENERATE, gen(False, params)), expected)


GREEDY = [
    pytest.param({"temperature": 0}, None, id="t-0"),
    pytest.param({"temperature": 0.0}, None, id="t-0.0"),
    pytest.param({"temperature": 1e-7}, None, id="t-1e-7"),
    pytest.param({"temperature": 5e-7, "top_k": None}, None, id="t-5e-7-top_k-null"),
    pytest.param({"temperature": 0, "top_k": -1}, None, id="t-0-top_k-minus-1"),
    pytest.param({"temperature": 0, "top_k": TOP_K_ALL}, None, id="t-0-top_k-all"),
    pytest.param({"temperature": 1e-6}, MASK, id="t-1e-6"),
    pytest.param({"temperature": 0.7}, MASK, id="t-0.7"),
    pytest.param({"temperature": -0.1}, MASK, id="t-negative"),
    pytest.param({"temperature": "0"}, MASK, id="t-str-0"),
    pytest.param({"temperature": None}, MASK, id="t-null"),
]


@pytest.mark.parametrize(("params", "expected"), GREEDY)
def test_generate_greedy(params: dict[str, Any], expected: Expected) -> None:
    """Rule 3: a greedy item has top_k = 1 whatever was sent, so its mask is bounded."""
    assert_outcome(both(Kind.GENERATE, gen(True, params)), expected)


GENERATE_SHAPES = [
    pytest.param(gen(True, top_k=5), MASK, id="top-level-top_k-ignored"),
    pytest.param(gen(True, {"top_p": 0.5}, top_k=5), MASK, id="top-level-top_k-ignored-2"),
    pytest.param(gen(True, None), MASK, id="sampling_params-null"),
    pytest.param(gen(True, {}), MASK, id="sampling_params-empty"),
    pytest.param(gen(True, "top_k=5"), BadField("sampling_params"), id="sampling_params-str"),
    pytest.param(gen(True, 5), BadField("sampling_params"), id="sampling_params-int"),
    pytest.param(gen(True, True), BadField("sampling_params"), id="sampling_params-bool"),
    pytest.param(gen(False, "x"), BadField("sampling_params"), id="sampling_params-str-no-mask"),
    pytest.param(gen(True, input_ids=[1, 2, 3]), MASK, id="input_ids"),
    pytest.param(gen([False], input_ids=[1, 2, 3]), MASK, id="input_ids-[false]"),
    pytest.param(gen("on", {"top_k": 3}, input_ids=[1, 2]), None, id="input_ids-finite"),
]


@pytest.mark.parametrize(("body", "expected"), GENERATE_SHAPES)
def test_generate_body_shapes(body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(Kind.GENERATE, body), expected)


# --- /generate, batches and n (contract section 4) -----------------------------------------------

TWO = ["a", "b"]
THREE = ["a", "b", "c"]
K5: dict[str, Any] = {"top_k": 5}

BATCHES = [
    # a scalar mask is shared by every item
    pytest.param(gen(True, K5, text=TWO), None, id="scalar-mask-shared-finite"),
    pytest.param(gen(True, {}, text=TWO), MASK, id="scalar-mask-shared-unbounded"),
    pytest.param(gen("yes", text=TWO), MASK, id="scalar-yes-no-params"),
    pytest.param(gen(True, [K5, K5], text=TWO), None, id="scalar-mask-per-item-finite"),
    pytest.param(gen(True, [K5, {}], text=TWO), MASK, id="scalar-mask-item-1-unbounded"),
    pytest.param(gen(False, [{}, {}], text=TWO), None, id="scalar-off"),
    # a list mask is per item; [false] in a batch is off for that item
    pytest.param(gen([True, False], [K5, {}], text=TWO), None, id="list-mask-item-0-bounded"),
    pytest.param(gen([True, False], [{}, K5], text=TWO), MASK, id="list-mask-item-1-bounded"),
    pytest.param(gen([False, "on"], [K5, {}], text=TWO), MASK, id="list-mask-lax-on"),
    pytest.param(gen([False, False], text=TWO), None, id="list-mask-all-off"),
    pytest.param(gen([False], text=["a"]), None, id="batch-of-one-[false]"),
    pytest.param(gen([True], text=["a"]), MASK, id="batch-of-one-[true]"),
    pytest.param(gen([True, 0], [K5, {"top_k": 0}], text=TWO), bad_top_k(0), id="item-top_k-0"),
    # one unbounded item refuses the whole batch (SGLang answers one 400 for all)
    pytest.param(gen(True, [K5, K5, {}], text=THREE), MASK, id="three-one-absent"),
    pytest.param(gen(True, [K5, {"top_k": -1}, K5], text=THREE), MASK, id="three-one-minus-1"),
    pytest.param(gen(True, [K5, {"top_k": 7}, K5], text=THREE), None, id="three-finite"),
    pytest.param(gen(True, [K5, {"temperature": 0}, K5], text=THREE), None, id="three-greedy-item"),
    # sampling_params shorter than the batch: an item has no top_k
    pytest.param(gen(True, [K5, K5], text=THREE), REFUSED, id="params-shorter-than-batch"),
    pytest.param(gen(True, "x", text=TWO), BadField("sampling_params"), id="params-str"),
    pytest.param(gen(True, [K5, "x"], text=TWO), BadField("sampling_params"), id="params-item"),
    # input_ids as a list of lists is a batch too
    pytest.param(
        gen([True, False], [K5, {}], input_ids=[[1, 2], [3]]), None, id="input_ids-batch-bounded"
    ),
    pytest.param(
        gen([False, True], [K5, {}], input_ids=[[1, 2], [3]]), MASK, id="input_ids-batch-unbounded"
    ),
    pytest.param(gen(True, input_ids=[[1], [2]]), MASK, id="input_ids-batch-scalar"),
]


@pytest.mark.parametrize(("body", "expected"), BATCHES)
def test_generate_batch(body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(Kind.GENERATE, body), expected)


N2: dict[str, Any] = {"top_k": 5, "n": 2}

PARALLEL_SAMPLING = [
    # n > 1 forbids a list-valued mask, whatever its values
    pytest.param(gen([True, True], [N2, N2], text=TWO), PARALLEL, id="batch-list-mask"),
    pytest.param(gen([True, False], N2, text=TWO), PARALLEL, id="batch-list-mask-shared-params"),
    pytest.param(gen([False, False], [N2, N2], text=TWO), PARALLEL, id="batch-list-all-false"),
    pytest.param(gen([True], N2), PARALLEL, id="single-list-mask"),
    pytest.param(gen([False], N2), PARALLEL, id="single-[false]"),
    pytest.param(gen([], N2), PARALLEL, id="single-empty-list"),
    pytest.param(gen([], N2, text=TWO), PARALLEL, id="batch-empty-list"),
    # a scalar mask is fine with n > 1
    pytest.param(gen(True, N2), None, id="single-scalar"),
    pytest.param(gen(True, N2, text=TWO), None, id="batch-scalar"),
    pytest.param(gen(True, {"n": 2}), MASK, id="scalar-unbounded"),
    # n == 1 is not parallel sampling
    pytest.param(gen([True], {"top_k": 5, "n": 1}), None, id="n-1-list-mask"),
]


@pytest.mark.parametrize(("body", "expected"), PARALLEL_SAMPLING)
def test_generate_parallel_sampling(body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(Kind.GENERATE, body), expected)


# --- /vertex_generate ----------------------------------------------------------------------------

INSTANCES = [{"text": "a"}, {"text": "b"}]


def vertex(parameters: Any = _ABSENT, instances: Any = INSTANCES) -> dict[str, Any]:
    body: dict[str, Any] = {} if instances is _ABSENT else {"instances": instances}
    if parameters is not _ABSENT:
        body["parameters"] = parameters
    return body


VERTEX = [
    pytest.param(
        vertex({"return_sampling_mask": True, "sampling_params": K5}), None, id="mask-finite"
    ),
    pytest.param(
        vertex({"return_sampling_mask": True, "sampling_params": {"top_p": 0.9}}),
        MASK,
        id="mask-unbounded",
    ),
    pytest.param(vertex({"return_sampling_mask": "yes"}), MASK, id="mask-yes-no-params"),
    pytest.param(vertex({"return_sampling_mask": False}), None, id="mask-off"),
    pytest.param(vertex({"sampling_params": {"top_k": 0}}), bad_top_k(0), id="top_k-0"),
    pytest.param(
        vertex({"return_sampling_mask": [True, False], "sampling_params": [K5, {}]}),
        None,
        id="list-mask-bounded",
    ),
    pytest.param(
        vertex({"return_sampling_mask": [False, True], "sampling_params": [K5, {}]}),
        MASK,
        id="list-mask-unbounded",
    ),
    pytest.param(
        vertex({"return_sampling_mask": True, "top_k": 5}), MASK, id="parameters-top-level-top_k"
    ),
    pytest.param(vertex(), None, id="parameters-absent"),
    pytest.param(vertex(None), None, id="parameters-null"),
    pytest.param(vertex([True]), BadField("parameters"), id="parameters-list"),
    pytest.param(vertex(instances="a"), BadField("instances"), id="instances-str"),
    pytest.param(vertex(instances={"text": "a"}), BadField("instances"), id="instances-object"),
    pytest.param(vertex(instances=_ABSENT), BadField("instances"), id="instances-absent"),
    pytest.param(
        vertex({"return_sampling_mask": True}, instances="a"),
        BadField("instances"),
        id="instances-str-mask-on",
    ),
]


@pytest.mark.parametrize(("body", "expected"), VERTEX)
def test_vertex(body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(Kind.VERTEX, body), expected)


# --- /v1/chat/completions ------------------------------------------------------------------------

SGLANG_CHAT_REGRESSION_BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "Say hi."}],
    "top_k": 10,
    "top_p": 0.99,
    "return_sampling_mask": True,
    "return_meta_info": True,
    "return_token_ids": True,
}

CHAT = [
    # rule 4: unbounded top_k (omitted counts as unbounded: fail closed)
    pytest.param(chat_mask(), MASK, id="no-top_k"),
    pytest.param(chat_mask(top_p=0.9), MASK, id="top_p-only"),
    pytest.param(chat_mask(top_k=None), MASK, id="top_k-null"),
    pytest.param(chat_mask(top_k=-1), MASK, id="top_k-minus-1"),
    pytest.param(chat_mask(top_k=TOP_K_ALL), MASK, id="top_k-TOP_K_ALL"),
    pytest.param(chat_mask(top_k=2**40), MASK, id="top_k-2**40"),
    pytest.param(chat(return_sampling_mask="yes", return_meta_info=1), MASK, id="lax-flags"),
    # a finite top_k with return_meta_info is forwarded
    pytest.param(chat_mask(top_k=10), None, id="top_k-10"),
    pytest.param(chat_mask(top_k=1), None, id="top_k-1"),
    pytest.param(chat_mask(top_k=TOP_K_ALL - 1), None, id="top_k-TOP_K_ALL-1"),
    pytest.param(chat_mask(top_k="5"), None, id="top_k-str-5-lax-int"),
    pytest.param(chat_mask(top_k=5.0), None, id="top_k-5.0"),
    pytest.param(chat_mask(top_k=True), None, id="top_k-true"),
    pytest.param(chat_mask(top_k=10, stream=False), None, id="stream-false"),
    pytest.param(
        chat(return_sampling_mask="On", return_meta_info="yes", top_k=10), None, id="lax-on"
    ),
    pytest.param(SGLANG_CHAT_REGRESSION_BODY, None, id="sglang-regression-body"),
    # rule 5: SGLang's own chat refusals
    pytest.param(chat(return_sampling_mask=True, top_k=10), META, id="no-return_meta_info"),
    pytest.param(
        chat(return_sampling_mask=True, return_meta_info=False, top_k=10), META, id="meta-false"
    ),
    pytest.param(
        chat(return_sampling_mask=True, return_meta_info="no", top_k=10), META, id="meta-no"
    ),
    pytest.param(chat_mask(top_k=10, stream=True), STREAM, id="stream"),
    pytest.param(chat_mask(top_k=10, stream="true"), STREAM, id="stream-str-true"),
    pytest.param(chat_mask(top_k=0), bad_top_k(0), id="top_k-0"),
    pytest.param(chat_mask(top_k=-2), bad_top_k(-2), id="top_k-minus-2"),
    pytest.param(chat(top_k=0), bad_top_k(0), id="top_k-0-mask-off"),
    pytest.param(chat_mask(top_k=5.5), BadField("top_k"), id="top_k-5.5"),
    pytest.param(chat_mask(top_k="abc"), BadField("top_k"), id="top_k-str-abc"),
    pytest.param(chat_mask(top_k=[5]), BadField("top_k"), id="top_k-list"),
    pytest.param(
        chat(return_sampling_mask="maybe", top_k=10),
        BadField("return_sampling_mask"),
        id="mask-maybe",
    ),
    pytest.param(
        chat(return_sampling_mask=[True], top_k=10),
        BadField("return_sampling_mask"),
        id="mask-list",
    ),
    pytest.param(
        chat(return_sampling_mask=True, return_meta_info="maybe", top_k=10),
        BadField("return_meta_info"),
        id="meta-maybe",
    ),
    # mask on, unbounded and no return_meta_info: refused either way
    pytest.param(chat(return_sampling_mask=True), REFUSED, id="no-top_k-no-meta"),
    # only top-level fields count on chat
    pytest.param(chat_mask(sampling_params={"top_k": 5}), MASK, id="literal-sampling_params"),
    pytest.param(chat_mask(extra_body={"top_k": 5}), MASK, id="literal-extra_body"),
    # rule 3: greedy chat has top_k = 1
    pytest.param(chat_mask(temperature=0), None, id="greedy-0"),
    pytest.param(chat_mask(temperature=0.0, top_p=0.5), None, id="greedy-0.0"),
    pytest.param(chat_mask(temperature=5e-7), None, id="greedy-5e-7"),
    pytest.param(chat_mask(temperature=1e-6), MASK, id="temperature-1e-6"),
    pytest.param(chat_mask(temperature=1.0), MASK, id="temperature-1"),
    # pydantic reads a numeric string as its float: "0" is greedy in SGLang, so top_k = 1.
    pytest.param(chat_mask(temperature="0"), None, id="temperature-str-0"),
    pytest.param(chat_mask(temperature=" 0.0 "), None, id="temperature-str-0.0-spaces"),
    pytest.param(chat_mask(temperature="0.5"), MASK, id="temperature-str-0.5"),
    pytest.param(chat_mask(temperature="hot"), MASK, id="temperature-str-word"),
    pytest.param(chat_mask(temperature=False), None, id="temperature-false-is-0.0"),
    # pydantic's lax integers: whitespace, underscores and a zero fraction.
    pytest.param(chat_mask(top_k=" 5"), None, id="top_k-str-leading-space"),
    pytest.param(chat_mask(top_k="5 \n"), None, id="top_k-str-trailing-space"),
    pytest.param(chat_mask(top_k="1_000"), None, id="top_k-str-underscore"),
    pytest.param(chat_mask(top_k="-1.0"), MASK, id="top_k-str-minus-1.0"),
    pytest.param(chat(return_sampling_mask=True, temperature=0), META, id="greedy-no-meta"),
    # SGLang's serving layer asks for return_meta_info before the scheduler sees top_k.
    pytest.param(chat(return_sampling_mask=True), META, id="unbounded-no-meta-names-meta"),
    pytest.param(
        chat(return_sampling_mask=True, stream=True, return_meta_info=True),
        STREAM,
        id="unbounded-stream-names-stream",
    ),
    pytest.param(chat_mask(temperature=0, stream=True), STREAM, id="greedy-stream"),
    # rule 6: no mask, no rule
    pytest.param(chat(), None, id="plain"),
    pytest.param(chat(return_sampling_mask=False, stream=True), None, id="mask-off-stream"),
    pytest.param(chat(return_sampling_mask="off", top_p=0.9), None, id="mask-off-str"),
    pytest.param(chat(return_sampling_mask=None), None, id="mask-null"),
    pytest.param(chat(return_sampling_mask=0, top_k=-1), None, id="mask-0-top_k-minus-1"),
]


@pytest.mark.parametrize(("body", "expected"), CHAT)
def test_chat(body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(Kind.CHAT, body), expected)


# --- /v1/completions and /v1/responses: core rule, fail closed, no return_meta_info -------------

OPENAI_CORE = [
    pytest.param(chat(return_sampling_mask=True), MASK, id="mask-no-top_k"),
    pytest.param(chat(return_sampling_mask="yes", top_p=0.9), MASK, id="mask-yes-top_p-only"),
    pytest.param(chat(return_sampling_mask=True, top_k=-1), MASK, id="mask-top_k-minus-1"),
    pytest.param(chat(return_sampling_mask=True, top_k=None), MASK, id="mask-top_k-null"),
    pytest.param(chat(return_sampling_mask=True, top_k=TOP_K_ALL), MASK, id="mask-TOP_K_ALL"),
    pytest.param(chat(return_sampling_mask=True, top_k=5), None, id="mask-top_k-5"),
    pytest.param(chat(return_sampling_mask=True, top_k="5"), None, id="mask-top_k-str-5"),
    pytest.param(
        chat(return_sampling_mask=True, top_k=5, stream=True), None, id="mask-top_k-5-stream"
    ),
    pytest.param(chat(return_sampling_mask=True, temperature=0), None, id="mask-greedy"),
    pytest.param(chat(return_sampling_mask=True, top_k=0), bad_top_k(0), id="top_k-0"),
    pytest.param(chat(return_sampling_mask=True, top_k=5.5), BadField("top_k"), id="top_k-5.5"),
    pytest.param(chat(return_sampling_mask=False), None, id="mask-off"),
    pytest.param(chat(), None, id="plain"),
]


@pytest.mark.parametrize(
    "kind", [Kind.COMPLETIONS, Kind.RESPONSES], ids=["completions", "responses"]
)
@pytest.mark.parametrize(("body", "expected"), OPENAI_CORE)
def test_completions_and_responses(kind: Kind, body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(kind, body), expected)


def test_passthrough_kind_is_not_inspected() -> None:
    assert_outcome(both(Kind.PASSTHROUGH, gen(True)), None)


# --- an operator-configured default top_k (rule 3) -----------------------------------------------

DEFAULT_20 = BodyRules(mask=SamplingMaskRule(default_top_k=20))

DEFAULT_TOP_K = [
    pytest.param(Kind.CHAT, chat_mask(), None, id="chat-omitted"),
    pytest.param(Kind.CHAT, chat_mask(top_k=None), None, id="chat-null-falls-back"),
    pytest.param(Kind.CHAT, chat_mask(top_k=-1), MASK, id="chat-minus-1-explicit"),
    pytest.param(Kind.CHAT, chat_mask(top_k=0), bad_top_k(0), id="chat-0"),
    pytest.param(Kind.CHAT, chat(return_sampling_mask=True), META, id="chat-no-meta"),
    pytest.param(Kind.GENERATE, gen(True, {"top_p": 0.9}), None, id="generate-omitted"),
    pytest.param(Kind.GENERATE, gen(True), None, id="generate-no-params"),
    pytest.param(Kind.GENERATE, gen(True, {"top_k": None}), MASK, id="generate-null-explicit"),
    pytest.param(Kind.GENERATE, gen(True, {"top_k": -1}), MASK, id="generate-minus-1"),
    pytest.param(Kind.GENERATE, gen(True, [{}, {}], text=TWO), None, id="generate-batch"),
    pytest.param(Kind.VERTEX, vertex({"return_sampling_mask": True}), None, id="vertex-omitted"),
    pytest.param(Kind.COMPLETIONS, chat(return_sampling_mask=True), None, id="completions"),
]


@pytest.mark.parametrize(("kind", "body", "expected"), DEFAULT_TOP_K)
def test_default_top_k(kind: Kind, body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(kind, body, DEFAULT_20), expected)


# --- inspect_body: rule 1 (never forward a body that could not be read) --------------------------

DEEP = b'{"a":' * 1025 + b"1" + b"}" * 1025
DEEPEST_OK = b'{"a":' * 1024 + b"1" + b"}" * 1024

UNREADABLE = [
    pytest.param(b'{"text": "a", "return_sampling_mask": true', "invalid_json", id="truncated"),
    pytest.param(b"{'text': 'a'}", "invalid_json", id="single-quotes"),
    pytest.param(b'\xef\xbb\xbf{"text": "a"}', "invalid_json", id="utf8-bom"),
    pytest.param(b'{"text": "a", "sampling_params": {"top_k": NaN}}', "invalid_json", id="NaN"),
    pytest.param(b'{"text": "a", "x": Infinity}', "invalid_json", id="Infinity"),
    pytest.param(b'{"text": "a", "x": -Infinity}', "invalid_json", id="minus-Infinity"),
    pytest.param(b'{"text": "a", "sampling_params": {"top_k": 1e400}}', "invalid_json", id="1e400"),
    pytest.param(b'{"text": "\\ud800"}', "invalid_json", id="lone-surrogate"),
    pytest.param(b'{"\\udc00": true}', "invalid_json", id="lone-low-surrogate-key"),
    pytest.param(b'{"text": "\xff\xfe"}', "invalid_json", id="invalid-utf8"),
    pytest.param(b'{"text": "\xed\xa0\x80"}', "invalid_json", id="utf8-encoded-surrogate"),
    pytest.param(b'{"text": "a"} {"text": "b"}', "invalid_json", id="trailing-object"),
    pytest.param(b'{"text": "a"} x', "invalid_json", id="trailing-garbage"),
    pytest.param(DEEP, "invalid_json", id="nesting-1025"),
    pytest.param(b"", "invalid_json", id="empty"),
    pytest.param(b"   ", "invalid_json", id="whitespace"),
    pytest.param(b'[{"text": "a", "return_sampling_mask": true}]', "not_an_object", id="array"),
    pytest.param(b'"return_sampling_mask"', "not_an_object", id="string"),
    pytest.param(b"null", "not_an_object", id="null"),
    pytest.param(b"1", "not_an_object", id="number"),
    pytest.param(b"true", "not_an_object", id="true"),
]


@pytest.mark.parametrize(("raw", "reason"), UNREADABLE)
@pytest.mark.parametrize("kind", [Kind.GENERATE, Kind.CHAT], ids=["generate", "chat"])
def test_inspect_body_unreadable(kind: Kind, raw: bytes, reason: str) -> None:
    rejection = resolve(inspect_body(kind, raw, POLICY))
    assert rejection is not None
    assert (rejection.status, rejection.rule, rejection.reason) == (400, "request_body", reason)
    assert rejection.validation is True
    assert rejection.message


READABLE = [
    pytest.param(b'{"text": "a", "return_sampling_mask": true}', MASK, id="plain"),
    pytest.param(b'{"text": "a"}', None, id="no-mask"),
    pytest.param(b' \n{"text": "a"}\n ', None, id="surrounding-whitespace"),
    pytest.param(DEEPEST_OK, None, id="nesting-1024"),
    # escapes are decoded before the key is read: this IS return_sampling_mask
    pytest.param(b'{"\\u0072eturn_sampling_mask": true, "text": "a"}', MASK, id="escaped-key"),
    pytest.param(
        b'{"return_sampling_mask": "\\u0079es", "text": "a"}', MASK, id="escaped-value-yes"
    ),
    pytest.param(
        b'{"text": "a", "return_sampling_mask": true, "sampling_params": {"\\u0074op_k": 5}}',
        None,
        id="escaped-top_k",
    ),
    # duplicate keys: the last one wins, as in orjson and SGLang
    pytest.param(
        b'{"text": "a", "return_sampling_mask": false, "return_sampling_mask": true}',
        MASK,
        id="duplicate-mask-last-true",
    ),
    pytest.param(
        b'{"text": "a", "return_sampling_mask": true, "return_sampling_mask": false}',
        None,
        id="duplicate-mask-last-false",
    ),
    pytest.param(
        b'{"text": "a", "return_sampling_mask": true, '
        b'"sampling_params": {"top_k": 5, "top_k": -1}}',
        MASK,
        id="duplicate-top_k-last-unbounded",
    ),
    pytest.param(
        b'{"text": "a", "return_sampling_mask": true, '
        b'"sampling_params": {"top_k": -1, "top_k": 5}}',
        None,
        id="duplicate-top_k-last-finite",
    ),
    # integers beyond 64 bits become floats, still >= TOP_K_ALL
    pytest.param(
        b'{"text": "a", "return_sampling_mask": true, '
        b'"sampling_params": {"top_k": 1180591620717411303424}}',
        MASK,
        id="top_k-beyond-64-bits",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), READABLE)
def test_inspect_body_readable(raw: bytes, expected: Expected) -> None:
    assert_outcome(resolve(inspect_body(Kind.GENERATE, raw, POLICY)), expected)


# --- check_headers: rule 1 (415 for what SGLang would read differently) ---------------------------

HEADERS = [
    pytest.param(None, None, None, id="no-content-type"),
    pytest.param("application/json", None, None, id="json"),
    pytest.param("application/json; charset=utf-8", None, None, id="json-utf-8"),
    pytest.param("application/json; charset=UTF-8", None, None, id="json-UTF-8"),
    pytest.param("application/json;charset=utf-8", None, None, id="json-utf-8-no-space"),
    pytest.param('application/json; charset="utf-8"', None, None, id="json-quoted-charset"),
    pytest.param("Application/JSON", None, None, id="json-mixed-case"),
    pytest.param("application/vnd.foo+json", None, None, id="vendor-json"),
    pytest.param("application/json", "identity", None, id="identity"),
    pytest.param("application/json", "Identity", None, id="identity-mixed-case"),
    pytest.param("text/plain", None, "media_type", id="text-plain"),
    pytest.param("text/json", None, "media_type", id="text-json"),
    pytest.param("application/x-www-form-urlencoded", None, "media_type", id="form"),
    pytest.param("multipart/form-data; boundary=x", None, "media_type", id="multipart"),
    pytest.param("application/jsonp", None, "media_type", id="jsonp"),
    pytest.param("application/octet-stream", None, "media_type", id="octet-stream"),
    pytest.param("application/json; charset=latin-1", None, "charset", id="latin-1"),
    pytest.param("application/json; charset=utf-16", None, "charset", id="utf-16"),
    pytest.param("application/json", "gzip", "content_encoding", id="gzip"),
    pytest.param("application/json", "br", "content_encoding", id="br"),
    pytest.param("application/json", "deflate", "content_encoding", id="deflate"),
    pytest.param("application/json", "GZIP", "content_encoding", id="gzip-upper"),
    pytest.param("application/json", "gzip, identity", "content_encoding", id="gzip-list"),
    pytest.param(None, "gzip", "content_encoding", id="gzip-no-content-type"),
]


@pytest.mark.parametrize(("content_type", "content_encoding", "reason"), HEADERS)
def test_check_headers(
    content_type: str | None, content_encoding: str | None, reason: str | None
) -> None:
    rejection = check_headers(content_type, content_encoding)
    if reason is None:
        assert rejection is None
    else:
        assert rejection is not None
        assert (rejection.status, rejection.rule, rejection.reason) == (
            415,
            "request_body",
            reason,
        )
        assert rejection.message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # SGLang pairs only the first batch_size flags and params with the items.
        pytest.param(
            {
                "text": ["a", "b"],
                "return_sampling_mask": [True, True, True],
                "sampling_params": [{"top_k": 5}, {"top_k": 5}],
            },
            None,
            id="mask-list-longer-than-batch",
        ),
        pytest.param(
            {
                "text": ["a", "b"],
                "return_sampling_mask": True,
                "sampling_params": [{"top_k": 5}, {"top_k": 5}, {"top_p": 0.9}],
            },
            None,
            id="params-list-longer-than-batch",
        ),
        # Shorter lists: SGLang fails or broadcasts; every pairing is checked.
        pytest.param(
            {
                "text": ["a", "b", "c"],
                "return_sampling_mask": [False, True],
                "sampling_params": [{"top_k": 5}, {"top_k": 5}],
            },
            MASK,
            id="lists-shorter-than-batch",
        ),
        pytest.param(
            {
                "text": ["a", "b"],
                "return_sampling_mask": [True, True, True],
                "sampling_params": [{"top_k": 5}, {"top_p": 0.9}, {"top_k": 5}],
            },
            MASK,
            id="an-unbounded-item-within-the-batch",
        ),
    ],
)
def test_batch_lists_longer_than_the_batch(body: dict[str, Any], expected: Expected) -> None:
    assert_outcome(both(Kind.GENERATE, body), expected)
