"""Where the requests a worker held go when it lets them go (`frontend.replay`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import cast

import pytest

from frontend import replay
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
    is_heard_since_a_death: bool = True
    sent: list[ToWorker] = field(default_factory=list)

    def send(self, message: ToWorker) -> bool:
        self.sent.append(message)
        return True


def _holding(table: InFlightTable, entries: list[InFlight]) -> WorkerLink:
    """A worker link that holds ``entries``' next attempts, none a trial."""
    link = cast(WorkerLink, _Link())
    for entry in entries:
        entry.next_attempt()
        table.hand_to(entry, link, is_trial=False)
    return link


def _on_trial_beside_an_innocent() -> tuple[InFlightTable, WorkerLink, InFlight, InFlight]:
    """A suspect on trial on a worker, and a request beside it that made progress."""
    table = InFlightTable(10)
    (suspect,) = table.add([GenerateRequest("suspect", "x", 4)], 1e9)
    (innocent,) = table.add([GenerateRequest("innocent", "y", 4)], 1e9)
    table.waiting.clear()
    link = cast(WorkerLink, _Link())
    for entry, is_trial in ((suspect, True), (innocent, False)):
        entry.next_attempt()
        table.hand_to(entry, link, is_trial)
    innocent.made_progress = True
    return table, link, suspect, innocent


@pytest.mark.parametrize("is_death", [False, True])
def test_a_trial_is_still_a_suspect_after_its_worker_lets_it_go(is_death: bool) -> None:
    """Whether its worker died or only greeted again (everything back to the
    line), the trial goes back among the suspects, not into the line beside the
    innocent request, where it would go out beside others, no longer alone."""
    table, link, suspect, innocent = _on_trial_beside_an_innocent()
    assert release(table, link, "went", is_death=is_death, max_worker_deaths=3) == 2
    assert table.suspects == [suspect]
    assert table.waiting == [innocent]
    assert link.trial is None and not link.held


@pytest.mark.parametrize(
    ("beside", "is_blamed"),
    [
        ("a trial", True),
        ("a newcomer", True),
        ("one whose Admitted was lost", True),
        ("one that only waited", False),
        ("nothing", False),
    ],
)
def test_a_death_beside_a_request_that_made_no_progress_is_blamed_on_it(
    beside: str, is_blamed: bool
) -> None:
    """Several poison requests sent at once: the innocent request died on two
    workers already, and the third death came beside a request that ran there
    without progress (a suspect's trial, a newcomer, or one taken for a request
    that only waited though it had died before: its `Admitted` lost). That death
    is likely that request's: the innocent request goes on. Beside one that only
    waited in the queue, or alone, it counts."""
    table, link, other, innocent = _on_trial_beside_an_innocent()
    if beside != "a trial":
        link.trial = None
    if beside in ("one whose Admitted was lost", "one that only waited"):
        other.is_waiting = True  # as far as its frontend knows
    if beside in ("a trial", "one whose Admitted was lost"):
        other.num_worker_deaths = 1
    if beside == "nothing":
        table.forget(other)
    innocent.num_worker_deaths = 2
    release(table, link, "died", is_death=True, max_worker_deaths=3)
    assert innocent.num_worker_deaths == 3
    if is_blamed:
        assert innocent in table.waiting
        assert not innocent.events.qsize()
    else:
        assert innocent not in table.waiting
        _, final = innocent.events.get_nowait()
        assert "in flight on 3 workers that died" in str(final)


def test_deaths_blamed_on_others_still_bound_a_request_that_made_progress() -> None:
    """A request that kills workers after its first tokens, each time beside a
    suspect's trial, is failed after twice MAX_WORKER_DEATHS deaths."""
    table = InFlightTable(100)
    (killer,) = table.add([GenerateRequest("killer", "x", 4)], 1e9)
    link = cast(WorkerLink, _Link())
    for death in range(1, 7):
        assert table.waiting == [killer], f"failed after {death - 1} deaths"
        table.waiting.clear()
        (suspect,) = table.add([GenerateRequest(f"suspect{death}", "y", 4)], 1e9)
        table.waiting.remove(suspect)
        suspect.num_worker_deaths = 1
        for entry, is_trial in ((suspect, True), (killer, False)):
            entry.next_attempt()
            table.hand_to(entry, link, is_trial)
        killer.made_progress = True
        release(table, link, "died", is_death=True, max_worker_deaths=3)
    assert killer not in table.waiting
    _, final = killer.events.get_nowait()
    assert "in flight on 6 workers that died" in str(final)


def test_a_replay_onto_a_worker_killed_at_the_same_moment_counts_one_death() -> None:
    """Both workers killed at once: the first found dead sent its streams to the
    second, found dead milliseconds later, before it was heard from again. That
    is one incident: a second one like it must not fail the streams."""
    table = InFlightTable(10)
    (stream,) = table.add([GenerateRequest("stream", "x", 40)], 1e9)
    table.waiting.clear()
    first, second = cast(WorkerLink, _Link()), cast(WorkerLink, _Link())
    for incident in (1, 2):
        stream.next_attempt()
        table.hand_to(stream, first, is_trial=False)
        stream.made_progress = True
        release(table, first, "died", is_death=True, max_worker_deaths=3)
        assert table.waiting == [stream]
        table.waiting.clear()
        stream.next_attempt()
        table.hand_to(stream, second, is_trial=False)
        second.is_heard_since_a_death = False  # pinged, not answered
        release(table, second, "died", is_death=True, max_worker_deaths=3)
        assert table.suspects == [stream], f"failed in incident {incident}"  # tried alone
        assert stream.num_deaths_without_progress == 0
        assert (stream.num_worker_deaths, stream.num_deaths_excused) == (2 * incident, incident)
        table.suspects.clear()


@pytest.mark.parametrize("case", ["heard from", "made progress there"])
def test_a_replay_that_ran_where_it_died_counts_a_death(case: str) -> None:
    """The worker was heard from since the last death, or the replay made
    progress on it: alive when it took the replay, it died of something else."""
    table, link, alone, innocent = _on_trial_beside_an_innocent()
    table.forget(alone)
    innocent.is_replay_after_progress = True
    innocent.made_progress = case == "made progress there"
    link.is_heard_since_a_death = case == "heard from"
    release(table, link, "died", is_death=True, max_worker_deaths=3)
    assert (innocent.num_worker_deaths, innocent.num_deaths_excused) == (1, 0)


def test_excused_deaths_of_both_kinds_share_one_cap() -> None:
    """A request that streams, then kills its worker beside a newcomer (the
    death blamed on the newcomer), then kills the next worker as it resumes
    there before it was heard from (a death in the same incident), and so on.
    Each death is excused by one rule or the other; with a cap for each, it
    killed 11 workers. With one cap it is failed after twice MAX_WORKER_DEATHS."""
    table = InFlightTable(100)
    (killer,) = table.add([GenerateRequest("killer", "x", 40)], 1e9)
    for death in range(1, 13):
        assert table.waiting == [killer] or table.suspects == [killer], death
        table.waiting.clear()
        table.suspects.clear()
        streams_here = death % 2 == 1
        link = cast(WorkerLink, _Link(is_heard_since_a_death=streams_here))
        killer.next_attempt()
        table.hand_to(killer, link, is_trial=False)
        killer.made_progress = streams_here
        if streams_here:  # a newcomer beside it, admitted, no token yet
            (newcomer,) = table.add([GenerateRequest(f"new{death}", "y", 4)], 1e9)
            table.waiting.remove(newcomer)
            newcomer.next_attempt()
            table.hand_to(newcomer, link, is_trial=False)
        release(table, link, "died", is_death=True, max_worker_deaths=3)
        table.suspects = [entry for entry in table.suspects if entry is killer]
        if killer.events.qsize():
            break
    _, final = killer.events.get_nowait()
    assert "that died" in str(final)
    assert death <= 6, f"failed after killing {death} workers"


def test_a_death_without_progress_counts_only_where_the_request_alone_may_have_caused_it() -> None:
    """Two workers killed from outside seconds apart: the first caught a burst of
    newcomers before their first token, and the second the trial of one of them.
    Each death without progress counted, and the innocent newcomer was failed
    after two. A death with several requests there without progress says
    nothing of which, if any, caused it: it counts toward MAX_WORKER_DEATHS
    alone; a death with one such request counts against it."""
    table = InFlightTable(10)
    burst = [table.add([GenerateRequest(f"new{i}", "x", 4)], 1e9)[0] for i in range(3)]
    table.waiting.clear()
    release(table, _holding(table, burst), "died", is_death=True, max_worker_deaths=3)
    assert table.suspects == burst
    assert [entry.num_deaths_without_progress for entry in burst] == [0, 0, 0]
    trial = table.suspects.pop(0)
    for death in (2, 3):
        link = cast(WorkerLink, _Link())
        trial.next_attempt()
        table.hand_to(trial, link, is_trial=True)
        release(table, link, "died", is_death=True, max_worker_deaths=4)
        assert trial.num_deaths_without_progress == death - 1
        assert (trial in table.suspects) == (death == 2)  # failed after two alone
        table.suspects = [entry for entry in table.suspects if entry is not trial]


def test_a_trials_death_counts_against_it_beside_newcomers() -> None:
    """While the other worker restarts, a suspect's trial shares its worker with
    newcomers: its deaths counted against none, and a poison request killed
    MAX_WORKER_DEATHS workers, however many that was."""
    table, link, trial, newcomer = _on_trial_beside_an_innocent()
    newcomer.made_progress = False  # admitted beside the trial, no token yet
    trial.num_worker_deaths = trial.num_deaths_without_progress = 1
    release(table, link, "died", is_death=True, max_worker_deaths=8)
    assert trial.num_deaths_without_progress == 2 and trial not in table.suspects
    _, final = trial.events.get_nowait()
    assert "in flight on 2 workers that died" in str(final)
    assert newcomer in table.suspects and newcomer.num_deaths_without_progress == 0


def test_the_choices_of_one_request_are_one_that_may_have_killed_the_worker() -> None:
    """A request of two choices, sent to one worker together, killed it before
    its first token: counted as two requests that might have, the death counted
    against neither, and a poison request of n choices cost MAX_WORKER_DEATHS
    workers instead of two."""
    table = InFlightTable(10)
    choices = table.add([GenerateRequest(f"poison-{i}", "x", 4) for i in range(2)], 1e9)
    table.waiting.clear()
    release(table, _holding(table, choices), "died", is_death=True, max_worker_deaths=8)
    assert [entry.num_deaths_without_progress for entry in choices] == [1, 1]


def test_a_worker_that_greets_again_and_again_is_logged_once_a_second(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that re-sent its hello in a loop wrote 15,000 replay lines in 40 s;
    a death's replay is logged every time."""
    # A throttle of this test's own, gone with it (a throttle left alive is
    # flushed into whichever test flushes them all).
    monkeypatch.setattr(replay, "_regreeted_lines", {})
    table = InFlightTable(10)
    (entry,) = table.add([GenerateRequest("r", "x", 4)], 1e9)
    table.waiting.clear()
    link = cast(WorkerLink, _Link(endpoint="tcp://127.0.0.1:5999"))

    def released(times: int, why: str, is_death: bool) -> int:
        """Lines logged for ``times`` releases of the entry, each handed back first."""
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="frontend.replay"):
            for _ in range(times):
                entry.next_attempt()
                table.hand_to(entry, link, is_trial=False)
                table.waiting.clear()
                release(table, link, why, is_death, max_worker_deaths=100)
        return sum(f"{why}: replaying" in record.getMessage() for record in caplog.records)

    assert released(50, "greeted this frontend again", is_death=False) == 1
    assert released(2, "died", is_death=True) == 2
