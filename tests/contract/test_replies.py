"""Truth tables: the body of a gateway-made reply, per route shape and status."""

from __future__ import annotations

import orjson
import pytest

from gateway.contract.policy import Rejection
from gateway.contract.replies import render, render_rejection
from gateway.contract.routes import ErrorShape

# -- error rendering ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "status", "expected"),
    [
        (ErrorShape.GENERATE, 400, {"error": {"message": "m"}}),
        (ErrorShape.GENERATE, 503, {"error": {"message": "m"}}),
        (ErrorShape.OPENAI, 400, {"object": "error", "message": "m", "type": "BadRequestError",
                              "param": None, "code": 400}),
        (ErrorShape.OPENAI, 413, {"object": "error", "message": "m",
                              "type": "RequestEntityTooLarge", "param": None, "code": 413}),
        (ErrorShape.OPENAI, 418, {"object": "error", "message": "m", "type": "Error", "param": None,
                              "code": 418}),
        (ErrorShape.PLAIN, 404, {"detail": "m"}),
        (ErrorShape.PLAIN, 500, {"detail": "m"}),
    ],
)  # fmt: skip
def test_render(shape: ErrorShape, status: int, expected: dict) -> None:
    assert orjson.loads(render(shape, status, "m")) == expected


@pytest.mark.parametrize("shape", list(ErrorShape))
def test_validation_rejections_use_the_openai_shape_on_every_route(shape: ErrorShape) -> None:
    rule = Rejection(400, "sampling_mask", "unbounded_top_k", "rule says no")
    invalid = Rejection(400, "request_body", "invalid_json", "bad json", validation=True)
    assert orjson.loads(render_rejection(shape, rule)) == orjson.loads(
        render(shape, 400, "rule says no")
    )
    body = orjson.loads(render_rejection(shape, invalid))
    assert body == {
        "object": "error",
        "message": "bad json",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
