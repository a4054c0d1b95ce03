"""`--workers N`: N gateway processes sharing the listen port, under one supervisor.

Each worker is a full gateway with its own event loop, upstream pool and health probes,
bound to the same port with SO_REUSEPORT so the kernel spreads connections across them.
Probing independently keeps health consistent enough: every worker sees the same backends
with the same thresholds, a few probe intervals apart at worst.

The supervisor owns the admin listener. `/metrics` scrapes every worker's private admin
port (loopback, ephemeral) and merges the series with a `worker` label, so counters are
per worker and sum correctly across them; `/readyz` is ready while any worker is. Signals
go to every worker (SIGHUP reload, SIGTERM drain); a worker that dies is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.admin import make_admin_app
from gateway.config import GatewayConfig

log = logging.getLogger("gateway.workers")

REPORT_FD_ENV = "SGLANG_GATEWAY_REPORT_FD"
_RESTART_BACKOFF_S = 1.0


@dataclass
class Worker:
    index: int
    proc: asyncio.subprocess.Process | None = None
    admin_port: int = 0
    restarts: int = 0
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


def merge_metrics(texts: Sequence[tuple[int, str]]) -> bytes:
    """Many workers' exposition text -> one, each sample labelled with its worker."""
    merged: dict[str, Metric] = {}
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
    return generate_latest(registry)


class Supervisor:
    def __init__(self, cfg: GatewayConfig, n: int, worker_argv: Sequence[str]) -> None:
        self.cfg = cfg
        self.workers = [Worker(i) for i in range(n)]
        self._argv = list(worker_argv)
        self._stopping = False
        self._session: aiohttp.ClientSession | None = None

    async def _spawn(self, w: Worker) -> None:
        read_fd, write_fd = os.pipe()
        env = {**os.environ, REPORT_FD_ENV: str(write_fd)}
        w.started.clear()
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            *self._argv,
            "--worker-index",
            str(w.index),
            env=env,
            pass_fds=(write_fd,),
        )
        os.close(write_fd)
        loop = asyncio.get_running_loop()
        line = await loop.run_in_executor(None, _read_line, read_fd)
        if line:
            w.admin_port = int(line)
            w.started.set()
            log.info("worker %d (pid %d) ready", w.index, w.proc.pid)

    async def _watch(self, w: Worker) -> None:
        while not self._stopping:
            await self._spawn(w)
            assert w.proc is not None
            code = await w.proc.wait()
            if self._stopping:
                return
            w.restarts += 1
            log.error("worker %d exited with %s; restarting", w.index, code)
            await asyncio.sleep(_RESTART_BACKOFF_S)

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
        results = await asyncio.gather(*(self._fetch(w, "/readyz") for w in self.workers))
        ok = sum(1 for r in results if r is not None and r[0] == 200)
        return ok > 0, f"{ok}/{len(self.workers)} workers ready"

    async def metrics(self) -> tuple[bytes, str]:
        results = await asyncio.gather(*(self._fetch(w, "/metrics") for w in self.workers))
        texts = [(w.index, r[1]) for w, r in zip(self.workers, results, strict=True) if r]
        return merge_metrics(texts), CONTENT_TYPE_LATEST

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: self._signal_all(signal.SIGHUP))
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        admin = make_admin_app(ready=self.ready, metrics=self.metrics)
        runner = web.AppRunner(admin, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.cfg.admin.host, self.cfg.admin.port).start()
        watchers = [
            asyncio.create_task(self._watch(w), name=f"worker-{w.index}") for w in self.workers
        ]
        log.info("supervisor: %d workers on port %d", len(self.workers), self.cfg.listen.port)
        try:
            await stop.wait()
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
        return 0


def _read_line(fd: int) -> str:
    with os.fdopen(fd, "r") as pipe:
        return pipe.readline().strip()
