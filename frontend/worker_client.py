"""The frontend's side of the workers: the in-flight table, routing and replay.

Every accepted request stays in the table until it is answered, exactly once.
It waits here, in the order it was accepted, until a live worker has a free
slot, and goes to the one with the most (`frontend.router`). So requests start
in the order they came whichever worker runs them, and a worker holds little
more than it runs, which is all its death can cost. Every attempt streams from
the worker, so the frontend knows which requests made progress, and a replay
resumes after the last token.

When a worker dies (its connection closes; or it is declared dead or hung while
another worker is live), the requests it held are replayed on the others:
- at once, those that had made progress there: they ran beside whatever killed
  it, and waiting would cost them the failover;
- one at a time, those that had not (suspects: one may be what killed it), each
  once the one before has made progress, on a worker that runs no other suspect,
  and never on every live worker at once when two or more are live. A poison
  request kills one worker at a time and no innocent suspect with it.
A request in flight on two workers that died before it made progress there, or
on three workers that died, is answered with an error and not replayed again.
So an innocent request beside a poison one (it made progress, or it is new) is
never failed for it: it can die without progress only once before it runs.

A lone worker that was only late, live again as the same instance, keeps its
requests. A worker that greets this frontend again (it timed this frontend out
and dropped its requests) holds none of them, and they are sent again.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import uuid

import zmq
import zmq.asyncio

from frontend.config import FrontendConfig
from frontend.discovery import Discovery
from frontend.inflight import Event, InFlight
from frontend.router import pick
from frontend.tasks import start_task, stop_tasks
from frontend.worker_link import WorkerLink
from protocol import (
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    Hello,
    Ping,
    TokenDelta,
    encode,
)
from protocol.liveness import Verdict, WorkerState

log = logging.getLogger(__name__)

# Workers that died while a request was in flight on them, after which the request
# is failed rather than replayed again: two that died before it made progress
# there, or three in all.
MAX_DEATHS_WITHOUT_PROGRESS = 2
MAX_WORKER_DEATHS = 3


class Overloaded(Exception):
    """MAX_INFLIGHT_REQUESTS requests are already waiting for an answer."""


class WorkerClient:
    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.frontend_id = uuid.uuid4().hex
        self._ping = encode(Ping(self.frontend_id))
        self.num_worker_restarts = 0
        self._inflight: dict[str, InFlight] = {}  # by request_id
        self._by_wire_id: dict[str, InFlight] = {}
        self._waiting: list[InFlight] = []  # for a free slot, in order
        self._suspects: list[InFlight] = []  # for a trial, in order
        self._links: dict[str, WorkerLink] = {}  # by endpoint
        self._discovery = Discovery(config.endpoints)
        self._context = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        await self._update_links()
        self._tasks = [start_task(self._tick_loop(), "worker-tick")]
        if not self._discovery.is_static:
            self._tasks.append(start_task(self._discovery_loop(), "worker-discovery"))

    async def close(self) -> None:
        await stop_tasks(self._tasks)
        for link in self._links.values():
            await link.close()
        self._context.term()

    # --- requests -------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_waiting(self) -> int:
        """Accepted requests that no worker holds yet."""
        return len(self._waiting) + len(self._suspects)

    def submit(self, request: GenerateRequest, deadline: float) -> InFlight:
        """Accept a request; it is sent as soon as a live worker has a free slot."""
        if len(self._inflight) >= self.config.max_inflight_requests:
            raise Overloaded(
                f"{len(self._inflight)} requests are already waiting "
                f"(MAX_INFLIGHT_REQUESTS={self.config.max_inflight_requests}); retry later"
            )
        if request.request_id in self._inflight:
            raise ValueError(f"request id {request.request_id} is already in flight")
        entry = InFlight(request, deadline)
        self._inflight[entry.request_id] = entry
        self._waiting.append(entry)
        self._dispatch()
        return entry

    def cancel(self, entry: InFlight) -> None:
        """Forget a request the client no longer waits for, and free its slot."""
        link = entry.link
        if self._forget(entry) and link is not None:
            link.send(AbortRequest(entry.wire_id))
            link.on_done()
            self._dispatch()

    # --- the workers, for /health and /metrics ---------------------------------------

    def workers(self) -> list[WorkerLink]:
        return list(self._links.values())

    def verdict(self) -> Verdict:
        """Live while any worker is; otherwise why none is."""
        verdicts = [link.verdict() for link in self._links.values()]
        if len(verdicts) == 1:
            return verdicts[0]
        num_live = sum(verdict.is_live for verdict in verdicts)
        if num_live:
            return Verdict(WorkerState.LIVE, f"{num_live} of {len(verdicts)} workers live")
        if not verdicts:
            endpoints = ", ".join(self.config.endpoints)
            return Verdict(WorkerState.CONNECTING, f"no worker found at {endpoints} yet")
        state = min((verdict.state for verdict in verdicts), key=_STATE_ORDER.index)
        reasons = "; ".join(verdict.reason for verdict in verdicts[:3])
        more = f"; and {len(verdicts) - 3} more" if len(verdicts) > 3 else ""
        return Verdict(state, f"no worker is live: {reasons}{more}")

    @property
    def hello(self) -> Hello | None:
        """The hello of a live worker, else of any worker that has said one."""
        links = sorted(self._links.values(), key=lambda link: not link.verdict().is_live)
        return next((link.hello for link in links if link.hello is not None), None)

    # --- sending ------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Send what waits to the workers with free slots: suspects' trials first,
        then every other request in the order it was accepted."""
        num_live = sum(link.verdict().is_live for link in self._links.values())
        num_trials = sum(link.trial is not None for link in self._links.values())
        while self._suspects and num_trials < max(1, num_live - 1):
            link = pick(self._links.values(), is_trial=True)
            if link is None or not self._send_attempt(self._suspects, link, is_trial=True):
                break
            num_trials += 1
        while self._waiting:
            link = pick(self._links.values())
            if link is None or not self._send_attempt(self._waiting, link):
                break

    def _send_attempt(self, line: list[InFlight], link: WorkerLink, is_trial: bool = False) -> bool:
        """Send the first request of ``line`` to ``link``; False if it could not go."""
        entry = line[0]
        request = entry.next_attempt()
        frame = encode(request)
        assert link.hello is not None  # it is live
        if len(frame) > link.hello.max_message_bytes:
            # The worker's socket would drop the connection, and every request with it.
            self._resolve(entry, _too_large(entry, len(frame), link.hello.max_message_bytes))
            return True
        if not link.send_frame(frame):
            return False  # its connection just closed: the monitor will say so
        line.pop(0)
        entry.link = link
        link.held.add(entry)
        link.on_sent()
        if is_trial:
            link.trial = entry
        self._by_wire_id[entry.wire_id] = entry
        return True

    def _forget(self, entry: InFlight) -> bool:
        self._by_wire_id.pop(entry.wire_id, None)
        is_known = self._inflight.pop(entry.request_id, None) is not None
        if entry.link is not None:
            entry.link.held.discard(entry)
            if entry.link.trial is entry:
                entry.link.trial = None
            entry.link = None
        else:
            for line in (self._waiting, self._suspects):
                if entry in line:
                    line.remove(entry)
        return is_known

    def _resolve(self, entry: InFlight, final: GenerateResult | ErrorResult) -> None:
        self._forget(entry)
        entry.events.put_nowait(final)

    # --- what the workers send ------------------------------------------------------------

    def on_event(self, link: WorkerLink, message: Event) -> None:
        entry = self._by_wire_id.get(message.request_id)
        if entry is None or entry.link is not link:
            return  # from an earlier attempt, for a request already answered, or a stranger
        if isinstance(message, TokenDelta):
            entry.record(message)
            if entry.request.stream:
                entry.events.put_nowait(message)
            if message.token_ids:
                entry.made_progress = True  # it ran a step: likely not what kills workers
                entry.is_running = True
                is_trial_passed = link.trial is entry
                if is_trial_passed:
                    link.trial = None
                # A passed trial lets the next suspect go. A request that the step
                # under way ends frees its slot: its successor, sent now, waits in
                # the worker and starts right after that step, not a step later.
                if is_trial_passed or entry.ends_this_step:
                    self._dispatch()
        else:
            link.on_done()
            self._resolve(entry, message)
            self._dispatch()

    def on_hello(self, link: WorkerLink, hello: Hello) -> None:
        previous = link.hello
        if link.liveness.on_hello(hello):
            log.info(
                "worker %s at %s says hello: model %s%s, capacity %d",
                hello.instance_id[:8],
                link.endpoint,
                hello.model,
                " (random weights)" if hello.is_random_weights else "",
                hello.capacity,
            )
            if previous is not None:
                self.num_worker_restarts += 1
                self._release(link, f"was replaced by {hello.instance_id[:8]}", is_death=True)
        else:
            # A worker greets a peer only on first contact: it timed this frontend
            # out (FRONTEND_TIMEOUT_S) and aborted its requests, or this frontend
            # reconnected as a new peer. Either way it holds none of them now.
            self._release(link, "greeted this frontend again", is_death=False)
        link.was_live = True
        self._dispatch()

    def on_heartbeat(self, link: WorkerLink) -> None:
        self._check_liveness(link)
        self._dispatch()  # it may show slots freed by another frontend

    def on_connected(self, link: WorkerLink) -> None:
        # A worker greets a peer once it hears from it: ping now, not at the next
        # tick, so that a replacement takes work the moment it is up.
        link.send_frame(self._ping)

    def on_disconnected(self, link: WorkerLink) -> None:
        log.error("worker at %s declared dead: its connection closed", link.endpoint)
        link.was_live = False
        self._release(link, "closed its connection", is_death=True)

    # --- replay -------------------------------------------------------------------------------

    def _release(self, link: WorkerLink, why: str, is_death: bool) -> None:
        """Take back every request ``link`` holds, to send elsewhere. After a death,
        those that made progress there go first in line, the rest become suspects,
        and those that were in flight on too many dead workers are failed."""
        entries = sorted(link.held, key=lambda entry: entry.order)
        link.held.clear()
        link.trial = None
        if not entries:
            return
        num_suspects = num_failed = 0
        for entry in entries:
            # Should the worker still run it (it was only frozen), it stops.
            link.send(AbortRequest(entry.wire_id))
            self._by_wire_id.pop(entry.wire_id, None)
            entry.link = None
            if not is_death:
                _insert_in_order(self._waiting, entry)
                continue
            entry.num_worker_deaths += 1
            made_progress, entry.made_progress = entry.made_progress, False
            if not made_progress:
                entry.num_deaths_without_progress += 1
            if (
                entry.num_deaths_without_progress >= MAX_DEATHS_WITHOUT_PROGRESS
                or entry.num_worker_deaths >= MAX_WORKER_DEATHS
            ):
                log.error(
                    "request %s was in flight on %d workers that died; failing it",
                    entry.request_id,
                    entry.num_worker_deaths,
                )
                num_failed += 1
                self._resolve(entry, _quarantined(entry))
            elif made_progress:
                _insert_in_order(self._waiting, entry)
            else:
                num_suspects += 1
                _insert_in_order(self._suspects, entry)
        log.warning(
            "worker at %s %s: replaying %d requests, %d of them one at a time",
            link.endpoint,
            why,
            len(entries) - num_failed,
            num_suspects,
        )
        self._dispatch()

    def _check_liveness(self, link: WorkerLink) -> None:
        verdict = link.verdict()
        if verdict.is_live and not link.was_live:
            # The same instance, only late: it still holds what it was sent.
            log.warning(
                "worker is live again at %s, the same instance: it keeps what it holds",
                link.endpoint,
            )
        elif not verdict.is_live and link.was_live:
            log.error("worker declared %s: %s", verdict.state.value, verdict.reason)
        link.was_live = verdict.is_live
        is_any_other_live = any(
            other.verdict().is_live for other in self._links.values() if other is not link
        )
        if link.held and not verdict.is_live and is_any_other_live:
            # Frozen, hung or cut off: a live worker runs its requests meanwhile.
            self._release(link, f"is {verdict.state.value}", is_death=True)

    # --- background ---------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            for link in list(self._links.values()):
                link.send_frame(self._ping)
                self._check_liveness(link)
            self._dispatch()
            await asyncio.sleep(self.config.ping_interval_s)

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.worker_resolve_interval_s)
            await self._update_links()

    async def _update_links(self) -> None:
        """Connect to every worker found; drop one whose address is gone once it is
        no longer live (a live one serves on until its connection closes)."""
        endpoints, is_complete = await self._discovery.resolve()
        for endpoint in sorted(endpoints - self._links.keys()):
            log.info("connecting to a worker at %s", endpoint)
            link = WorkerLink(endpoint, self.config, self._context, self)
            self._links[endpoint] = link
            link.start()
        gone = self._links.keys() - endpoints if is_complete else set()
        for endpoint in sorted(gone):
            link = self._links[endpoint]
            if not link.verdict().is_live:
                log.info("the worker at %s is gone from %s", endpoint, self.config.endpoints)
                del self._links[endpoint]
                self._release(link, "is gone", is_death=True)
                await link.close()


_STATE_ORDER = [WorkerState.HUNG, WorkerState.DEAD, WorkerState.CONNECTING, WorkerState.LIVE]


def _insert_in_order(line: list[InFlight], entry: InFlight) -> None:
    bisect.insort(line, entry, key=lambda waiting: waiting.order)


def _quarantined(entry: InFlight) -> ErrorResult:
    return ErrorResult(
        entry.wire_id,
        ErrorCode.WORKERS_DIED,
        f"the request was in flight on {entry.num_worker_deaths} workers that died; it is "
        "not replayed again, since it may be what kills them (the worker logs say why)",
    )


def _too_large(entry: InFlight, num_bytes: int, limit: int) -> ErrorResult:
    return ErrorResult(
        entry.wire_id,
        ErrorCode.INVALID_REQUEST,
        f"the request is {num_bytes:,} bytes on the wire, more than the worker accepts "
        f"(its MAX_MESSAGE_BYTES={limit:,}); shorten the prompt",
    )
