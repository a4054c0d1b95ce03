"""The document --workers share: merging changes, adopting them, losing none."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.config import BackendsConfig
from gateway.fleet import engines
from gateway.fleet.membership import Fleet
from gateway.fleet.shared import (
    Change,
    Damaged,
    SharedState,
    merge,
    new_document,
    validate,
    write_document,
)

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


def test_merge_applies_each_kind_of_change() -> None:
    doc = new_document([A])
    merge(doc, Change(added={B: {"worker_type": "regular"}}))
    merge(doc, Change(states={A: {"paused": True}, B: {"paused": True}}))
    merge(doc, Change(states={A: {"weight_version": "v2"}}, latest_version="v2"))
    merge(doc, Change(removed=frozenset({B})))
    assert doc["members"] == {A: {}}
    assert doc["backends"] == {A: {"paused": True, "weight_version": "v2"}}
    assert doc["latest_version"] == "v2" and doc["generation"] == 4


def test_an_empty_change_is_not_shared() -> None:
    assert not Change()
    assert Change(states={A: {"asleep": True}})


async def test_concurrent_changes_from_two_workers_all_land(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    write_document(path, new_document([]))
    one, two = SharedState(path, 0, 1), SharedState(path, 0, 1)  # alone: no sibling to wait for
    urls = [f"http://127.0.0.1:{1000 + i}" for i in range(40)]
    await asyncio.gather(
        *((one if i % 2 else two).record(Change(added={url: {}})) for i, url in enumerate(urls))
    )
    doc = one.load()
    assert doc is not None and set(doc["members"]) == set(urls) and doc["generation"] == 40


async def test_a_worker_adopts_what_another_changed(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    write_document(path, new_document([A]))
    fleet = Fleet(BackendsConfig(discovery="registry", static=[A]))
    assert fleet.registry is not None
    await fleet.registry.run(fleet.pool.update)
    sibling = SharedState(path, 0, 1)
    await sibling.record(Change(added={B: {"bootstrap_port": 8998}}))
    await sibling.record(Change(states={A: {"paused": True}, B: {"weight_version": "v5"}}))
    shared = SharedState(path, 0, 2)
    shared.attach(fleet.adopt)
    await shared.take(shared.load())
    by_url = {b.url: b for b in fleet.pool.backends}
    assert set(by_url) == {A, B} and fleet.registry.extras(B) == {"bootstrap_port": 8998}
    assert by_url[A].paused and not by_url[B].paused
    assert by_url[B].weight_version == "v5" and by_url[A].weight_version is None
    # An older document (a poll that read the file before this worker's own change) is
    # never taken over a newer one.
    stale = {"generation": 1, "members": {A: {}}, "backends": {A: {"paused": False}}}
    await shared.take(stale)
    assert by_url[A].paused and set(fleet.registry.urls) == {A, B}


async def _worker(path: Path, index: int, workers: int) -> tuple[Fleet, SharedState]:
    fleet = Fleet(BackendsConfig(discovery="registry", static=[A]))
    assert fleet.registry is not None
    await fleet.registry.run(fleet.pool.update)
    shared = SharedState(path, index, workers)
    shared.attach(fleet.adopt)
    await shared.take(shared.load())
    return fleet, shared


async def test_a_siblings_document_never_undoes_a_change_being_recorded(tmp_path: Path) -> None:
    """A worker adopts documents whole; between applying a change and adopting the document
    that holds it, a sibling's newer document (without it) must not revert it."""
    path = tmp_path / "fleet.json"
    write_document(path, new_document([A]))
    fleet, shared = await _worker(path, 0, 1)
    sibling = SharedState(path, 0, 1)
    await sibling.record(Change(added={B: {}}))
    (backend,) = fleet.pool.backends
    backend.paused = True  # the engine paused; what the control call applies here first
    recording = shared.record(Change(states={A: {"paused": True}}))
    await shared.take(shared.load())  # the sibling's document, polled meanwhile
    assert backend.paused
    await recording
    by_url = {b.url: b for b in fleet.pool.backends}
    assert set(by_url) == {A, B} and by_url[A].paused


async def test_a_document_restored_from_an_older_copy_still_reaches_every_worker(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fleet.json"
    write_document(path, new_document([A]))
    first, second = await _worker(path, 0, 2), await _worker(path, 1, 2)
    one, two = first[0], second[0]
    await one.join(first[1])
    await two.join(second[1])
    try:
        for paused in (True, False, True):
            await one.share(Change(states={A: {"paused": paused}}))
        assert second[1].generation == 3
        write_document(path, new_document([A]))  # generation 0, behind both workers
        await asyncio.sleep(0.2)
        await one.share(Change(states={A: {"weight_version": "v9"}}))
        assert [b.weight_version for b in two.pool.backends] == ["v9"]
    finally:
        await one.stop()
        await two.stop()


async def test_adapters_and_worker_types_reach_a_sibling(tmp_path: Path) -> None:
    """What a load call did to an engine, and a worker registered as prefill through
    another worker, hold in this worker too: it routes alike."""
    path = tmp_path / "fleet.json"
    write_document(path, new_document([A]))
    fleet = Fleet(BackendsConfig(discovery="registry", static=[A]))
    assert fleet.registry is not None
    await fleet.registry.run(fleet._publish)
    sibling = SharedState(path, 0, 1)
    await sibling.record(Change(added={B: {"worker_type": "prefill", "bootstrap_port": 8998}}))
    await sibling.record(Change(states={A: {"lora_adapters": ["x", "y"]}}))
    shared = SharedState(path, 0, 2)
    shared.attach(fleet.adopt)
    await shared.take(shared.load())
    by_url = {b.url: b for b in fleet.pool.backends}
    assert by_url[A].adapters == {"x", "y"} and by_url[B].adapters == frozenset()
    assert by_url[A].plain and by_url[B].worker_type == "prefill" and not by_url[B].plain


def test_a_document_with_adapters_of_the_wrong_type_is_damaged() -> None:
    doc = new_document([A])
    doc["backends"] = {A: {"lora_adapters": "x"}}
    with pytest.raises(Damaged, match="lora_adapters"):
        validate(doc)
    doc["backends"] = {A: {"lora_adapters": ["x", 1]}}
    with pytest.raises(Damaged, match="lora_adapters"):
        validate(doc)
    doc["backends"] = {A: {"lora_adapters": ["x"]}}
    assert validate(doc) is doc


@pytest.mark.heavy
async def test_a_worker_keeps_what_an_engine_reported_when_a_sibling_shares_a_change(
    tmp_path: Path,
) -> None:
    """The document holds the versions control calls wrote; an engine updated directly since
    (each worker reads it on its probes) must not go back to it when a sibling shares
    something else."""
    path = tmp_path / "fleet.json"
    write_document(path, new_document([A]))
    fleet, shared = await _worker(path, 0, 2)
    sibling = SharedState(path, 1, 2)
    await sibling.record(Change(states={A: {"weight_version": "v1"}}, latest_version="v1"))
    await shared.take(shared.load())
    (backend,) = fleet.pool.backends
    assert backend.weight_version == "v1"
    engines.reported(fleet.pool, backend, "v2", engines.mark(backend))  # its own report
    await sibling.record(Change(states={A: {"paused": True}}))
    await shared.take(shared.load())
    assert backend.paused
    assert (backend.weight_version, fleet.pool.latest_version) == ("v2", "v2")


def test_an_updated_registration_replaces_a_members_extras_and_never_revives_one() -> None:
    doc = new_document([A])
    merge(doc, Change(updated={A: {"priority": 3}, B: {"priority": 1}}))
    assert doc["members"] == {A: {"priority": 3}}  # B was not a member: not added
    assert Change(updated={A: {}})
