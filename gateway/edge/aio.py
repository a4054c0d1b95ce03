"""What the gateway checks of aiohttp itself.

aiohttp serves the admin listener and makes the gateway's own calls (health probes,
/server_info, the Kubernetes API); the request path has its own protocols on llhttp
(gateway/edge/server.py, gateway/edge/relay.py). aiohttp's C parser reads those answers.
"""

from __future__ import annotations

from typing import Final

import aiohttp
from aiohttp import http_parser

_MIN_AIOHTTP: Final = (3, 14, 2)


def check_runtime() -> str | None:
    """Refuse to run on an aiohttp without its C HTTP parser or older than 3.14.2.

    The admin listener's requests and the answers to the gateway's own calls are parsed by
    it (client requests are not: httptools parses those). The pure-Python parser is slower
    and has had request-smuggling bugs the C one did not, so the gateway must not run on it
    unnoticed.
    """
    version = tuple(int(x) for x in aiohttp.__version__.split(".")[:3] if x.isdigit())
    if version < _MIN_AIOHTTP:
        return f"aiohttp {aiohttp.__version__} is too old; 3.14.2 or newer is required"
    c_parser = getattr(http_parser, "HttpRequestParserC", None)
    if c_parser is None or http_parser.HttpRequestParser is not c_parser:
        return (
            "aiohttp's C HTTP parser is not in use (AIOHTTP_NO_EXTENSIONS set, or a build "
            "without extensions); refusing to start"
        )
    return None
