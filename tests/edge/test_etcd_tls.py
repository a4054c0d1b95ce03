"""etcd over TLS with client-certificate auth (mutual TLS, as kubeadm secures etcd), against
a real etcd (tests/etcd.py) serving https only with --client-cert-auth.

The certificates are made once per module by the openssl CLI: a CA with etcd's server
certificate (for IP 127.0.0.1) and a client certificate, and a second CA that signed
neither. What is checked: the client with the CA and its certificate reads and writes; one
without a certificate, or with the wrong CA, is refused with an error naming the endpoint
and why; a gateway given a key that is not its certificate's refuses to start, naming the
key file and never printing what it holds; a gateway over mutual TLS shares a registration
through etcd."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from gateway.config import EtcdConfig
from gateway.edge.etcd import EtcdClient
from gateway.fleet.kv import EtcdError
from gateway.testing.stub import StubBackend
from tests.conftest import gateway_process, spawn
from tests.etcd import EtcdServer, Pki, etcd_binary, make_pki, openssl_binary

PREFIX = "/tls-test/"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Another CA's files: it signed neither etcd's certificate nor the client's."""
    return make_pki(tmp_path_factory.mktemp("stranger"))


@pytest.fixture
async def etcd_tls(tmp_path: Path, pki: Pki) -> AsyncIterator[EtcdServer]:
    server = EtcdServer(etcd_binary(), tmp_path / "etcd-data", tls=pki)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def body_line(key_file: Path) -> str:
    """A line of the key's base64 body: it must appear in no output."""
    lines = key_file.read_text().splitlines()
    assert lines[0].startswith("-----BEGIN") and len(lines[1]) >= 40
    return lines[1]


async def test_mutual_tls_puts_and_reads(etcd_tls: EtcdServer, pki: Pki) -> None:
    assert etcd_tls.url.startswith("https://")
    client = EtcdClient(
        [etcd_tls.url],
        ca_file=str(pki.ca),
        cert_file=str(pki.client_cert),
        key_file=str(pki.client_key),
    )
    try:
        revision = await client.put(b"/tls/doc", b"over mutual TLS")
        kv, read_at = await client.get(b"/tls/doc")
        assert kv is not None and kv.value == b"over mutual TLS" and kv.mod_revision == revision
        assert read_at >= revision
    finally:
        await client.close()
    # Another client of the same cluster sees it: it went to etcd, not a cache.
    assert await etcd_tls.get("/tls/doc") == b"over mutual TLS"


async def test_no_client_certificate_is_refused(etcd_tls: EtcdServer, pki: Pki) -> None:
    client = EtcdClient([etcd_tls.url], ca_file=str(pki.ca), timeout_s=5)
    try:
        with pytest.raises(EtcdError) as refused:
            await client.put(b"/tls/anonymous", b"x")
    finally:
        await client.close()
    message = str(refused.value)
    assert etcd_tls.url in message
    assert "refused the TLS handshake" in message
    assert "state.etcd.cert_file" in message
    assert "Traceback" not in message and "\n" not in message
    assert await etcd_tls.get("/tls/anonymous") is None


async def test_a_ca_that_did_not_sign_etcd_is_refused(
    etcd_tls: EtcdServer, pki: Pki, stranger: Pki
) -> None:
    # The right client certificate, the wrong CA: the gateway refuses etcd, not etcd it.
    client = EtcdClient(
        [etcd_tls.url],
        ca_file=str(stranger.ca),
        cert_file=str(pki.client_cert),
        key_file=str(pki.client_key),
        timeout_s=5,
    )
    try:
        with pytest.raises(EtcdError) as refused:
            await client.get(b"/tls/doc")
    finally:
        await client.close()
    message = str(refused.value)
    assert etcd_tls.url in message
    assert "certificate verify failed" in message and "state.etcd.ca_file" in message
    assert "Traceback" not in message and "\n" not in message


async def test_a_certificate_with_a_common_name_is_named_once_auth_is_on(
    etcd_tls: EtcdServer, pki: Pki
) -> None:
    # etcd's JSON gateway, with auth on, refuses any client certificate that has a CN
    # (pki's is CN=client), password or not: the error says so, not "bad credentials".
    secret = "tls-Pass-4k"
    await etcd_tls.call("/v3/auth/user/add", {"name": "root", "password": secret})
    await etcd_tls.call("/v3/auth/role/add", {"name": "root"})
    await etcd_tls.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
    await etcd_tls.call("/v3/auth/enable", {})
    files = {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert)}
    for credentials in ({"username": "root", "password": secret}, {}):
        client = EtcdClient([etcd_tls.url], key_file=str(pki.client_key), **files, **credentials)
        try:
            with pytest.raises(EtcdError) as refused:
                await client.put(b"/tls/cn", b"x")
        finally:
            await client.close()
        message = str(refused.value)
        assert message.startswith(f"etcd at {etcd_tls.url} refuses a client certificate with")
        assert "Common Name" in message and "state.etcd.cert_file" in message
        assert "credentials" not in message and secret not in message


def test_a_key_that_is_not_the_certificates_is_refused_by_the_client(
    pki: Pki, stranger: Pki
) -> None:
    with pytest.raises(ValueError, match=r"^state\.etcd\.key_file '.*' is not the key of") as bad:
        EtcdClient(
            ["https://127.0.0.1:1"],
            ca_file=str(pki.ca),
            cert_file=str(pki.client_cert),
            key_file=str(stranger.client_key),
        )
    assert str(stranger.client_key) in str(bad.value)
    assert body_line(stranger.client_key) not in str(bad.value)


def test_config_refuses_tls_files_it_cannot_use(tmp_path: Path, pki: Pki, stranger: Pki) -> None:
    encrypted = tmp_path / "encrypted.key"
    encrypt = ["pkey", "-in", str(pki.client_key), "-aes256", "-passout", "pass:pw-Secret-1"]
    subprocess.run(
        [openssl_binary(), *encrypt, "-out", str(encrypted)], check=True, capture_output=True
    )
    cert, key = str(pki.client_cert), str(pki.client_key)
    cases = {
        (cert, None): r"cert_file and key_file go together",
        (None, key): r"cert_file and key_file go together",
        (cert, str(tmp_path / "absent.key")): r"key_file '.*absent\.key' is not a readable file",
        (cert, str(stranger.client_key)): r"key_file '.*' is not the key of cert_file '.*'",
        (cert, str(pki.ca)): r"key_file '.*ca\.crt' holds no PEM private key",
        (key, key): r"cert_file '.*client\.key' holds no PEM certificate",
        (cert, str(encrypted)): r"key_file '.*encrypted\.key' is encrypted",
    }
    for (cert_file, key_file), expected in cases.items():
        with pytest.raises(ValidationError, match=expected) as refused:
            EtcdConfig(
                endpoints=["https://127.0.0.1:1"],
                ca_file=str(pki.ca),
                cert_file=cert_file,
                key_file=key_file,
            )
        for pem in (pki.client_key, stranger.client_key, encrypted):
            assert body_line(pem) not in str(refused.value)
    # The pair that belongs together passes, with or without a CA of its own.
    assert EtcdConfig(endpoints=["https://e:1"], cert_file=cert, key_file=key).key_file == key
    # A CA file that holds no certificate is refused as well.
    with pytest.raises(ValidationError, match=r"ca_file '.*client\.key' holds no PEM certificate"):
        EtcdConfig(endpoints=["https://e:1"], ca_file=key)


def tls_config(etcd_url: str, seed: str, ca: Path, cert: Path, key: Path) -> str:
    return (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        f"backends:\n  discovery: registry\n  static: ['{seed}']\n"
        "  health: {interval_s: 0.1}\n"
        "logging: {access_log: false}\n"
        "state:\n  backend: etcd\n  etcd:\n"
        f"    endpoints: ['{etcd_url}']\n    prefix: {PREFIX}\n"
        f"    ca_file: {ca}\n    cert_file: {cert}\n    key_file: {key}\n"
        "    lease_ttl_s: 3\n    lock_wait_s: 1\n    timeout_s: 2\n"
    )


async def test_gateway_with_a_mismatched_pair_does_not_start(
    tmp_path: Path, pki: Pki, stranger: Pki
) -> None:
    key = stranger.client_key  # a real key, but not the one pki.client_cert was made for
    config = tmp_path / "gateway.yaml"
    config.write_text(
        tls_config("https://127.0.0.1:1", "http://127.0.0.1:1", pki.ca, pki.client_cert, key)
    )
    proc = await spawn(
        "gateway",
        "--config",
        str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2  # a config error's status
    text = (out + err).decode()
    naming = [line for line in text.splitlines() if str(key) in line]
    assert len(naming) == 1, text
    assert "is not the key of" in naming[0] and str(pki.client_cert) in naming[0]
    assert "Traceback" not in text
    assert body_line(key) not in text and "PRIVATE KEY" not in text


async def test_gateway_over_mutual_tls_shares_a_registration(
    etcd_tls: EtcdServer, pki: Pki, stubs: list[StubBackend], tmp_path: Path
) -> None:
    first, second, _ = stubs
    config = tls_config(etcd_tls.url, first.url, pki.ca, pki.client_cert, pki.client_key)
    async with gateway_process(config, tmp_path) as gw:
        base = f"http://127.0.0.1:{gw.port}"
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/workers", json={"url": second.url}) as r:
                assert r.status == 200, await r.text()
            async with s.get(base + "/workers") as r:
                listed = {w["url"] for w in (await r.json())["workers"]}
            async with s.get(f"http://127.0.0.1:{gw.admin}/readyz") as r:
                assert r.status == 200, await r.text()
        assert listed == {first.url, second.url}
        # The registration is in etcd (read by this test's own mutual-TLS client).
        doc = await etcd_tls.get(PREFIX + "doc")
        assert doc is not None and set(json.loads(doc)["members"]) == {first.url, second.url}
