"""Which worker takes the next request."""

from __future__ import annotations

from collections.abc import Iterable

from frontend.worker_link import WorkerLink


def pick(links: Iterable[WorkerLink], is_trial: bool = False) -> WorkerLink | None:
    """The live worker with the most free slots, or None while none has one.

    A suspect's trial goes only to a worker that runs no other: two suspects
    side by side could be one poison request and an innocent one, and the
    innocent one would die a second time before making progress. Nor to one not
    heard from since a worker last died (`WorkerLink.is_heard_since_a_death`).
    Other requests prefer a worker with no trial, the fewer to replay if its
    suspect is poison."""
    best: WorkerLink | None = None
    best_key = (False, 0)
    for link in links:
        if is_trial and (link.trial is not None or not link.is_heard_since_a_death):
            continue
        num_free = link.free_slots()
        key = (link.trial is None, num_free)
        if num_free > 0 and key > best_key and link.verdict().is_live:
            best, best_key = link, key
    return best
