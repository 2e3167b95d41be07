"""Raising the open-file limit (`protocol.open_files`), with the system's calls
stood in for: what each answers decides the limit."""

from __future__ import annotations

import resource

import pytest

from protocol import open_files
from protocol.open_files import raise_open_file_limit

INFINITY = resource.RLIM_INFINITY


def _system(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, most: int
) -> list[tuple[int, int]]:
    """A system at ``soft`` and ``hard`` that refuses a soft limit past ``most``;
    the limits set, in order."""
    set_to: list[tuple[int, int]] = []

    def setrlimit(_: int, limits: tuple[int, int]) -> None:
        if limits[0] > most:
            raise ValueError("not allowed to raise maximum limit")
        set_to.append(limits)

    monkeypatch.setattr(open_files.resource, "getrlimit", lambda _: (soft, hard))
    monkeypatch.setattr(open_files.resource, "setrlimit", setrlimit)
    return set_to


def test_the_soft_limit_is_raised_to_the_hard_one(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to = _system(monkeypatch, 1024, 524288, most=1 << 20)
    assert raise_open_file_limit() == 524288
    assert set_to == [(524288, 524288)]


def test_an_unlimited_hard_limit_raises_it_as_far_as_the_system_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """macOS: unlimited, yet no soft limit past OPEN_MAX; its 256 kept, the
    frontend held one connection."""
    set_to = _system(monkeypatch, 256, INFINITY, most=10240)
    assert raise_open_file_limit() == 10240
    assert set_to == [(10240, INFINITY)]


def test_an_unlimited_soft_limit_is_read_as_a_large_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was read as -1, and the frontend held one connection."""
    _system(monkeypatch, INFINITY, INFINITY, most=0)
    assert raise_open_file_limit() > 100_000


def test_a_limit_that_cannot_be_raised_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to = _system(monkeypatch, 1024, 4096, most=1024)
    assert raise_open_file_limit() == 1024
    assert set_to == []
