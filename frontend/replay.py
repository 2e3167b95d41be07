"""Replay policy: what becomes of the requests a worker held when it dies.

When a worker dies (its connection closes; or it is declared dead or hung while
another worker is live), the requests it held are replayed on the others:
- at once, those that had made progress there: they ran beside whatever killed
  it, and waiting would cost them the failover;
- one at a time, those that had not (suspects: one may be what killed it), each
  once the one before has made progress, on a worker that runs no other suspect
  and has shown it is alive since the death (`WorkerLink.on_other_death`: one
  killed with it, not yet found dead, would count a second death against the
  suspect), and never on every live worker at once when two or more are live.
  A poison request kills one worker at a time and no innocent suspect with it.
A request that died without progress on two workers, each time the only such
request there or on trial, or that was in flight on MAX_WORKER_DEATHS workers
that died (3 by default), is answered with an error and not replayed again. A
death beside several requests without progress (a burst of newcomers, killed
from outside before their first token) says nothing of which caused it: it
counts toward MAX_WORKER_DEATHS only, and each is tried alone.
So an innocent request beside a poison one (it made progress, or it is new) is
never failed for it: it can die alone without progress only once before it
runs.
Two kinds of death are excused, not counted toward MAX_WORKER_DEATHS, up to
MAX_WORKER_DEATHS excused deaths a request, so that every request is still
failed after at most twice MAX_WORKER_DEATHS deaths:
- a replay's death in the same incident: a request replayed at once (it had
  made progress on the worker that died) died on a worker not heard from since
  a death, before making progress there: both were most likely killed at the
  same moment, found dead milliseconds apart. It is tried alone, as a suspect
  is, but no death without progress is counted.
- a death beside a request that ran on that worker without progress (admitted
  and no token yet, a suspect's trial, or one taken for a request that only
  waited though it had died before: its `Admitted` may have been lost): that
  request is the likely culprit, and the requests that made progress beside it
  are excused. Two poison requests sent at once each kill a worker, and the
  innocent requests replayed from the first onto the second die twice; the
  poison requests' further kills must not add the third death that would fail
  them.
A death while the request only waited in its worker's queue (the worker said
`Waiting`, and no `Admitted` since) is not one without progress: nothing of it
ran there, unless it has a grammar, which compiles while it waits. It goes back
in its line as it was, a suspect's trial still a suspect. It still counts toward
MAX_WORKER_DEATHS, which bounds every request's replays: a poison request's too,
should its `Admitted` be lost with the worker it kills.

A worker that did not die but holds none of its requests any more (it greeted
this frontend again) has them all sent again, in their places in line, a
suspect's trial still a suspect; so does
one that stops when told to (SIGTERM), which hands each back with an error
`shutting_down` (`frontend.worker_client`): no death is counted.
"""

from __future__ import annotations

import enum
import logging

from frontend.inflight import InFlight
from frontend.inflight_table import InFlightTable
from frontend.worker_link import WorkerLink
from protocol import AbortRequest, ErrorCode, ErrorResult
from protocol.throttled import Throttled

log = logging.getLogger(__name__)
# A line a second per worker's endpoint (they are few) for replays that no death
# caused: a peer that greeted this frontend again and again wrote 15,000 in 40 s.
_regreeted_lines: dict[str, Throttled] = {}

# Workers that died before a request made progress there, after which it is failed
# rather than replayed again (deaths in all: the frontend's MAX_WORKER_DEATHS).
MAX_DEATHS_WITHOUT_PROGRESS = 2


def release(
    table: InFlightTable, link: WorkerLink, why: str, is_death: bool, max_worker_deaths: int
) -> int:
    """Take back every request ``link`` holds, to send elsewhere, and say how
    many. After a death, those that made progress there, or only waited in its
    queue, go back in line, the rest become suspects, and those that were in
    flight on too many dead workers are failed."""
    trial = link.trial
    entries = table.take_back(link)
    if not entries:
        return 0
    for entry in entries:
        # Should the worker still run it (it was only frozen), it stops.
        link.send(AbortRequest(entry.wire_id))
    if not is_death:
        for entry in entries:
            table.requeue(entry, is_suspect=entry is trial)
        message = _replay_line(link, why, len(entries), int(trial is not None), 0)
        endpoint = link.endpoint
        lines = _regreeted_lines.setdefault(endpoint, Throttled(log, f"replays from {endpoint}"))
        lines.warn(message)
        return len(entries)
    same_incident = [
        entry
        for entry in entries
        if _died_in_the_same_incident(entry, link) and entry.num_deaths_excused < max_worker_deaths
    ]
    for entry in same_incident:
        _excuse_as_the_same_incident(table, entry)
    others = [entry for entry in entries if entry not in same_incident]
    # Client requests: the n choices of one, sent together, are one suspect.
    num_may_have_killed = len({id(entry.events) for entry in others if _may_have_killed(entry)})
    outcomes = [
        _count_the_death(table, entry, entry is trial, num_may_have_killed, max_worker_deaths)
        for entry in others
    ]
    num_suspects = outcomes.count(_Outcome.SUSPECT) + len(same_incident)
    num_replayed = len(entries) - outcomes.count(_Outcome.FAILED)
    log.warning("%s", _replay_line(link, why, num_replayed, num_suspects, len(same_incident)))
    return len(entries)


class _Outcome(enum.Enum):
    """What a death made of a request it caught."""

    REQUEUED = "requeued"  # in its line, as it was
    SUSPECT = "suspect"  # tried alone
    FAILED = "failed"


def _excuse_as_the_same_incident(table: InFlightTable, entry: InFlight) -> None:
    """A replay that died where it was just sent, most likely killed with the
    worker it came from: excused, but tried alone, since a request that kills
    each worker it resumes on would otherwise go at once to the next one not
    heard from, and take every worker down together."""
    entry.num_worker_deaths += 1
    entry.num_deaths_excused += 1
    entry.is_replay_after_progress = False
    table.requeue(entry, is_suspect=True)


def _count_the_death(
    table: InFlightTable,
    entry: InFlight,
    was_on_trial: bool,
    num_may_have_killed: int,
    max_worker_deaths: int,
) -> _Outcome:
    """Count the death against ``entry`` (excused if it made progress beside
    ``num_may_have_killed`` requests that may have caused it; one without
    progress when it alone may have, or it was on trial there), then fail it past
    its bounds, or send it again: at once if it made progress, in its line as it
    was if it only waited, else as a suspect."""
    entry.num_worker_deaths += 1
    made_progress, entry.made_progress = entry.made_progress, False
    entry.is_replay_after_progress = made_progress
    # A trial is the request on trial, whatever newcomers came beside it (it may
    # have to share a worker, while the other restarts).
    if (
        not made_progress
        and not entry.is_idle_in_queue
        and (num_may_have_killed == 1 or was_on_trial)
    ):
        entry.num_deaths_without_progress += 1
    if made_progress and num_may_have_killed and entry.num_deaths_excused < max_worker_deaths:
        entry.num_deaths_excused += 1
    if (
        entry.num_deaths_without_progress >= MAX_DEATHS_WITHOUT_PROGRESS
        or entry.num_worker_deaths - entry.num_deaths_excused >= max_worker_deaths
    ):
        log.error(
            "request %s was in flight on %s that died (%d of them excused); failing it",
            entry.request_id,
            _workers(entry.num_worker_deaths),
            entry.num_deaths_excused,
        )
        table.resolve(entry, _quarantined(entry))
        return _Outcome.FAILED
    if made_progress:
        table.requeue(entry)
        return _Outcome.REQUEUED
    if entry.is_idle_in_queue:
        table.requeue(entry, is_suspect=was_on_trial)
        return _Outcome.SUSPECT if was_on_trial else _Outcome.REQUEUED
    table.requeue(entry, is_suspect=True)
    return _Outcome.SUSPECT


def _may_have_killed(entry: InFlight) -> bool:
    """``entry`` ran something on the worker that died and made no progress
    there: admitted (or a trial), or taken for one that only waited though it was
    in flight on a worker that died before (its `Admitted` may have been lost
    with that worker too)."""
    return not entry.made_progress and (not entry.is_idle_in_queue or entry.num_worker_deaths > 0)


def _died_in_the_same_incident(entry: InFlight, link: WorkerLink) -> bool:
    """``entry`` was replayed here at once when another worker died (it had made
    progress there), made none here, and this worker died before it was heard
    from since the last death it was told of: most likely killed at the same
    moment, found dead a few milliseconds later. One incident: the replay never
    ran."""
    return (
        entry.is_replay_after_progress
        and not entry.made_progress
        and not link.is_heard_since_a_death
    )


def _replay_line(
    link: WorkerLink, why: str, num_replayed: int, num_suspects: int, num_same_incident: int
) -> str:
    same = (
        f" ({num_same_incident} sent here as another worker died: excused, tried alone)"
        if num_same_incident
        else ""
    )
    return (
        f"worker at {link.endpoint} {why}: replaying {num_replayed} request(s), "
        f"{num_suspects} of them one at a time{same}"
    )


def _quarantined(entry: InFlight) -> ErrorResult:
    return ErrorResult(
        entry.wire_id,
        ErrorCode.WORKERS_DIED,
        f"the request was in flight on {_workers(entry.num_worker_deaths)} that died or "
        "stopped answering (each taken for dead); it is not replayed again, since it may "
        "be what kills workers (the worker logs say why a worker failed; the supervisor's "
        "log names a worker killed from outside, which the request did not cause)",
    )


def _workers(count: int) -> str:
    return "a worker" if count == 1 else f"{count} workers"
