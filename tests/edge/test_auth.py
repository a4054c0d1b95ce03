"""Optional client authentication (bearer keys) and backend credentials."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest

from gateway import config as config_mod
from gateway.app import Gateway, proxy_settings
from gateway.edge import auth as auth_mod
from gateway.edge.auth import ApiKeys
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, gw_url, last_proxied

KEY = "sk-gw-0123456789abcdef"
OK = orjson.dumps({"text": "x", "sampling_params": {"top_k": 3}})
JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def gw(stub: StubBackend, make_gateway: GatewayFactory) -> Gateway:
    return await make_gateway(
        stub.url, auth={"enabled": True, "keys": [KEY, "sk-other"], "exempt_paths": ["/health"]}
    )


@pytest.mark.parametrize(
    ("authorization", "reason"),
    [
        (None, "missing_key"),
        ("Bearer sk-wrong", "invalid_key"),
        (f"Basic {KEY}", "malformed_key"),
        ("Bearer ", "malformed_key"),
        (f"Bearer {KEY}x", "invalid_key"),
        (f"Bearer {KEY[:-1]}", "invalid_key"),
    ],
)
def test_key_check_reasons(authorization: str | None, reason: str) -> None:
    assert ApiKeys([KEY]).check(authorization) == reason
    assert ApiKeys([KEY]).check(f"bearer {KEY}") is None
    assert ApiKeys([KEY]).check(f"Bearer  {KEY} ") is None


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = auth_mod.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", counting)
    keys = ApiKeys(["k1", "k2", "k3", "k4"])
    for token in ("k1", "k4", "nope"):
        calls.clear()
        keys.check(f"Bearer {token}")
        assert len(calls) == 4  # no early exit on a match


async def test_missing_wrong_and_right_key(
    stub: StubBackend, gw: Gateway, session: aiohttp.ClientSession
) -> None:
    async def post(path: str, headers: dict[str, str]) -> tuple[int, bytes, str | None]:
        async with session.post(gw_url(gw, path), data=OK, headers={**JSON, **headers}) as r:
            return r.status, await r.read(), r.headers.get("WWW-Authenticate")

    status, body, challenge = await post("/generate", {})
    assert (status, challenge) == (401, "Bearer")
    assert orjson.loads(body) == {"error": {"message": "Missing or invalid API key."}}
    status, body, _ = await post("/v1/chat/completions", {"Authorization": "Bearer nope"})
    assert status == 401
    assert orjson.loads(body)["type"] == "AuthenticationError"
    status, _, _ = await post("/no/such/path", {})
    assert status == 401  # paths are not revealed before authentication
    assert stub.generation_requests() == []
    status, _, _ = await post("/generate", {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    # The client's key for the gateway is not forwarded to the backend.
    assert "Authorization" not in last_proxied(stub).headers


async def test_exempt_probe_path(
    stub: StubBackend, gw: Gateway, session: aiohttp.ClientSession
) -> None:
    async with session.get(gw_url(gw, "/health")) as r:
        assert r.status == 200
    async with session.get(gw_url(gw, "/model_info")) as r:
        assert r.status == 401


async def test_openai_sdk_with_key(stub: StubBackend, gw: Gateway) -> None:
    async with openai.AsyncOpenAI(base_url=gw_url(gw, "/v1"), api_key=KEY, max_retries=0) as c:
        resp = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert resp.choices[0].message.content
    async with openai.AsyncOpenAI(base_url=gw_url(gw, "/v1"), api_key="bad", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


async def test_upstream_credentials_replace_the_clients(
    stub: StubBackend, make_gateway: GatewayFactory, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    secret = tmp_path / "upstream"
    secret.write_text("Bearer sglang-api-key\n")
    gw = await make_gateway(stub.url, auth={"upstream_authorization_file": str(secret)})
    async with session.post(
        gw_url(gw, "/generate"), data=OK, headers={**JSON, "Authorization": "Bearer client"}
    ) as r:
        assert r.status == 200
    assert last_proxied(stub).headers.getall("Authorization") == ["Bearer sglang-api-key"]


async def test_keys_rotate_on_reload_and_never_reach_logs(
    stub: StubBackend,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated monthly\nsk-old-key-1\n")
    path = tmp_path / "gw.yaml"
    path.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        f"backends: {{static: ['{stub.url}']}}\n"
        f"auth: {{enabled: true, keys_file: '{keys}'}}\n"
    )
    gw = Gateway(config_mod.load(str(path)), config_path=str(path))
    await gw.start()
    caplog.set_level(logging.DEBUG)

    async def status(key: str) -> int:
        async with session.post(
            gw_url(gw, "/generate"), data=OK, headers={**JSON, "Authorization": f"Bearer {key}"}
        ) as r:
            await r.read()
            return r.status

    try:
        assert await status("sk-old-key-1") == 200
        keys.write_text("sk-new-key-2\n")
        assert await gw.reload()
        assert await status("sk-old-key-1") == 401
        assert await status("sk-new-key-2") == 200
        keys.unlink()
        assert not await gw.reload()  # unreadable key file: refused, old keys stay
        assert await status("sk-new-key-2") == 200
    finally:
        await gw.stop()
    assert "sk-old-key-1" not in caplog.text and "sk-new-key-2" not in caplog.text
    assert "rejected:auth" in caplog.text


async def test_check_config_never_prints_keys() -> None:
    cfg = config_mod.build(
        {
            "backends": {"static": ["http://127.0.0.1:1"]},
            "auth": {
                "enabled": True,
                "keys": ["sk-visible?"],
                "upstream_authorization": "Bearer x1",
            },
        }
    )
    dumped = cfg.model_dump_json()
    assert "sk-visible?" not in dumped and "Bearer x1" not in dumped


@pytest.mark.parametrize("value", ["Bearer a\r\nX-Injected: 1", "Bearer a\nb", "Bearer \x00"])
def test_upstream_credentials_with_control_characters_are_a_config_error(value: str) -> None:
    # The value goes into the upstream request head: a newline would inject a header.
    with pytest.raises(config_mod.ConfigError, match="one line"):
        config_mod.build(
            {
                "backends": {"static": ["http://127.0.0.1:1"]},
                "auth": {"upstream_authorization": value},
            }
        )


async def test_upstream_credentials_file_of_two_lines_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "upstream"
    secret.write_text("Bearer one\nX-Injected: 1\n")
    cfg = config_mod.build(
        {
            "backends": {"static": ["http://127.0.0.1:1"]},
            "auth": {"upstream_authorization_file": str(secret)},
        }
    )
    with pytest.raises(ValueError, match="one line"):
        proxy_settings(cfg)
