"""The frontend's side of the ZMQ link: the in-flight table, liveness and replay.

Every accepted request stays in the table until it is answered, exactly once.
It is sent while a worker is live; when that worker is declared dead or hung,
or a new worker instance says hello, every unanswered request is sent again to
the live worker, in the order it was accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import typing
import uuid

import zmq
import zmq.asyncio

from frontend.inflight import Event, InFlight
from protocol import (
    AbortRequest,
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
        return self._inflight.pop(entry.request_id, None) is not None

    def _send(self, message: ToWorker) -> bool:
        assert self._socket is not None
        # A non-blocking send on an asyncio socket completes (or fails) at once.
        sent = typing.cast(
            "asyncio.Future[object]", self._socket.send(encode(message), zmq.NOBLOCK)
        )
        return sent.exception() is None

    def _send_attempt(self, entry: InFlight) -> None:
        if entry.sent_to is not None:
            # The previous attempt may still run on this instance: stop it.
            self._send(AbortRequest(entry.wire_id))
        self._by_wire_id.pop(entry.wire_id, None)
        if entry.request.max_new_tokens - len(entry.streamed_token_ids) <= 0:
            self._resolve(entry, _finished_by_stream(entry))
            return
        request = entry.next_attempt()
        hello = self.liveness.hello
        if hello is not None and self._send(request):
            entry.sent_to = hello.instance_id
            self._by_wire_id[entry.wire_id] = entry
        else:
            entry.sent_to = None

    def _replay_all(self) -> None:
        pending = sorted(self._inflight.values(), key=lambda entry: entry.order)
        if pending:
            log.warning("replaying %d requests on the live worker", len(pending))
        for entry in pending:
            self._send_attempt(entry)

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
        had_worker = self.liveness.hello is not None
        if self.liveness.on_hello(hello):
            self.num_worker_restarts += had_worker
            log.info(
                "worker %s says hello: model %s%s, capacity %d",
                hello.instance_id[:8],
                hello.model,
                " (random weights)" if hello.is_random_weights else "",
                hello.capacity,
            )
        else:
            # A worker greets a frontend only on first contact: it timed this one
            # out (FRONTEND_TIMEOUT_S) and aborted its requests, so resend them.
            log.warning("worker %s greeted this frontend again", hello.instance_id[:8])
        self._was_live = True
        self._replay_all()

    def _check_liveness(self) -> None:
        verdict = self.liveness.verdict()
        if verdict.is_live and not self._was_live:
            log.warning("worker is live again; resending unanswered requests")
            self._replay_all()
        elif not verdict.is_live and self._was_live:
            log.error("worker declared %s: %s", verdict.state.value, verdict.reason)
        self._was_live = verdict.is_live

    async def _tick_loop(self) -> None:
        ping = Ping(self.frontend_id)
        while True:
            self._send(ping)
            self._check_liveness()
            await asyncio.sleep(self.config.ping_interval_s)


def _finished_by_stream(entry: InFlight) -> GenerateResult:
    """A stream that received all its tokens before its worker died."""
    return GenerateResult(
        request_id=entry.wire_id,
        text="",
        token_ids=[],
        finish_reason="length",
        prompt_tokens=0,
        completion_tokens=0,
        queue_wait_ms=0.0,
        generate_ms=0.0,
    )
