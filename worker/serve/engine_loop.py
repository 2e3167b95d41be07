"""The worker's engine thread: the busy loop of take input, admit + step, send
outputs (`WorkerServer` starts it beside the I/O thread, `io_loop`).

Told to stop, it hands every request that has not started back to its frontend
(`shutting_down`: sent on elsewhere, no death counted), and so each new one; it
lets those it runs go on for up to STOP_GRACE_S, then hands back what is left.
An engine that fails whatever it is given raises `EngineBroken`, which ends the
process: a new worker replaces it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from protocol import AbortRequest, ErrorCode, ErrorResult, GenerateRequest, RequestNews, ToWorker
from protocol.throttled import Throttled
from worker.serve.config import WorkerConfig
from worker.serve.inbox import Inbox
from worker.serve.outputs import LAST_MESSAGES_MS, handed_back, send_outputs
from worker.serve.scheduler import QueueFull, Scheduler

log = logging.getLogger(__name__)

# How often an idle engine thread checks for shutdown.
_IDLE_POLL_S = 0.1
_PREPARING_POLL_S = 0.002  # how often one that waits on a grammar's compile checks
_MAX_FAILURES_IN_A_ROW = 3  # engine failures with no request finished between them


class EngineBroken(RuntimeError):
    """The engine fails whatever it is given: only a new process can recover."""


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        config: WorkerConfig,
        inbox: Inbox,
        stopping: threading.Event,
        context: zmq.Context[zmq.Socket[bytes]],
        outputs_address: str,
    ) -> None:
        """Runs until ``stopping`` is set, taking what the I/O thread puts in
        ``inbox`` and sending outputs to its PULL socket at ``outputs_address``."""
        self.scheduler = scheduler
        self.config = config
        self._inbox = inbox
        self._stopping = stopping
        self._context = context
        self._outputs_address = outputs_address
        # The engine thread sends nothing more, so the I/O thread may close: it must
        # outlive every send, as a PUSH whose inproc peer has closed blocks forever.
        self.done = threading.Event()
        self._queue_full = Throttled(log, "refusals for a full queue")

    def run(self) -> None:
        push = self._context.socket(zmq.PUSH)
        push.connect(self._outputs_address)

        def send(messages: list[RequestNews]) -> None:
            send_outputs(push, messages)

        try:
            while not self._stopping.is_set():
                outputs: list[RequestNews] = []
                # 1. take input; block only while there is nothing to run (or
                # nothing but requests whose grammars compile on their own thread)
                self._take_input(outputs, block=not self.scheduler.can_run())
                # 2. admit into free slots, 3. one step: first tokens are sent as
                # soon as the prefill made them, before the decode
                outputs.extend(self.scheduler.run_once(send))
                # 4. send the rest at once
                send(outputs)
                if self.scheduler.num_failures_in_a_row >= _MAX_FAILURES_IN_A_ROW:
                    raise EngineBroken(
                        f"the engine failed {self.scheduler.num_failures_in_a_row} times in a "
                        "row; exiting so that a new worker replaces this one"
                    )
            self._finish_running(send)
            send(_hand_back(self.scheduler.held_request_ids() + self._inbox.take_request_ids()))
        finally:
            self.done.set()
            push.close(linger=LAST_MESSAGES_MS)

    def _finish_running(self, send: Callable[[list[RequestNews]], None]) -> None:
        """Stopping: step the requests that run here for up to STOP_GRACE_S, or
        until none is left, taking nothing new (`_apply` hands it back). A signal
        to a whole process group (^C, systemd) stops the frontends with the
        workers: handed back at once, every request under way was answered 503,
        where the frontends had 5 s to let them finish."""
        deadline = time.monotonic() + self.config.stop_grace_s
        outputs = _hand_back(self.scheduler.take_queued())
        self._take_input(outputs, block=False)  # aborts count; new requests go back
        send(outputs)
        if self.scheduler.num_running and self.config.stop_grace_s > 0:
            log.info(
                "stopping: letting %d requests run for up to %g s (STOP_GRACE_S)",
                self.scheduler.num_running,
                self.config.stop_grace_s,
            )
        while self.scheduler.num_running and time.monotonic() < deadline:
            outputs = []
            self._take_input(outputs, block=False)
            outputs.extend(self.scheduler.run_once(send))
            send(outputs)

    def _take_input(self, outputs: list[RequestNews], block: bool) -> None:
        timeout = _PREPARING_POLL_S if self.scheduler.has_work() else _IDLE_POLL_S
        self._inbox.drain(
            lambda message, received_at: self._apply(message, received_at, outputs),
            timeout if block else None,
        )

    def _apply(self, message: ToWorker, received_at: float, outputs: list[RequestNews]) -> None:
        if isinstance(message, GenerateRequest) and self._stopping.is_set():
            outputs.append(handed_back(message.request_id))
        elif isinstance(message, GenerateRequest):
            try:
                self.scheduler.submit(message, received_at)
            except QueueFull as full:
                self._queue_full.warn(f"request {message.request_id:.64} refused: {full}")
                outputs.append(ErrorResult(message.request_id, ErrorCode.QUEUE_FULL, str(full)))
        elif isinstance(message, AbortRequest):
            outputs.extend(self.scheduler.abort([message.request_id]))


def _hand_back(request_ids: list[str]) -> list[RequestNews]:
    """Stopping: these requests go back to their frontends unfinished, to run
    elsewhere (resumed where they stopped) as if never sent here, rather than
    be replayed as the requests of a worker that died."""
    if request_ids:
        log.info("stopping: handing %d requests back to their frontends", len(request_ids))
    return [handed_back(request_id) for request_id in request_ids]
