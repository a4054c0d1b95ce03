"""Bypasses of the sampling-mask rule found by differential testing, pinned as plain truth tables.

Each row is a body that SGLang 0.5.19 (per tests/sglang_model.py, ported from its source) runs
with the mask on and an unbounded top_k; the gateway must refuse every one. The model's verdict
is asserted too, so a row cannot silently stop being a bypass candidate.
"""

from __future__ import annotations

import pytest

from gateway.contract.inspection import inspect_body
from gateway.contract.policy import BodyRules, resolve
from gateway.contract.routes import Kind
from tests import sglang_model as sglang

POLICY = BodyRules()
ROUTE = {Kind.GENERATE: "/generate", Kind.VERTEX: "/vertex_generate"}

# SGLang decides single vs batch from the first of text, input_ids, input_embeds that is not
# null and ignores the others for it: a batch-shaped input_ids/input_embeds next to a string
# text (or flat input_ids) is a single request, where a list mask such as [false] is truthy.
SHAPE_PRECEDENCE = [
    b'{"text": "hi", "input_embeds": [[[0.1]], [[0.2]]], "return_sampling_mask": [false]}',
    b'{"input_ids": [1, 2], "input_embeds": [[[0.1]], [[0.2]]], "return_sampling_mask": [false]}',
    b'{"text": "hi", "input_embeds": [[[0.1]], [[0.2]]], "return_sampling_mask": [false, false],'
    b' "sampling_params": {"top_p": 0.5}}',
]


@pytest.mark.parametrize("body", SHAPE_PRECEDENCE)
def test_batch_shape_follows_sglang_precedence(body: bytes) -> None:
    assert sglang.read("POST", "/generate", body).runs_unbounded_mask
    rejection = resolve(inspect_body(Kind.GENERATE, body, POLICY))
    assert rejection is not None
    assert rejection.status == 400


def test_batch_shape_precedence_keeps_real_batches() -> None:
    body = (
        b'{"text": ["a", "b"], "input_embeds": [[0.1]], "return_sampling_mask": [true, false],'
        b' "sampling_params": [{"top_k": 5}, {}]}'
    )
    assert sglang.read("POST", "/generate", body).accepted
    assert resolve(inspect_body(Kind.GENERATE, body, POLICY)) is None


# /vertex_generate builds GenerateReqInput(**parameters) directly, without pydantic, so the
# mask is read with Python truthiness ("false" and ["off"] are ON) and the batch shape comes
# from the raw lists (a parameters text, or one instance's flat embedding, is a single request).
VERTEX_RAW = [
    b'{"instances": [{"text": "a"}], "parameters": {"return_sampling_mask": "false"}}',
    b'{"instances": [{"text": "a"}], "parameters": {"return_sampling_mask": "no"}}',
    b'{"instances": [{"text": "a"}], "parameters": {"return_sampling_mask": "0"}}',
    b'{"instances": [{"text": "a"}], "parameters": {"return_sampling_mask": ["off"]}}',
    b'{"instances": [{"text": "a"}, {"text": "b"}],'
    b' "parameters": {"return_sampling_mask": [false, "n"]}}',
    b'{"instances": [{}], "parameters": {"text": "a", "return_sampling_mask": [false]}}',
    b'{"instances": [{"input_embeds": [0.1, 0.2]}], "parameters": {"return_sampling_mask": [0]}}',
]


@pytest.mark.parametrize("body", VERTEX_RAW)
def test_vertex_parameters_read_as_sglang_reads_them(body: bytes) -> None:
    assert sglang.read("POST", "/vertex_generate", body).runs_unbounded_mask
    rejection = resolve(inspect_body(Kind.VERTEX, body, POLICY))
    assert rejection is not None
    assert rejection.status == 400


@pytest.mark.parametrize(
    "body",
    [
        # Not a pydantic boolean, but SGLang never validates it here: greedy, so it runs.
        b'{"instances": [{"text": "a"}],'
        b' "parameters": {"return_sampling_mask": 2, "sampling_params": {"temperature": 0}}}',
        b'{"instances": [{"text": "a"}, {"text": "b"}],'
        b' "parameters": {"return_sampling_mask": [true, ""], "sampling_params": {"top_k": 8}}}',
        b'{"instances": [{"text": "a"}], "parameters": {"return_sampling_mask": ""}}',
    ],
)
def test_vertex_accepted_bodies_still_forwarded(body: bytes) -> None:
    assert sglang.read("POST", "/vertex_generate", body).accepted
    assert resolve(inspect_body(Kind.VERTEX, body, POLICY)) is None


# SamplingParams.__post_init__ returns early when `is_normalized` is truthy (it is a keyword
# argument like any other): greedy forcing (top_k = 1) and -1 -> TOP_K_ALL are skipped, so a
# greedy temperature no longer makes top_k finite.
IS_NORMALIZED = [
    (
        Kind.GENERATE,
        b'{"text": "hi", "sampling_params": {"temperature": 0, "is_normalized": true},'
        b' "return_sampling_mask": true}',
    ),
    (
        Kind.GENERATE,
        b'{"text": ["a", "b"], "sampling_params": [{"top_k": 3}, {"temperature": 0.0,'
        b' "is_normalized": 1}], "return_sampling_mask": true}',
    ),
    (
        Kind.VERTEX,
        b'{"instances": [{"text": "a"}], "parameters": {"return_sampling_mask": true,'
        b' "sampling_params": {"temperature": 0, "is_normalized": "yes"}}}',
    ),
]


@pytest.mark.parametrize(("kind", "body"), IS_NORMALIZED)
def test_is_normalized_disables_greedy_forcing(kind: Kind, body: bytes) -> None:
    assert sglang.read("POST", ROUTE[kind], body).runs_unbounded_mask
    rejection = resolve(inspect_body(kind, body, POLICY))
    assert rejection is not None
    assert rejection.status == 400


def test_is_normalized_with_a_finite_top_k_is_forwarded() -> None:
    body = (
        b'{"text": "hi", "sampling_params": {"temperature": 0, "is_normalized": true,'
        b' "top_k": 4}, "return_sampling_mask": true}'
    )
    assert sglang.read("POST", "/generate", body).accepted
    assert resolve(inspect_body(Kind.GENERATE, body, POLICY)) is None
