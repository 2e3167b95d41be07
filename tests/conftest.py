"""Fixtures shared across test files."""

from __future__ import annotations

import time

import pytest

from tests.fake_clock import FakeClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """``time.monotonic``, standing still until the test moves it."""
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock
