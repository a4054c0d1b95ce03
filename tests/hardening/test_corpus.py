"""The adversarial corpus (tests/hardening/corpus.py) through a running gateway to the stub."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import orjson
import pytest

from tests import sglang_model as sglang
from tests.hardening.corpus import CASES, FORWARD, Case
from tests.hardening.live import LiveGateway, exchange


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    gw = LiveGateway().start()
    yield gw
    gw.stop()


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
    assert sum(c.expect == FORWARD for c in CASES) >= 20
    assert sum(c.expect != FORWARD for c in CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_corpus_case(live: LiveGateway, case: Case) -> None:
    rid = uuid.uuid4().hex
    headers = {"Content-Type": "application/json", "X-Request-Id": rid, **case.headers}
    content_type = headers.get("Content-Type")
    reading = sglang.read(case.method, case.path, case.body, content_type)
    # The expectation never contradicts SGLang's own reading.
    if reading.runs_unbounded_mask:
        assert case.expect != FORWARD, reading
    conn = live.connection()
    try:
        status, resp_headers, data = exchange(conn, case.method, case.path, case.body, headers)
    finally:
        conn.close()
    got = live.last_received()
    forwarded = got is not None and got.headers.get("X-Request-Id") == rid
    assert resp_headers.get("x-request-id") == rid
    if case.expect == FORWARD:
        assert forwarded, (status, data)
        assert got is not None
        assert got.body == case.body
        assert got.headers["Content-Length"] == str(len(case.body))
    else:
        assert not forwarded
        assert status == case.expect, data
        orjson.loads(data)  # a JSON error body
