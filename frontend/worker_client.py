"""The frontend's side of the ZMQ link: the in-flight table, liveness and replay.

Every accepted request stays in the table until it is answered, exactly once.
It is sent while a worker is live, and sent again only when it must be: when a
new worker instance says hello (the one that held it is gone), or when the
worker greets this frontend again (it timed this frontend out and dropped its
requests). A worker that was only late, and is live again as the same
instance, keeps its requests.

A request that was in flight on a worker that died is a suspect: it may be what
killed it. Suspects are replayed one at a time, each once the one before has
made progress (a token, or its answer) on the new worker, so that a poison
request kills at most one more worker and takes no innocent suspect with it.
A suspect in flight on a second worker that died before it made progress there
is answered with an error and not replayed again; one that had made progress
(it was running beside the one to blame) gets one more try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import typing
import uuid

import zmq
import zmq.asyncio

from frontend.inflight import Event, InFlight
from protocol import (
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    Hello,
    Ping,
    ProtocolError,
    TokenDelta,
    ToWorker,
    decode_to_frontend,
    encode,
)
from protocol.config import FrontendConfig
from protocol.curve import secure_client
from protocol.liveness import Liveness, Verdict

log = logging.getLogger(__name__)

# Workers that died while a request was in flight on them, after which the request
# is failed rather than replayed again: two if it made no progress after the
# first, three in all.
MAX_WORKER_DEATHS = 2
MAX_WORKER_DEATHS_AFTER_PROGRESS = 3
_TASK_DIED_EXIT_CODE = 4


class Overloaded(Exception):
    """MAX_QUEUE_DEPTH requests are already waiting for an answer."""


class WorkerClient:
    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.frontend_id = uuid.uuid4().hex
        self.liveness = Liveness(config.heartbeat_timeout_s, config.step_timeout_s)
        self.num_worker_restarts = 0
        self._inflight: dict[str, InFlight] = {}  # by request_id
        self._by_wire_id: dict[str, InFlight] = {}
        self._suspects: list[InFlight] = []  # waiting to be replayed, in order
        self._suspect_on_trial: InFlight | None = None  # replayed, no progress seen yet
        self._was_live = False
        self._context = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        # Queue nothing for a worker that is not connected: what it misses is
        # replayed to its successor instead of delivered twice.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        secure_client(socket, self.config.curve)
        socket.connect(self.config.worker_endpoint)
        self._socket = socket
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="worker-receive"),
            asyncio.create_task(self._tick_loop(), name="worker-tick"),
        ]
        for task in self._tasks:
            task.add_done_callback(_exit_if_failed)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._socket is not None:
            self._socket.close(linger=0)
        self._context.term()

    # --- requests -------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def submit(self, request: GenerateRequest, deadline: float) -> InFlight:
        """Accept a request; it is sent now if a worker is live, else on its hello."""
        if len(self._inflight) >= self.config.max_queue_depth:
            raise Overloaded(
                f"{len(self._inflight)} requests are already waiting "
                f"(MAX_QUEUE_DEPTH={self.config.max_queue_depth}); retry later"
            )
        if request.request_id in self._inflight:
            raise ValueError(f"request id {request.request_id} is already in flight")
        entry = InFlight(request, deadline)
        self._inflight[entry.request_id] = entry
        if self.liveness.verdict().is_live:
            self._send_attempt(entry)
        return entry

    def cancel(self, entry: InFlight) -> None:
        """Forget a request the client no longer waits for, and free its slot."""
        if self._forget(entry) and entry.sent_to is not None:
            self._send(AbortRequest(entry.wire_id))

    def verdict(self) -> Verdict:
        return self.liveness.verdict()

    # --- internals ----------------------------------------------------------------------

    def _forget(self, entry: InFlight) -> bool:
        self._by_wire_id.pop(entry.wire_id, None)
        is_known = self._inflight.pop(entry.request_id, None) is not None
        if entry is self._suspect_on_trial:
            self._suspect_on_trial = None
            self._replay_next_suspect()
        return is_known

    def _send(self, message: ToWorker) -> bool:
        return self._send_frame(encode(message))

    def _send_frame(self, frame: bytes) -> bool:
        assert self._socket is not None
        # A non-blocking send on an asyncio socket completes (or fails) at once.
        sent = typing.cast("asyncio.Future[object]", self._socket.send(frame, zmq.NOBLOCK))
        return sent.exception() is None

    def _send_attempt(self, entry: InFlight) -> None:
        if entry.sent_to is not None:
            # The previous attempt may still run on this instance: stop it.
            self._send(AbortRequest(entry.wire_id))
        self._by_wire_id.pop(entry.wire_id, None)
        request = entry.next_attempt(stream=entry is self._suspect_on_trial)
        hello = self.liveness.hello
        frame = encode(request)
        if hello is not None and len(frame) > hello.max_message_bytes:
            # The worker's socket would drop the connection, and every request with it.
            self._resolve(entry, _too_large(entry, len(frame), hello.max_message_bytes))
        elif hello is not None and self._send_frame(frame):
            entry.sent_to = hello.instance_id
            self._by_wire_id[entry.wire_id] = entry
        else:
            entry.sent_to = None

    def _resend(self, entries: list[InFlight], why: str) -> None:
        """Send these requests again, in the order they were accepted."""
        if entries:
            log.warning("replaying %d requests: %s", len(entries), why)
        for entry in sorted(entries, key=lambda entry: entry.order):
            self._send_attempt(entry)

    def _send_unsent(self) -> None:
        """Send what no live worker holds: requests accepted while none was live,
        and the next suspect."""
        self._replay_next_suspect()
        unsent = [
            entry
            for entry in self._inflight.values()
            if entry.sent_to is None and entry not in self._suspects
        ]
        for entry in sorted(unsent, key=lambda entry: entry.order):
            self._send_attempt(entry)

    def _on_worker_replaced(self, dead_instance_id: str) -> None:
        """The dead instance's requests become suspects, replayed one at a time;
        one that was a suspect already is failed instead."""
        self._suspect_on_trial = None
        for entry in sorted(self._inflight.values(), key=lambda entry: entry.order):
            if entry.sent_to != dead_instance_id:
                continue
            entry.sent_to = None
            entry.num_worker_deaths += 1
            limit = MAX_WORKER_DEATHS_AFTER_PROGRESS if entry.made_progress else MAX_WORKER_DEATHS
            entry.made_progress = False
            if entry.num_worker_deaths >= limit:
                log.error(
                    "request %s was in flight on %d workers that died; failing it",
                    entry.request_id,
                    entry.num_worker_deaths,
                )
                self._resolve(entry, _quarantined(entry))
            elif entry not in self._suspects:
                self._suspects.append(entry)
        self._suspects.sort(key=lambda entry: entry.order)
        if self._suspects:
            log.warning(
                "replaying %d requests one at a time: worker %s was replaced",
                len(self._suspects),
                dead_instance_id[:8],
            )
        self._send_unsent()

    def _replay_next_suspect(self) -> None:
        """Replay the next suspect once the one on trial has made progress."""
        if self._suspect_on_trial is not None or not self.liveness.verdict().is_live:
            return
        while self._suspects:
            entry = self._suspects.pop(0)
            if entry.request_id in self._inflight:
                self._suspect_on_trial = entry
                self._send_attempt(entry)
                return

    def _resolve(self, entry: InFlight, final: GenerateResult | ErrorResult) -> None:
        self._forget(entry)
        entry.events.put_nowait(final)

    def _on_event(self, message: Event) -> None:
        entry = self._by_wire_id.get(message.request_id)
        if entry is None:
            return  # from an earlier attempt, or for a request already answered
        if isinstance(message, TokenDelta):
            entry.record(message)
            entry.events.put_nowait(message)
            if entry is self._suspect_on_trial and message.token_ids:
                entry.made_progress = True  # it ran a step: likely not what kills workers
                self._suspect_on_trial = None
                self._replay_next_suspect()
        else:
            self._resolve(entry, message)

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            frame = await self._socket.recv()
            try:
                message = decode_to_frontend(frame)
            except ProtocolError as exc:
                log.error("dropped a malformed frame from the worker: %s", exc)
                continue
            if isinstance(message, Hello):
                self._on_hello(message)
            elif isinstance(message, Heartbeat):
                self.liveness.on_heartbeat(message)
                self._check_liveness()
            else:
                self._on_event(message)

    def _on_hello(self, hello: Hello) -> None:
        previous = self.liveness.hello
        self._was_live = True
        if self.liveness.on_hello(hello):
            log.info(
                "worker %s says hello: model %s%s, capacity %d",
                hello.instance_id[:8],
                hello.model,
                " (random weights)" if hello.is_random_weights else "",
                hello.capacity,
            )
            if previous is None:
                self._send_unsent()
            else:
                self.num_worker_restarts += 1
                self._on_worker_replaced(previous.instance_id)
        else:
            # A worker greets a peer only on first contact: it timed this frontend
            # out (FRONTEND_TIMEOUT_S) and aborted its requests, or this frontend
            # reconnected as a new peer. Either way it holds none of them now.
            held = [e for e in self._inflight.values() if e.sent_to == hello.instance_id]
            self._resend(held, f"worker {hello.instance_id[:8]} greeted this frontend again")
            self._send_unsent()

    def _check_liveness(self) -> None:
        verdict = self.liveness.verdict()
        if verdict.is_live and not self._was_live:
            # The same instance, only late: it still holds what it was sent.
            log.warning("worker is live again; sending only what it was never sent")
            self._send_unsent()
        elif not verdict.is_live and self._was_live:
            log.error("worker declared %s: %s", verdict.state.value, verdict.reason)
        self._was_live = verdict.is_live

    async def _tick_loop(self) -> None:
        ping = Ping(self.frontend_id)
        while True:
            self._send(ping)
            self._check_liveness()
            await asyncio.sleep(self.config.ping_interval_s)


def _exit_if_failed(task: asyncio.Task[None]) -> None:
    """A background task that ends by an exception leaves the frontend half alive
    (no replies, or no liveness): end the process loudly so that it is replaced."""
    if task.cancelled() or task.exception() is None:
        return
    log.critical(
        "background task %s failed; exiting so that the frontend is restarted",
        task.get_name(),
        exc_info=task.exception(),
    )
    logging.shutdown()
    os._exit(_TASK_DIED_EXIT_CODE)


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
