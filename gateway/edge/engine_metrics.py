"""Every engine's Prometheus text as one exposition, each series labelled with its engine.

`GET /engine_metrics` is SMG's route (sgl-model-gateway's WorkerManager::get_engine_metrics
and metrics_aggregator.rs): the router reads `/metrics` of every worker and merges the
families, adding `worker_addr="<url>"` to each sample and writing metric names with `_` for
`:` (`sglang:num_running_reqs` is `sglang_num_running_reqs` there); Miles' dashboard and
slime's Prometheus set-up read it so. `GET /metrics` on the main port gets the same merge
with SGLang's own names, so a scrape set up against one SGLang server sees the whole fleet
instead of one engine picked at random per scrape. Both add `worker_id` (the id of
`GET /workers`) beside `worker_addr`.

Bounded: each engine has `engine_metrics.timeout_s` to answer and may send at most
`engine_metrics.max_bytes_per_engine`; all engines together at most
`engine_metrics.max_total_bytes`. An engine that fails (no connection, no answer in time,
a non-2xx status, too much text) is left out with a comment line saying why and
`sglang_gateway_engine_metrics_scraped{...} 0`; the answer fails only when every engine
did. Concurrent requests share one scrape, so a burst of scrapers costs the engines one
read each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from gateway.edge.failures import ConnectFailed, UpstreamFailure, UpstreamTimeout
from gateway.edge.upstream import Upstream
from gateway.fleet.pool import worker_id

ADDR_LABEL: Final = "worker_addr"  # SMG's label, which Miles' scraper reads
ID_LABEL: Final = "worker_id"
SCRAPED: Final = "sglang_gateway_engine_metrics_scraped"
# Suffixes a sample's name may add to its family's (counters, histograms, summaries).
_SUFFIXES: Final = ("_total", "_bucket", "_sum", "_count", "_created", "_info", "_gsum", "_gcount")
_HELP_SCRAPED: Final = (
    f"# HELP {SCRAPED} 1 when this engine's /metrics is in this answer, 0 when it could "
    "not be read (the comment above says why).\n"
    f"# TYPE {SCRAPED} gauge\n"
)
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Results counted in sglang_gateway_engine_metrics_scrapes_total: per engine read, and
# "forbidden" per request refused before any read.
RESULTS: Final = ("ok", "unreachable", "timeout", "bad_status", "too_large", "forbidden")


@dataclass(frozen=True, slots=True)
class Limits:
    timeout_s: float
    max_bytes_per_engine: int
    max_total_bytes: int


@dataclass(frozen=True, slots=True)
class Scrape:
    """One engine's /metrics: its text, or why there is none."""

    url: str
    text: str | None
    result: str  # one of RESULTS
    why: str = ""


class _Budget:
    """Bytes all engines of one scrape may still send."""

    __slots__ = ("left",)

    def __init__(self, total: int) -> None:
        self.left = total


class _TooLarge(Exception):
    pass


async def scrape(
    upstream: Upstream,
    url: str,
    headers: list[tuple[str, str]],
    limits: Limits,
    budget: _Budget,
    *,
    connect_s: float,
) -> Scrape:
    """`url`'s /metrics within the limits, or the reason it is left out."""
    deadline = limits.timeout_s
    try:
        async with asyncio.timeout(deadline):
            resp = await upstream.request(
                url, "GET", "/metrics", headers, None, connect_s=connect_s, ttfb_s=deadline,
                total_s=deadline,
            )  # fmt: skip
            clean = False
            try:
                if not 200 <= resp.status < 300:
                    return Scrape(url, None, "bad_status", f"answered HTTP {resp.status}")
                chunks: list[bytes] = []
                size = 0
                while chunk := await resp.read():
                    size += len(chunk)
                    budget.left -= len(chunk)
                    if size > limits.max_bytes_per_engine:
                        raise _TooLarge(
                            f"more than {limits.max_bytes_per_engine} bytes "
                            "(engine_metrics.max_bytes_per_engine)"
                        )
                    if budget.left < 0:
                        raise _TooLarge(
                            f"all engines together sent more than {limits.max_total_bytes} "
                            "bytes (engine_metrics.max_total_bytes)"
                        )
                    chunks.append(chunk)
                clean = True
            finally:
                if clean:
                    resp.release()
                else:
                    resp.close()
    except _TooLarge as exc:
        return Scrape(url, None, "too_large", str(exc))
    except ConnectFailed as exc:
        return Scrape(url, None, "unreachable", f"could not connect ({exc.cause})")
    except (TimeoutError, UpstreamTimeout):
        return Scrape(url, None, "timeout", f"no whole answer within {deadline:g} s")
    except UpstreamFailure as exc:
        return Scrape(url, None, "unreachable", f"broken answer ({exc.cause})")
    return Scrape(url, b"".join(chunks).decode("utf-8", "replace"), "ok")


@dataclass(slots=True)
class _Family:
    name: str
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label_spans(line: str, start: int) -> list[tuple[int, int]] | None:
    """Where each label name of the label set opening at `line[start] == "{"` lies, or
    None when it is not a well-formed one."""
    spans: list[tuple[int, int]] = []
    i, n = start + 1, len(line)
    while i < n:
        while i < n and line[i] in " ,":
            i += 1
        if i < n and line[i] == "}":
            return spans
        eq = line.find("=", i)
        if eq < 0 or eq + 1 >= n or line[eq + 1] != '"':
            return None
        spans.append((i, eq))
        i = eq + 2
        while i < n and line[i] != '"':
            i += 2 if line[i] == "\\" else 1
        i += 1  # past the closing quote
    return None


def _ours(addr: str, wid: str) -> str:
    return f'{ADDR_LABEL}="{_quote(addr)}",{ID_LABEL}="{wid}"'


def _labelled(line: str, end: int, ours: str) -> str | None:
    """The sample line with our labels first; an engine's own label of the same name is
    kept as exported_<name>, as Prometheus keeps a target's clashing labels. None for a
    label set that cannot be read."""
    if end >= len(line) or line[end] != "{":
        return f"{line[:end]}{{{ours}}}{line[end:]}"
    if ADDR_LABEL in line or ID_LABEL in line:  # rare: read the label set to be sure
        spans = _label_spans(line, end)
        if spans is None:
            return None
        for a, b in reversed(spans):
            if line[a:b].strip() in (ADDR_LABEL, ID_LABEL):
                line = f"{line[:a]}exported_{line[a:]}"
    joiner = "" if line.startswith("}", end + 1) else ","
    return f"{line[: end + 1]}{ours}{joiner}{line[end + 1 :]}"


def _name_end(line: str) -> int:
    for i, ch in enumerate(line):
        if ch in "{ \t":
            return i
    return len(line)


def merge(scrapes: Sequence[Scrape], *, smg_names: bool) -> str:
    """One exposition of every scraped engine's families, each family once (its first
    HELP and TYPE), its samples engine by engine, each with the engine's labels; then a
    comment and a 0 for each engine left out."""
    families: dict[str, _Family] = {}

    def family(name: str) -> _Family:
        fam = families.get(name)
        if fam is None:
            fam = families[name] = _Family(name)
        return fam

    for s in scrapes:
        if s.text is None:
            continue
        ours = _ours(s.url, worker_id(s.url))
        current: _Family | None = None
        for raw in s.text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    name = parts[2].replace(":", "_") if smg_names else parts[2]
                    current = family(name)
                    rest = parts[3] if len(parts) > 3 else ""
                    if parts[1] == "HELP" and current.help is None:
                        current.help = rest
                    elif parts[1] == "TYPE" and current.type is None:
                        current.type = rest
                continue  # other comments (and an OpenMetrics # EOF) are the engine's
            end = _name_end(line)
            name = line[:end]
            if smg_names and ":" in name:
                line = name.replace(":", "_") + line[end:]
                name = line[:end]
            labelled = _labelled(line, end, ours)
            if labelled is None:
                continue  # a sample no Prometheus could read either
            owner = current
            if owner is None or not (
                name == owner.name
                or (name.startswith(owner.name) and name[len(owner.name) :] in _SUFFIXES)
            ):
                owner = family(name)
            owner.samples.append(labelled)
    out: list[str] = []
    for fam in families.values():
        if fam.help is not None:
            out.append(f"# HELP {fam.name} {fam.help}\n")
        if fam.type is not None:
            out.append(f"# TYPE {fam.name} {fam.type}\n")
        out.extend(f"{sample}\n" for sample in fam.samples)
    out.append(_HELP_SCRAPED)
    for s in scrapes:
        if s.text is None:
            out.append(f"# sglang-gateway: {s.url} ({worker_id(s.url)}) left out: {s.why}\n")
        value = 1 if s.text is not None else 0
        out.append(f"{SCRAPED}{{{_ours(s.url, worker_id(s.url))}}} {value}\n")
    return "".join(out)


class EngineMetrics:
    """Scrapes every member's /metrics for one gateway process, one scrape at a time."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._running: asyncio.Task[list[Scrape]] | None = None
        self._running_for: tuple[str, ...] = ()
        # result -> engines scraped so, for sglang_gateway_engine_metrics_scrapes_total
        self.counts: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self.last_duration_s = 0.0

    async def collect(
        self,
        urls: Sequence[str],
        headers: list[tuple[str, str]],
        limits: Limits,
        *,
        connect_s: float,
    ) -> list[Scrape]:
        """Every engine's scrape. A request that comes while one for the same members is
        running takes its result: scrapers in a burst cost the engines one read each."""
        members = tuple(urls)
        running = self._running
        if running is None or running.done() or self._running_for != members:
            running = asyncio.ensure_future(self._scrape_all(members, headers, limits, connect_s))
            self._running, self._running_for = running, members
        # Shielded: a scraper that leaves must not cancel the scrape the others wait on.
        return await asyncio.shield(running)

    async def _scrape_all(
        self,
        urls: tuple[str, ...],
        headers: list[tuple[str, str]],
        limits: Limits,
        connect_s: float,
    ) -> list[Scrape]:
        started = time.perf_counter()
        budget = _Budget(limits.max_total_bytes)
        scrapes = await asyncio.gather(
            *(
                scrape(self._upstream, url, headers, limits, budget, connect_s=connect_s)
                for url in urls
            )
        )
        for s in scrapes:
            self.counts[s.result] = self.counts.get(s.result, 0) + 1
        self.last_duration_s = time.perf_counter() - started
        return list(scrapes)
