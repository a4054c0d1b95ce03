"""The Grafana dashboard and the Prometheus rules in deploy/monitoring, judged by the real
tools: promtool checks and unit-tests the rules, kubectl renders the kustomization, and a
real Prometheus scrapes a real gateway process in front of stub processes while scripted
traffic runs; every query of every dashboard panel must then return data from it.

promtool, prometheus and kubectl come from Debian packages (.ci/run installs prometheus);
without them these tests skip locally and fail under CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from tests.conftest import ROOT, free_port, gateway_process, start_stub_process

MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "rules.yaml"
DASHBOARD = MONITORING / "dashboard.json"
RENDER = ROOT / "scripts" / "render-dashboard.py"
JOB = "sglang-gateway"
WORKERS_JOB = "sglang-gateway-workers"
ENGINES_JOB = "sglang-engines"  # the engines' own /metrics, as an operator scrapes them
OPERATOR = "op-key-monitoring"
JSON = {"Content-Type": "application/json"}
PLAIN = orjson.dumps({"text": "hi", "sampling_params": {"top_k": 2}})
# Refused by every release's admission: a mask needs a finite top_k.
MASK = orjson.dumps({"text": "hi", "sampling_params": {"top_p": 0.9}, "return_sampling_mask": True})
STREAM = orjson.dumps({"text": "hi", "stream": True, "sampling_params": {"top_k": 2}})
# The series a panel reads: the gateway's own and the standard process_* / python_* ones.
# What Prometheus 2.x sends when it scrapes (scrape.go's acceptHeader): OpenMetrics first.
SCRAPE_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
SELECTOR = re.compile(r"\b((?:sglang_gateway|process|python)_\w+)(\{[^}]*\})?")
# The engines' series (SGLang's names), read by the prefix-cache panels.
ENGINE_SELECTOR = re.compile(r"\b(sglang:\w+)(\{[^}]*\})?")
# A prompt long enough for cache_aware's blocks, sent twice to see a match and a hit.
CACHED = orjson.dumps({"text": " ".join(f"w{i}" for i in range(300)), "sampling_params": {}})


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        package = "kubectl" if name == "kubectl" else "prometheus"
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; CI must run these tests (.ci/run)")
        pytest.skip(f"{name} is not installed here (apt-get install {package})")
    return path


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, input=stdin, capture_output=True, text=True, timeout=240, check=False, cwd=ROOT
    )


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


# -- rules ----------------------------------------------------------------------------------


def test_rules_pass_promtool_check() -> None:
    done = run(tool("promtool"), "check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_rules_unit_tests_pass() -> None:
    done = run(tool("promtool"), "test", "rules", str(MONITORING / "rules.test.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load((MONITORING / "rules.test.yaml").read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for rule in alerts():
        name = rule["alert"]
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name} is never tested firing"
        assert any(not c.get("exp_alerts") for c in mine), f"{name} is never tested quiet"


def test_every_alert_says_how_bad_and_what_happened() -> None:
    found = alerts()
    assert {"SGLangGatewayNoRoutableBackend", "SGLangGatewayRejectionSpike"} <= {
        r["alert"] for r in found
    }
    for rule in found:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]


def test_prometheusrule_carries_exactly_the_rules_file() -> None:
    resource = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_kustomization_renders_the_rules_and_a_dashboard_configmap() -> None:
    done = run(tool("kubectl"), "kustomize", str(MONITORING))
    assert done.returncode == 0, done.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(done.stdout)}
    assert set(docs) == {"ConfigMap", "PrometheusRule"}
    assert docs["PrometheusRule"]["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    cm = docs["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    [(name, text)] = cm["data"].items()
    assert name.endswith(".json")
    assert json.loads(text) == dashboard()


# -- dashboard ------------------------------------------------------------------------------


def test_dashboard_imports_anywhere() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36
    assert board["uid"]
    assert board["id"] is None  # an id belongs to one Grafana's database
    found = variables()
    assert found["datasource"]["type"] == "datasource"
    assert found["datasource"]["query"] == "prometheus"
    for name in ("job", "instance", "engine_job"):
        assert found[name]["type"] == "query"
        assert found[name]["datasource"]["uid"] == "${datasource}"
        assert found[name]["query"].startswith("label_values(")


def test_every_panel_queries_the_chosen_gateways() -> None:
    found = panels()
    assert len(found) >= 10
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in found]
    assert len(titles) == len(set(titles))  # the live test and the PNG name panels by title
    for panel in found:
        title = panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", title
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            assert target["datasource"]["uid"] == "${datasource}", title
            selectors = SELECTOR.findall(target["expr"])
            engine = ENGINE_SELECTOR.findall(target["expr"])
            assert selectors or engine, title
            # Every series read is narrowed by both variables, or a panel would mix in
            # gateways the viewer did not pick; an engine's by the engine jobs picked.
            for metric, matchers in selectors:
                assert 'job=~"$job"' in matchers, (title, metric)
                assert 'instance=~"$instance"' in matchers, (title, metric)
            for metric, matchers in engine:
                assert 'job=~"$engine_job"' in matchers, (title, metric)


# -- live: a gateway, its backends and Prometheus as real processes -----------------------


def grafana_regex(values: list[str]) -> str:
    """Variable values as Grafana writes them into a =~ matcher (regex-escaped, the
    backslash doubled again inside PromQL's string)."""
    escaped = [re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


class Prometheus:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def api(self, path: str, **params: str) -> Any:
        async with self.session.get(f"{self.url}/api/v1/{path}", params=params) as r:
            reply = await r.json()
        assert reply["status"] == "success", (path, params, reply)
        return reply["data"]

    async def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        data = await self.api("query", query=expr, time=str(at))
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    async def label_values(self, definition: str) -> list[str]:
        """label_values(selector, label), as Grafana's variable query runs it."""
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
        assert m, definition
        return list(await self.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)}))


@contextlib.asynccontextmanager
async def prometheus(tmp_path: Path, admin_port: int, engines: list[str]) -> AsyncIterator[str]:
    """Debian's prometheus on its own port and storage, scraping the admin listener every
    second and evaluating rules.yaml every second.

    Two more scrape jobs read the same listener into job WORKERS_JOB, one labelling it
    worker="0" and the other worker="1": the series a `--workers 2` gateway exposes (its
    supervisor adds `worker` to every sample), for queries that must not double count or
    fail to match with them. Job ENGINES_JOB scrapes the engines themselves.
    """
    port = free_port()
    target = f"127.0.0.1:{admin_port}"
    workers = [
        {
            "job_name": f"{WORKERS_JOB}-{w}",
            "static_configs": [{"targets": [target], "labels": {"worker": str(w)}}],
            "relabel_configs": [{"target_label": "job", "replacement": WORKERS_JOB}],
        }
        for w in range(2)
    ]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {"job_name": JOB, "static_configs": [{"targets": [target]}]},
                    *workers,
                    {
                        "job_name": ENGINES_JOB,
                        "static_configs": [
                            {"targets": [url.removeprefix("http://") for url in engines]}
                        ],
                    },
                ],
            }
        )
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        tool("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            async with asyncio.timeout(15):
                while True:
                    assert proc.returncode is None, (tmp_path / "prometheus.log").read_text()
                    with contextlib.suppress(aiohttp.ClientError):
                        async with s.get(f"{url}/-/ready") as r:
                            if r.status == 200:
                                break
                    await asyncio.sleep(0.1)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def stopped(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


async def abandoned_stream(
    session: aiohttp.ClientSession, base: str, started: asyncio.Event
) -> None:
    """A client that leaves a slow stream after its first events."""
    headers = {**JSON, "X-Stub-Chunk-Delay-Ms": "200", "X-Stub-Events": "100"}
    with pytest.raises(TimeoutError):
        async with session.post(
            f"{base}/generate",
            data=STREAM,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=1),
        ) as r:
            assert r.status == 200
            started.set()
            await r.read()


async def traffic(session: aiohttp.ClientSession, base: str, rounds: int) -> None:
    """Plain generations, refused mask requests, generations the backend drops before
    answering and ones it answers 503 itself, spread over time so that rates and quantiles
    have several scrapes to work on. A backend's 503s come between its 200s, never the
    five in a row that would eject it."""
    dropped = {**JSON, "X-Stub-Drop": "before-headers"}
    unavailable = {**JSON, "X-Stub-Status": "503"}
    for _ in range(rounds):
        for _ in range(2):
            async with session.post(f"{base}/generate", data=PLAIN, headers=JSON) as r:
                assert r.status == 200, await r.text()
        async with session.post(f"{base}/generate", data=MASK, headers=JSON) as r:
            assert r.status == 400, await r.text()
        async with session.post(f"{base}/generate", data=PLAIN, headers=dropped) as r:
            assert r.status == 502, await r.text()
        async with session.post(f"{base}/generate", data=PLAIN, headers=unavailable) as r:
            assert r.status == 503, await r.text()
        await asyncio.sleep(0.25)


async def control_calls(session: aiohttp.ClientSession, base: str) -> asyncio.Task[None]:
    """One control call of each result, and a stream its client abandons (returned: it
    ends when the client gives up)."""
    op = {"Authorization": f"Bearer {OPERATOR}"}
    async with session.post(f"{base}/flush_cache", headers=op) as r:
        assert r.status == 200, await r.text()
    async with session.post(f"{base}/flush_cache") as r:
        assert r.status == 403
    started = asyncio.Event()
    stream = asyncio.create_task(abandoned_stream(session, base, started))
    await started.wait()
    # Like SGLang, a backend with a request running refuses to flush: the call fails (502).
    async with session.post(f"{base}/flush_cache", headers=op) as r:
        assert r.status == 502, await r.text()
    return stream


async def backends_known(session: aiohttp.ClientSession, admin: str, n: int) -> None:
    """Until the gateway has read every backend's /server_info: before that a mask request
    is judged without the backend's release."""
    async with asyncio.timeout(10):
        while True:
            async with session.get(f"{admin}/metrics") as r:
                text = await r.text()
            if (
                len(re.findall(r'^sglang_gateway_backend_info\{[^}]*version="0\.5', text, re.M))
                == n
            ):
                return
            await asyncio.sleep(0.1)


Results = dict[str, list[dict[str, Any]]]


async def panel_data(prom: Prometheus, values: dict[str, str], at: float) -> Results:
    """Every panel's series, by title; each target must return data, not only NaN."""
    results: Results = {}
    for panel in panels():
        got = results.setdefault(panel["title"], [])
        for target in panel["targets"]:
            result = await prom.query(substitute(target["expr"], values), at)
            assert result, f"{panel['title']}: no data for {target['expr']} with {values}"
            assert any(not math.isnan(float(s["value"][1])) for s in result), (
                panel["title"],
                result,
            )
            got.extend(result)
    return results


def values_of(results: Results, title: str, **labels: str) -> list[float]:
    """The values of the panel's series that carry these labels (there must be some)."""
    found = [float(s["value"][1]) for s in results[title] if labels.items() <= s["metric"].items()]
    assert found, (title, labels, results[title])
    return found


@pytest.mark.heavy
async def test_every_panel_has_data_from_a_live_gateway(tmp_path: Path) -> None:
    promtool = tool("promtool")
    tool("prometheus")
    (steady, steady_url), (doomed, doomed_url) = await asyncio.gather(
        # With a prefix cache, so the engines count cached and prompt tokens.
        start_stub_process("--prefix-cache-tokens", "4096"),
        start_stub_process("--prefix-cache-tokens", "4096"),
    )
    config = yaml.safe_dump(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "backends": {
                "static": [steady_url, doomed_url],
                # For its decision counters. Prompts too short for a block (the scripted
                # traffic's) rotate over the backends, so the one that dies is sure to be
                # tried and ejected.
                "balancer": "cache_aware",
                "health": {"interval_s": 0.5, "timeout_s": 1, "unhealthy_threshold": 2},
                # Ejected for 3 s: long enough for scrapes a second apart to see it.
                "passive": {"base_eject_s": 3, "max_eject_s": 3},
            },
            "control": {"keys": [OPERATOR], "trusted_cidrs": []},
            "timeouts": {"shutdown_grace_s": 1},
        }
    )
    try:
        async with (
            gateway_process(config, tmp_path) as gw,
            prometheus(tmp_path, gw.admin, [steady_url, doomed_url]) as prom_url,
            aiohttp.ClientSession() as session,
        ):
            base = f"http://127.0.0.1:{gw.port}"
            target = f"127.0.0.1:{gw.admin}"
            admin = f"http://{target}"
            prom = Prometheus(session, prom_url)
            await backends_known(session, admin, 2)
            # Every scrape job (the gateway, the two posing as its workers, and the two
            # engines) has read the counters at 0 before the first event, or increase()
            # would miss it there.
            async with asyncio.timeout(10):
                while len(await prom.query("up == 1", time.time())) < 3 + 2:
                    await asyncio.sleep(0.2)
            began = time.time()

            # Once each: the gateway exports every counter whose labels it knows at 0 from
            # the start (outcomes, disconnect phases, control routes x results, each
            # member's attempts, errors by cause and responses by class), so rate() and
            # increase() see a first event.
            stream = await control_calls(session, base)
            await traffic(session, base, rounds=8)
            await stream

            await stopped(doomed)
            # Time for the gateway to see its idle connections to it close (a request on one
            # would fail as upstream_error, not be retried), well within the two probes
            # that mark it unhealthy: the next request to it must be a refused connect.
            await asyncio.sleep(0.1)
            await traffic(session, base, rounds=8)
            # One prompt twice, to the backend left: cache_aware matches the second where it
            # sent the first, and that engine reports it cached.
            for _ in range(2):
                async with session.post(f"{base}/generate", data=CACHED, headers=JSON) as r:
                    assert r.status == 200, await r.text()
                    assert "cached_tokens" in (await r.json())["meta_info"]
            await asyncio.sleep(2.5)  # two more scrapes and rule evaluations
            now = time.time()

            # The variables as Grafana resolves them, then every panel query with them:
            # for each job alone, and for "All".
            found = variables()
            jobs = await prom.label_values(found["job"]["query"])
            assert sorted(jobs) == [JOB, WORKERS_JOB]
            # The whole run in one window, so a quantile sees every request.
            window = f"{math.ceil(now - began) + 2}s"
            builtins = {"__rate_interval": window, "__range": window, "__interval": "1s"}
            data: dict[str, Results] = {}
            for job in jobs:
                values = {"job": grafana_regex([job])}
                instances = await prom.label_values(substitute(found["instance"]["query"], values))
                assert instances == [target]
                values["instance"] = grafana_regex(instances)
                engine_jobs = await prom.label_values(found["engine_job"]["query"])
                assert engine_jobs == [ENGINES_JOB]
                values["engine_job"] = grafana_regex(engine_jobs)
                data[job] = await panel_data(prom, values | builtins, now)
            every = {name: found[name]["allValue"] for name in ("job", "instance", "engine_job")}
            await panel_data(prom, every | builtins, now)

            # What the scripted traffic did shows where the panels say it does.
            def most(title: str, **labels: str) -> float:
                return max(values_of(data[JOB], title, **labels))

            assert most("Rejections by policy and reason", policy="sampling_mask") > 0
            assert most("Request outcomes", outcome="rejected:sampling_mask") > 0
            assert most("Request rate by route and status class", status_class="4xx") > 0
            assert most("Client disconnects by phase", phase="streaming") > 0
            for result in ("ok", "forbidden", "failed"):
                assert most("Control calls by route and result", result=result) > 0
            errors = "Upstream errors by backend and cause"
            assert most(errors, backend=steady_url, cause="upstream_error") > 0
            # A single event, on a series that was there at 0 before it.
            assert most(errors, backend=doomed_url, cause="connect_failed") > 0
            assert most("Upstream error ratio by backend", backend=steady_url) > 0
            responses = "Backend responses by status class"
            for status_class in ("2xx", "5xx"):
                assert most(responses, backend=steady_url, status_class=status_class) > 0
            # Answered 503 by the backend, 502 by the gateway (dropped before an answer):
            # only the first is the backend's own 5xx. One 503 in five forwarded requests.
            assert 0 < most("Backend 5xx ratio", backend=steady_url) < 0.5
            assert most("Passive ejections by backend", backend=doomed_url) > 0
            # The second of the two long prompts was matched and hit: the engines' figure and
            # the gateway's estimate are both above 0, and below 1 (the short prompts miss).
            for job in jobs:
                for rate in values_of(data[job], "Prefix-cache hit rate"):
                    assert 0 < rate < 1, data[job]["Prefix-cache hit rate"]
            assert 0 < max(values_of(data[JOB], "Prefix-cache hit rate by engine")) < 1
            decided = "cache_aware decisions by backend"
            assert most(decided, decision="matched") > 0
            assert most(decided, decision="no_prompt") > 0
            codes = {
                s["metric"]["status_code"]: float(s["value"][1])
                for s in data[JOB]["Top status codes"]
            }
            assert all(codes[code] > 0 for code in ("200", "400", "502", "503")), codes
            # The one refused flush is listed, but need not count: a requests_total series
            # (route, method and code are not known ahead) appears with its first request,
            # which increase() cannot see.
            assert "403" in codes, codes
            assert max(codes, key=codes.__getitem__) == "200", codes
            for job in jobs:
                assert min(values_of(data[job], "Gateway CPU")) > 0
                assert min(values_of(data[job], "Gateway resident memory")) > 2**20
            assert most("Upstream time to first byte", route="/generate") > 0
            for job in jobs:
                # Per gateway, not per worker: one unhealthy backend, one routable.
                assert values_of(data[job], "Backend pool by state", state="unhealthy") == [1]
                assert values_of(data[job], "Routable backends") == [1]
            # The backend that died: unhealthy now, ejected for a while, refused once.
            doomed_sel = f'job="{JOB}", backend="{doomed_url}"'
            refused = (
                f'sglang_gateway_upstream_errors_total{{{doomed_sel}, cause="connect_failed"}}'
            )
            checks = {
                f"sglang_gateway_backend_healthy{{{doomed_sel}}}": "0",
                f"max_over_time(sglang_gateway_backend_ejected{{{doomed_sel}}}[{window}])": "1",
                f"clamp_max({refused}, 1)": "1",
            }
            for expr, expected in checks.items():
                assert [s["value"][1] for s in await prom.query(expr, now)] == [expected], expr

            # The rules load and evaluate cleanly against real series.
            groups = (await prom.api("rules"))["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) == sum(
                len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"]
            )
            assert all(r["health"] == "ok" for r in rules), rules
            routable = await prom.query("sglang_gateway:backends_routable:sum", now)
            assert sorted(
                (s["metric"]["job"], s["metric"].get("worker", "")) for s in routable
            ) == [
                (JOB, ""),
                (WORKERS_JOB, "0"),
                (WORKERS_JOB, "1"),
            ]
            assert {s["value"][1] for s in routable} == {"1"}

            async with session.get(f"{admin}/metrics") as r:
                scraped = await r.text()
            checked = run(promtool, "check", "metrics", stdin=scraped)
            assert checked.returncode == 0, checked.stdout + checked.stderr
            assert checked.stdout.strip() == ""
            # Prometheus was answered in OpenMetrics: the series every panel read above came
            # that way (promtool checks the text format the gateway serves by default).
            async with session.get(f"{admin}/metrics", headers={"Accept": SCRAPE_ACCEPT}) as r:
                assert r.content_type == "application/openmetrics-text", r.headers
                assert (await r.text()).endswith("# EOF\n")

            png = tmp_path / "dashboard.png"
            drawn = run(
                sys.executable,
                str(RENDER),
                f"--prometheus={prom_url}",
                f"--out={png}",
                f"--start={began}",
                f"--end={now}",
                "--step=1",
                "--scrape-interval=1",
                f"--var=job={JOB}",
                f"--var=instance={target}",
                "--require-data",
            )
            assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    finally:
        await asyncio.gather(stopped(steady), stopped(doomed))

    assert f"{len(panels())} panels, 0 without data" in drawn.stdout, drawn.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib import image

    pixels = image.imread(png)
    assert pixels.shape[0] > 1000
    assert pixels.shape[1] > 1000
    assert pixels.std() > 0.05  # drawn, not a blank canvas
    # docs/dashboard.png is this picture: DASHBOARD_PNG=docs/dashboard.png python -m pytest ...
    if copy_to := os.environ.get("DASHBOARD_PNG"):
        shutil.copyfile(png, ROOT / copy_to)
