"""The command line as an operator uses it: real processes, real signals."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator
from importlib import metadata
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from gateway import cli
from gateway.testing.stub import StubBackend
from tests.conftest import ROOT, read_match, spawn, start_stub_process


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await spawn(
        "gateway",
        *args,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.heavy
async def test_check_config_prints_the_frozen_config_as_yaml(tmp_path: Path) -> None:
    code, out, _ = await run_cli("--check-config", "--backend", "http://127.0.0.1:30000")
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["backends"]["static"] == ["http://127.0.0.1:30000"]
    assert cfg["policy"]["sampling_mask"]["mode"] == "enforce"
    # The format it reads: saved and read back, it is the same config.
    saved = tmp_path / "saved.yaml"
    saved.write_text(out)
    code, again, _ = await run_cli("--check-config", "--config", str(saved))
    assert code == 0
    assert again == out
    code, as_json, _ = await run_cli("--check-config", "--json", "--config", str(saved))
    assert code == 0
    assert orjson.loads(as_json) == cfg


@pytest.mark.heavy
async def test_every_key_settable_from_the_environment(tmp_path: Path) -> None:
    """File, then environment over it, then flags over both."""
    file = tmp_path / "gw.yaml"
    file.write_text(
        "backends: {static: ['http://127.0.0.1:1']}\nlisten: {port: 8000}\n"
        "timeouts: {client_keepalive_s: 11}\nlogging: {format: text}\n"
    )
    env = {
        "SGLANG_GATEWAY_LISTEN__PORT": "9000",
        "SGLANG_GATEWAY_TIMEOUTS__CLIENT_KEEPALIVE_S": "12.5",
        "SGLANG_GATEWAY_POLICY__SAMPLING_MASK__MODE": "log_only",
        "SGLANG_GATEWAY_BACKENDS__STATIC": "[http://127.0.0.1:2, 'http://127.0.0.1:3']",
        "SGLANG_GATEWAY_LOGGING__ACCESS_LOG": "false",
        "SGLANG_GATEWAY_REVISION": "abc",  # no '__': the build's variable, not a config key
    }
    code, out, err = await run_cli("--check-config", "--config", str(file), env=env)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["listen"]["port"] == 9000
    assert cfg["timeouts"]["client_keepalive_s"] == 12.5
    assert cfg["policy"]["sampling_mask"]["mode"] == "log_only"
    assert cfg["backends"]["static"] == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert cfg["logging"] == {"level": "info", "access_log": False, "format": "text"}
    code, out, _ = await run_cli(
        "--check-config",
        "--config",
        str(file),
        "--port",
        "7000",
        "--backend",
        "http://h:4",
        env=env,
    )
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["listen"]["port"] == 7000
    assert cfg["backends"]["static"] == ["http://h:4"]


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (
            "SGLANG_GATEWAY_LISTEN__PROT",
            "1",
            r"listen\.prot: value 1: Extra inputs.*\n"
            r"\(set from the environment: SGLANG_GATEWAY_LISTEN__PROT\)",
        ),
        ("SGLANG_GATEWAY_LISTEN__PORT", "eighty", r"listen\.port: value 'eighty'"),
        ("SGLANG_GATEWAY_LISTEN____PORT", "1", r"SGLANG_GATEWAY_LISTEN____PORT: an empty key"),
        ("SGLANG_GATEWAY_LISTEN__PORT", "[1", r"SGLANG_GATEWAY_LISTEN__PORT: not a valid YAML"),
    ],
)
async def test_a_bad_environment_key_is_a_config_error(
    name: str, value: str, expected: str
) -> None:
    code, _, err = await run_cli("--check-config", "--backend", "http://h:1", env={name: value})
    assert code == 2
    assert re.search(expected, err), err


def test_example_configs_are_valid(capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted((ROOT / "config").glob("*.yaml"))
    assert files
    for path in files:
        code = cli.main(["--check-config", "--config", str(path)])
        assert code == 0, (path, capsys.readouterr().err)


def test_example_configs_name_the_namespace_the_manifests_use() -> None:
    """The examples are copied next to the overlays and the chart: a Kubernetes namespace
    they name (a Service's DNS name, backends.kubernetes.namespace, in effect or in a
    comment) is the one the ingress overlay and the chart's README commands install into."""
    overlay = yaml.safe_load(
        (ROOT / "deploy/kubernetes/overlays/ingress/kustomization.yaml").read_text()
    )
    assert overlay["namespace"] == "sglang"
    named = re.compile(r"\.([a-z0-9-]+)\.svc\.cluster\.local|namespace: ([a-z0-9-]+)")
    found = {}
    for path in sorted((ROOT / "config").glob("*.yaml")):
        # A config of its own overlay names that overlay's namespace (rl-filter-replicas:
        # its etcd in sglang-rl); the others, the ingress overlay's and the chart's.
        own = ROOT / "deploy/kubernetes/overlays" / path.stem / "kustomization.yaml"
        expected = yaml.safe_load(own.read_text())["namespace"] if own.is_file() else "sglang"
        for m in named.finditer(path.read_text()):
            found.setdefault(path.name, set()).add(m.group(1) or m.group(2))
        assert found.get(path.name, {expected}) == {expected}, (path.name, found[path.name])
    assert found


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        (
            "backends: {static: [http://a:1]}\nlisten: {prot: 8080}\n",
            r"listen\.prot: value 8080: Extra inputs",
        ),
        (
            "backends: {static: ['ftp://x']}\n",
            r"backends\.static\[0\]: value 'ftp://x': must be an http",
        ),
        ("backends: {static: []}\n", r"backends: .*at least one URL"),
        (
            "backends: {static: [http://a:1]}\nlisten: {port: 70000}\n",
            r"listen\.port: value 70000: .*less than or equal",
        ),
        (
            "backends: {static: [http://a:1]}\nroutes: {passthrough: [/generate]}\n",
            r"routes: .*generation routes cannot be passthrough: /generate",
        ),
        (
            "backends: {static: [http://a:1]}\nstate: {backend: etcd}\n",
            r"state: .*state\.backend: etcd needs state\.etcd\.endpoints",
        ),
        (
            "backends: {static: [http://a:1]}\n"
            "state: {backend: etcd, etcd: {endpoints: ['ftp://e:1']}}\n",
            r"state\.etcd\.endpoints\[0\]: must be an http",
        ),
        (
            "backends: {static: [http://a:1]}\n"
            "state: {backend: etcd, etcd: {endpoints: ['http://e:1'], prefix: x}}\n",
            r"state\.etcd\.prefix: must start and end with '/'",
        ),
        (
            "backends: {static: [http://a:1]}\n"
            "state: {backend: etcd, etcd: {endpoints: ['http://e:1'], password: pw-Secret-1}}\n",
            r"state\.etcd: username and a password",
        ),
        (
            "backends: {static: [http://a:1]}\n"
            "state: {backend: etcd, etcd: {endpoints: ['https://e:1'], cert_file: /c.pem}}\n",
            r"state\.etcd: cert_file and key_file go together",
        ),
        (
            "backends: {static: [http://a:1]}\nstate: {etcd: {endpoints: ['http://e:1']}}\n",
            r"state: .*backend is local",
        ),
        ("- just\n- a list\n", r"top level must be a mapping"),
        ("backends: {static: [http://a:1]\n", r"not valid YAML"),
    ],
)
def test_bad_config_exits_2_with_path_value_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str, expected: str
) -> None:
    """In-process: the CLI's own entry point, its exit code and what it prints."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml_text)
    code = cli.main(["--config", str(cfg), "--check-config"])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(expected, err), err


async def test_refuses_to_run_without_the_c_parser() -> None:
    code, _, err = await run_cli(
        "--backend", "http://127.0.0.1:9", "--port", "0", env={"AIOHTTP_NO_EXTENSIONS": "1"}
    )
    assert code == 1
    assert "C HTTP parser" in err


@pytest.fixture
async def gateway_process(
    stub: StubBackend,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, int]]:
    proc = await spawn(
        "gateway",
        *("--backend", stub.url, "--host", "127.0.0.1", "--port", "0", "--admin-port", "0"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    m = await read_match(
        proc.stderr, r"listening on 127\.0\.0\.1:(\d+) \(admin 127\.0\.0\.1:(\d+)\)"
    )
    yield proc, int(m.group(1)), int(m.group(2))
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def test_sigterm_drains_streams_then_exits_0(
    stub: StubBackend, gateway_process: tuple[asyncio.subprocess.Process, int, int]
) -> None:
    proc, port, admin = gateway_process
    body = orjson.dumps({"text": "x", "stream": True, "sampling_params": {"top_k": 2}})
    hdrs = {
        "Content-Type": "application/json",
        "X-Stub-Chunk-Delay-Ms": "100",
        "X-Stub-Events": "10",
    }
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{admin}/livez") as r:
            assert r.status == 200
        async with s.post(f"http://127.0.0.1:{port}/generate", data=body, headers=hdrs) as r:
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            async with s.get(f"http://127.0.0.1:{admin}/readyz") as ready:
                assert ready.status == 503
                assert (await ready.json())["reason"] == "draining"
            with pytest.raises(aiohttp.ClientConnectorError):
                async with s.get(f"http://127.0.0.1:{port}/health") as _:
                    pass
            rest = await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert await asyncio.wait_for(proc.wait(), timeout=10) == 0


async def test_stub_runs_as_a_module() -> None:
    proc, url = await start_stub_process()
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0


@pytest.mark.heavy
async def test_sighup_reloads_the_config_file(stub: StubBackend, tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    base = (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        f"backends: {{static: ['{stub.url}']}}\n"
    )
    path.write_text(base + "policy: {sampling_mask: {mode: enforce}}\n")
    proc = await spawn(
        "gateway",
        "--config",
        str(path),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    unbounded = orjson.dumps({"text": "x", "return_sampling_mask": True})

    async def wait_line(pattern: str) -> re.Match[str]:
        return await read_match(proc.stderr, pattern)

    try:
        port = int((await wait_line(r"listening on 127\.0\.0\.1:(\d+)")).group(1))
        url = f"http://127.0.0.1:{port}/generate"
        async with aiohttp.ClientSession() as s:
            async with s.post(
                url, data=unbounded, headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 400
            assert stub.generation_requests() == []
            path.write_text(base + "policy: {sampling_mask: {mode: log_only}}\n")
            proc.send_signal(signal.SIGHUP)
            await wait_line("config reloaded")
            async with s.post(
                url, data=unbounded, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
            assert [r.body for r in stub.generation_requests()] == [unbounded]
            path.write_text("listen: {prot: 1}\n")
            proc.send_signal(signal.SIGHUP)
            await wait_line("reload refused")
            async with s.post(
                url, data=unbounded, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
            assert len(stub.generation_requests()) == 2  # still log_only
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0


async def test_version_names_the_release_revision_and_runtime() -> None:
    env = {**os.environ, "SGLANG_GATEWAY_REVISION": "abc1234"}
    proc = await spawn("gateway", "--version", stdout=asyncio.subprocess.PIPE, env=env)
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    line = out.decode().strip()
    version = metadata.version("sglang-gateway")
    assert re.fullmatch(
        rf"sglang-gateway {re.escape(version)} \(revision abc1234; Python \d+\.\d+\.\d+, "
        rf"aiohttp {re.escape(metadata.version('aiohttp'))}; (compiled|pure) build\)",
        line,
    ), line


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SGLANG_GATEWAY_LISTEN__PORT": "010"}, ("listen", "port", 10)),  # not octal
        (
            {"SGLANG_GATEWAY_BACKENDS__HASH_HEADER": "X-Session #1"},
            ("backends", "hash_header", "X-Session #1"),
        ),
        ({"SGLANG_GATEWAY__LISTEN__PORT": "1"}, ("listen", "port", 8080)),  # "__" at the prefix
        ({"SGLANG_GATEWAY_SERVICE_HOST": "10.0.0.1"}, ("listen", "port", 8080)),  # k8s' own
    ],
)
async def test_environment_values_are_read_as_written(
    env: dict[str, str], expected: tuple[str, str, object]
) -> None:
    """A plain value is kept as text but for true/false, null and decimal numbers: YAML
    1.1's octal, base-60 numbers, yes/no and '#' comments do not apply."""
    section, key, want = expected
    code, out, err = await run_cli("--check-config", "--backend", "http://h:1", env=env)
    if want is None:
        assert code == 2, out
        return
    assert code == 0, err
    assert yaml.safe_load(out)[section][key] == want


@pytest.mark.parametrize(
    "env",
    [
        {"SGLANG_GATEWAY_AUTH__KEYS": "sk-supersecret-1"},  # a string where a list belongs
        {
            "SGLANG_GATEWAY_AUTH__KEYS": "[sk-supersecret-1]",
            "SGLANG_GATEWAY_AUTH__KEYS_FILE": "/no",
        },
        {"SGLANG_GATEWAY_AUTH__UPSTREAM_AUTHORIZATION": '"Bearer sk-supersecret-1\\x01"'},
        {"SGLANG_GATEWAY_CONTROL__KEYS": "[*sk-supersecret-1]"},  # a YAML alias: unparseable
        {"SGLANG_GATEWAY_TRACING__ENDPOINT": "http://u:sk-supersecret-1@h:4318/v1/traces"},
        {"SGLANG_GATEWAY_TRACING__HEADERS": '{authorization: "Bearer sk-supersecret-1\\x01"}'},
    ],
)
async def test_a_config_error_never_prints_a_secret(env: dict[str, str]) -> None:
    code, out, err = await run_cli("--check-config", "--backend", "http://h:1", env=env)
    assert code == 2
    assert "supersecret" not in out + err, err
    assert "invalid config" in err


@pytest.mark.parametrize(
    "url", ["http://alice:sk-supersecret-1@10.0.0.1:30000", "http://sk-supersecret-1@10.0.0.1:1"]
)
async def test_a_backend_url_refused_for_its_credentials_does_not_print_them(
    tmp_path: Path, url: str
) -> None:
    src = tmp_path / "gw.yaml"
    src.write_text(f"backends: {{static: ['{url}']}}\n")
    code, out, err = await run_cli("--check-config", "--config", str(src))
    assert code == 2
    assert "supersecret" not in out + err, err
    assert "backends.static[0]" in err and "credentials" in err


@pytest.mark.heavy
async def test_the_mask_check_config_prints_is_refused_as_a_secret(tmp_path: Path) -> None:
    """Saved --check-config output holds "**********" where each secret was: running it
    would make that string an operator key."""
    src = tmp_path / "gw.yaml"
    src.write_text("backends: {static: ['http://h:1']}\ncontrol: {keys: [op-key-1]}\n")
    code, out, _ = await run_cli("--check-config", "--config", str(src))
    assert code == 0
    assert "op-key-1" not in out
    saved = tmp_path / "saved.yaml"
    saved.write_text(out)
    code, _, err = await run_cli("--check-config", "--config", str(saved))
    assert code == 2
    assert "control.keys[0]" in err and "the mask --check-config prints" in err
