"""Every use of aiohttp's internals, in one place: what the gateway extends of aiohttp's
client machinery, and what it checks of aiohttp itself.

The request path's upstream connection keeps aiohttp's response side (its C HTTP parser,
flow control towards the socket, read timeouts) and holds it to one rule: the backend speaks
only when asked (no stray response is ever read as an answer). That subclasses an aiohttp
class and touches attributes that are not public API, which can change in a patch release;
keeping it here means one module to review on every aiohttp upgrade, and the rest of the
gateway imports only aiohttp's public names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import aiohttp
from aiohttp import http_parser
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_parser import RawResponseMessage
from aiohttp.streams import StreamReader

from gateway.edge.failures import UpstreamBroken, UpstreamError, UpstreamTimeout

_MIN_AIOHTTP: Final = (3, 14, 2)
# Interim (1xx) responses accepted before the final one. RFC 9110 sets no limit, but every
# real server sends at most a few (100 Continue, 103 Early Hints); each one costs a parse and
# a queued message, so a backend that streams them without end would stall the loop.
MAX_INTERIM_RESPONSES: Final = 16


def check_runtime() -> str | None:
    """Refuse to run on an aiohttp without its C HTTP parser or older than 3.14.2.

    The pure-Python parser is slower and has had request-smuggling bugs the C one did
    not; a filter in front of SGLang must not run on it unnoticed.
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


# -- the request path's upstream connection ---------------------------------------------------


class UpstreamConnection(ResponseHandler):
    """aiohttp's client protocol, remembering how its parser was set up (the C parser reads
    one response after another, so a kept-alive connection need not build a new one), and
    holding each connection to one rule: the backend speaks only when asked.

    HTTP/1.1 has no request ids: a response is matched to a request only by its place on
    the connection. Bytes that arrive while no response is expected (on an idle pooled
    connection, or after a response ended) would be read as the answer to the next request
    sent on it, and every later answer would belong to the request before. So such bytes are
    never parsed: they mark the connection unusable and close it, and so does an EOF while
    idle. What cannot be told apart is a stray response that lands after a request went out;
    then the real answer arrives unasked and closes the connection, so at most that one
    request is affected, never the ones after it.
    """

    head_only: bool | None = None  # None: no parser yet
    # Set from the request write until its response body ended (or its head, for no body).
    expecting = False
    final_head = False  # the final (non-1xx) head of the current request was delivered
    interim = 0
    unsolicited = False  # bytes or EOF arrived unasked: never reuse
    on_unsolicited: Callable[[], None] | None = None

    def begin(self) -> None:
        self.expecting = True
        self.final_head = False
        self.interim = 0

    def _refuse(self) -> None:
        if not self.unsolicited:
            self.unsolicited = True
            if self.on_unsolicited is not None:
                self.on_unsolicited()
        transport = self.transport
        if transport is not None:
            transport.abort()

    def data_received(self, data: bytes) -> None:
        # aiohttp calls this with b"" itself when it resumes reading: not the backend's doing.
        if data and not self.expecting:
            self._refuse()
            return
        super().data_received(data)

    def eof_received(self) -> None:
        if not self.expecting:
            self.unsolicited = True  # a FIN on an idle connection: the backend closed it
        super().eof_received()

    def feed_data(self, data: tuple[RawResponseMessage, StreamReader], size: int = 0) -> None:
        """Each response head the parser completes, before it is queued for the reader."""
        if self.final_head:
            # A second response to one request (the parser found it in the same read as the
            # first one's end): it answers nothing, and whatever comes next is suspect.
            self._refuse()
            return
        code = data[0].code
        if 100 <= code <= 199 and code != 101:
            self.interim += 1
            if self.interim > MAX_INTERIM_RESPONSES:
                self.set_exception(UpstreamError("too many interim responses"))
                transport = self.transport
                if transport is not None:
                    transport.abort()
                return
        else:
            self.final_head = True
            payload = data[1]
            # The response ends with its body; from then on the backend has nothing to say.
            payload.on_eof(self._response_ended)
        super().feed_data(data, size)

    def _response_ended(self) -> None:
        self.expecting = False

    def set_exception(self, exc: BaseException, *cause: BaseException) -> None:
        """Fail the response under way too, not only the wait for the next head.

        aiohttp puts a parser error (a bad chunk size mid-body, say) on the queue of heads
        only, and drops the read timeout: the body's reader would wait forever on a
        connection already closed, and the client with it.
        """
        super().set_exception(exc, *cause)
        payload = self._payload
        if payload is not None and not payload.is_eof() and payload.exception() is None:
            kind = UpstreamTimeout if isinstance(exc, TimeoutError) else UpstreamBroken
            payload.set_exception(kind(type(exc).__name__))

    @property
    def reusable(self) -> bool:
        return not self.unsolicited and not self._buffer and self.is_connected()
