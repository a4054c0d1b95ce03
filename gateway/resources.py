"""The process's own limits: which failures are the gateway's fault, and how many client
connections its descriptor limit allows.

A connect that fails with EMFILE is no sign that the backend is down: counting it against
the backend ejected healthy ones in turn, each ejection doubling. And a gateway that accepts
connections until it has no descriptor left cannot open one to a backend, nor answer its own
probes; refusing clients early keeps a reserve for both.
"""

from __future__ import annotations

import errno
import resource
from typing import Final

# A local resource is exhausted: another backend would fare no better.
LOCAL_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

# Descriptors kept back from clients: listeners, the admin side, health probes, discovery,
# log files, the event loop's own.
RESERVED_FDS: Final = 64


def is_local(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in LOCAL_ERRNOS


def default_max_client_connections() -> int:
    """Half of the descriptors left after the reserve: each client connection may need one
    more, to its backend."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - RESERVED_FDS) // 2)
