"""How an exchange with a backend can fail, in the gateway's own types: the proxy decides
retry or status from these alone."""

from __future__ import annotations


class ConnectFailed(Exception):
    """Nothing reached the backend, so the request may be tried on another one.

    `local` is set when the cause is the gateway's own (out of descriptors or buffers):
    then the backend is not to blame, and no other backend would fare better.
    """

    def __init__(self, cause: str, *, local: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.local = local


class UpstreamBroken(Exception):
    """The request went out and the backend's answer is unusable (not HTTP, an upgrade the
    gateway does not relay, endless interim responses): never replayed elsewhere."""
