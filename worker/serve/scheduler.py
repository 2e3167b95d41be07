"""Continuous (iteration-level) batching over an `InferenceEngine`.

Transport-free: the server feeds requests in and sends out whatever `run_once`
returns. One call of `run_once` is one iteration: admit from the FCFS queue into
every free slot, advance every active sequence one token, and report each
finished sequence at once, so its slot is refilled before the next step. A
queued request that the engine is still preparing (compiling its grammar, off
this thread) waits in its place while those behind it may go first; only the
first `PREPARED_AHEAD` past as many as the slots are prepared at once, so that a
queue of costly grammars holds a bounded number compiled. A request
that waits past an iteration is reported `Waiting`, and `Admitted` when a slot
takes it, before its prefill runs: the frontend knows what a worker that dies was
doing with it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import islice

from protocol import (
    Admitted,
    ErrorCode,
    ErrorResult,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RequestNews,
    Waiting,
)
from worker.engine.interface import FinishedSequence, InferenceEngine, RequestRejected, StepOutput

log = logging.getLogger(__name__)

# Queued requests past the free slots whose preparation (a grammar's compile,
# up to ~35 MB each) may run before a slot is near: a peer that queues a
# thousand distinct grammars made the worker hold every one compiled, 3.7 GB for
# 120 of them.
PREPARED_AHEAD = 16


class QueueFull(Exception):
    """MAX_QUEUE_DEPTH requests wait beyond those the free slots take; the caller
    must push back."""


class Scheduler:
    def __init__(
        self,
        engine: InferenceEngine,
        max_queue_depth: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.max_queue_depth = max_queue_depth
        self._num_working_iterations = 0
        self.num_finished = 0  # requests answered (result or error): heartbeats report it
        # Iterations in which the engine failed (admission, prefill or step) with
        # no request finished between them: a worker whose engine fails
        # everything (a poisoned CUDA context, say) must be replaced, not kept.
        # Steps that only go on decoding older streams are no success here: an
        # engine failing every newcomer beside a long stream failed them all.
        self.num_failures_in_a_row = 0
        self._engine_failed = False  # in this iteration
        self._request_finished = False  # in this iteration
        # Slots busy, as heartbeats report them (read on another thread): those
        # of the latest step while a request waits ready, since the next
        # iteration refills any slot that step freed before it steps again;
        # else those active now.
        self.num_busy = 0
        self._clock = clock
        self._queue: OrderedDict[str, tuple[GenerateRequest, float]] = OrderedDict()
        # Requests in slots, each with when it arrived and when it was admitted.
        self._running: dict[str, tuple[float, float]] = {}
        self._reported_waiting: set[str] = set()  # queued ids the frontend was told wait
        # Queued since the last iteration, in order (a dict: an abort drops its id).
        self._newly_queued: dict[str, None] = {}

    @property
    def num_steps(self) -> int:
        """The progress counter of heartbeats: iterations that did work, and the
        extra passes over the model of long prefills. Safe to read from any
        thread."""
        return self._num_working_iterations + self.engine.num_extra_prefill_passes()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def has_work(self) -> bool:
        return bool(self._queue) or self.engine.num_active() > 0

    def can_run(self) -> bool:
        """Whether `run_once` would do anything now: a sequence is active, or a
        queued request is prepared. When not, the caller may wait for input."""
        return self.engine.num_active() > 0 or any(
            self.engine.prepare(request) for request in self._next_in_line()
        )

    def held_request_ids(self) -> list[str]:
        """Every request queued or running here."""
        return [*self._queue, *self._running]

    @property
    def num_running(self) -> int:
        """Requests admitted into slots, not yet finished."""
        return len(self._running)

    def take_queued(self) -> list[str]:
        """Drop every queued request, unanswered (a stopping worker hands them
        back); their ids."""
        for request, _ in self._queue.values():
            self.engine.unprepare(request)
        request_ids = list(self._queue)
        self._queue.clear()
        self._reported_waiting.clear()
        self._newly_queued.clear()
        return request_ids

    def is_known(self, request_id: str) -> bool:
        return request_id in self._queue or request_id in self._running

    def submit(self, request: GenerateRequest, arrival: float | None = None) -> None:
        """Queue a request that arrived at ``arrival`` (the scheduler's clock; now if
        None). A request id already queued or running is ignored, so a frame
        delivered twice runs once. Raises QueueFull when the queue is full."""
        if self.is_known(request.request_id):
            log.warning("request %s is already queued or running; ignored", request.request_id)
            return
        if self.is_full(len(self._queue), self.engine.num_active()):
            raise self.queue_full_error()
        self._queue[request.request_id] = (request, self._clock() if arrival is None else arrival)
        self._newly_queued[request.request_id] = None
        if len(self._queue) <= self._prepare_window:
            self.engine.prepare(request)  # starts now, while it waits for a slot

    def is_full(self, num_queued: int, num_active: int) -> bool:
        """Whether a request that finds ``num_queued`` requests queued and
        ``num_active`` slots busy is refused: those the next iteration admits
        into free slots are not waiting."""
        num_free = self.engine.capacity - num_active
        return num_queued - num_free >= self.max_queue_depth

    def queue_full_error(self) -> QueueFull:
        return QueueFull(
            f"the worker's queue is full ({self.max_queue_depth} requests waiting); retry later"
        )

    def abort(self, request_ids: list[str]) -> list[RequestNews]:
        """Drop queued requests and free the slots of running ones. Each known id is
        answered with finish_reason abort; unknown ids are ignored."""
        outputs: list[RequestNews] = []
        for request_id in request_ids:
            queued = self._queue.pop(request_id, None)
            self._reported_waiting.discard(request_id)
            self._newly_queued.pop(request_id, None)
            if queued is not None:
                self.engine.unprepare(queued[0])
                waited_ms = (self._clock() - queued[1]) * 1000
                aborted = GenerateResult(
                    request_id=request_id,
                    text="",
                    token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    prompt_tokens=0,
                    completion_tokens=0,
                    queue_wait_ms=waited_ms,
                    generate_ms=0.0,
                )
                outputs.append(aborted)
        running = [r for r in request_ids if r in self._running]
        for finished in self.engine.abort(running):
            outputs.append(self._finished_result(finished))
        self.num_finished += len(outputs)
        self._count_busy_unless_refilled()
        return outputs

    def run_once(
        self, send: Callable[[list[RequestNews]], None] | None = None
    ) -> list[RequestNews]:
        """One iteration: admit into free slots, one step, report what it produced.
        With ``send``, which requests wait and which left the queue goes to ``send``
        before the step runs, what the step's prefill produced (newcomers' first
        tokens) before the decode runs, and the rest is returned."""
        outputs: list[RequestNews] = []
        if not self.has_work():
            self.num_busy = 0
            return outputs
        self._engine_failed = self._request_finished = False
        num_free = self.engine.capacity - self.engine.num_active()
        prepared: list[str] = []
        for request in self._next_in_line():
            if len(prepared) == num_free:
                break
            if self.engine.prepare(request):
                prepared.append(request.request_id)
        newcomers = [self._queue.pop(request_id) for request_id in prepared]
        notices = self._queue_notices(prepared)
        if send is not None and notices:
            send(notices)  # before the step: should it kill the worker, they are known
        else:
            outputs.extend(notices)
        # Busy while admitted too: a whole prompt's prefill runs in the admission,
        # and heartbeats then said the worker had nothing to run (a stopping one
        # was taken for stuck in its stop, and killed mid-prefill).
        self.num_busy = self.engine.num_active() + len(newcomers)
        # Queue time ends when admission starts; the prefill counts as generation.
        self._admit(newcomers, self._clock(), outputs)
        self.num_busy = self.engine.num_active()
        # A failed step is no progress. Admission with nothing to step is: a queue
        # of prompts each refused once tokenized (too long for the context window)
        # never steps, and a worker taking it in was declared hung after
        # STEP_TIMEOUT_S and killed.
        if self.engine.num_active() > 0:
            if self._step(outputs, send):
                self._num_working_iterations += 1
        elif newcomers:
            self._num_working_iterations += 1
        if self._request_finished:
            self.num_failures_in_a_row = 0
        if self._engine_failed:
            self.num_failures_in_a_row += 1
        self._count_finished(outputs)
        self._count_busy_unless_refilled()
        return outputs

    def _queue_notices(self, admitted: list[str]) -> list[RequestNews]:
        """`Admitted` for the requests just taken from the queue that were reported
        waiting, and `Waiting` for those queued since the last iteration that are
        still in it. Only those: the step loop never walks the whole queue."""
        notices: list[RequestNews] = []
        for request_id in admitted:
            if request_id in self._reported_waiting:
                self._reported_waiting.remove(request_id)
                notices.append(Admitted(request_id))
        for request_id in self._newly_queued:
            if request_id in self._queue:
                self._reported_waiting.add(request_id)
                notices.append(Waiting(request_id))
        self._newly_queued.clear()
        return notices

    def _count_busy_unless_refilled(self) -> None:
        """Slots freed with no request ready to refill them (none waits, or those
        that wait are still being prepared) are idle now."""
        if not any(self.engine.prepare(request) for request in self._next_in_line()):
            self.num_busy = self.engine.num_active()

    def _next_in_line(self) -> Iterator[GenerateRequest]:
        """The queued requests that may be prepared now: as many as the slots and
        `PREPARED_AHEAD` more, first come first."""
        return (request for request, _ in islice(self._queue.values(), self._prepare_window))

    @property
    def _prepare_window(self) -> int:
        return self.engine.capacity + PREPARED_AHEAD

    def _count_finished(self, outputs: list[RequestNews]) -> None:
        self.num_finished += sum(isinstance(o, (GenerateResult, ErrorResult)) for o in outputs)

    def _admit(
        self,
        newcomers: list[tuple[GenerateRequest, float]],
        admitted_at: float,
        outputs: list[RequestNews],
    ) -> None:
        while newcomers:
            try:
                self.engine.admit([request for request, _ in newcomers])
            except RequestRejected as rejected:
                if all(request.request_id != rejected.request_id for request, _ in newcomers):
                    # No newcomer's own fault (an engine's bug): a failure like any other.
                    self._admit_failed(newcomers, admitted_at, outputs, rejected)
                    return
                outputs.append(ErrorResult(rejected.request_id, rejected.code, rejected.message))
                for request, _ in newcomers:
                    if request.request_id == rejected.request_id:
                        self.engine.unprepare(request)
                newcomers = [n for n in newcomers if n[0].request_id != rejected.request_id]
                continue
            except Exception as exc:
                self._admit_failed(newcomers, admitted_at, outputs, exc)
                return
            for request, arrival in newcomers:
                self._running[request.request_id] = (arrival, admitted_at)
            return

    def _admit_failed(
        self,
        newcomers: list[tuple[GenerateRequest, float]],
        admitted_at: float,
        outputs: list[RequestNews],
        exc: Exception,
    ) -> None:
        if len(newcomers) > 1:
            # Admit is atomic, so no slot changed: admit each newcomer alone, and the
            # failure falls only on the request that causes it.
            log.warning("admit failed for %d newcomers; admitting each alone", len(newcomers))
            for newcomer in newcomers:
                self._admit([newcomer], admitted_at, outputs)
            return
        request = newcomers[0][0]
        log.error("admit failed for request %s", request.request_id, exc_info=exc)
        self.engine.unprepare(request)
        outputs.append(_internal_error(request.request_id, exc))
        self._engine_failed = True

    def _step(
        self, outputs: list[RequestNews], send: Callable[[list[RequestNews]], None] | None
    ) -> bool:
        """One step; return whether it succeeded."""

        def send_prefilled(prefilled: StepOutput) -> None:
            assert send is not None
            early = outputs[:]  # admission's rejections, then the first tokens
            outputs.clear()
            self._report(prefilled, early)
            self._count_finished(early)
            send(early)

        try:
            step = self.engine.step(None if send is None else send_prefilled)
        except Exception as exc:
            log.exception("step failed; failing %d active sequences", self.engine.num_active())
            for request_id in self.engine.reset():
                self._running.pop(request_id, None)
                outputs.append(_internal_error(request_id, exc))
            self._engine_failed = True
            return False
        self._report(step, outputs)
        return True

    def _report(self, step: StepOutput, outputs: list[RequestNews]) -> None:
        for request_id, error in step.failed:  # the engine failed on these alone
            self._running.pop(request_id, None)
            if isinstance(error, RequestRejected):  # the request's own fault (its grammar)
                outputs.append(ErrorResult(request_id, error.code, error.message))
            else:
                outputs.append(_internal_error(request_id, error))
                # Failures on single requests count, as at admission: an engine that
                # fails on every request is broken, whichever request it is.
                self._engine_failed = True
        outputs.extend(step.deltas)
        outputs.extend(self._finished_result(finished) for finished in step.finished)
        self._request_finished = self._request_finished or bool(step.finished)

    def _finished_result(self, finished: FinishedSequence) -> GenerateResult:
        arrival, admitted = self._running.pop(finished.request_id)
        return GenerateResult(
            request_id=finished.request_id,
            text=finished.text,
            token_ids=finished.token_ids,
            finish_reason=finished.finish_reason,
            prompt_tokens=finished.num_prompt_tokens,
            completion_tokens=len(finished.token_ids),
            queue_wait_ms=(admitted - arrival) * 1000,
            generate_ms=(self._clock() - admitted) * 1000,
            logprobs=finished.logprobs,
            prompt_logprobs=finished.prompt_logprobs,
            prompt_token_ids=finished.prompt_token_ids,
            prompt_text=finished.prompt_text,
            looked_up_tokens=finished.num_looked_up_tokens,
            cached_tokens=finished.num_cached_tokens,
        )


def _internal_error(request_id: str, exc: Exception) -> ErrorResult:
    return ErrorResult(
        request_id,
        ErrorCode.INTERNAL,
        f"the engine failed while serving this request ({type(exc).__name__}: {exc}); "
        "the worker log has the traceback",
    )
