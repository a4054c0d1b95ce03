"""The stub as one half of a prefill/decode pair, as SGLang's disaggregated engines meet.

A request for a disaggregated engine carries `bootstrap_host`, `bootstrap_port` and
`bootstrap_room` (one per item of a batch, expanded as SGLang's
`_normalize_bootstrap_params` expands them). The prefill engine runs a bootstrap server on
its bootstrap port; the decode engine connects to it for each room and waits there for the
KV cache. Here:

- a **prefill** stub listens on its bootstrap port (HTTP, `POST /bootstrap/{room}`); a
  request waits until the decode side of each of its rooms has arrived, does its share of
  the work (`prefill_s`), hands the rooms over, then answers as any generation;
- a **decode** stub calls the prefill's bootstrap server for each room and answers only
  once every room was handed over; a room whose prefill request failed or went away is a
  500 (SGLang aborts such a request: its KV cache never came); one that never comes waits
  until its connection closes or `transfer_timeout_s`.

A request without the keys is refused (400), as SGLang's engines assert on it: nothing
can be sent to one side alone unnoticed. `rooms` lists every room a stub took part in, in
order, so a test can check each room met both sides exactly once. A decode stub reports
`input_token_logprobs` empty (the prefill engine computed the prompt), in a whole answer
and in each streamed event, so a router's merge of the two shows.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from gateway.testing.stub.rules import Reject

PREFILL: Final = "prefill"
DECODE: Final = "decode"


@dataclass(slots=True)
class _Room:
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    handed: asyncio.Future[bool] | None = None
    users: int = 0


def _n(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def items_of(path: str, body: dict[str, Any]) -> tuple[int | None, int]:
    """(batch size or None for a single request, parallel samples) as SGLang counts them."""
    if path in ("/v1/chat/completions", "/invocations"):
        return None, _n(body.get("n"))
    if path == "/v1/completions":
        prompt = body.get("prompt")
        size = (
            len(prompt)
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            else None
        )
        return size, _n(body.get("n"))
    text, ids = body.get("text"), body.get("input_ids")
    size = None
    if isinstance(text, list):
        size = len(text)
    elif text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        size = len(ids)
    params = body.get("sampling_params")
    first = params[0] if isinstance(params, list) and params else params
    return size, _n(first.get("n") if isinstance(first, dict) else None)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def _expand(value: object, num: int, parallel: int, *, count_up: bool) -> list[Any]:
    # SGLang's _normalize_bootstrap_params: a scalar room counts up per item, any other
    # scalar repeats; a list repeats once per parallel sample.
    if isinstance(value, list):
        return (value * parallel)[:num]
    if count_up and isinstance(value, int):
        return [value + i for i in range(num)]
    return [value] * num


def bootstraps(path: str, body: dict[str, Any]) -> list[tuple[str, int | None, int]]:
    """(host, port, room) of every request SGLang makes of the body; Reject without them."""
    room = body.get("bootstrap_room")
    if room is None or (isinstance(room, list) and not room):
        raise Reject(
            "bootstrap_room is missing: a disaggregated engine takes requests from a router "
            "that pairs prefill with decode."
        )
    size, parallel = items_of(path, body)
    if size is None and parallel == 1:
        host, port = _first(body.get("bootstrap_host")), _first(body.get("bootstrap_port"))
        return [(host, port, _first(room))]
    num = (size or 1) * parallel
    hosts = _expand(body.get("bootstrap_host"), num, parallel, count_up=False)
    ports = _expand(body.get("bootstrap_port"), num, parallel, count_up=False)
    rooms = _expand(room, num, parallel, count_up=True)
    return list(zip(hosts, ports, rooms, strict=True))


class PdStub:
    """One stub's role in a pair (StubBackend(pd=PdStub(...)))."""

    def __init__(
        self,
        role: str,
        *,
        bootstrap_port: int = 0,
        prefill_s: float = 0.0,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        if role not in (PREFILL, DECODE):
            raise ValueError(f"role must be {PREFILL} or {DECODE}, not {role!r}")
        self.role = role
        self.bootstrap_port = bootstrap_port  # the bound one once started (prefill)
        self.prefill_s = prefill_s
        self.transfer_timeout_s = transfer_timeout_s
        self.rooms: list[int] = []  # every room this side took part in, in order
        self.handed_over = 0  # rooms whose KV cache went to (or came from) the other side
        self.failed = 0  # rooms that never were handed over
        self._rooms: dict[int, _Room] = {}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle (StubBackend.start and stop call these) -----------------------------------

    async def start(self, host: str) -> None:
        if self.role != PREFILL:
            return
        app = web.Application()
        app.router.add_post("/bootstrap/{room}", self._arrive)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await runner.setup()
        site = web.TCPSite(runner, host, self.bootstrap_port)
        await site.start()
        self._runner = runner
        self.bootstrap_port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # -- a generation ------------------------------------------------------------------------

    async def serve(self, path: str, raw: bytes) -> None:
        """This side's part of the request, before it answers; Reject when it cannot."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return  # the route's own parse refuses it
        if not isinstance(body, dict):
            return
        meets = bootstraps(path, body)
        self.rooms += [room for _, _, room in meets]
        if self.role == PREFILL:
            await self._prefill([room for _, _, room in meets])
        else:
            await self._decode(meets)

    def _room(self, room: int) -> _Room:
        state = self._rooms.get(room)
        if state is None:
            state = self._rooms[room] = _Room(handed=asyncio.get_running_loop().create_future())
        state.users += 1
        return state

    def _leave(self, room: int, state: _Room) -> None:
        state.users -= 1
        if state.users <= 0 and self._rooms.get(room) is state:
            del self._rooms[room]

    async def _prefill(self, rooms: list[int]) -> None:
        states = [(room, self._room(room)) for room in rooms]
        handed = False
        try:
            async with asyncio.timeout(self.transfer_timeout_s):
                for _, state in states:
                    await state.arrived.wait()
            if self.prefill_s > 0:
                await asyncio.sleep(self.prefill_s)
            handed = True
        except TimeoutError:
            raise Reject("KV transfer failed: the decode side never arrived", 500) from None
        finally:
            for room, state in states:
                assert state.handed is not None
                if not state.handed.done():
                    state.handed.set_result(handed)
                self.handed_over += handed
                self.failed += not handed
                self._leave(room, state)

    async def _arrive(self, request: web.Request) -> web.Response:
        """The decode side of a room, on the bootstrap port: answered once it is handed over
        (200) or never will be (410)."""
        try:
            room = int(request.match_info["room"])
        except ValueError:
            return web.Response(status=400)
        state = self._room(room)
        state.arrived.set()
        assert state.handed is not None
        try:
            async with asyncio.timeout(self.transfer_timeout_s):
                ok = await asyncio.shield(state.handed)
        except TimeoutError:
            ok = False
        finally:
            self._leave(room, state)
        return web.Response(status=200 if ok else 410)

    async def _decode(self, meets: list[tuple[str, int | None, int]]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        session = self._session
        timeout = aiohttp.ClientTimeout(total=self.transfer_timeout_s)

        async def fetch(host: str, port: int | None, room: int) -> bool:
            shown = f"[{host}]" if ":" in str(host) else host
            url = f"http://{shown}:{port}/bootstrap/{room}"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(url, timeout=timeout) as resp:
                    return resp.status == 200
            return False

        results = await asyncio.gather(*(fetch(h, p, r) for h, p, r in meets))
        self.handed_over += sum(results)
        self.failed += len(results) - sum(results)
        if not all(results):
            raise Reject("KV transfer failed: the prefill side did not hand the cache over", 500)

    def event(self, event: object) -> None:
        """A decode engine's streamed events report no input logprobs of its own either."""
        meta = event.get("meta_info") if self.role == DECODE and isinstance(event, dict) else None
        if isinstance(meta, dict) and "input_token_logprobs" in meta:
            meta["input_token_logprobs"] = []

    def finish(self, response: web.StreamResponse) -> None:
        """A decode engine's whole answer reports no input logprobs of its own: the prefill
        engine computed the prompt."""
        if self.role != DECODE or not isinstance(response, web.Response):
            return
        body = response.body
        if not isinstance(body, bytes) or b"input_token_logprobs" not in body:
            return
        parsed = orjson.loads(body)
        for out in parsed if isinstance(parsed, list) else [parsed]:
            meta = out.get("meta_info") if isinstance(out, dict) else None
            if isinstance(meta, dict) and "input_token_logprobs" in meta:
                meta["input_token_logprobs"] = []
        response.body = orjson.dumps(parsed)
