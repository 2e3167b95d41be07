"""Sending what waits in the in-flight table to the workers with free slots.

A request waits in the table, in the order it was accepted, until a live worker
whose limits take it has a free slot, and goes to the one with the most
(`frontend.router`). So requests start in the order they came whichever worker
runs them, and a worker holds little more than it runs, which is all its death
can cost. Where workers differ in their limits (a context window), a request
that only busy ones take lets those behind it go to the others meanwhile: it
takes the first slot of a worker that takes it all the same. Every attempt
streams from the worker, so the frontend knows which requests made progress, and
a replay resumes after the last token.

The choices of one client request (OpenAI's ``n``) go together, to the same
worker, one frame right after another, so that they reach its queue together
and it can admit them in one go and prefill their shared prompt once. So a
worker may be sent up to n - 1 more than its free slots; those wait in its
queue, as many as it has room for (a low MAX_QUEUE_DEPTH), the others here. A
replayed choice goes wherever there is room, with whichever of its siblings
wait beside it.

Suspects (`frontend.replay`) go first, each on a worker that runs no other
suspect and has shown it is alive since the last death, and never on every
live worker at once when two or more are live. While no worker qualifies (up
to a heartbeat interval after a death), the others take the free slots.
"""

from __future__ import annotations

from collections.abc import Collection

from frontend.inflight import InFlight
from frontend.inflight_table import InFlightTable
from frontend.router import pick
from frontend.worker_link import WorkerLink
from protocol import ErrorCode, ErrorResult, encode


def dispatch(table: InFlightTable, links: Collection[WorkerLink]) -> None:
    """Send what waits to the workers with free slots: suspects' trials first,
    then every other request in the order it was accepted, passing over those
    that only busy workers take."""
    num_live = sum(link.verdict().is_live for link in links)
    num_trials = sum(link.trial is not None for link in links)
    while table.suspects and num_trials < max(1, num_live - 1):
        link = pick(links, table.suspects[0], is_trial=True)
        if link is None or not _send_at(table, table.suspects, 0, link, is_trial=True):
            break
        num_trials += 1
    at = 0  # the first in line not passed over
    num_passed_over = 0
    while at < len(table.waiting) and num_passed_over < _MAX_PASSED_OVER:
        link = pick(links, table.waiting[at])
        if link is not None:
            if not _send_with_siblings(table, at, link):
                break
        elif _any_free_slot(links):
            at = _past_siblings(table.waiting, at)  # only busy workers take it
            num_passed_over += 1
        else:
            break


# Requests that only busy workers take, looked past at one dispatch: each costs a
# `pick`, and the frontend dispatches at every step's end. Those further behind
# wait until some of these have gone.
_MAX_PASSED_OVER = 64


def _any_free_slot(links: Collection[WorkerLink]) -> bool:
    return any(link.verdict().is_live and link.free_slots() > 0 for link in links)


def _past_siblings(line: list[InFlight], at: int) -> int:
    """The place in ``line`` of the first request after the one at ``at`` and the
    other choices of its client request (which wait right behind it)."""
    first, at = line[at], at + 1
    while at < len(line) and line[at].is_sibling(first):
        at += 1
    return at


def _send_with_siblings(table: InFlightTable, at: int, link: WorkerLink) -> bool:
    """Send the waiting request at ``at`` to ``link``, and the other choices of
    its client request that wait right behind it (the line is in accept order,
    so they do) while the worker's queue has room for them; False if the first
    could not go. Those that find no room wait here for the next free slot: past
    its MAX_QUEUE_DEPTH the worker would refuse them."""
    first = table.waiting[at]
    if not _send_at(table, table.waiting, at, link):
        return False
    assert link.hello is not None  # it is live
    while (
        at < len(table.waiting)
        and table.waiting[at].is_sibling(first)
        and -link.free_slots() < link.hello.max_queue_depth
    ):
        if not _send_at(table, table.waiting, at, link):
            break
    return True


def _send_at(
    table: InFlightTable, line: list[InFlight], at: int, link: WorkerLink, is_trial: bool = False
) -> bool:
    """Send the request at ``at`` in ``line`` to ``link``; False if it could not go."""
    entry = line[at]
    request = entry.next_attempt()
    frame = encode(request)
    assert link.hello is not None  # it is live
    if len(frame) > link.hello.max_message_bytes:
        # The worker's socket would drop the connection, and every request with it.
        table.resolve(entry, _too_large(entry, len(frame), link.hello.max_message_bytes))
        return True
    if not link.send_frame(frame):
        return False  # its connection just closed: the monitor will say so
    line.pop(at)
    table.hand_to(entry, link, is_trial)
    link.on_sent()
    return True


def _too_large(entry: InFlight, num_bytes: int, limit: int) -> ErrorResult:
    return ErrorResult(
        entry.wire_id,
        ErrorCode.INVALID_REQUEST,
        f"the request is {num_bytes:,} bytes on the wire, more than the worker accepts "
        f"(its MAX_MESSAGE_BYTES={limit:,}); shorten the prompt",
    )
