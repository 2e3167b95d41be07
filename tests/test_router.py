"""Which worker takes the next request (`frontend.router`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from frontend.inflight import InFlight
from frontend.router import pick
from frontend.worker_link import WorkerLink
from protocol import GenerateRequest
from protocol.liveness import Verdict, WorkerState


@dataclass(eq=False)
class _Link:
    """What `pick` reads of a worker link."""

    num_free: int
    held: set[InFlight] = field(default_factory=set)
    trial: InFlight | None = None
    is_heard_since_a_death: bool = True

    def free_slots(self) -> int:
        return self.num_free

    def verdict(self) -> Verdict:
        return Verdict(WorkerState.LIVE, "live")


def _replay() -> InFlight:
    entry = InFlight(GenerateRequest("replayed", "x", 4), 1e9)
    entry.num_worker_deaths = 1
    return entry


def test_a_trial_prefers_a_worker_that_holds_no_replay() -> None:
    """A replay that killed its worker mid-stream may kill this one too: the trial
    beside it would die a second time without progress and fail."""
    busy_with_replay = _Link(num_free=6, held={_replay()})
    plain = _Link(num_free=2)
    links = cast(list[WorkerLink], [busy_with_replay, plain])
    assert pick(links, is_trial=True) is plain
    assert pick(links) is busy_with_replay  # other requests go by free slots
    only = cast(list[WorkerLink], [busy_with_replay])
    assert pick(only, is_trial=True) is busy_with_replay  # a preference, not a rule


def test_a_trial_never_goes_beside_another_or_to_a_worker_not_heard_from() -> None:
    links = cast(
        list[WorkerLink],
        [_Link(num_free=8, trial=_replay()), _Link(num_free=8, is_heard_since_a_death=False)],
    )
    assert pick(links, is_trial=True) is None
