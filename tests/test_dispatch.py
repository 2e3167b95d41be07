"""Sending the waiting line to the workers (`frontend.dispatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import pytest

from frontend import dispatch as dispatch_module
from frontend.choices import choice_requests
from frontend.dispatch import dispatch
from frontend.inflight import InFlight
from frontend.inflight_table import InFlightTable
from frontend.worker_link import WorkerLink
from protocol import GenerateRequest, Hello, decode_to_worker
from protocol.liveness import Verdict, WorkerState
from tests.stand_in_worker import stand_in_hello


@dataclass(eq=False)
class _Link:
    """What `dispatch` reads of a worker link, and what it was sent."""

    hello: Hello
    num_free: int
    held: set[InFlight] = field(default_factory=set)
    trial: InFlight | None = None
    is_heard_since_a_death: bool = True
    sent: list[str] = field(default_factory=list)  # client request ids

    def free_slots(self) -> int:
        return self.num_free - len(self.sent)

    def verdict(self) -> Verdict:
        return Verdict(WorkerState.LIVE, "live")

    def send_frame(self, frame: bytes) -> bool:
        request = decode_to_worker(frame)
        assert isinstance(request, GenerateRequest)
        # "<id>-<choice>.<attempt>" for a choice of several
        self.sent.append(request.request_id.rsplit(".", 1)[0].rsplit("-", 1)[0])
        return True

    def on_sent(self) -> None:
        pass


def _worker(context_window: int, num_free: int) -> _Link:
    hello = stand_in_hello(context_window=context_window, vocab_size=99, max_token_chars=8)
    return _Link(hello, num_free)


def _line(*requests: tuple[str, int], n: int = 1) -> InFlightTable:
    """A table whose line holds, in order, a request of ``n`` choices of each
    (id, max_new_tokens)."""
    table = InFlightTable(1000)
    for request_id, max_new_tokens in requests:
        _add(table, request_id, max_new_tokens, n)
    return table


def _add(table: InFlightTable, request_id: str, max_new_tokens: int, n: int = 1) -> None:
    table.add(choice_requests(GenerateRequest(request_id, "hi", max_new_tokens), n), 1e9)


def _waiting(table: InFlightTable) -> list[str]:
    return [entry.request_id.rsplit("-", 1)[0] for entry in table.waiting]


def test_a_request_only_a_busy_worker_takes_lets_those_behind_it_go_elsewhere() -> None:
    """A request too long for a small worker's context window waited for the full
    roomy one, and every request behind it waited too, the small one idle."""
    small, roomy = _worker(context_window=64, num_free=4), _worker(1024, num_free=0)
    table = _line(("long", 200), ("short0", 8), ("short1", 8))
    dispatch(table, cast(list[WorkerLink], [small, roomy]))
    assert small.sent == ["short0", "short1"]
    assert _waiting(table) == ["long"]
    # The roomy worker's first free slot is the long one's, not a later short's.
    roomy.num_free = 1
    _add(table, "short2", 8)
    small.num_free = len(small.sent)  # full
    dispatch(table, cast(list[WorkerLink], [small, roomy]))
    assert roomy.sent == ["long"]
    assert _waiting(table) == ["short2"]


def test_the_choices_of_a_request_passed_over_are_passed_over_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As one: passed over one by one, they would use up what a dispatch looks past."""
    monkeypatch.setattr(dispatch_module, "_MAX_PASSED_OVER", 2)
    small, roomy = _worker(context_window=64, num_free=8), _worker(1024, num_free=0)
    table = _line(("long", 200), n=3)
    _add(table, "short", 8, n=2)
    dispatch(table, cast(list[WorkerLink], [small, roomy]))
    assert small.sent == ["short", "short"]
    assert _waiting(table) == ["long"] * 3


def test_where_every_worker_takes_every_request_the_line_keeps_its_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the same limits everywhere, a request that finds no slot finds none
    for those behind it either: nothing is looked past."""
    first, second = _worker(64, num_free=1), _worker(64, num_free=0)
    table = _line(("a", 8), ("b", 8), ("c", 8))
    picked = []
    pick = dispatch_module.pick
    monkeypatch.setattr(dispatch_module, "pick", lambda *args: picked.append(args) or pick(*args))
    dispatch(table, cast(list[WorkerLink], [first, second]))
    assert (first.sent, second.sent) == (["a"], [])
    assert _waiting(table) == ["b", "c"]
    assert len(picked) == 2  # "a", then "b", which found no slot: not "c"


def test_a_dispatch_looks_past_a_bounded_number_of_requests() -> None:
    """Each costs a pick, at every dispatch, while they wait."""
    small, roomy = _worker(context_window=64, num_free=4), _worker(1024, num_free=0)
    num_long = dispatch_module._MAX_PASSED_OVER
    table = _line(*[(f"long{i}", 200) for i in range(num_long)], ("short", 8))
    dispatch(table, cast(list[WorkerLink], [small, roomy]))
    assert small.sent == []
    assert len(table.waiting) == num_long + 1
