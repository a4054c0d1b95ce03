"""Bypasses of the sampling-mask rule found by differential testing, pinned as plain truth tables.

Each row is a body that SGLang 0.5.19 (per tests/sglang_model.py, ported from its source) runs
with the mask on and an unbounded top_k; the gateway must refuse every one. The model's verdict
is asserted too, so a row cannot silently stop being a bypass candidate.
"""

from __future__ import annotations

import pytest

from gateway.inspection import inspect_body
from gateway.policy import MaskPolicy
from gateway.routes import Kind
from tests import sglang_model as sglang

POLICY = MaskPolicy()
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
    rejection = inspect_body(Kind.GENERATE, body, POLICY)
    assert rejection is not None
    assert rejection.status == 400


def test_batch_shape_precedence_keeps_real_batches() -> None:
    body = (
        b'{"text": ["a", "b"], "input_embeds": [[0.1]], "return_sampling_mask": [true, false],'
        b' "sampling_params": [{"top_k": 5}, {}]}'
    )
    assert sglang.read("POST", "/generate", body).accepted
    assert inspect_body(Kind.GENERATE, body, POLICY) is None
