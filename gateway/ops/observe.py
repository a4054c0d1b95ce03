"""What happened to one request, and the one access-log line it becomes.

The proxy fills an `Exchange` as it goes; at the end it is handed to the observers
(access log, metrics). The record holds no prompt text and no header values other than
the request id, so nothing secret can reach a log from here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import orjson

from gateway.contract.replies import Outcome

access_log = logging.getLogger("gateway.access")


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
    first_byte: float | None = None  # perf_counter when upstream headers arrived
    finished: float | None = None

    @property
    def outcome_label(self) -> str:
        """`rejected:<rule>` for a refusal, else the outcome's name."""
        if self.outcome is Outcome.REJECTED:
            return f"rejected:{self.rejected_by}"
        return self.outcome.value


class Observer(Protocol):
    def finish(self, ex: Exchange) -> None: ...


class AccessLog:
    """One line per request, JSON for machines or plain text for a terminal."""

    def __init__(self, fmt: str = "json") -> None:
        self._json = fmt == "json"

    def finish(self, ex: Exchange) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        end = ex.finished or time.perf_counter()
        total_ms = round((end - ex.started) * 1000, 3)
        ttfb_ms = None if ex.first_byte is None else round((ex.first_byte - ex.started) * 1000, 3)
        ts = _timestamp(time.time())
        if self._json:
            record = {
                "ts": ts,
                "request_id": ex.request_id,
                "method": ex.method,
                "route": ex.route,
                "status": ex.status,
                "outcome": ex.outcome_label,
                "reason": ex.reason or None,
                "backend": ex.backend or None,
                "attempts": ex.attempts,
                "bytes_in": ex.bytes_in,
                "bytes_out": ex.bytes_out,
                "ttfb_ms": ttfb_ms,
                "duration_ms": total_ms,
            }
            if ex.log_only:
                record["log_only"] = ex.log_only
            if ex.profile:
                record["profile"] = ex.profile
            if ex.detail:
                record["detail"] = ex.detail
            access_log.info(orjson.dumps(record).decode())
        else:
            access_log.info(
                "%s %s %s %s %d %s reason=%s backend=%s attempts=%d in=%d out=%d "
                "ttfb_ms=%s ms=%.1f%s",
                ts,
                ex.request_id,
                ex.method,
                ex.route,
                ex.status,
                ex.outcome_label,
                ex.reason or "-",
                ex.backend or "-",
                ex.attempts,
                ex.bytes_in,
                ex.bytes_out,
                "-" if ttfb_ms is None else f"{ttfb_ms:.1f}",
                total_ms,
                f" detail={ex.detail}" if ex.detail else "",
            )


def _timestamp(epoch: float) -> str:
    """RFC 3339 in UTC with milliseconds, e.g. 2026-11-30T08:15:02.127Z."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"
