"""Which worker takes the next request."""

from __future__ import annotations

from collections.abc import Iterable

from frontend.worker_link import WorkerLink


def pick(links: Iterable[WorkerLink], is_trial: bool = False) -> WorkerLink | None:
    """The live worker with the most free slots, or None while none has one.

    A worker that runs a suspect on trial takes nothing else until the suspect
    has made progress: if it is what kills workers, it takes nothing innocent
    down with it. For the same reason a trial goes only to a worker whose
    requests have all made progress there (a death costs those a third try, not
    their second)."""
    best: WorkerLink | None = None
    most_free = 0
    for link in links:
        if link.trial is not None:
            continue
        if is_trial and not all(entry.made_progress for entry in link.held):
            continue
        num_free = link.free_slots()
        if num_free > most_free and link.verdict().is_live:
            best, most_free = link, num_free
    return best
