"""Process lifecycle helpers shared by a gateway and the --workers supervisor: polling a
config file for changes, and a worker's lifeline to its supervisor.

The lifeline is a pipe whose write end only the supervisor holds. The kernel closes it
when the supervisor dies, however it dies (SIGKILL included), so the worker sees EOF and
drains: no orphan keeps serving the port, and a new supervisor never shares it with the
old one's workers. Unlike PR_SET_PDEATHSIG it needs no Linux-only call, and it cannot miss
a supervisor that died before the worker got to arm it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Final

from gateway import config as config_mod
from gateway.config import ConfigError, GatewayConfig

log = logging.getLogger("gateway.reload")

LIFELINE_ENV: Final = "SGLANG_GATEWAY_LIFELINE_FD"


async def watch_mtime(
    path: str | Path, interval: float, on_change: Callable[[], Awaitable[object]]
) -> None:
    """Call `on_change` each time the file's modification time changes; runs until cancelled."""
    file = Path(path)

    def mtime() -> float | None:
        try:
            return file.stat().st_mtime
        except OSError:
            return None

    last = await asyncio.to_thread(mtime)
    while True:
        await asyncio.sleep(interval)
        now = await asyncio.to_thread(mtime)
        if now is not None and now != last:
            last = now
            await on_change()


async def read_reload(
    path: str, overrides: Mapping[str, object], running: GatewayConfig
) -> GatewayConfig | None:
    """The config a reload of `path` would run, or None (logged) when the file is refused.

    Read and validated off the loop, so requests keep flowing meanwhile; restart-only
    settings keep their running values (config.as_reloaded)."""
    try:
        cfg = await asyncio.to_thread(config_mod.load, path, overrides)
    except ConfigError as exc:
        log.error("reload refused, keeping the running config:\n%s", exc)
        return None
    for key in config_mod.restart_only_changes(cfg, running):
        log.warning("reload: %s changed; it takes effect only after a restart", key)
    return config_mod.as_reloaded(cfg, running)


def hold_lifeline(on_lost: Callable[[], None]) -> bool:
    """In a worker: call `on_lost` once the supervisor is gone. False when not a worker."""
    fd_text = os.environ.get(LIFELINE_ENV)
    if fd_text is None:
        return False
    fd = int(fd_text)
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # EOF: the write end closed with the supervisor
            loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
            on_lost()

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    return True
