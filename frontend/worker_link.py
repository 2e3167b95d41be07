"""One worker as the frontend sees it: a DEALER on its endpoint, a socket monitor
that sees the connection close, its liveness, and how busy it is.

A worker process that dies has its TCP connection closed by its kernel at once;
the monitor reports that, and the link is dead without waiting for heartbeats to
stop. Heartbeat timeouts remain for what a closed socket cannot show: a frozen
or hung process, or a network partition.

libzmq gives up on a connection whose handshake failed (a CURVE key the worker
does not allow, CURVE on one side only) and never tries it again, so a worker
restarted with this frontend's key allowed would never hear from it. The link
connects again itself, after 1 s, then twice as long each time up to
`HANDSHAKE_RETRY_MAX_S` (each refusal is a warning in the worker's log), and
says once why it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.config import FrontendConfig
from frontend.inflight import Event, InFlight, QueueNotice
from frontend.tasks import start_task, stop_tasks
from protocol import (
    AbortRequest,
    ErrorCode,
    ErrorResult,
    Heartbeat,
    Hello,
    ProtocolError,
    ToWorker,
    VersionMismatch,
    decode_to_frontend,
    encode,
)
from protocol.lifeline import is_supervised
from protocol.liveness import Liveness, Verdict
from protocol.peer import HANDSHAKE_FAILED, handshake_advice, worker_socket
from protocol.throttled import Throttled

log = logging.getLogger(__name__)

HANDSHAKE_RETRY_MAX_S = 10.0
# After another worker's death, a heartbeat read sooner than this may have been
# sent before it (`on_other_death`): frames that waited in the socket are read in
# a burst, within a few turns of the event loop. (A loop held up longer than this
# in that moment could still take one for a sign of life.)
HEARD_AFTER_DEATH_S = 0.1
# After this long with no hello, a worker's verdict asks whether one runs there at
# all (a first start that downloads a model takes longer, and says so in its log).
SILENT_WORKER_HINT_S = 15.0


class LinkEvents(Protocol):
    """What a link reports, in the order its worker sent it."""

    def on_hello(self, link: WorkerLink, hello: Hello) -> None: ...

    def on_heartbeat(self, link: WorkerLink) -> None: ...

    def on_event(self, link: WorkerLink, message: Event | QueueNotice) -> None: ...

    def on_connected(self, link: WorkerLink) -> None: ...

    def on_disconnected(self, link: WorkerLink) -> None: ...


class WorkerLink:
    def __init__(
        self,
        endpoint: str,
        config: FrontendConfig,
        context: zmq.asyncio.Context,
        events: LinkEvents,
    ) -> None:
        self.endpoint = endpoint
        self.liveness = Liveness(config.heartbeat_timeout_s, config.step_timeout_s)
        self.held: set[InFlight] = set()  # requests whose current attempt this worker holds
        self.trial: InFlight | None = None  # a suspect replayed here, no progress seen yet
        # It said hello, or sent a heartbeat read well after another worker last
        # died (`on_other_death`). A suspect's trial goes only to one that did:
        # killed with the worker that died, and not yet found dead, it would die
        # again with the trial and fail it, an innocent request, for two deaths it
        # had no part in (`frontend.replay`).
        self.is_heard_since_a_death = True
        self._heard_from = 0.0  # time.monotonic() from which a heartbeat counts
        self.was_live = False
        self._events = events
        # Requests sent and answers received since the last heartbeat, which counted
        # the worker's load from every frontend as it was then.
        self._num_sent = 0
        self._num_done = 0
        # The worker refused a request for its full queue (another client filled
        # it): nothing more goes to it before its next heartbeat says how full it is.
        self._is_queue_full = False
        self.is_stopping = False  # it said so, handing requests back: sent nothing more
        self.num_handed_back = 0  # requests this instance handed back as it stopped
        self._socket = worker_socket(context, endpoint, config.curve, is_immediate=True)
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
        )
        self._retry_after_s = 0.0  # 0 while no handshake has failed since the last success
        # Why this frontend cannot talk to the worker, in words that follow its
        # endpoint: its last handshake failed (until one succeeds), or it speaks
        # another protocol version (until it says hello in this one).
        self._refusal = ""
        self._started_at = time.monotonic()  # when this frontend began to look for it
        self._is_silence_logged = False
        self._malformed = Throttled(log, "malformed frames", logging.ERROR)
        # Each hello of another version says so: one a ping, or as many as a peer sends.
        self._mismatched = Throttled(log, "hellos of another version", logging.ERROR)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._socket.connect(self.endpoint)
        self._tasks = [
            start_task(self._receive_loop(), "worker-receive"),
            start_task(self._monitor_loop(), "worker-monitor"),
        ]

    async def close(self) -> None:
        await stop_tasks(self._tasks)
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

    @property
    def hello(self) -> Hello | None:
        return self.liveness.hello

    @property
    def instance_id(self) -> str | None:
        hello = self.liveness.hello
        return None if hello is None else hello.instance_id

    def verdict(self) -> Verdict:
        # A busy event loop (a burst of large bodies to validate) can leave the
        # worker's heartbeats unread past the timeout: that is no silence.
        if not self._socket.closed and typing.cast(int, self._socket.get(zmq.EVENTS)) & zmq.POLLIN:
            self.liveness.on_frames_waiting()
        verdict = self.liveness.verdict()
        if self._refusal and not verdict.is_live:
            return Verdict(verdict.state, f"{self.endpoint} {self._refusal}")
        hint = self._silence_hint()
        return verdict if hint is None else Verdict(verdict.state, hint)

    def _silence_hint(self) -> str | None:
        """Whether a worker runs at this address at all, asked once none has said
        hello for SILENT_WORKER_HINT_S (and nothing else is known to be wrong)."""
        silent_s = time.monotonic() - self._started_at
        if self.hello is not None or self._refusal or silent_s < SILENT_WORKER_HINT_S:
            return None
        if is_supervised():  # its worker is there, or about to be: the model loads first
            return (
                f"no hello from {self.endpoint} in {silent_s:.0f} s: minibatch-serve's worker "
                "says hello once its model is loaded (WORKER_START_TIMEOUT_S bounds that)"
            )
        return (
            f"no hello from {self.endpoint} in {silent_s:.0f} s: is a worker running "
            "there? (one says hello once its model is loaded; WORKER_ENDPOINT, or "
            "WORKER_ENDPOINTS, is where this frontend looks)"
        )

    def log_silence(self) -> None:
        """Say once, in the log, that no worker greeted from this address for
        SILENT_WORKER_HINT_S, as its verdict then does: a warning for a frontend
        run alone, only a note under `minibatch-serve`, whose worker is there,
        loading (the supervisor bounds that by WORKER_START_TIMEOUT_S)."""
        hint = None if self._is_silence_logged else self._silence_hint()
        if hint is not None:
            log.log(logging.INFO if is_supervised() else logging.WARNING, "%s", hint)
            self._is_silence_logged = True

    def send(self, message: ToWorker) -> bool:
        return self.send_frame(encode(message))

    def send_frame(self, frame: bytes) -> bool:
        # A non-blocking send on an asyncio socket completes (or fails) at once.
        sent = typing.cast("asyncio.Future[object]", self._socket.send(frame, zmq.NOBLOCK))
        return sent.exception() is None

    def refuse_answer(self, request_id: str, problem: str) -> ErrorResult:
        """The failure of a request whose answer from this worker cannot be taken
        (a frame that does not decode, or one that disagrees with the request): it
        fails rather than waiting for one that may never come, and the worker is
        told to stop running it."""
        self._malformed.warn(
            f"malformed answer from worker {self.endpoint}, its request fails: {problem}"
        )
        self.send(AbortRequest(request_id))
        return ErrorResult(
            request_id,
            ErrorCode.INTERNAL,
            f"the worker sent an answer this frontend cannot take ({problem}); "
            "this frontend's log names the worker",
        )

    def on_other_death(self, ping: bytes) -> None:
        """Another worker died, and this one may have died with it, unseen yet. Its
        heartbeats read in the next HEARD_AFTER_DEATH_S may have waited in this
        socket since before (read in a burst after this frontend's own pause, say):
        only a later one shows it alive after the death. ``ping`` goes then, for a
        heartbeat in answer at once rather than at its timer's next turn."""
        self.is_heard_since_a_death = False
        self._heard_from = time.monotonic() + HEARD_AFTER_DEATH_S
        asyncio.get_running_loop().call_later(HEARD_AFTER_DEATH_S, self._ping_if_open, ping)

    def _ping_if_open(self, ping: bytes) -> None:
        if not self._socket.closed:
            self.send_frame(ping)

    def on_sent(self) -> None:
        self._num_sent += 1

    def on_done(self) -> None:
        """A request this frontend sent here was answered or aborted: a slot freed."""
        self._num_done += 1

    def on_queue_full(self) -> None:
        """The worker refused a request this frontend sent: its queue was full."""
        self._is_queue_full = True

    def on_stopping(self) -> None:
        """The worker is stopping: it is sent nothing more (until a new instance
        says hello here)."""
        self.is_stopping = True

    def on_handed_back(self) -> None:
        """The stopping worker handed back a request this frontend sent it."""
        self.on_stopping()
        self.num_handed_back += 1

    @property
    def is_refused(self) -> bool:
        """It refused this frontend (its latest handshake failed: a key it does not
        allow), or speaks another protocol version, and has not taken it since."""
        return bool(self._refusal)

    def free_slots(self) -> int:
        """Slots free for another request, as far as this frontend can tell: the
        worker's last heartbeat, plus what was sent here and answered since, plus
        the slots of this frontend's requests that the step under way ends (see
        `InFlight.ends_this_step`). Below zero when requests wait in the worker's
        queue."""
        hello = self.liveness.hello
        if hello is None:
            return 0
        heartbeat = self.liveness.last_heartbeat
        busy = heartbeat.num_active + heartbeat.num_queued if heartbeat else 0
        num_ending = sum(entry.ends_this_step for entry in self.held)
        free = hello.capacity - max(0, busy + self._num_sent - self._num_done) + num_ending
        if self.is_stopping:
            return min(free, 0)
        return min(free, -hello.max_queue_depth) if self._is_queue_full else free

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._socket.recv()
            try:
                message = decode_to_frontend(frame)
            except VersionMismatch as exc:
                if exc.request_id is None:  # its hello: no request of ours can be served
                    self._refuse_version(exc)
                    continue
                message = self.refuse_answer(exc.request_id, str(exc))
            except ProtocolError as exc:
                if exc.request_id is None:
                    self._malformed.warn(
                        f"malformed frame from worker {self.endpoint}, dropped: {exc}"
                    )
                    continue
                message = self.refuse_answer(exc.request_id, str(exc))
            if isinstance(message, Hello):
                self._refusal = ""
                self.is_heard_since_a_death = True
                if message.instance_id != self.instance_id:
                    self._num_sent = self._num_done = 0  # a new worker: no heartbeat yet
                    self._is_queue_full = self.is_stopping = False
                    self.num_handed_back = 0
                self._events.on_hello(self, message)
            elif isinstance(message, Heartbeat):
                if message.instance_id == self.instance_id:
                    self._num_sent = self._num_done = 0
                    self._is_queue_full = False
                    if message.is_stopping:
                        self.on_stopping()
                    if time.monotonic() >= self._heard_from:
                        self.is_heard_since_a_death = True
                self.liveness.on_heartbeat(message)
                self._events.on_heartbeat(self)
            else:
                self._events.on_event(self, message)

    async def _monitor_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._retry_after_s:
                    log.info("worker %s accepted this frontend's handshake", self.endpoint)
                    self._retry_after_s = 0.0
                    self._refusal = ""
                self._events.on_connected(self)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.liveness.on_disconnected()
                self._events.on_disconnected(self)
            elif event["event"] & HANDSHAKE_FAILED:
                if not self._retry_after_s:
                    self._log_refusal(zmq.Event(event["event"]))
                self._refusal = (
                    f"refused this frontend's handshake: {handshake_advice(event['event'])}"
                )
                self._retry_after_s = min(2 * self._retry_after_s or 1.0, HANDSHAKE_RETRY_MAX_S)
                await asyncio.sleep(self._retry_after_s)
                self._connect_again()

    def _refuse_version(self, mismatch: VersionMismatch) -> None:
        """The worker greeted in another protocol version: it is never sent a
        request, and /health and every request's timeout say why."""
        refusal = f"speaks another protocol version ({mismatch})"
        self._mismatched.warn(f"worker {self.endpoint} {refusal}")
        self._refusal = refusal

    def _log_refusal(self, event: zmq.Event) -> None:
        log.error(
            "worker %s refused this frontend's handshake (%s): %s; trying again, at most %gs apart",
            self.endpoint,
            event.name,
            handshake_advice(event),
            HANDSHAKE_RETRY_MAX_S,
        )

    def _connect_again(self) -> None:
        # A DEALER ignores a connect to an endpoint it still lists, and it lists
        # the one libzmq gave up on (suppressed: should libzmq have dropped it).
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disconnect(self.endpoint)
        self._socket.connect(self.endpoint)
