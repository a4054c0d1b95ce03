"""Discovery failures as an operator meets them: what the log says, what the metrics count,
what /readyz names, and how soon discovery asks again.

A gateway in front of stub backends, its Kubernetes API a fake API server on loopback
(tests/fleet/kubeapi.py) that refuses as a real one does: a token it does not accept, a
RoleBinding that is missing or removed at run time, an expired watch, an API server that
goes away and comes back. DNS answers come from a scripted resolver. The API and the
resolver (and, for the backoff, the sleep) are the only seams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway import config as config_mod
from gateway.app import Gateway
from gateway.config import ConfigError
from gateway.edge.clients import KubernetesApi
from gateway.fleet.discovery import KubernetesDiscovery, api_message
from gateway.testing.stub import StubBackend
from tests.conftest import GatewayFactory, admin_url, wait_for
from tests.fleet.kubeapi import SA_USER, FakeKubernetesApi

DISCOVERY = "gateway.fleet.discovery"
K8S_CAUSES = ("unauthorized", "forbidden", "gone", "unreachable", "bad_response", "empty")
DNS_CAUSES = ("unreachable", "bad_response", "empty")
DNS_NAME = "sglang-workers.sglang.svc.cluster.local"


async def samples(session: aiohttp.ClientSession, gw: Gateway) -> dict[tuple[str, str], float]:
    """Every sample of the scrape, keyed by name and its labels as `k=v,k=v` (sorted)."""
    async with session.get(admin_url(gw, "/metrics")) as r:
        text = await r.text()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def errors(m: dict[tuple[str, str], float], source: str, cause: str) -> float | None:
    return m.get(("sglang_gateway_discovery_errors_total", f"cause={cause},source={source}"))


def failing(m: dict[tuple[str, str], float], source: str) -> float | None:
    return m.get(("sglang_gateway_discovery_failing", f"source={source}"))


async def readyz(session: aiohttp.ClientSession, gw: Gateway) -> tuple[int, str]:
    async with session.get(admin_url(gw, "/readyz")) as r:
        return r.status, (await r.json())["reason"]


def discovery_lines(caplog: pytest.LogCaptureFixture, level: int | None = None) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == DISCOVERY and (level is None or r.levelno == level)
    ]


@pytest.fixture
async def backend() -> Any:
    stub = StubBackend()
    await stub.start()
    yield stub
    await stub.stop()


@pytest.fixture
async def api(backend: StubBackend) -> Any:
    fake = FakeKubernetesApi()
    port = int(backend.url.rsplit(":", 1)[1])
    fake.put(fake.endpoint_slice("sglang-a", [("127.0.0.1", True)], port), "ADDED")
    await fake.start()
    yield fake
    await fake.stop()


def token_file(tmp_path: Path, token: str) -> Path:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    return path


async def kubernetes_gateway(
    make_gateway: GatewayFactory, api: FakeKubernetesApi, token: Path, **kube: Any
) -> Gateway:
    return await make_gateway(
        backends={
            "discovery": "kubernetes",
            "kubernetes": {
                "namespace": "llm",
                "service": "sglang",
                "port_name": "http",
                "api_server": api.url,
                "token_file": str(token),
                "ca_file": None,
                "resync_s": 0.5,
                **kube,
            },
        }
    )


# -- 403: a RoleBinding missing, then removed at run time -------------------------------------


async def test_a_forbidden_list_names_the_user_and_the_missing_permission(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    backend: StubBackend,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DISCOVERY)
    api.tokens = {"sa-token-1"}
    api.granted = set()  # the RoleBinding is not there yet
    gw = await kubernetes_gateway(make_gateway, api, token_file(tmp_path, "sa-token-1"))
    await wait_for(lambda: any("HTTP 403" in line for line in discovery_lines(caplog)), 10)
    line = next(line for line in discovery_lines(caplog) if "HTTP 403" in line)
    # The call, the resource, and the API's own words: who lacks which permission.
    assert "list endpointslices" in line
    assert f'User "{SA_USER}" cannot list resource "endpointslices"' in line
    assert "forbidden" in line
    assert "sa-token-1" not in caplog.text  # the credential never reaches the log
    m = await samples(session, gw)
    assert (errors(m, "kubernetes", "forbidden") or 0) >= 1
    assert failing(m, "kubernetes") == 1
    status, reason = await readyz(session, gw)
    assert status == 503
    assert "no healthy backend" in reason and "forbidden" in reason
    assert SA_USER not in reason  # the API's message stays in the log

    api.granted = {"list", "watch"}  # the RoleBinding is applied: discovery recovers
    await wait_for(lambda: len(gw.fleet.pool.backends) == 1, 10)
    await wait_for(lambda: gw.readiness() == (True, "ok"), 10)
    assert failing(await samples(session, gw), "kubernetes") == 0

    # Removed at run time: the next relist is refused; the last good set keeps serving.
    before = errors(await samples(session, gw), "kubernetes", "forbidden") or 0
    api.granted = set()
    await wait_for(lambda: "forbidden" in gw.readiness()[1], 10)
    assert gw.readiness()[0]  # still ready: the last good set is served
    assert [b.url for b in gw.fleet.pool.backends] == [backend.url]
    m = await samples(session, gw)
    assert (errors(m, "kubernetes", "forbidden") or 0) > before
    assert failing(m, "kubernetes") == 1


# -- 401: a token the API server does not accept -----------------------------------------------


async def test_an_unaccepted_token_is_unauthorized_and_never_logged(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=DISCOVERY)
    api.tokens = {"sa-token-new"}
    token = token_file(tmp_path, "sa-token-old")
    gw = await kubernetes_gateway(make_gateway, api, token)
    await wait_for(lambda: any("HTTP 401" in line for line in discovery_lines(caplog)), 10)
    line = next(line for line in discovery_lines(caplog) if "HTTP 401" in line)
    assert "unauthorized" in line and "Unauthorized" in line  # the cause, the API's words
    assert "list endpointslices" in line
    assert "sa-token-old" not in caplog.text
    m = await samples(session, gw)
    assert (errors(m, "kubernetes", "unauthorized") or 0) >= 1
    assert errors(m, "kubernetes", "forbidden") == 0
    status, reason = await readyz(session, gw)
    assert status == 503 and "unauthorized" in reason

    token.write_text("sa-token-new\n")  # the projected token rotates: re-read on every call
    await wait_for(lambda: gw.readiness() == (True, "ok"), 10)
    assert "sa-token-new" not in caplog.text


async def test_a_token_file_that_cannot_be_read_is_unauthorized(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DISCOVERY)
    missing = tmp_path / "not-mounted" / "token"  # automountServiceAccountToken: false
    gw = await kubernetes_gateway(make_gateway, api, missing)
    await wait_for(lambda: "unauthorized" in gw.readiness()[1], 10)
    assert api.lists == 0  # nothing to authenticate with: the call is not made
    line = next(line for line in discovery_lines(caplog, logging.WARNING))
    assert f"cannot read the token file {missing}" in line and "unauthorized" in line
    assert (errors(await samples(session, gw), "kubernetes", "unauthorized") or 0) >= 1


def test_the_apis_message_is_one_bounded_line_and_nothing_else_is_taken() -> None:
    forged = "denied\n2026-01-01 INFO gateway: all fine\x1b[0m " + "x" * 5000
    message = api_message({"kind": "Status", "code": 403, "message": forged})
    assert "\n" not in message and "\x1b" not in message
    assert len(message) == 300 and message.endswith("...")
    assert message.startswith("denied 2026-01-01 INFO gateway: all fine")
    # Only a Status object's message: never another body, nor another field.
    assert api_message({"kind": "EndpointSliceList", "message": "x"}) == ""
    assert api_message({"kind": "Status", "reason": "Forbidden"}) == ""
    assert api_message(b"<html>403</html>") == ""
    assert api_message({"kind": "Status", "message": "short"}) == "short"


# -- 410: an expired watch is routine ----------------------------------------------------------


async def test_an_expired_watch_relists_at_once_logged_at_info_and_counted(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    backend: StubBackend,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DISCOVERY)
    api.expire_watches = 1  # the first watch is answered 410 Gone itself
    # A long resync and a long backoff: a relist that comes quickly comes from the 410.
    gw = await kubernetes_gateway(
        make_gateway, api, token_file(tmp_path, "t"), resync_s=60, retry_base_s=30
    )
    await wait_for(lambda: api.watches >= 2 and api.lists == 2, 5)
    await wait_for(lambda: gw.readiness()[0], 10)
    # An event, then the running watch expires: an ERROR event in the stream.
    port = int(backend.url.rsplit(":", 1)[1])
    api.put(api.endpoint_slice("sglang-a", [("127.0.0.1", True), ("127.0.0.9", False)], port))
    await asyncio.sleep(0.1)
    api.expire_watch()
    await wait_for(lambda: api.lists == 3 and api.watches >= 3, 5)
    m = await samples(session, gw)
    assert errors(m, "kubernetes", "gone") == 2
    assert failing(m, "kubernetes") == 0
    assert sum(errors(m, "kubernetes", c) or 0 for c in K8S_CAUSES) == 2
    gone = [line for line in discovery_lines(caplog, logging.INFO) if "410" in line]
    assert len(gone) == 2 and all("relist" in line for line in gone)
    assert not discovery_lines(caplog, logging.WARNING)  # routine: nothing to alarm anyone
    assert gw.readiness() == (True, "ok")


# -- the API server goes away and comes back ---------------------------------------------------


@pytest.mark.heavy
async def test_an_api_server_that_goes_away_is_unreachable_until_it_comes_back(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    backend: StubBackend,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DISCOVERY)
    gw = await kubernetes_gateway(make_gateway, api, token_file(tmp_path, "t"))
    await wait_for(lambda: gw.readiness() == (True, "ok"), 10)
    port = api.port
    await api.stop()  # restarting: the watch is cut, connects are refused
    await wait_for(lambda: "unreachable" in gw.readiness()[1], 10)
    assert gw.readiness()[0]  # the last good set keeps serving
    m = await samples(session, gw)
    assert (errors(m, "kubernetes", "unreachable") or 0) >= 1
    assert failing(m, "kubernetes") == 1
    assert any("unreachable" in line for line in discovery_lines(caplog, logging.WARNING))

    lists = api.lists
    api.fail_status = 503  # back, but not serving yet
    await api.start(port)
    await wait_for(lambda: api.lists > lists, 10)
    api.fail_status = None
    await wait_for(lambda: gw.readiness() == (True, "ok"), 10)
    m = await samples(session, gw)
    assert failing(m, "kubernetes") == 0
    assert errors(m, "kubernetes", "forbidden") == errors(m, "kubernetes", "unauthorized") == 0
    # And it follows changes again.
    stub2 = StubBackend()
    await stub2.start("127.0.0.2", int(backend.url.rsplit(":", 1)[1]))
    try:
        port2 = int(backend.url.rsplit(":", 1)[1])
        api.put(api.endpoint_slice("sglang-b", [("127.0.0.2", True)], port2), "ADDED")
        await wait_for(lambda: len(gw.fleet.pool.backends) == 2, 10)
    finally:
        await stub2.stop()


# -- the backoff (the sleep and the jitter are seams: the waits are exact) --------------------


def discovery(client: KubernetesApi, waits: list[float], jitter: float) -> KubernetesDiscovery:
    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0.01)

    return KubernetesDiscovery(
        client,
        scheme="http",
        port=1,
        port_name=None,
        resync_s=60,
        retry_base_s=1,
        retry_max_s=8,
        sleep=sleep,
        jitter=lambda: jitter,
    )


@contextlib.asynccontextmanager
async def running(d: KubernetesDiscovery) -> AsyncIterator[None]:
    task = asyncio.create_task(d.run(lambda urls: None))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_retries_back_off_exponentially_with_jitter_up_to_the_cap(
    api: FakeKubernetesApi,
) -> None:
    async with aiohttp.ClientSession() as http:
        client = KubernetesApi(
            http,
            api_server=api.url,
            namespace="llm",
            label_selector="app=sglang",
            token_file=None,
            ca_file=None,
        )
        api.fail_status = 503
        # Half of each doubling step for sure, the other half at random; capped at 8 s.
        for jitter, expected in ((0.0, [0.5, 1, 2, 4, 4, 4]), (1.0, [1, 2, 4, 8, 8, 8])):
            waits: list[float] = []
            async with running(discovery(client, waits, jitter)):
                await wait_for(lambda w=waits: len(w) >= 6)  # type: ignore[misc]
            assert waits[:6] == expected

        # A watch that works resets it: the next failure waits the first step again.
        waits = []
        d = discovery(client, waits, 0.5)
        async with running(d):
            await wait_for(lambda: len(waits) >= 3)
            api.fail_status = None
            api.put(api.endpoint_slice("sglang-b", [("127.0.0.2", True)], 1), "ADDED")
            await wait_for(lambda: d.failing is None and d._streak == 0)
            api.fail_status = 503
            api.expire_watch()  # routine 410: relisted at once, and that list fails
            await wait_for(lambda: len(waits) >= 4)
        assert waits[:4] == [0.75, 1.5, 3, 0.75]
        assert d.errors["gone"] == 1 and d.errors["unreachable"] >= 4

        # An API that expires every watch at once is not relisted in a tight loop: the
        # first 410 is relisted at once, one again before any event waits like a failure.
        api.fail_status = None
        api.expire_watches = 3
        waits = []
        d = discovery(client, waits, 0.0)
        lists, watches = api.lists, api.watches
        async with running(d):
            await wait_for(lambda: api.lists == lists + 4 and api.watches == watches + 4)
            await asyncio.sleep(0.1)  # the fourth watch runs: nothing more happens
            assert api.lists == lists + 4
        assert waits == [0.5, 1]
        assert d.errors["gone"] == 3 and d.failing is None


def test_the_backoff_settings_are_checked() -> None:
    kube = {"service": "s", "port": 1, "retry_base_s": 10, "retry_max_s": 5}
    with pytest.raises(ConfigError, match=r"backends\.kubernetes: .*retry_max_s \(5\.0\) must"):
        config_mod.build({"backends": {"discovery": "kubernetes", "kubernetes": kube}})
    with pytest.raises(ConfigError, match=r"backends\.kubernetes\.retry_base_s: value 0"):
        config_mod.build(
            {"backends": {"discovery": "kubernetes", "kubernetes": {**kube, "retry_base_s": 0}}}
        )
    ok = config_mod.build(
        {"backends": {"discovery": "kubernetes", "kubernetes": {"service": "s", "port": 1}}}
    )
    assert ok.backends.kubernetes is not None
    assert (ok.backends.kubernetes.retry_base_s, ok.backends.kubernetes.retry_max_s) == (1, 30)


# -- an answer that is not an EndpointSliceList ---------------------------------------------------


async def test_a_malformed_list_is_a_bad_response_and_discovery_keeps_asking(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    session: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    api.slices["junk"] = "not an EndpointSlice"  # type: ignore[assignment]
    gw = await kubernetes_gateway(make_gateway, api, token_file(tmp_path, "t"), retry_base_s=0.05)
    # Counted, and asked again: the discovery task must outlive a malformed answer.
    await wait_for(lambda: api.lists >= 3, 10)
    m = await samples(session, gw)
    assert (errors(m, "kubernetes", "bad_response") or 0) >= 2
    assert "bad_response" in gw.readiness()[1]
    del api.slices["junk"]
    await wait_for(lambda: gw.readiness() == (True, "ok"), 10)


# -- series at 0 for every cause the configured source can report ---------------------------------


async def test_every_cause_of_the_configured_source_is_exported_at_zero(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    session: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    gw = await kubernetes_gateway(make_gateway, api, token_file(tmp_path, "t"))
    await wait_for(lambda: gw.readiness()[0], 10)
    m = await samples(session, gw)
    assert {c: errors(m, "kubernetes", c) for c in K8S_CAUSES} == dict.fromkeys(K8S_CAUSES, 0)
    assert failing(m, "kubernetes") == 0
    found = {k for k in m if k[0] == "sglang_gateway_discovery_errors_total"}
    assert len(found) == len(K8S_CAUSES)  # nothing for a source that is not configured


# -- DNS: the same causes where they apply ----------------------------------------------


class ScriptedResolver:
    def __init__(self) -> None:
        self.answer: list[str] | Exception = []
        self.calls = 0

    async def resolve(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


async def test_dns_failures_carry_a_cause_in_the_log_the_metrics_and_readyz(
    make_gateway: GatewayFactory,
    backend: StubBackend,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DISCOVERY)
    port = int(backend.url.rsplit(":", 1)[1])
    resolver = ScriptedResolver()
    resolver.answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    gw = await make_gateway(
        resolver=resolver,
        backends={"discovery": "dns", "dns": {"name": DNS_NAME, "port": port, "interval_s": 0.05}},
    )
    await wait_for(lambda: resolver.calls >= 2)
    m = await samples(session, gw)
    assert {c: errors(m, "dns", c) or 0 for c in DNS_CAUSES}["unreachable"] >= 1
    assert failing(m, "dns") == 1
    status, reason = await readyz(session, gw)
    assert status == 503 and "unreachable" in reason and DNS_NAME in reason
    assert any(
        "unreachable" in line and "Temporary failure" in line for line in discovery_lines(caplog)
    )

    script: list[tuple[list[str] | Exception, str]] = [
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "empty"),
        ([], "empty"),
        (["not-an-address"], "bad_response"),
    ]
    for answer, cause in script:
        before = errors(await samples(session, gw), "dns", cause) or 0
        resolver.answer = answer
        calls = resolver.calls
        await wait_for(lambda c=calls: resolver.calls > c + 1)  # type: ignore[misc]
        assert (errors(await samples(session, gw), "dns", cause) or 0) > before, answer
        assert cause in gw.readiness()[1], answer

    resolver.answer = ["127.0.0.1"]
    await wait_for(lambda: gw.readiness() == (True, "ok"), 10)
    m = await samples(session, gw)
    assert failing(m, "dns") == 0
    assert {k[1] for k in m if k[0] == "sglang_gateway_discovery_errors_total"} == {
        f"cause={c},source=dns" for c in DNS_CAUSES
    }
