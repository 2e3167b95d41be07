"""Which worker takes the next request (`frontend.router`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import pytest

import frontend.inflight
from frontend.inflight import InFlight
from frontend.router import pick
from frontend.worker_link import WorkerLink
from protocol import GenerateRequest, Hello
from protocol.liveness import Verdict, WorkerState
from tests.stand_in_worker import stand_in_hello

_REQUEST = GenerateRequest("r", "a prompt", 8)


def _entry(request: GenerateRequest = _REQUEST) -> InFlight:
    return InFlight(request, 1e9)


@dataclass(eq=False)
class _Link:
    """What `pick` reads of a worker link."""

    num_free: int
    held: set[InFlight] = field(default_factory=set)
    trial: InFlight | None = None
    is_heard_since_a_death: bool = True
    hello: Hello | None = None

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
    assert pick(links, _entry(), is_trial=True) is plain
    assert pick(links, _entry()) is busy_with_replay  # other requests go by free slots
    only = cast(list[WorkerLink], [busy_with_replay])
    assert pick(only, _entry(), is_trial=True) is busy_with_replay  # a preference, not a rule


def test_a_trial_never_goes_beside_another_or_to_a_worker_not_heard_from() -> None:
    links = cast(
        list[WorkerLink],
        [_Link(num_free=8, trial=_replay()), _Link(num_free=8, is_heard_since_a_death=False)],
    )
    assert pick(links, _entry(), is_trial=True) is None


def test_a_request_goes_to_a_worker_whose_limits_take_it() -> None:
    """Of two workers with a free slot each, it went to the first, whose context
    window could not hold it, and was refused there."""
    tiny = stand_in_hello(context_window=4, vocab_size=99, max_token_chars=8)
    roomy = stand_in_hello(context_window=64, vocab_size=99, max_token_chars=8)
    small, large = _Link(num_free=2, hello=tiny), _Link(num_free=1, hello=roomy)
    links = cast(list[WorkerLink], [small, large])
    assert pick(links, _entry()) is large  # 8 new tokens: past a window of 4
    assert pick(links, _entry(GenerateRequest("r", "a", 2))) is small  # the most free slots
    large.num_free = 0
    assert pick(links, _entry()) is None  # it waits for the one that takes it
    # With none live that takes it, any may have it, and refuse it.
    assert pick(cast(list[WorkerLink], [small]), _entry()) is small


def test_workers_of_the_same_limits_are_not_asked_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checks parse a request's grammar: 20 ms for one of 30,000 characters,
    for each worker, at every dispatch while it waited."""
    asked = []
    monkeypatch.setattr(frontend.inflight, "request_problem", lambda *args: asked.append(args))
    same = stand_in_hello(context_window=64, vocab_size=99, max_token_chars=8)
    links = cast(list[WorkerLink], [_Link(num_free=1, hello=same), _Link(num_free=2, hello=same)])
    entry = _entry()
    assert pick(links, entry) is links[1]
    assert asked == []
    other = stand_in_hello(context_window=32, vocab_size=99, max_token_chars=8)
    links.append(cast(WorkerLink, _Link(num_free=0, hello=other)))
    pick(links, entry)
    assert len(asked) == 2  # once for each limits
    pick(links, entry)
    assert len(asked) == 2  # and once only, however often it waits
