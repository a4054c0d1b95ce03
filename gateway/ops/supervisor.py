"""`--workers N`: N gateway processes sharing the listen port, under one supervisor.

Each worker is a full gateway with its own event loop, upstream pool and health probes,
bound to the same port with SO_REUSEPORT so the kernel spreads connections across them.
Probing independently keeps health consistent enough: every worker sees the same backends
with the same thresholds, a few probe intervals apart at worst. What operators change
(registry members, paused/asleep engines, weight versions) is shared exactly, through a
document the supervisor owns (gateway/fleet/shared.py).

The supervisor owns the config: it validates the file, and workers run a snapshot of the
last config it accepted (see Supervisor). It owns the admin listener: `/metrics` scrapes
every worker's private admin port (loopback, ephemeral) and merges the series with a
`worker` label, so counters are per worker and sum correctly across them; `/readyz` is
ready while any worker is and none is failing to start. SIGTERM drains every worker; a
worker that dies is restarted, with back-off while it keeps failing; and each worker holds
a lifeline to the supervisor (gateway/ops/lifecycle.py), so none outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway import config as config_mod
from gateway import runtime
from gateway.config import GatewayConfig
from gateway.fleet.shared import STATE_ENV, WORKERS_ENV, new_document, reseed, write_document
from gateway.ops.admin import make_admin_app
from gateway.ops.lifecycle import LIFELINE_ENV, read_reload, watch_mtime
from gateway.ops.metrics import render

log = logging.getLogger("gateway.ops.supervisor")

REPORT_FD_ENV = "SGLANG_GATEWAY_REPORT_FD"
_RESTART_BACKOFF_S = 0.25  # doubled for each start in a row that never became ready
_MAX_BACKOFF_S = 30.0
_FAILING_AFTER = 3  # failed starts in a row that make a worker (and readiness) failing


@dataclass
class Worker:
    index: int
    proc: asyncio.subprocess.Process | None = None
    admin_port: int = 0
    restarts: int = 0
    failed_starts: int = 0  # exits in a row before reporting ready
    ready_this_start: bool = False
    lifeline: int | None = None  # our end of the worker's lifeline pipe
    started: asyncio.Event = field(default_factory=asyncio.Event)


def report_ready(admin_port: int) -> None:
    """In a worker: tell the supervisor where its private admin listener is."""
    fd = os.environ.get(REPORT_FD_ENV)
    if fd is None:
        return
    with os.fdopen(int(fd), "w") as pipe:
        pipe.write(f"{admin_port}\n")


class _Merged(Collector):
    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def _reason(body: str) -> str:
    """The `reason` of a worker's /readyz answer ("" when it is not one)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return ""
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return reason if isinstance(reason, str) else ""


def merge_metrics(
    texts: Sequence[tuple[int, str]], own: Sequence[Metric] = (), accept: str | None = None
) -> tuple[bytes, str]:
    """Many workers' exposition text -> one, each sample labelled with its worker, and the
    supervisor's own families."""
    merged: dict[str, Metric] = {family.name: family for family in own}
    for index, text in texts:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = target
            for sample in family.samples:
                labels = {**sample.labels, "worker": str(index)}
                target.add_sample(sample.name, labels, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return render(registry, accept)


class Supervisor:
    """Owns the config the workers run, the admin listener, and the workers' lives.

    Workers never read the operator's config file: they run a snapshot of the config the
    supervisor last accepted (private directory, mode 0600: it holds secrets). A reload is
    validated here first; only an accepted one is written and signalled to the workers, so a
    worker restarted after a refused reload, or after an edit nobody reloaded, runs exactly
    the rules its siblings run.
    """

    def __init__(
        self,
        cfg: GatewayConfig,
        *,
        config_path: str | None = None,
        overrides: Mapping[str, object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.workers = [Worker(i) for i in range(cfg.listen.workers)]
        self._config_path = config_path
        self._overrides = dict(overrides or {})
        self._stopping = False
        self._session: aiohttp.ClientSession | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="sglang-gateway-"))  # 0700
        self.snapshot = self._dir / "config.json"
        self._write_snapshot(cfg)
        # The fleet state the workers share (gateway/fleet/shared.py): registry members and
        # engine states live here, so a restarted worker finds them.
        self.fleet_state = self._dir / "fleet.json"
        write_document(self.fleet_state, new_document(cfg.backends.members))
        self.reloads = 0
        self.reload_failures = 0
        self._reload_lock = asyncio.Lock()

    def _write_snapshot(self, cfg: GatewayConfig) -> None:
        data = json.dumps(config_mod.to_data(cfg)).encode()
        tmp = self._dir / "config.json.new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, self.snapshot)  # a worker starting now reads the old or the new

    async def reload(self) -> bool:
        async with self._reload_lock:
            if self._config_path is None:
                log.warning("reload requested, but the gateway was started without --config")
                return False
            cfg = await read_reload(self._config_path, self._overrides, self.cfg)
            if cfg is None:
                self.reload_failures += 1  # the workers keep the running config
                return False
            await asyncio.to_thread(self._write_snapshot, cfg)
            turned_on = cfg.backends.discovery == "registry"
            if turned_on and self.cfg.backends.discovery != "registry":
                # Registry discovery turned on: every worker starts from the new seed.
                try:
                    await asyncio.to_thread(
                        reseed, self.fleet_state, cfg.backends.members, len(self.workers)
                    )
                except OSError as exc:
                    log.error(
                        "the workers' registry could not be reseeded (%s): they keep its members",
                        type(exc).__name__,
                    )
            self.cfg = cfg
            self.reloads += 1
            self._signal_all(signal.SIGHUP)
            log.info("config accepted; workers reloading")
            return True

    def _worker_argv(self, w: Worker) -> list[str]:
        return ["--config", str(self.snapshot), "--worker-index", str(w.index)]

    async def _spawn(self, w: Worker) -> None:
        if not self.snapshot.exists():  # a /tmp cleaner took it: the config is still ours
            await asyncio.to_thread(self._write_snapshot, self.cfg)
        read_fd, write_fd = os.pipe()
        life_read, life_write = os.pipe()
        env = {
            **os.environ,
            REPORT_FD_ENV: str(write_fd),
            LIFELINE_ENV: str(life_read),
            STATE_ENV: str(self.fleet_state),
            WORKERS_ENV: str(len(self.workers)),
        }
        w.started.clear()
        w.ready_this_start = False
        try:
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway",
                *self._worker_argv(w),
                env=env,
                pass_fds=(write_fd, life_read),
            )
        finally:
            os.close(write_fd)
            os.close(life_read)
        # Held (never written) for the worker's life: the kernel closes it when we die.
        if w.lifeline is not None:
            os.close(w.lifeline)
        w.lifeline = life_write
        loop = asyncio.get_running_loop()
        line = await loop.run_in_executor(None, _read_line, read_fd)
        if line:
            w.admin_port = int(line)
            w.failed_starts = 0
            w.ready_this_start = True
            w.started.set()
            log.info("worker %d (pid %d) ready", w.index, w.proc.pid)

    async def _watch(self, w: Worker) -> None:
        while not self._stopping:
            await self._spawn(w)
            assert w.proc is not None
            code = await w.proc.wait()
            w.started.clear()
            if self._stopping:
                return
            w.restarts += 1
            if not w.ready_this_start:
                w.failed_starts += 1
            backoff = min(_MAX_BACKOFF_S, _RESTART_BACKOFF_S * 2 ** min(w.failed_starts, 8))
            log.error(
                "worker %d exited with %s; restarting in %.1fs (%d restarts)",
                w.index,
                code,
                backoff,
                w.restarts,
            )
            await asyncio.sleep(backoff)

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    async def _fetch(self, w: Worker, path: str) -> tuple[int, str] | None:
        if not w.started.is_set() or self._session is None:
            return None
        try:
            async with self._session.get(f"http://127.0.0.1:{w.admin_port}{path}") as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def ready(self) -> tuple[bool, str]:
        """Ready while a worker is and none is failing to start: a crash-looping worker
        is a broken deployment even while its siblings serve."""
        results = await asyncio.gather(*(self._fetch(w, "/readyz") for w in self.workers))
        ok = sum(1 for r in results if r is not None and r[0] == 200)
        failing = [w.index for w in self.workers if w.failed_starts >= _FAILING_AFTER]
        reason = f"{ok}/{len(self.workers)} workers ready"
        if failing:
            reason += "; failing to start: " + ", ".join(f"worker {i}" for i in failing)
        # Why the others are not: each distinct reason once (the workers share a fleet
        # config, so a discovery failure reads the same in each).
        why: dict[str, list[int]] = {}
        for w, r in zip(self.workers, results, strict=True):
            if r is not None and r[0] != 200 and (text := _reason(r[1])):
                why.setdefault(text, []).append(w.index)
        for text, indexes in why.items():
            reason += f"; worker {', '.join(map(str, indexes))}: {text}"
        return ok > 0 and not failing, reason

    async def metrics(self, accept: str | None = None) -> tuple[bytes, str]:
        results = await asyncio.gather(*(self._fetch(w, "/metrics") for w in self.workers))
        texts = [(w.index, r[1]) for w, r in zip(self.workers, results, strict=True) if r]
        return merge_metrics(texts, own=list(self._own_metrics()), accept=accept)

    def _own_metrics(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily(
            "sglang_gateway_worker_restarts",
            "Worker processes restarted by the supervisor after they exited.",
            labels=["worker"],
        )
        up = GaugeMetricFamily(
            "sglang_gateway_worker_up",
            "1 while the worker process has started and reported ready, else 0.",
            labels=["worker"],
        )
        failing = GaugeMetricFamily(
            "sglang_gateway_worker_failing",
            f"1 while the worker has failed to start {_FAILING_AFTER} times in a row.",
            labels=["worker"],
        )
        for w in self.workers:
            restarts.add_metric([str(w.index)], float(w.restarts))
            up.add_metric([str(w.index)], 1.0 if w.started.is_set() else 0.0)
            failing.add_metric([str(w.index)], 1.0 if w.failed_starts >= _FAILING_AFTER else 0.0)
        yield restarts
        yield up
        yield failing
        reloads = CounterMetricFamily(
            "sglang_gateway_supervisor_config_reloads",
            "Config reloads the supervisor validated, by result (only accepted ones reach the "
            "workers).",
            labels=["result"],
        )
        reloads.add_metric(["ok"], float(self.reloads))
        reloads.add_metric(["refused"], float(self.reload_failures))
        yield reloads

    async def run(self) -> int:
        async with runtime.Signals(on_hup=self.reload) as signals:
            return await self._run(signals)

    async def _run(self, signals: runtime.Signals) -> int:
        admin = make_admin_app(ready=self.ready, metrics=self.metrics)
        runner = web.AppRunner(admin, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.cfg.admin.host, self.cfg.admin.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        # Opened once the admin port is ours, so a failed start leaves nothing open.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        watchers = [
            asyncio.create_task(self._watch(w), name=f"worker-{w.index}") for w in self.workers
        ]
        interval = self.cfg.reload.watch_interval_s
        if interval is not None and self._config_path is not None:
            watchers.append(
                asyncio.create_task(
                    watch_mtime(self._config_path, interval, self.reload), name="config-watch"
                )
            )
        log.info("supervisor: %d workers on port %d", len(self.workers), self.cfg.listen.port)
        try:
            await signals.wait()
        finally:
            self._stopping = True
            self._signal_all(signal.SIGTERM)
            grace = self.cfg.timeouts.shutdown_grace_s + 5
            procs = [w.proc for w in self.workers if w.proc is not None]
            try:
                async with asyncio.timeout(grace):
                    await asyncio.gather(*(p.wait() for p in procs))
            except TimeoutError:
                self._signal_all(signal.SIGKILL)
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            await runner.cleanup()
            await self._session.close()
            for w in self.workers:
                if w.lifeline is not None:
                    os.close(w.lifeline)
                    w.lifeline = None
            shutil.rmtree(self._dir, ignore_errors=True)
        return 0


def _read_line(fd: int) -> str:
    with os.fdopen(fd, "r") as pipe:
        return pipe.readline().strip()
