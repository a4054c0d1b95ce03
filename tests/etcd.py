"""A real etcd for tests: Debian's etcd-server on loopback ephemeral ports, a temporary data
directory, stopped (and restartable, for the fault tests) by the test that started it.

Without the binary a test that needs it skips locally and fails under CI (.ci/run installs
etcd-server as it installs Prometheus).

With `tls` (a Pki: a CA and the certificates it signed, made by the openssl CLI) the member
serves its clients over https only and asks each for a client certificate its CA signed
(--client-cert-auth, as kubeadm runs etcd); its peer URL stays plain http (one member)."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import free_port


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed; CI must run these tests (.ci/run)")
        pytest.skip("etcd is not installed here (apt-get install etcd-server)")
    return path


def openssl_binary() -> str:
    path = shutil.which("openssl")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("openssl is not installed; CI must run the etcd TLS tests")
        pytest.skip("openssl is not installed here")
    return path


@dataclass(frozen=True)
class Pki:
    """A CA and the PEM files it signed: etcd's server certificate for 127.0.0.1, a client's."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run([openssl_binary(), *map(str, args)], check=True, capture_output=True, timeout=30)


def _key(path: Path) -> Path:
    # P-256: generated in milliseconds, where an RSA key takes a noticeable share of a second.
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path)
    return path


def _signed(pki_dir: Path, name: str, ca: Path, ca_key: Path, extensions: str) -> Path:
    key = _key(pki_dir / f"{name}.key")
    csr, ext, cert = (pki_dir / f"{name}.{suffix}" for suffix in ("csr", "ext", "crt"))
    _openssl("req", "-new", "-key", key, "-subj", f"/CN={name}", "-out", csr)
    # The key identifiers and key usage a strict verifier (Python 3.13's default) wants.
    ext.write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n" + extensions
    )
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-days", "2", "-extfile", ext, "-out", cert,
    )  # fmt: skip
    return cert


def make_pki(pki_dir: Path) -> Pki:
    """A fresh CA in `pki_dir`, with a server and a client certificate signed by it."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    ca_key = _key(pki_dir / "ca.key")
    ca = pki_dir / "ca.crt"
    _openssl(
        "req", "-x509", "-new", "-key", ca_key, "-subj", f"/CN={pki_dir.name}-ca",
        "-days", "2", "-out", ca,
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    # clientAuth too: with --client-cert-auth, etcd's JSON gateway dials its own gRPC
    # server with the server certificate, which etcd then checks as a client's.
    server_cert = _signed(
        pki_dir, "server", ca, ca_key,
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
    )  # fmt: skip
    client_cert = _signed(pki_dir, "client", ca, ca_key, "extendedKeyUsage=clientAuth\n")
    return Pki(ca, ca_key, server_cert, pki_dir / "server.key", client_cert, pki_dir / "client.key")


def client_ssl(pki: Pki) -> ssl.SSLContext:
    """What a client that etcd accepts (the Pki's CA and client certificate) connects with."""
    context = ssl.create_default_context(cafile=pki.ca)
    context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


class _PortTaken(AssertionError):
    """etcd could not bind its port: another process took it first."""


class EtcdServer:
    """One single-member etcd; `stop` and `start` again keep its data (a restart)."""

    def __init__(self, binary: str, data_dir: Path, tls: Pki | None = None) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.tls = tls
        self.client_port = self.peer_port = 0
        self.url = ""
        self._ports(free_port(), free_port())
        self._started = False
        # This helper's own requests: as a client etcd accepts.
        self._ssl: ssl.SSLContext | bool = client_ssl(tls) if tls is not None else True
        self.proc: asyncio.subprocess.Process | None = None
        self.log = data_dir.parent / "etcd.log"

    async def start(self) -> None:
        # free_port() only finds a port free a moment ago: another process of a full run
        # can take it before etcd binds it (a fresh-clone CI run lost one so). A first
        # start moves to new ports; a restart keeps its URL, which clients hold.
        for attempt in range(3):
            try:
                await self._launch()
                self._started = True
                return
            except _PortTaken:
                if attempt == 2:
                    raise
                if self._started:
                    await asyncio.sleep(0.5)
                else:
                    # The failed start may have written a member with the old peer URL.
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                    self._ports(free_port(), free_port())

    def _ports(self, client: int, peer: int) -> None:
        self.client_port, self.peer_port = client, peer
        scheme = "https" if self.tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.client_port}"

    async def _launch(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = self.tls
        secured = (
            [
                f"--cert-file={tls.server_cert}",
                f"--key-file={tls.server_key}",
                f"--trusted-ca-file={tls.ca}",
                "--client-cert-auth",
            ]
            if tls is not None
            else []
        )
        logged = len(self.log.read_text()) if self.log.exists() else 0  # this launch's lines
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                "--name=test",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.url}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--initial-cluster-state=new",
                # Quick elections: a restarted single member leads within a second.
                "--heartbeat-interval=50",
                "--election-timeout=500",
                *secured,
                stdout=out,
                stderr=out,
            )
        async with aiohttp.ClientSession() as s, asyncio.timeout(20):
            while True:
                if self.proc.returncode is not None:
                    tail = self.log.read_text()[logged:][-2000:]
                    if "address already in use" in tail:
                        raise _PortTaken(tail)
                    raise AssertionError(tail)
                try:
                    async with s.get(self.url + "/health", ssl=self._ssl) as r:
                        if (
                            r.status == 200
                            and (await r.json(content_type=None)).get("health") == "true"
                        ):
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(self.url + path, json=body, ssl=self._ssl) as r,
        ):
            data: dict[str, Any] = await r.json(content_type=None)
            assert r.status == 200, data
            return data

    async def revision(self) -> int:
        head = await self.call("/v3/kv/range", {"key": b64(b"\0")})
        return int(head["header"]["revision"])

    async def compact(self) -> int:
        """Compact the whole history up to now; the revision compacted at."""
        revision = await self.revision()
        await self.call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    async def get(self, key: str) -> bytes | None:
        found = await self.call("/v3/kv/range", {"key": b64(key.encode())})
        kvs = found.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    server = EtcdServer(etcd_binary(), tmp_path / "etcd-data")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
