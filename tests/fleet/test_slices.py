"""Truth table: an EndpointSlice -> the backend URLs discovery takes from it."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.fleet.discovery import slice_urls

# -- discovery: EndpointSlice -> backend URLs ---------------------------------------------------


def _slice(endpoints: list[dict[str, Any]], ports: list[dict[str, Any]] | None = None) -> dict:
    return {"metadata": {"name": "s"}, "endpoints": endpoints, "ports": ports or []}


SLICES = [
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}]), 30000, None, ["http://10.0.0.1:30000"],
                 id="ready-unknown-counts-as-ready"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}]), 30000, None,
                 ["http://10.0.0.1:30000"], id="ready"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"], "conditions": {"ready": False}}]), 30000, None,
                 [], id="not-ready-or-terminating"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"], "conditions": {"ready": None}}]), 30000, None,
                 ["http://10.0.0.1:30000"], id="ready-null-counts-as-ready"),
    pytest.param(_slice([{"addresses": ["10.0.0.1", "10.0.0.2"]}]), 1, None,
                 ["http://10.0.0.1:1", "http://10.0.0.2:1"], id="every-address"),
    pytest.param(_slice([{"addresses": ["fd00::1"]}]), 30000, None, ["http://[fd00::1]:30000"],
                 id="ipv6-bracketed"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}], [{"name": "http", "port": 8000}]), None,
                 "http", ["http://10.0.0.1:8000"], id="named-port"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}], [{"name": "grpc", "port": 9000}]), None,
                 "http", [], id="named-port-absent"),
    pytest.param(_slice([{"addresses": ["10.0.0.1"]}], [{"name": "http", "port": "8000"}]), None,
                 "http", [], id="named-port-not-an-int"),
    pytest.param({"metadata": {"name": "s"}, "endpoints": None}, 30000, None, [],
                 id="endpoints-null"),
    pytest.param({"metadata": {"name": "s"}}, 30000, None, [], id="endpoints-missing"),
    pytest.param(_slice([{"conditions": {"ready": True}}]), 30000, None, [],
                 id="no-addresses"),
]  # fmt: skip


@pytest.mark.parametrize(("item", "port", "port_name", "urls"), SLICES)
def test_slice_urls(item: dict, port: int | None, port_name: str | None, urls: list[str]) -> None:
    assert slice_urls(item, scheme="http", port=port, port_name=port_name) == urls
