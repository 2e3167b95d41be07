"""Where the requests a worker held go when it lets them go (`frontend.replay`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import pytest

from frontend.inflight import InFlight
from frontend.inflight_table import InFlightTable
from frontend.replay import release
from frontend.worker_link import WorkerLink
from protocol import GenerateRequest, ToWorker


@dataclass(eq=False)
class _Link:
    """What `release` and the table touch of a worker link."""

    endpoint: str = "tcp://127.0.0.1:5555"
    held: set[InFlight] = field(default_factory=set)
    trial: InFlight | None = None
    sent: list[ToWorker] = field(default_factory=list)

    def send(self, message: ToWorker) -> bool:
        self.sent.append(message)
        return True


def _on_trial_beside_an_innocent() -> tuple[InFlightTable, WorkerLink, InFlight, InFlight]:
    """A suspect on trial on a worker, and a request beside it that made progress."""
    table = InFlightTable(10)
    suspect, innocent = table.add(
        [GenerateRequest("suspect", "x", 4), GenerateRequest("innocent", "y", 4)], 1e9
    )
    table.waiting.clear()
    link = cast(WorkerLink, _Link())
    for entry, is_trial in ((suspect, True), (innocent, False)):
        entry.next_attempt()
        table.hand_to(entry, link, is_trial)
    innocent.made_progress = True
    return table, link, suspect, innocent


@pytest.mark.parametrize("is_death", [False, True])
def test_a_trial_is_still_a_suspect_after_its_worker_lets_it_go(is_death: bool) -> None:
    """Greeted again (no death), its worker sent everything back to the line: the
    trial went back with the innocent, and out beside others, no longer alone."""
    table, link, suspect, innocent = _on_trial_beside_an_innocent()
    assert release(table, link, "went", is_death=is_death, max_worker_deaths=3) == 2
    assert table.suspects == [suspect]
    assert table.waiting == [innocent]
    assert link.trial is None and not link.held
