"""The merge of the prefill's input logprobs into a streamed decode answer, on its own
(gateway/edge/pd_logprobs.py): event framing over chunks, by index, and the fast path that
leaves a chunk as it came. tests/edge/test_pd.py sends such streams through the gateway."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.edge.pd_logprobs import StreamMerge, merge_event, prefill_logprobs

_END = b"\n\n"


def _events(raw: bytes) -> list[Any]:
    return [orjson.loads(e[len(b"data: ") :]) for e in raw.split(_END) if e.strip()]


PREFILL_LISTS = {0: [[None, 1, None], [-0.5, 2, None]], 1: [[None, 7, None]]}
# As prefill_logprobs gives them: each list's elements, serialised once.
PREFILL = {i: orjson.dumps(lp)[1:-1] for i, lp in PREFILL_LISTS.items()}


def _event(index: int | None, lp: list[Any] | None, text: str = "t") -> bytes:
    out: dict[str, Any] = {"text": text, "meta_info": {"id": "r"}}
    if lp is not None:
        out["meta_info"]["input_token_logprobs"] = lp
    if index is not None:
        out["index"] = index
    return b"data: " + orjson.dumps(out) + _END


def test_a_chunk_of_whole_events_without_the_key_leaves_as_the_same_object() -> None:
    merge = StreamMerge(PREFILL)
    chunk = _event(None, None) + _event(None, None)
    assert merge.feed(chunk) is chunk
    done = b"data: [DONE]\n\n"
    assert merge.feed(done) is done
    assert merge.flush() == b"" and merge.merged == 0


def test_an_event_split_over_chunks_is_merged_once_it_ends() -> None:
    merge = StreamMerge(PREFILL)
    event = _event(None, [[-1.0, 3, None]])
    cuts = [event[:5], event[5:-1], event[-1:]]
    outs = [merge.feed(c) for c in cuts]
    assert outs[:2] == [b"", b""]
    (got,) = _events(outs[2])
    assert got["meta_info"]["input_token_logprobs"] == [*PREFILL_LISTS[0], [-1.0, 3, None]]
    assert merge.merged == 1


def test_events_sharing_a_chunk_are_each_merged_by_index_and_a_tail_waits() -> None:
    merge = StreamMerge(PREFILL)
    second = _event(0, [])
    data = _event(1, []) + _event(None, None, "keep") + second[:10]
    first = _events(merge.feed(data))
    assert [e["meta_info"].get("input_token_logprobs") for e in first] == [PREFILL_LISTS[1], None]
    assert first[1]["text"] == "keep"
    (rest,) = _events(merge.feed(second[10:]))
    assert rest["meta_info"]["input_token_logprobs"] == PREFILL_LISTS[0]
    assert merge.merged == 2


def test_an_unended_event_at_the_streams_end_goes_out_as_it_came() -> None:
    merge = StreamMerge(PREFILL)
    cut = _event(None, [])[:-2]
    assert merge.feed(cut) == b""
    assert merge.flush() == cut


def test_an_index_the_prefill_did_not_answer_is_left_alone() -> None:
    event = _event(5, [[-1.0, 3, None]])
    assert merge_event(PREFILL, event[:-2]) is None


def test_prefill_logprobs_read_sse_and_whole_json_alike() -> None:
    lp = [[None, 1, None]]
    sse = _event(None, [[None, 9, None]]) + _event(None, lp) + b"data: [DONE]\n\n"
    assert prefill_logprobs(sse) == {0: b"[null,1,null]"}
    batch = orjson.dumps([{"meta_info": {"input_token_logprobs": lp}}, {"meta_info": {}}])
    assert prefill_logprobs(batch) == {0: b"[null,1,null]"}
    assert prefill_logprobs(b"not json") == {}


def test_an_empty_list_on_either_side_joins_without_a_stray_comma() -> None:
    for before, own in (([], [[-1.0, 3, None]]), ([[None, 1, None]], []), ([], [])):
        prefill = {0: orjson.dumps(before)[1:-1]}
        merged = merge_event(prefill, _event(None, own)[:-2])
        assert merged is not None
        got = orjson.loads(merged[len(b"data: ") :])
        assert got["meta_info"]["input_token_logprobs"] == before + own
