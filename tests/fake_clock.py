"""``time.monotonic`` under a test's hand, for what happens "at most once a
second" or "after 60 s": the `clock` fixture (tests/conftest.py) installs one."""

from __future__ import annotations


class FakeClock:
    """Stands still until the test moves it: ``clock.now += seconds``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
