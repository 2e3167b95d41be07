"""The in-flight table: every request the frontend accepted and has not answered,
and where each one is now.

A request is in exactly one place: in line for a free slot (``waiting``), in
line for a trial on a worker of its own (``suspects``: it was in flight on a
worker that died before it made progress there), or held by one worker, which
runs its current attempt. Both lines keep the order requests were accepted in.
A request leaves the table once: answered (`resolve`) or forgotten (`forget`).
The choices of one client request (OpenAI's ``n``) enter together, each an
entry of its own, and each counts against MAX_INFLIGHT_REQUESTS.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence

from frontend.inflight import Event, Final, InFlight
from frontend.worker_link import WorkerLink
from protocol import GenerateRequest


class Overloaded(Exception):
    """MAX_INFLIGHT_REQUESTS requests are already in flight, waiting for an answer."""


class InFlightTable:
    def __init__(self, max_inflight_requests: int) -> None:
        self.max_inflight_requests = max_inflight_requests
        self.waiting: list[InFlight] = []  # for a free slot, in order
        self.suspects: list[InFlight] = []  # for a trial, in order
        self._by_request_id: dict[str, InFlight] = {}
        self._by_wire_id: dict[str, InFlight] = {}  # those a worker holds

    @property
    def num_inflight(self) -> int:
        return len(self._by_request_id)

    @property
    def num_waiting(self) -> int:
        """Accepted requests that no worker holds yet."""
        return len(self.waiting) + len(self.suspects)

    def add(self, requests: Sequence[GenerateRequest], deadline: float) -> list[InFlight]:
        """Accept one client request's choices, one worker request each, at the
        end of the line, all of them or none: Overloaded when the table has no
        room for them all."""
        if len(self._by_request_id) + len(requests) > self.max_inflight_requests:
            needs = f"; this one needs {len(requests)}, one per choice" if len(requests) > 1 else ""
            num = len(self._by_request_id)
            raise Overloaded(
                f"{num} {'request is' if num == 1 else 'requests are'} already in flight "
                f"(MAX_INFLIGHT_REQUESTS={self.max_inflight_requests}){needs}; retry later"
            )
        for request in requests:
            if request.request_id in self._by_request_id:
                raise ValueError(f"request id {request.request_id} is already in flight")
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        entries = [
            InFlight(request, deadline, index, events) for index, request in enumerate(requests)
        ]
        for entry in entries:
            self._by_request_id[entry.request_id] = entry
        self.waiting.extend(entries)
        return entries

    def held(self, wire_id: str) -> InFlight | None:
        """The request whose current attempt has this wire id, if a worker holds it."""
        return self._by_wire_id.get(wire_id)

    def hand_to(self, entry: InFlight, link: WorkerLink, is_trial: bool) -> None:
        """``entry``'s current attempt was sent to ``link``, which holds it now."""
        entry.link = link
        link.held.add(entry)
        if is_trial:
            link.trial = entry
        self._by_wire_id[entry.wire_id] = entry

    def put_back(self, entry: InFlight) -> None:
        """``entry``'s worker gave it back (its queue was full, or it is stopping
        and hands back what it holds): back in its line, at its place, a trial
        still a suspect."""
        link = entry.link
        is_trial = link is not None and link.trial is entry
        if link is not None:
            link.held.discard(entry)
            if is_trial:
                link.trial = None
        self._by_wire_id.pop(entry.wire_id, None)
        entry.link = None
        self.requeue(entry, is_suspect=is_trial)

    def take_back(self, link: WorkerLink) -> list[InFlight]:
        """Every request ``link`` holds, in order, now held by none (and in no line)."""
        entries = sorted(link.held, key=lambda entry: entry.order)
        link.held.clear()
        link.trial = None
        for entry in entries:
            self._by_wire_id.pop(entry.wire_id, None)
            entry.link = None
        return entries

    def take_unheld(self) -> list[InFlight]:
        """Every request no worker holds, in order, now in no line (still in the
        table, to be resolved)."""
        entries = sorted(self.waiting + self.suspects, key=lambda entry: entry.order)
        self.waiting.clear()
        self.suspects.clear()
        return entries

    def all_entries(self) -> list[InFlight]:
        """Every request in the table, in accept order."""
        return sorted(self._by_request_id.values(), key=lambda entry: entry.order)

    def requeue(self, entry: InFlight, is_suspect: bool = False) -> None:
        """Put a request no worker holds back in line, at its place by accept order."""
        line = self.suspects if is_suspect else self.waiting
        bisect.insort(line, entry, key=lambda waiting: waiting.order)

    def forget(self, entry: InFlight) -> bool:
        """Drop a request from the table, and from its line or its worker; False
        if it had already left."""
        self._by_wire_id.pop(entry.wire_id, None)
        is_known = self._by_request_id.pop(entry.request_id, None) is not None
        if entry.link is not None:
            entry.link.held.discard(entry)
            if entry.link.trial is entry:
                entry.link.trial = None
            entry.link = None
        else:
            for line in (self.waiting, self.suspects):
                if entry in line:
                    line.remove(entry)
        return is_known

    def resolve(self, entry: InFlight, final: Final) -> None:
        """Answer a request: it leaves the table, and its handler gets ``final``."""
        self.forget(entry)
        entry.post(final)
