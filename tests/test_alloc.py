"""gateway/runtime.py: the malloc settings apply on glibc and can be switched off."""

from __future__ import annotations

import platform

import pytest

from gateway import runtime as alloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applies_on_glibc() -> None:
    assert alloc.tune_malloc() is True


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(alloc.DISABLE_ENV, "0")
    assert alloc.tune_malloc() is False
