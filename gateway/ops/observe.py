"""What happened to one request, and the one access-log line it becomes.

The proxy fills an `Exchange` as it goes; at the end it is handed to the observers
(access log, metrics). The record holds no prompt text and, of the request's headers, only
the request id, the User-Agent (cut to USER_AGENT_MAX) and the trace context, so nothing
secret can reach a log from here: no credential, cookie or query string.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Final, Protocol

import orjson

from gateway.contract.replies import Outcome
from gateway.ops.logs import AccessWriter, timestamp

access_log = logging.getLogger("gateway.access")

# Long enough for every real client's product tokens; a longer one is cut, not refused.
USER_AGENT_MAX: Final = 256


@dataclass(slots=True)
class Exchange:
    request_id: str
    method: str
    route: str  # canonical route path, or "unmatched": bounded, safe as a metric label
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    outcome: Outcome = Outcome.OK
    rejected_by: str = ""  # the rule that refused it, when the outcome is REJECTED
    reason: str = ""  # the rejecting rule's reason label, when rejected
    log_only: str = ""  # a policy in log_only mode that would have rejected (then: reason)
    profile: str = ""  # the backend profile whose admission refused (mask refusals)
    detail: str = ""  # internal detail for the log only, never sent to the client
    backend: str = ""
    attempts: int = 0
    connect_failed: tuple[str, ...] = ()  # backends that refused a connection, in order
    bytes_in: int = 0
    bytes_out: int = 0
    streamed: bool = False  # the reply went out as a stream (no Content-Length)
    # The client side, filled only when the access log is on (AccessLog.wants_details).
    client: str = ""  # peer address
    # The request target's path as sent, for a known route only; never the query string:
    # either may hold a key pasted in the wrong place.
    path: str = ""
    http_version: str = ""
    user_agent: str = ""  # truncated to USER_AGENT_MAX characters
    # W3C trace context, as sent (with tracing on: the gateway's server span, in the client's
    # trace where it sent a valid one); only its trace id is logged.
    traceparent: str = ""
    first_byte: float | None = None  # perf_counter when upstream headers arrived
    finished: float | None = None

    @property
    def outcome_label(self) -> str:
        """`rejected:<rule>` for a refusal, else the outcome's name."""
        if self.outcome is Outcome.REJECTED:
            return f"rejected:{self.rejected_by}"
        # _value_, not .value: the property is Python code, run twice per request.
        return self.outcome._value_


class Observer(Protocol):
    def finish(self, ex: Exchange) -> None: ...


class AccessLog:
    """One line per request, JSON for machines or plain text for a terminal.

    The line is built from the exchange's fields directly (no logging record, no generic
    formatter) and handed to the process's batched writer; without one (a gateway run
    inside another program, tests) it goes through the `gateway.access` logger instead.
    """

    # Read by the proxy: fill the exchange's client-side fields, which only this uses.
    wants_details = True

    def __init__(self, fmt: str = "json", writer: AccessWriter | None = None) -> None:
        self._json = fmt == "json"
        self._writer = writer

    def finish(self, ex: Exchange) -> None:
        writer = self._writer
        if writer is None and not access_log.isEnabledFor(logging.INFO):
            return
        line = self.json_line(ex) if self._json else self.text_line(ex).encode()
        if writer is not None:
            writer.write(line)
        else:
            access_log.info(line.decode())

    @staticmethod
    def json_line(ex: Exchange) -> bytes:
        end = ex.finished or time.perf_counter()
        record: dict[str, object] = {
            "ts": timestamp(),
            "level": "info",
            "logger": "gateway.access",
            "request_id": ex.request_id,
            "client": ex.client or None,
            "method": ex.method,
            "path": ex.path or None,
            "http": ex.http_version or None,
            "route": ex.route,
            "status": ex.status,
            "outcome": ex.outcome_label,
            "reason": ex.reason or None,
            "backend": ex.backend or None,
            "attempts": ex.attempts,
            "bytes_in": ex.bytes_in,
            "bytes_out": ex.bytes_out,
            "streamed": ex.streamed,
            "ttfb_ms": None if ex.first_byte is None else _ms(ex.first_byte - ex.started),
            "duration_ms": _ms(end - ex.started),
            "user_agent": ex.user_agent or None,
        }
        trace = trace_id(ex.traceparent)
        if trace:
            record["trace_id"] = trace
        if ex.log_only:
            record["log_only"] = ex.log_only
        if ex.profile:
            record["profile"] = ex.profile
        if ex.detail:
            record["detail"] = ex.detail
        return orjson.dumps(record)

    @staticmethod
    def text_line(ex: Exchange) -> str:
        end = ex.finished or time.perf_counter()
        ttfb = "-" if ex.first_byte is None else f"{(ex.first_byte - ex.started) * 1000:.1f}"
        trace = trace_id(ex.traceparent)
        return (
            f"{timestamp()} {ex.request_id} {ex.client or '-'} "
            f'"{ex.method} {ex.path or "-"} HTTP/{ex.http_version or "-"}" {ex.status} '
            f"{ex.outcome_label} route={ex.route} reason={ex.reason or '-'} "
            f"backend={ex.backend or '-'} "
            f"attempts={ex.attempts} in={ex.bytes_in} out={ex.bytes_out} "
            f"streamed={'yes' if ex.streamed else 'no'} ttfb_ms={ttfb} "
            f"ms={(end - ex.started) * 1000:.1f}"
            + (f" trace={trace}" if trace else "")
            + (f" detail={orjson.dumps(ex.detail).decode()}" if ex.detail else "")
            + (f" ua={orjson.dumps(ex.user_agent).decode()}" if ex.user_agent else "")
        )


# W3C trace context: version-traceid-parentid-flags, lower-case hex; an all-zero id is
# invalid. Only the trace id is logged: it is what joins this line to the trace.
# Version ff is forbidden by the spec.
_TRACEPARENT: Final = re.compile(r"(?!ff)[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_ZERO_TRACE: Final = "0" * 32


def trace_id(traceparent: str) -> str:
    if not traceparent:
        return ""
    m = _TRACEPARENT.match(traceparent.strip())
    if m is None or m.group(1) == _ZERO_TRACE:
        return ""
    return m.group(1)


def _ms(seconds: float) -> float:
    """Seconds as milliseconds with three decimals: round(x, 3) on the access log's two
    durations showed in a profile of a small request; integer rounding gives the same
    figure for the non-negative durations logged here, but for half-microsecond ties."""
    return int(seconds * 1_000_000 + 0.5) / 1000
