"""Which worker takes the next request."""

from __future__ import annotations

from collections.abc import Collection

from frontend.inflight import InFlight
from frontend.worker_link import WorkerLink
from protocol.request_checks import limits_of


def pick(
    links: Collection[WorkerLink], entry: InFlight, is_trial: bool = False
) -> WorkerLink | None:
    """The live worker with the most free slots for ``entry``, or None while none
    has one.

    Of those whose limits (as their hellos say them) take its request, where any
    live worker's do: a request too long for one worker's context window waits
    for another that holds it, rather than be refused by the first. Where none
    live takes it (the one that did has died), any may have it, and refuse it.

    A suspect's trial goes only to a worker that runs no other: two suspects
    side by side could be one poison request and an innocent one, and the
    innocent one would die a second time before making progress. Nor to one not
    heard from since a worker last died (`WorkerLink.is_heard_since_a_death`).
    It prefers one that holds no replay of a request that was on a worker that
    died: should that one kill this worker too, the trial would die a second
    time without progress, and be blamed for it (`frontend.replay`). Other
    requests prefer a worker with no trial, the fewer to replay if its suspect
    is poison."""
    best: WorkerLink | None = None
    best_key = (False, 0)
    live = [link for link in links if link.verdict().is_live]
    for link in _takers(live, entry) or live:
        if is_trial and (link.trial is not None or not link.is_heard_since_a_death):
            continue
        num_free = link.free_slots()
        preferred = not _holds_a_replay(link) if is_trial else link.trial is None
        key = (preferred, num_free)
        if num_free > 0 and key > best_key:
            best, best_key = link, key
    return best


def _takers(live: list[WorkerLink], entry: InFlight) -> list[WorkerLink]:
    """The workers of ``live`` whose limits take ``entry``'s request (one that
    does not say its limits may take anything). Checked only where they differ
    in their limits (`InFlight.is_taken_by`)."""
    limits = {link: limits_of(link.hello) if link.hello else None for link in live}
    if len(set(limits.values())) < 2:
        return live  # the same for each: none better placed than another
    return [link for link in live if entry.is_taken_by(limits[link])]


def _holds_a_replay(link: WorkerLink) -> bool:
    """A replay that has not yet made progress here, where it may kill again."""
    return any(entry.num_worker_deaths and not entry.made_progress for entry in link.held)
