"""Which worker takes the next request."""

from __future__ import annotations

from collections.abc import Collection

from frontend.worker_link import WorkerLink
from protocol import GenerateRequest
from protocol.request_checks import limits_of, request_problem


def pick(
    links: Collection[WorkerLink], request: GenerateRequest, is_trial: bool = False
) -> WorkerLink | None:
    """The live worker with the most free slots, or None while none has one.

    Of those whose limits (as their hellos say them) take ``request``, where any
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
    for link in _takers(live, request) or live:
        if is_trial and (link.trial is not None or not link.is_heard_since_a_death):
            continue
        num_free = link.free_slots()
        preferred = not _holds_a_replay(link) if is_trial else link.trial is None
        key = (preferred, num_free)
        if num_free > 0 and key > best_key:
            best, best_key = link, key
    return best


def _takers(live: list[WorkerLink], request: GenerateRequest) -> list[WorkerLink]:
    """The workers of ``live`` whose limits take ``request`` (one that does not
    say its limits may take anything). Checked only where they differ in their
    limits, once for each: the checks parse a grammar, and took 20 ms for one of
    30,000 characters, at every dispatch while it waited."""
    limits = {link: limits_of(link.hello) if link.hello else None for link in live}
    distinct = set(limits.values())
    if len(distinct) < 2:
        return live  # the same for each: none better placed than another
    takes = {each: each is None or request_problem(request, each) is None for each in distinct}
    return [link for link in live if takes[limits[link]]]


def _holds_a_replay(link: WorkerLink) -> bool:
    """A replay that has not yet made progress here, where it may kill again."""
    return any(entry.num_worker_deaths and not entry.made_progress for entry in link.held)
