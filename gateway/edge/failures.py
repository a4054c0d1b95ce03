"""How an exchange with a backend can fail, in the gateway's own types.

The upstream client (upstream.py) raises only these; the proxy and the control fan-out
decide retry, status and outcome from them alone, and import no HTTP library's exceptions.
`cause` is a short name for the log and the metrics' detail: the underlying exception's
type, or what was wrong.
"""

from __future__ import annotations


class UpstreamFailure(Exception):
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class ConnectFailed(UpstreamFailure):
    """Nothing reached the backend, so the request may be tried on another one.

    `local` is set when the cause is the gateway's own (out of descriptors or buffers):
    then the backend is not to blame, and no other backend would fare better.
    """

    def __init__(self, cause: str, *, local: bool = False) -> None:
        super().__init__(cause)
        self.local = local


class UpstreamTimeout(UpstreamFailure):
    """The response head (or, once it came, the next body chunk) did not arrive in time."""


class UpstreamError(UpstreamFailure):
    """The request went out and no usable response head came back: the backend closed the
    connection, sent what is not HTTP/1.1, switched protocols, or sent endless interim
    responses. Never replayed elsewhere: a generation may have started."""


class UpstreamBroken(UpstreamFailure):
    """The response head came, then the body broke off (closed early, a bad chunk)."""
