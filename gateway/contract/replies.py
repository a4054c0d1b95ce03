"""Bodies of the replies the gateway makes itself, in the error shape SGLang gives each route.

Clients of SGLang parse its error bodies (the openai SDK reads `message` from the OpenAI
shape; RL workers read `error.message` from /generate), so a reply from the gateway must
look exactly like one from SGLang (docs/sglang-contract.md section 6). Messages never name a
backend address or carry exception text from inside the gateway.
"""

from __future__ import annotations

import enum
from typing import Final

import orjson

from gateway.contract.policy import Rejection
from gateway.contract.routes import ErrorShape

# OpenAI-shape `type` values SGLang uses.
BAD_REQUEST_ERROR: Final = "BadRequestError"  # a rule in SGLang's serving code refused it
BAD_REQUEST: Final = "Bad Request"  # JSON or model validation refused it

_OPENAI_TYPES: Final = {
    400: BAD_REQUEST_ERROR,
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


def render(shape: ErrorShape, status: int, message: str, error_type: str | None = None) -> bytes:
    """The JSON body of a gateway-made reply."""
    if shape is ErrorShape.GENERATE:
        return orjson.dumps({"error": {"message": message}})
    if shape is ErrorShape.OPENAI:
        return orjson.dumps(
            {
                "object": "error",
                "message": message,
                "type": error_type or _OPENAI_TYPES.get(status, "Error"),
                "param": None,
                "code": status,
            }
        )
    return orjson.dumps({"detail": message})


def render_rejection(shape: ErrorShape, rejection: Rejection) -> bytes:
    if rejection.validation:
        # SGLang's validation handler answers in the OpenAI shape on every route.
        return render(ErrorShape.OPENAI, rejection.status, rejection.message, BAD_REQUEST)
    return render(shape, rejection.status, rejection.message)


NOT_FOUND: Final = orjson.dumps({"detail": "Not Found"})
METHOD_NOT_ALLOWED: Final = orjson.dumps({"detail": "Method Not Allowed"})


class Outcome(enum.StrEnum):
    """What became of a request: the access log's `outcome` and the metrics' label.

    A refusal is REJECTED together with the rule that refused it (Exchange.rejected_by),
    written `rejected:<rule>`; every other value is written as it is.
    """

    # Enum's own __hash__ is Python code (the hash of the name); a member equals its value
    # as a str does, so str's hash is the one that agrees with ==, and it is C's.
    __hash__ = str.__hash__

    OK = "ok"
    REJECTED = "rejected"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NO_BACKEND = "no_backend"
    NO_CAPACITY = "no_capacity"
    PAUSED = "paused"  # only paused or asleep engines could serve it, and it was not held on
    GATEWAY_OVERLOADED = "gateway_overloaded"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_BROKEN = "upstream_broken"
    CLIENT_DISCONNECT = "client_disconnect"
    CONTROL_FAILED = "control_failed"  # a fanned-out control call failed on some backend
    GATEWAY_ERROR = "gateway_error"
