"""What the framework replays share: a fleet of stub engines behind an in-process gateway,
clients bound to chosen loopback addresses, and a ledger of every call and its answer.

The replays write each framework's requests themselves (never importing framework code),
in the order the framework sends them; docs/rl-frameworks.md lists the calls and where
each comes from. Addresses play the cluster's hosts:

- 127.0.0.1: the operator (the RL driver next to the gateway), the only network in
  `control.trusted_cidrs`;
- 127.0.0.5: the cluster (GPU nodes that register their engines, agents and rollout
  workers that abort their own requests), in `control.membership.trusted_cidrs` only.

A check that fails does not stop the replay: the later calls still run and the ledger
says, per failed check, which gateway feature it depends on. The test fails at
its end with the whole list, and prints the calls and their answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway import config as config_mod
from gateway.app import Gateway
from gateway.testing.stub import StubBackend

ENGINES = 4
OPERATOR = "127.0.0.1"
CLUSTER = "127.0.0.5"
PROBE_S = 0.25  # backends.health.interval_s
QUEUE_S = 0.5  # backends.queue_timeout_s: a pause must outlast it to show a hold
ROUTING_KEY = "X-SMG-Routing-Key"

# Settings that the gateway may not know yet: each is tried on its own and
# left out when the config refuses it; the checks that need it then fail, naming the item.
OPTIONAL_SETTINGS: dict[tuple[str, ...], tuple[Any, int]] = {
    ("control", "membership", "trusted_cidrs"): ([f"{CLUSTER}/32"], 1),
}


def _nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def gateway_settings() -> dict[str, Any]:
    """The RL profile of config/rl-filter.yaml, on loopback, with short probes and queue."""
    return {
        "listen": {"host": OPERATOR, "port": 0},
        "admin": {"host": OPERATOR, "port": 0},
        "backends": {
            "discovery": "registry",  # empty at start: the engines register themselves
            "balancer": "consistent_hash",
            "hash_header": ROUTING_KEY,
            "queue_timeout_s": QUEUE_S,
            "health": {"interval_s": PROBE_S},
        },
        "control": {"trusted_cidrs": [f"{OPERATOR}/32"], "timeout_s": 60},
        "policy": {"skip_parse_without_mask_key": True},
        "timeouts": {"shutdown_grace_s": 2},
        "logging": {"access_log": False},
    }


@dataclass
class Entry:
    who: str
    method: str
    target: str
    status: int
    note: str = ""


@dataclass
class Ledger:
    """The calls made, in order, and the checks that failed (with the feature each depends on).
    A check repeated in a loop (one per engine) is one line, with each failing detail."""

    name: str
    entries: list[Entry] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    passed: int = 0

    def check(self, ok: bool, item: int | str, what: str, detail: object = "") -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed.setdefault(f"[item {item}] {what}", []).append(str(detail))
        return ok

    @property
    def failures(self) -> list[str]:
        out = []
        for key, details in self.failed.items():
            shown = [d for d in details if d]
            times = f" x{len(details)}" if len(details) > 1 else ""
            out.append(key + times + (f": {', '.join(shown[:4])}" if shown else ""))
        return out

    def report(self) -> str:
        lines = [f"{self.name}: {len(self.entries)} calls, {self.passed} checks passed"]
        lines += [
            f"  {e.who:>8} {e.method:6} {e.target} -> {e.status}"
            + (f"  ({e.note})" if e.note else "")
            for e in self.entries
        ]
        lines += [f"  FAILED {f}" for f in self.failures]
        return "\n".join(lines)

    def finish(self) -> None:
        print(self.report())
        assert not self.failures, "\n".join(self.failures)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any  # parsed JSON, the text when it is not JSON, None when empty

    def get(self, key: str, default: Any = None) -> Any:
        return self.body.get(key, default) if isinstance(self.body, dict) else default


class Client:
    """One party of the cluster: an aiohttp session bound to its own loopback address."""

    def __init__(self, who: str, address: str, ledger: Ledger) -> None:
        self.who = who
        self.address = address
        self.ledger = ledger
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        connector = aiohttp.TCPConnector(local_addr=(self.address, 0), force_close=True)
        self.session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def call(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30,
    ) -> Answer:
        assert self.session is not None
        kwargs: dict[str, Any] = {"params": params, "headers": headers or {}}
        if json is not None:
            kwargs["data"] = orjson.dumps(json)
            kwargs["headers"] = {"Content-Type": "application/json", **kwargs["headers"]}
        async with self.session.request(
            method, url, timeout=aiohttp.ClientTimeout(total=timeout), **kwargs
        ) as r:
            raw = await r.read()
            try:
                body: Any = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                body = raw.decode(errors="replace")
            answer = Answer(r.status, dict(r.headers), body)
        self.ledger.entries.append(Entry(self.who, method, _short(url, params), r.status))
        return answer


def _short(url: str, params: dict[str, str] | None) -> str:
    host, _, path = url.split("//", 1)[-1].partition("/")
    port = host.rpartition(":")[2]
    where = "gateway" if port == _GATEWAY_PORT.get("port") else f"engine:{port}"
    query = "?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else ""
    return f"{where} /{path}{query}"


_GATEWAY_PORT: dict[str, str] = {}


@dataclass
class Cluster:
    gateway: Gateway
    engines: list[StubBackend]
    ledger: Ledger
    missing_settings: list[str]

    @property
    def url(self) -> str:
        return f"http://{OPERATOR}:{self.gateway.port}"

    def proxied(self, engine: StubBackend, path: str) -> int:
        """How many `path` requests the gateway forwarded to `engine` for its clients."""
        return sum(1 for r in engine.received if r.path == path and "X-Forwarded-For" in r.headers)

    def direct(self, engine: StubBackend, path: str) -> int:
        """How many `path` requests reached `engine` without the gateway."""
        return sum(
            1 for r in engine.received if r.path == path and "X-Forwarded-For" not in r.headers
        )


@contextlib.asynccontextmanager
async def cluster(name: str, engines: int = ENGINES) -> AsyncIterator[Cluster]:
    """`engines` stubs and a gateway in front of none of them yet (they register)."""
    ledger = Ledger(name)
    stubs = [StubBackend() for _ in range(engines)]
    for s in stubs:
        await s.start()
    data = gateway_settings()
    missing = []
    for path, (value, item) in OPTIONAL_SETTINGS.items():
        extra = _nest(path, value)
        try:
            config_mod.build(_merge(data, extra))
        except config_mod.ConfigError:
            missing.append(f"{'.'.join(path)} (item {item})")
            ledger.check(False, item, f"the config takes {'.'.join(path)}")
            continue
        data = _merge(data, extra)
    gw = Gateway(config_mod.build(data))
    await gw.start()
    _GATEWAY_PORT["port"] = str(gw.port)
    try:
        yield Cluster(gw, stubs, ledger, missing)
    finally:
        await gw.stop()
        for s in stubs:
            await s.stop()


async def eventually(predicate: Callable[[], Any], timeout: float) -> bool:
    """Whether an async or plain predicate turns true within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)


def _probe_reads(engine: StubBackend) -> int:
    """The health probe's weight reads (/model_info) the engine has answered."""
    return sum(r.path in ("/model_info", "/get_model_info") for r in engine.received)


async def within_probes(
    engines: list[StubBackend], predicate: Callable[[], Any], probes: int = 3
) -> bool:
    """Whether the predicate turns true before every engine has answered `probes` more
    probe reads: "within one probe interval" counted in probes (the read in flight, the
    next, one more before the predicate is asked again), which load stretches in seconds
    but not in number. 30 s only ends a wait for a gateway that stopped probing."""
    start = [_probe_reads(e) for e in engines]

    async def seen_or_past() -> bool:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        past = all(_probe_reads(e) - s > probes for e, s in zip(engines, start, strict=True))
        seen.append(bool(value))
        return bool(value) or past

    seen: list[bool] = []
    return await eventually(seen_or_past, 30) and seen[-1]


async def engine_load(engine: StubBackend) -> int:
    """Running plus waiting requests on one engine, from its own /v1/loads (not recorded:
    the replay's observer, not a framework call)."""
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/v1/loads") as r:
        loads = (await r.json())["loads"]
    return sum(int(x["num_running_reqs"]) + int(x["num_waiting_reqs"]) for x in loads)


async def running(engines: list[StubBackend], n: int, timeout: float = 5.0) -> bool:
    """Whether at least `n` generations are in the engines."""

    async def total() -> bool:
        return sum([await engine_load(e) for e in engines]) >= n

    return await eventually(total, timeout)


async def list_workers(c: Cluster, who: Client, fallback: Client) -> list[dict[str, Any]]:
    """GET /workers from a cluster host (membership's listing, item 1); the operator's
    answer when the cluster's is refused, so the replay goes on."""
    r = await who.call("GET", c.url + "/workers")
    if not c.ledger.check(r.status == 200, 1, f"GET /workers from {who.address}", r.status):
        r = await fallback.call("GET", c.url + "/workers")
    return list(r.get("workers", []))


async def all_healthy(c: Cluster, who: Client, fallback: Client, n: int) -> None:
    """Wait until `n` registered engines have passed their first probe, then list them."""

    async def ready() -> bool:
        r = await fallback.call("GET", c.url + "/workers")
        c.ledger.entries.pop()  # a poll, not a framework call
        return [w["state"] for w in r.get("workers", [])] == ["healthy"] * n

    assert await eventually(ready, 10), "the registered engines never became healthy"
    await list_workers(c, who, fallback)


async def register(
    c: Cluster, who: Client, fallback: Client, method: str, path: str, **kw: Any
) -> None:
    """A membership call from a cluster host (item 1); the operator repeats a refused one,
    so the replay goes on."""
    r = await who.call(method, c.url + path, **kw)
    label = re.sub(r"^/workers/[^/]+", "/workers/{id}", path)
    if not c.ledger.check(r.status == 200, 1, f"{method} {label} from {who.address}", r.status):
        await fallback.call(method, c.url + path, **kw)


async def direct_version_seen(c: Cluster, operator: Client, version: str) -> None:
    """After one engine was updated to `version` behind the gateway's back: GET /workers
    shows it for that engine, and replies it serves say so in X-Weight-Version (item 2)."""
    target = c.engines[0]

    async def listed() -> bool:
        r = await operator.call("GET", c.url + "/workers")
        c.ledger.entries.pop()
        return any(
            w["url"] == target.url and w["weight_version"] == version for w in r.get("workers", [])
        )

    c.ledger.check(
        await within_probes(c.engines, listed),
        2,
        f"GET /workers shows the engine-direct update to {version!r} within one probe interval",
    )
    replies = [
        await operator.call(
            "POST",
            c.url + "/generate",
            json={"input_ids": [i], "sampling_params": {"max_new_tokens": 2}},
        )
        for i in range(8)
    ]
    stale = [
        (r.headers.get("X-Weight-Version"), r.body["meta_info"]["weight_version"])
        for r in replies
        if r.status == 200
        and r.headers.get("X-Weight-Version") != r.body["meta_info"]["weight_version"]
    ]
    c.ledger.check(not stale, 2, "X-Weight-Version is the serving engine's own version", stale[:2])


def sglang_loads(body: Any) -> int:
    """An engine's /v1/loads read as SGLang answers it: the top-level `loads`, each entry's
    running plus waiting requests (what a client that reads one engine does)."""
    loads = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(loads, list):
        return 0
    return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)


async def loads_check(c: Cluster, operator: Client, n: int, what: str) -> None:
    """The gateway's /v1/loads while `n` requests run: an engine's shape, entries tagged
    with their worker (item 3)."""
    r = await operator.call("GET", c.url + "/v1/loads", params={"include": "core"})
    seen = sglang_loads(r.body)
    c.ledger.check(seen == n, 3, f"{what}: {n} running, the top-level loads read {seen}")
    entries = r.get("loads") if isinstance(r.body, dict) else None
    tagged = isinstance(entries, list) and all(
        isinstance(x, dict)
        and x.get("worker_url") in {e.url for e in c.engines}
        and x.get("worker_id")
        for x in entries
    )
    c.ledger.check(tagged, 3, f"{what}: each loads entry names its worker id and url")
