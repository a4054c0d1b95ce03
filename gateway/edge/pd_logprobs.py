"""The prefill's input logprobs merged into a streamed decode answer (backends.mode: pd).

In a pair the prefill engine computes the prompt, so only its answer has the prompt's
`meta_info.input_token_logprobs`; the decode engine's events carry its own (empty, or the
last token's). As sglang-router merges them, an event of the decode's stream that carries
`input_token_logprobs` gets the prefill's in front of its own. Unlike sglang-router, which
reads the prefill's answer as one JSON document (a streamed prefill answer, SSE, gives it
nothing to merge) and merges only a network chunk that is exactly one event, the prefill's
answer is read as SSE or JSON alike, and the decode's stream is cut at event boundaries, so
an event split over chunks or sharing one is merged too. Items of a batch are matched by
their `index`.

The relay stays a relay: a chunk of whole events without the key leaves as it came (the
same object, no copy); only an event that carries the key is parsed and re-serialised, with
the prefill's list serialised once per item and spliced in as bytes (a 32k-token prompt's
list would otherwise be built and written again for every token streamed); the
bytes of an event not yet ended wait for its end (up to TAIL_MAX_BYTES, beyond which the
rest of the stream is relayed as it comes, unmerged).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

KEY: Final = b'"input_token_logprobs"'
_END: Final = b"\n\n"
_DATA: Final = b"data:"
# The most of one unfinished event held for its end; SGLang writes an event in one piece.
TAIL_MAX_BYTES: Final = 64 << 20

# Each item's list by index, read from the prefill's answer; Serialised, the same as each
# list's JSON elements without the brackets, ready to splice into an event.
Logprobs = dict[int, list[Any]]
Serialised = dict[int, bytes]


def _take(found: Logprobs, out: object, default: int) -> None:
    if not isinstance(out, dict):
        return
    meta = out.get("meta_info")
    lp = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(lp, list):
        return
    index = out.get("index", default)
    if isinstance(index, int) and not isinstance(index, bool):
        found[index] = lp  # SGLang repeats the whole list in each event: the last one holds


def _payload(event: bytes) -> bytes | None:
    """The data of an event written as SGLang writes one: a single `data:` line."""
    event = event.strip(b"\r\n")
    if not event.startswith(_DATA) or b"\n" in event:
        return None
    return event[len(_DATA) :].strip()


def _read(body: bytes) -> Logprobs:
    """Each item's input_token_logprobs in the prefill's answer, by index (0 for a single
    request); the answer may be SSE events or one JSON document (a list for a batch)."""
    found: Logprobs = {}
    start = body.lstrip()[:1]
    if start in (b"{", b"["):
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return found
        for i, out in enumerate(parsed if isinstance(parsed, list) else [parsed]):
            _take(found, out, i)
        return found
    for event in body.split(_END):
        data = _payload(event) if KEY in event else None
        if data is None:
            continue
        try:
            _take(found, orjson.loads(data), 0)
        except orjson.JSONDecodeError:
            continue
    return found


def prefill_logprobs(body: bytes) -> Serialised:
    """The prefill answer's input logprobs (see _read), each serialised once."""
    serialised: Serialised = {}
    for index, lp in _read(body).items():
        try:
            serialised[index] = orjson.dumps(lp)[1:-1]
        except orjson.JSONEncodeError:  # an integer beyond 64 bits: that item unmerged
            continue
    return serialised


def merge_event(prefill: Serialised, event: bytes) -> bytes | None:
    """One decode event (without its blank line) with the prefill's input logprobs in
    front of its own; None where it has none to merge."""
    data = _payload(event)
    if data is None:
        return None
    try:
        out = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(out, dict):
        return None
    meta = out.get("meta_info")
    own = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    index = out.get("index", 0)
    before = prefill.get(index) if isinstance(index, int) else None
    if not isinstance(own, list) or before is None:
        return None
    assert isinstance(meta, dict)
    try:
        mine = orjson.dumps(own)[1:-1]
        joined = b"[" + before + (b"," if before and mine else b"") + mine + b"]"
        meta["input_token_logprobs"] = orjson.Fragment(joined)
        return b"data: " + orjson.dumps(out)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: the event as it came
        return None


class StreamMerge:
    """Feeds a decode stream's chunks through the merge, event by event."""

    __slots__ = ("_held", "_held_bytes", "_prefill", "merged", "off")

    def __init__(self, prefill: Serialised) -> None:
        self._prefill = prefill
        self._held: list[bytes] = []
        self._held_bytes = 0
        self.off = not prefill  # nothing to merge: every chunk as it came
        self.merged = 0  # events merged, for the tests and the log

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream can go to the client now that `chunk` came."""
        if self.off:
            return chunk
        held = self._held
        if not held and chunk.endswith(_END) and KEY not in chunk:
            return chunk
        # A boundary may straddle the held bytes and this chunk ("\n" | "\n").
        joins = bool(held) and held[-1].endswith(b"\n") and chunk.startswith(b"\n")
        if _END not in chunk and not joins:
            held.append(chunk)
            self._held_bytes += len(chunk)
            if self._held_bytes > TAIL_MAX_BYTES:
                self.off = True
                return self.flush()
            return b""
        data = b"".join((*held, chunk)) if held else chunk
        held.clear()
        end = data.rfind(_END) + len(_END)
        whole, tail = data[:end], data[end:]
        if tail:
            held.append(tail)
        self._held_bytes = len(tail)
        if KEY not in whole:
            return whole
        events = whole.split(_END)
        events.pop()  # the empty rest after the last boundary
        pieces: list[bytes] = []
        for event in events:
            merged = merge_event(self._prefill, event) if KEY in event else None
            if merged is not None:
                self.merged += 1
            pieces += (event if merged is None else merged, _END)
        return b"".join(pieces)

    def flush(self) -> bytes:
        """The bytes of an unfinished event, as they came, at the stream's end."""
        rest = b"".join(self._held)
        self._held.clear()
        self._held_bytes = 0
        return rest
