"""Every reply the gateway makes itself names no internals (issue 5, item 4).

No backend address, no stack trace, no Python exception text in any body the gateway writes;
the detail goes to the log under the request id instead. Upstream failures (502/503/504) are
covered with the fault backends in test_faults.py; malformed HTTP in test_bad_inputs.py.
"""

from __future__ import annotations

import logging

import aiohttp
import orjson
import pytest

from gateway.server import Gateway
from gateway.stub import StubBackend
from tests.conftest import gw_url
from tests.hardening.checks import assert_no_internals

JSON = {"Content-Type": "application/json"}
MASK = orjson.dumps({"text": "x", "return_sampling_mask": True})


def _access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status"),
    [
        ("/generate", MASK, JSON, 400),
        ("/v1/chat/completions", b'{"messages": [], "return_sampling_mask": 1}', JSON, 400),
        ("/generate", b'{"text": "x",', JSON, 400),
        ("/generate", b'{"text": "x"} trailing', JSON, 400),
        ("/generate", b"\xef\xbb\xbf{}", JSON, 400),
        ("/generate", b'{"a": NaN}', JSON, 400),
        ("/generate", b'{"a": "\\ud800"}', JSON, 400),
        ("/generate", b'{"a": "\xff"}', JSON, 400),
        ("/generate", b"[" * 2000, JSON, 400),
        ("/generate", b'{"sampling_params": {"top_k": "5"}}', JSON, 400),
        ("/generate", b'{"return_sampling_mask": "maybe"}', JSON, 400),
        ("/generate", b"{}", {"Content-Type": "text/plain"}, 415),
        ("/generate", b"{}", {**JSON, "Content-Encoding": "gzip"}, 415),
        ("/generate", b"{}", {"Content-Type": "application/json; charset=koi8-r"}, 415),
        ("/nope", b"", {}, 404),
    ],
)
async def test_rejections_name_no_internals(
    stub: StubBackend,
    gateway: Gateway,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    async with session.post(gw_url(gateway, path), data=body, headers=headers) as r:
        assert r.status == status
        data = await r.read()
        rid = r.headers["X-Request-Id"]
    assert_no_internals(data, addresses=[stub.url])
    assert orjson.loads(data)
    records = [rec for rec in _access_records(caplog) if rec["request_id"] == rid]
    assert len(records) == 1 and records[0]["status"] == status


async def test_invalid_json_detail_goes_to_the_log(
    stub: StubBackend,
    gateway: Gateway,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The parser's own words are for the operator (under the request id), not the client."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    async with session.post(gw_url(gateway, "/generate"), data=b'{"a": 1,}', headers=JSON) as r:
        assert r.status == 400
        message = (await r.json())["message"]
        rid = r.headers["X-Request-Id"]
    assert message.startswith("Invalid JSON body")
    assert "line 1, column 8" in message  # where, in plain words
    assert_no_internals(message.encode())
    (record,) = [rec for rec in _access_records(caplog) if rec["request_id"] == rid]
    assert "trailing comma" in str(record["detail"])
