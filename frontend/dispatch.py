"""Sending what waits in the in-flight table to the workers with free slots.

A request waits in the table, in the order it was accepted, until a live worker
whose limits take it has a free slot, and goes to the one with the most
(`frontend.router`). So
requests start in the order they came whichever worker runs them, and a worker
holds little more than it runs, which is all its death can cost. Every attempt
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
    then every other request in the order it was accepted."""
    num_live = sum(link.verdict().is_live for link in links)
    num_trials = sum(link.trial is not None for link in links)
    while table.suspects and num_trials < max(1, num_live - 1):
        link = pick(links, table.suspects[0].request, is_trial=True)
        if link is None or not _send_first(table, table.suspects, link, is_trial=True):
            break
        num_trials += 1
    while table.waiting:
        link = pick(links, table.waiting[0].request)
        if link is None or not _send_with_siblings(table, link):
            break


def _send_with_siblings(table: InFlightTable, link: WorkerLink) -> bool:
    """Send the first waiting request to ``link``, and the other choices of its
    client request that wait right behind it (the line is in accept order, so
    they do) while the worker's queue has room for them; False if the first could
    not go. Those that find no room wait here for the next free slot: past its
    MAX_QUEUE_DEPTH the worker would refuse them."""
    first = table.waiting[0]
    if not _send_first(table, table.waiting, link):
        return False
    assert link.hello is not None  # it is live
    while (
        table.waiting
        and table.waiting[0].is_sibling(first)
        and -link.free_slots() < link.hello.max_queue_depth
    ):
        if not _send_first(table, table.waiting, link):
            break
    return True


def _send_first(
    table: InFlightTable, line: list[InFlight], link: WorkerLink, is_trial: bool = False
) -> bool:
    """Send the first request of ``line`` to ``link``; False if it could not go."""
    entry = line[0]
    request = entry.next_attempt()
    frame = encode(request)
    assert link.hello is not None  # it is live
    if len(frame) > link.hello.max_message_bytes:
        # The worker's socket would drop the connection, and every request with it.
        table.resolve(entry, _too_large(entry, len(frame), link.hello.max_message_bytes))
        return True
    if not link.send_frame(frame):
        return False  # its connection just closed: the monitor will say so
    line.pop(0)
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
