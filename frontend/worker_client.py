"""The frontend's side of the workers, as its HTTP handlers see it: requests go
in (`submit`, `cancel`), and what the workers say becomes changes to the
in-flight table.

Every accepted request stays in the table (`frontend.inflight_table`) until it
is answered, exactly once. What waits there is sent as slots free up
(`frontend.dispatch`); what a dead worker held is replayed (`frontend.replay`);
the workers and the loops that keep them are `frontend.worker_pool`'s.

A lone worker that was only late, live again as the same instance, keeps its
requests. A worker that greets this frontend again (it timed this frontend out
and dropped its requests) holds none of them, and they are sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable, Sequence

from frontend.config import FrontendConfig
from frontend.dispatch import dispatch
from frontend.inflight import Event, InFlight, QueueNotice
from frontend.inflight_table import InFlightTable
from frontend.replay import release
from frontend.worker_link import WorkerLink
from frontend.worker_pool import WorkerPool
from protocol import (
    AbortRequest,
    Admitted,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    Hello,
    Ping,
    TokenDelta,
    Waiting,
    encode,
)
from protocol.liveness import PauseWatch, Verdict
from protocol.stop_timing import FRONTEND_ANSWERS_LEFT_BEFORE_S

log = logging.getLogger(__name__)


class WorkerClient:
    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.frontend_id = uuid.uuid4().hex
        self._ping = encode(Ping(self.frontend_id))
        self.num_worker_restarts = 0
        self._table = InFlightTable(config.max_inflight_requests)
        self._pool = WorkerPool(config, self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.is_shutting_down = False
        self._pause = PauseWatch("frontend", config.heartbeat_timeout_s, config.ping_interval_s)
        # Set at the first hello of any worker, or once this frontend stops.
        self._greeted = asyncio.Event()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._pool.start()

    async def close(self) -> None:
        await self._pool.close()

    def shut_down_soon(self, grace_s: float) -> None:
        """From a signal handler: `shut_down` at the event loop's next turn."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.shut_down, grace_s)

    def shut_down(self, grace_s: float) -> None:
        """The frontend is stopping, and has ``grace_s`` before its connections are
        cut (uvicorn's graceful-shutdown timeout). Requests go on while a worker is
        live; once none is (a signal to the whole process group stops the workers
        too), what no worker holds is answered at once, and a second before the
        cut, whatever is left: 503, or a stream's error event, not a cut connection."""
        if self.is_shutting_down or self._loop is None:
            return
        self.is_shutting_down = True
        self._greeted.set()  # a request waiting for a first hello waits no more
        log.info("shutting down: %d requests in flight", self.num_inflight)
        left_s = max(0.0, grace_s - FRONTEND_ANSWERS_LEFT_BEFORE_S)
        why = (
            f"it did not finish in the {left_s:g} s this frontend's stop left it (its "
            f"{grace_s:g} s, less {FRONTEND_ANSWERS_LEFT_BEFORE_S:g} to answer)"
        )
        self._loop.call_later(left_s, self._end_all, why)
        self._dispatch()

    def end_all_soon(self, why: str) -> None:
        """From a signal handler, once `shut_down` began: answer every request at
        the event loop's next turn, as its grace's end would, saying ``why``."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._end_all, why)

    def _end_all(self, why: str) -> None:
        entries = self._table.all_entries()
        if entries:
            log.warning("shutting down: ending %d requests that did not finish", len(entries))
        for entry in entries:
            entry.post(_shutting_down(entry, why))
        self.cancel(entries)  # out of the table, and aborted in the workers that run them

    # --- requests -------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return self._table.num_inflight

    @property
    def num_waiting(self) -> int:
        """Accepted requests that no worker holds yet."""
        return self._table.num_waiting

    def submit(self, requests: Sequence[GenerateRequest], deadline: float) -> list[InFlight]:
        """Accept one client request's choices (one worker request each); they are
        sent as soon as a live worker has a free slot, all to that worker. Raises
        Overloaded when MAX_INFLIGHT_REQUESTS leaves no room for all of them."""
        entries = self._table.add(requests, deadline)
        self._dispatch()
        return entries

    def cancel(self, entries: Iterable[InFlight]) -> None:
        """Forget requests the client no longer waits for, and free their slots."""
        is_any_freed = False
        for entry in entries:
            link = entry.link
            if self._table.forget(entry) and link is not None:
                link.send(AbortRequest(entry.wire_id))
                link.on_done()
                is_any_freed = True
        if is_any_freed:
            self._dispatch()

    # --- the workers, for /health and /metrics ---------------------------------------

    def workers(self) -> list[WorkerLink]:
        return self._pool.links()

    def verdict(self) -> Verdict:
        """Live while any worker is; otherwise why none is."""
        return self._pool.verdict()

    @property
    def hello(self) -> Hello | None:
        """The hello of a live worker, else of any worker that has said one."""
        return self._pool.hello

    async def first_hello(self, timeout_s: float) -> Hello | None:
        """`hello`, waiting up to ``timeout_s`` for one while no worker has said
        any; None if none came (or this frontend began to stop)."""
        if self.hello is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._greeted.wait(), timeout_s)
        return self.hello

    # --- what the workers send ------------------------------------------------------------

    def on_event(self, link: WorkerLink, message: Event | QueueNotice) -> None:
        entry = self._table.held(message.request_id)
        if entry is None or entry.link is not link:
            return  # from an earlier attempt, for a request already answered, or a stranger
        if not isinstance(message, (Waiting, Admitted, ErrorResult)):
            problem = entry.answer_problem(message, link.hello)
            if problem is not None:
                message = link.refuse_answer(message.request_id, problem)
        if isinstance(message, (Waiting, Admitted)):
            entry.is_waiting = isinstance(message, Waiting)
        elif isinstance(message, TokenDelta):
            entry.record(message)
            if entry.request.stream:
                entry.post(message)
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
        elif isinstance(message, ErrorResult) and message.code == ErrorCode.QUEUE_FULL:
            # Another client (a second frontend) filled the worker's queue first.
            # This frontend accepted the request: it waits here for room again.
            link.on_queue_full()
            self._table.put_back(entry)
            self._dispatch()
        elif isinstance(message, ErrorResult) and message.code == ErrorCode.SHUTTING_DOWN:
            # The worker is stopping (SIGTERM) and hands back what it holds: each
            # goes to another worker (or its replacement), resumed where it
            # stopped. Not a death: nothing says that the request kills workers.
            link.on_handed_back()
            self._table.put_back(entry)
            self._dispatch()
        else:
            link.on_done()
            if isinstance(message, GenerateResult):
                message = entry.with_whole_wait(message)
            self._table.resolve(entry, message)
            self._dispatch()

    def on_hello(self, link: WorkerLink, hello: Hello) -> None:
        previous = link.hello
        self._greeted.set()
        if link.liveness.on_hello(hello):
            log.info(
                "worker %s at %s says hello: model %s%s, capacity %d",
                hello.instance_id[:8],
                link.endpoint,
                hello.model,
                " (random weights)" if hello.is_random_weights else "",
                hello.capacity,
            )
            for problem in self.config.timing_problems(
                hello.heartbeat_interval_s, hello.frontend_timeout_s
            ):
                log.error("worker at %s: %s", link.endpoint, problem)
            self._check_one_model(link, hello)
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

    def _check_one_model(self, link: WorkerLink, hello: Hello) -> None:
        """Say so where a worker serves another model than a live one: a frontend
        serves one model, names it in its answers and /v1/models, and checks
        requests' ``model`` against it, while any live worker may run any request."""
        others = {
            other.hello.model
            for other in self._pool.links()
            if other is not link and other.hello and other.verdict().is_live
        }
        others.discard(hello.model)
        if others:
            log.error(
                "worker at %s serves model %s, another worker %s: a frontend serves one "
                "model, and its answers would name either for both; give every worker "
                "of this frontend the same MODEL_ID",
                link.endpoint,
                hello.model,
                " and ".join(sorted(others)),
            )

    def on_heartbeat(self, link: WorkerLink) -> None:
        self._notice_own_pause(is_turn=False)
        self._check_liveness(link)
        self._dispatch()  # it may show slots freed by another frontend

    def on_connected(self, link: WorkerLink) -> None:
        # A worker greets a peer once it hears from it: ping now, not at the next
        # tick, so that a replacement takes work the moment it is up.
        link.send_frame(self._ping)

    def on_disconnected(self, link: WorkerLink) -> None:
        if self.is_shutting_down or link.is_stopping:  # stopped, not dead
            log.info(
                "worker at %s closed its connection as it stopped, having handed back %d "
                "request(s) to run elsewhere",
                link.endpoint,
                link.num_handed_back,
            )
        elif link.hello is None or link.is_refused:  # the link logs a refusal once
            log.debug("the connection to %s closed: no hello yet, or refused", link.endpoint)
        else:
            log.error("worker at %s declared dead: its connection closed", link.endpoint)
        link.was_live = False
        self._release(link, "closed its connection", is_death=True)

    # --- what the pool reports ------------------------------------------------------------

    def on_tick(self) -> None:
        self._notice_own_pause(is_turn=True)
        for link in self._pool.links():
            link.send_frame(self._ping)
            self._check_liveness(link)
        self._dispatch()

    def _notice_own_pause(self, is_turn: bool) -> None:
        """Heartbeats from before this frontend's own pause, read after it, would
        show a worker that made no progress all that while: it was declared hung
        for the frontend's stillness. Ticks are the turns."""
        if self._pause.was_paused(is_turn):
            for link in self._pool.links():
                link.liveness.on_own_pause()

    def on_gone(self, link: WorkerLink) -> None:
        self._release(link, "is gone", is_death=True)

    # --- sending and replay --------------------------------------------------------------

    def _dispatch(self) -> None:
        if self.is_shutting_down and not self.any_worker_takes_work():
            # Its workers are stopping too: what none holds now will never run.
            for entry in self._table.take_unheld():
                self._table.resolve(entry, _shutting_down(entry, "no worker is left to run it"))
            return
        dispatch(self._table, self._pool.links())

    def any_worker_takes_work(self) -> bool:
        """Whether a worker is live and not stopping."""
        return any(link.verdict().is_live and not link.is_stopping for link in self._pool.links())

    def _release(self, link: WorkerLink, why: str, is_death: bool) -> None:
        if is_death and link.hello is not None and not link.is_stopping and not link.is_refused:
            for other in self._pool.links():  # they may have died with it
                if other is not link:
                    other.on_other_death(self._ping)
        if release(self._table, link, why, is_death, self.config.max_worker_deaths):
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
            log.error(
                "worker at %s declared %s: %s", link.endpoint, verdict.state.value, verdict.reason
            )
        link.was_live = verdict.is_live
        link.log_silence()
        is_any_other_live = any(
            other.verdict().is_live for other in self._pool.links() if other is not link
        )
        if link.held and not verdict.is_live and is_any_other_live:
            # Frozen, hung or cut off: a live worker runs its requests meanwhile.
            self._release(link, f"is {verdict.state.value}", is_death=True)


def _shutting_down(entry: InFlight, why: str) -> ErrorResult:
    return ErrorResult(
        entry.wire_id,
        ErrorCode.SHUTTING_DOWN,
        f"this frontend is shutting down and {why}; retry it, on another instance or "
        "on this one once it is back",
    )
