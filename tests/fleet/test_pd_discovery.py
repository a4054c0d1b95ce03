"""Prefill/decode disaggregation with Kubernetes discovery: the pods' labels give the role.

A gateway (backends.mode pd, backends.kubernetes prefill_selector and decode_selector) in
front of stub engines playing both PD roles (gateway/testing/stub/pd.py: a decode stub
answers only once the prefill stub named by the request's bootstrap_host and
bootstrap_port handed the room over), its Kubernetes API the fake server on loopback
(tests/fleet/kubeapi.py), which filters pods by the call's labelSelector as the API server
does. The API is the only seam.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway import config as config_mod
from gateway.app import Gateway
from gateway.testing.stub import StubBackend
from gateway.testing.stub.pd import PdStub
from tests.conftest import GatewayFactory, gw_url, proxied, wait_for
from tests.fleet.kubeapi import FakeKubernetesApi
from tests.fleet.test_discovery_errors import K8S_CAUSES, errors, failing, samples

DISCOVERY = "gateway.fleet.discovery"
PREFILL = {"app": "sglang", "component": "prefill"}
DECODE = {"app": "sglang", "component": "decode"}
ANNOTATION = "sglang.ai/bootstrap-port"
POD_CAUSES = (*K8S_CAUSES, "ambiguous_role", "bad_annotation")


class Engines:
    """Prefill stubs on 127.0.0.2 and .3, decode stubs on .4 and .5, all on one port, as
    the pods of a Deployment listen on one container port at their own IPs."""

    def __init__(self) -> None:
        self.prefill = [StubBackend(pd=PdStub("prefill")) for _ in range(2)]
        self.decode = [StubBackend(pd=PdStub("decode", transfer_timeout_s=10)) for _ in range(2)]
        self.port = 0

    @property
    def all(self) -> list[StubBackend]:
        return [*self.prefill, *self.decode]

    async def start(self) -> None:
        for i, stub in enumerate(self.all, start=2):
            port = await stub.start(f"127.0.0.{i}", self.port)
            self.port = self.port or port

    @staticmethod
    def ip(stub: StubBackend) -> str:
        return stub.url.removeprefix("http://").rsplit(":", 1)[0]

    @staticmethod
    def bootstrap(stub: StubBackend) -> int:
        assert stub.pd is not None
        return stub.pd.bootstrap_port


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    e = Engines()
    await e.start()
    yield e
    for s in e.all:
        await s.stop()


@pytest.fixture
async def api() -> AsyncIterator[FakeKubernetesApi]:
    fake = FakeKubernetesApi(resource="pods")
    await fake.start()
    yield fake
    await fake.stop()


def prefill_pod(api: FakeKubernetesApi, name: str, stub: StubBackend, **kw: Any) -> dict[str, Any]:
    annotations = {ANNOTATION: str(Engines.bootstrap(stub))}
    return api.pod(name, Engines.ip(stub), PREFILL, annotations=annotations, **kw)


def decode_pod(api: FakeKubernetesApi, name: str, stub: StubBackend, **kw: Any) -> dict[str, Any]:
    return api.pod(name, Engines.ip(stub), DECODE, **kw)


async def pd_gateway(
    make_gateway: GatewayFactory, api: FakeKubernetesApi, port: int, tmp_path: Path, **kube: Any
) -> Gateway:
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    return await make_gateway(
        backends={
            "mode": "pd",
            "discovery": "kubernetes",
            "kubernetes": {
                "namespace": "llm",
                "prefill_selector": PREFILL,
                "decode_selector": DECODE,
                "port": port,
                "api_server": api.url,
                "token_file": str(token),
                "ca_file": None,
                "resync_s": 0.5,
                "retry_base_s": 0.05,
                "retry_max_s": 0.1,
                **kube,
            },
        }
    )


def members(gw: Gateway) -> dict[str, tuple[str, int | None]]:
    return {b.url: (b.worker_type, b.bootstrap_port) for b in gw.pool.backends}


async def generate(session: aiohttp.ClientSession, gw: Gateway, n: int) -> list[int]:
    statuses = []
    for i in range(n):
        body = orjson.dumps({"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 2}})
        async with session.post(
            gw_url(gw, "/generate"), data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            await resp.read()
            statuses.append(resp.status)
    return statuses


def served(stub: StubBackend) -> list[dict[str, Any]]:
    """The generations the gateway sent this stub, parsed."""
    return [orjson.loads(r.body) for r in proxied(stub) if r.path == "/generate"]


def rooms(stubs: list[StubBackend]) -> Counter[int]:
    return Counter(room for s in stubs if s.pd is not None for room in s.pd.rooms)


async def test_pods_of_both_roles_are_paired_and_a_deleted_or_unready_pod_leaves_its_role(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    engines: Engines,
    session: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    p0, p1 = engines.prefill
    d0, d1 = engines.decode
    for name, stub in (("prefill-0", p0), ("prefill-1", p1)):
        api.put(prefill_pod(api, name, stub), "ADDED")
    for name, stub in (("decode-0", d0), ("decode-1", d1)):
        api.put(decode_pod(api, name, stub), "ADDED")
    # Not ours (the API's selector leaves it out), and a prefill pod not ready yet.
    api.put(api.pod("other", "127.0.0.9", {"app": "other", "component": "prefill"}), "ADDED")
    api.put(api.pod("prefill-2", "127.0.0.8", PREFILL, ready=False), "ADDED")
    # No periodic relist in this test: what changes must come through the watch.
    gw = await pd_gateway(make_gateway, api, engines.port, tmp_path, resync_s=60)

    await wait_for(lambda: len(gw.pool.backends) == 4, 10)
    # One call for both roles: the selectors' shared key, and the key they differ in.
    assert api.selectors[0] == "app=sglang,component in (decode,prefill)"
    assert members(gw) == {
        p0.url: ("prefill", Engines.bootstrap(p0)),
        p1.url: ("prefill", Engines.bootstrap(p1)),
        d0.url: ("decode", None),
        d1.url: ("decode", None),
    }

    assert await generate(session, gw, 12) == [200] * 12
    # Each request met one prefill and one decode engine, exactly once each.
    assert rooms(engines.prefill) == rooms(engines.decode)
    assert sum(rooms(engines.prefill).values()) == 12
    assert set(rooms(engines.prefill).values()) == {1}
    assert all(served(s) for s in engines.all)
    # The bootstrap port each prefill engine was named by is its pod's annotation.
    for stub in engines.prefill:
        assert {b["bootstrap_port"] for b in served(stub)} == {Engines.bootstrap(stub)}
        assert {b["bootstrap_host"] for b in served(stub)} == {Engines.ip(stub)}

    # A deleted prefill pod leaves the prefill set: it gets no more requests.
    api.delete("prefill-0")
    await wait_for(lambda: p0.url not in members(gw), 10)
    before = len(served(p0)), len(served(p1))
    assert await generate(session, gw, 6) == [200] * 6
    assert (len(served(p0)), len(served(p1))) == (before[0], before[1] + 6)

    # A decode pod that loses readiness leaves the decode set.
    api.put(decode_pod(api, "decode-1", d1, ready=False))
    await wait_for(lambda: d1.url not in members(gw), 10)
    before = len(served(d0)), len(served(d1))
    assert await generate(session, gw, 4) == [200] * 4
    assert (len(served(d0)), len(served(d1))) == (before[0] + 4, before[1])
    assert members(gw) == {p1.url: ("prefill", Engines.bootstrap(p1)), d0.url: ("decode", None)}

    # Ready again, then relabelled: the same URL takes its new role and bootstrap port.
    api.put(decode_pod(api, "decode-1", d1))
    await wait_for(lambda: members(gw).get(d1.url) == ("decode", None), 10)
    api.put(api.pod("decode-1", Engines.ip(d1), PREFILL, annotations={ANNOTATION: "9000"}))
    await wait_for(lambda: members(gw).get(d1.url) == ("prefill", 9000), 10)


async def test_while_the_api_fails_the_last_set_of_each_role_keeps_serving(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    engines: Engines,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DISCOVERY)
    p0, d0 = engines.prefill[0], engines.decode[0]
    api.put(prefill_pod(api, "prefill-0", p0), "ADDED")
    api.put(decode_pod(api, "decode-0", d0), "ADDED")
    gw = await pd_gateway(make_gateway, api, engines.port, tmp_path)
    await wait_for(lambda: gw.readiness() == (True, "ok") and len(members(gw)) == 2, 10)
    m = await samples(session, gw)
    # Every cause pod discovery can report, at 0 from the start.
    assert {c: errors(m, "kubernetes", c) for c in POD_CAUSES} == dict.fromkeys(POD_CAUSES, 0)

    api.fail_status = 503  # the API server restarting: every list and watch refused
    api.expire_watch()  # ends the running watch, so the next list meets the 503
    await wait_for(lambda: "unreachable" in gw.readiness()[1], 10)
    ready, reason = gw.readiness()
    assert ready and "on list pods" in reason
    assert members(gw) == {p0.url: ("prefill", Engines.bootstrap(p0)), d0.url: ("decode", None)}
    assert await generate(session, gw, 3) == [200] * 3
    m = await samples(session, gw)
    assert (errors(m, "kubernetes", "unreachable") or 0) >= 1
    assert failing(m, "kubernetes") == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any('list pods in namespace "llm"' in w and "HTTP 503" in w for w in warned)
    assert any("keeping the last good set (2 backends)" in w for w in warned)

    # Back: a pod added meanwhile is found by the relist, in its role.
    api.put(decode_pod(api, "decode-1", engines.decode[1]), "ADDED")
    api.fail_status = None
    await wait_for(lambda: engines.decode[1].url in members(gw), 10)
    assert members(gw)[engines.decode[1].url] == ("decode", None)
    await wait_for(lambda: gw.readiness() == (True, "ok"), 10)
    assert failing(await samples(session, gw), "kubernetes") == 0


async def test_a_pod_matching_both_selectors_or_with_a_bad_annotation_is_refused_once(
    make_gateway: GatewayFactory,
    api: FakeKubernetesApi,
    engines: Engines,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DISCOVERY)
    prefill = {"app": "sglang", "sglang.ai/prefill": "true"}
    decode = {"app": "sglang", "sglang.ai/decode": "true"}
    p0, p1 = engines.prefill
    d0, d1 = engines.decode
    own = {ANNOTATION: str(Engines.bootstrap(p0))}
    api.put(api.pod("prefill-0", Engines.ip(p0), prefill, annotations=own), "ADDED")
    api.put(api.pod("decode-0", Engines.ip(d0), decode), "ADDED")
    both = {**prefill, **decode}
    api.put(api.pod("both", Engines.ip(d1), both), "ADDED")
    bad = {ANNOTATION: "8998x"}
    api.put(api.pod("bad-port", Engines.ip(p1), prefill, annotations=bad), "ADDED")
    gw = await pd_gateway(
        make_gateway, api, engines.port, tmp_path, prefill_selector=prefill, decode_selector=decode
    )
    await wait_for(lambda: len(members(gw)) == 2, 10)
    assert api.selectors[0] == "app=sglang"  # no key both name with other values
    assert members(gw) == {p0.url: ("prefill", Engines.bootstrap(p0)), d0.url: ("decode", None)}

    # Events and relists that show the same pods again count nothing more.
    lists = api.lists
    api.put(api.pod("both", Engines.ip(d1), both))
    api.put(api.pod("bad-port", Engines.ip(p1), prefill, annotations=bad))
    await wait_for(lambda: api.lists >= lists + 2, 10)
    m = await samples(session, gw)
    assert errors(m, "kubernetes", "ambiguous_role") == 1
    assert errors(m, "kubernetes", "bad_annotation") == 1
    assert failing(m, "kubernetes") == 0  # the rest of the set is taken: not a failing source
    assert gw.readiness() == (True, "ok")
    assert set(members(gw)) == {p0.url, d0.url}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warned if "pod both " in w]) == 1
    assert "match both prefill_selector and decode_selector" in next(
        w for w in warned if "pod both " in w
    )
    assert len([w for w in warned if "pod bad-port " in w]) == 1
    assert f"annotation {ANNOTATION} is not a port" in next(
        w for w in warned if "pod bad-port " in w
    )

    # Relabelled to one role, it joins; the same fault again later is counted again. A
    # prefill pod without the annotation gets the engine's default (null), as with SMG.
    api.put(api.pod("both", Engines.ip(d1), prefill))
    await wait_for(lambda: members(gw).get(d1.url) == ("prefill", None), 10)
    api.put(api.pod("both", Engines.ip(d1), both))
    await wait_for(lambda: d1.url not in members(gw), 10)
    assert errors(await samples(session, gw), "kubernetes", "ambiguous_role") == 2
    assert await generate(session, gw, 2) == [200] * 2
    assert not served(d1) and not served(p1)


def test_pd_with_kubernetes_discovery_is_checked() -> None:
    kube = {"port": 30000, "prefill_selector": PREFILL, "decode_selector": DECODE}

    def build(**backends: Any) -> config_mod.GatewayConfig:
        return config_mod.build({"backends": {"discovery": "kubernetes", **backends}})

    ok = build(mode="pd", kubernetes=kube)
    assert ok.backends.kubernetes is not None
    assert ok.backends.kubernetes.bootstrap_port_annotation == ANNOTATION
    assert ok.backends.kubernetes.selector == "app=sglang,component in (decode,prefill)"
    bad = [
        ({"kubernetes": kube}, "need backends.mode: pd"),
        ({"mode": "pd", "kubernetes": {"service": "s", "port": 1}}, "prefill_selector and"),
        (
            {"mode": "pd", "kubernetes": {**kube, "decode_selector": {}}},
            "set both prefill_selector and decode_selector",
        ),
        ({"mode": "pd", "kubernetes": {**kube, "service": "s"}}, "carry no pod labels"),
        (
            {"mode": "pd", "kubernetes": {**kube, "decode_selector": {"app": "sglang"}}},
            "also matches app=sglang",
        ),
        (
            {"mode": "pd", "kubernetes": {**kube, "decode_selector": {"app": "a b"}}},
            "not a label value",
        ),
        (
            {"mode": "pd", "kubernetes": {**kube, "bootstrap_port_annotation": "a,b"}},
            "not a Kubernetes label or annotation key",
        ),
    ]
    for backends, needle in bad:
        with pytest.raises(config_mod.ConfigError) as exc:
            build(**backends)
        assert needle in str(exc.value), (backends, str(exc.value))
