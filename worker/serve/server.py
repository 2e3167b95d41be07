"""The worker process's transport: a ZMQ ROUTER around the scheduler.

Two threads, each owning its sockets:
- the I/O thread owns the ROUTER. It takes any frames a peer sends, decodes and
  checks them (`protocol.request_checks`: a bad request is answered at once and
  never queued), greets new peers with `Hello`, remembers which peer sent each request,
  routes outputs back, sends heartbeats on a timer (a long step cannot starve
  them: the engine runs on the other thread and torch releases the GIL), and
  aborts the requests of a peer whose pings stopped;
- the engine thread runs the busy loop: take input, admit + step, send outputs.

Told to stop (SIGTERM, SIGINT, SIGHUP), the engine thread hands every request
that has not started back to its frontend (`shutting_down`: sent on elsewhere,
no death counted), and so each new one; it lets those it runs go on for up to
STOP_GRACE_S, then hands back what is left. The I/O thread hands back whatever
still arrives before the socket closes.

If either thread raises, the process ends: nothing stays half alive. So does an
engine that fails whatever it is given (`EngineBroken`): a new worker replaces it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import zmq

from protocol import (
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    Hello,
    RequestNews,
    ToWorker,
    encode,
)
from protocol.curve import secure_server
from protocol.exit_codes import ExitCode
from protocol.request_checks import RequestLimits
from protocol.settings import ConfigError
from protocol.throttled import Throttled
from worker.engine.memory_limit import resident_bytes
from worker.serve.config import WorkerConfig, not_this_machines
from worker.serve.inbox import Inbox
from worker.serve.peers import MAX_QUEUED_PER_PEER, Peers, sender_request_id
from worker.serve.scheduler import QueueFull, Scheduler
from worker.serve.watchdog import Watchdog

log = logging.getLogger(__name__)

# How often an idle engine thread checks for shutdown, and the I/O thread's
# longest wait between two looks at its stop flag.
_IDLE_POLL_S = 0.1
_PREPARING_POLL_S = 0.002  # how often one that waits on a grammar's compile checks
_MAX_FAILURES_IN_A_ROW = 3  # engine failures with no request finished between them
_MAX_FRAMES_PER_TURN = 256
_MAX_TURN_S = 0.05
_IDLE_PEER_ROOM = 64  # peers with no request in flight, beyond those that can have one
_MAX_RECEIVED_PER_PEER = 8  # messages read from a peer and not yet decoded
_FINAL = b"1"
_PARTIAL = b"0"
# How long a stopping worker's last messages (its hand-backs) may wait to be
# delivered before its sockets close.
_LAST_MESSAGES_MS = 1000
# How long a stopping worker hands back at once what peers still send: those that
# have not heard it is stopping go on sending until its connection closes.
_CLOSING_S = 0.5
_HANDED_BACK = "the worker is stopping; the frontend sends the request to another"


class WorkerServer:
    def __init__(self, scheduler: Scheduler, config: WorkerConfig) -> None:
        self.scheduler = scheduler
        self.config = config
        self.instance_id = uuid.uuid4().hex
        info = scheduler.engine.info
        self.limits = RequestLimits(
            info.vocab_size, info.context_window, info.max_token_chars, info.max_token_bytes
        )
        self.hello = Hello(
            instance_id=self.instance_id,
            model=info.name,
            is_random_weights=info.is_random_weights,
            capacity=scheduler.engine.capacity,
            context_window=info.context_window,
            vocab_size=self.limits.vocab_size,
            max_token_chars=self.limits.max_token_chars,
            max_token_bytes=self.limits.max_token_bytes,
            max_queue_depth=scheduler.max_queue_depth,
            max_message_bytes=config.max_message_bytes,
            compute=info.compute,
            kv_cache_bytes=info.kv_cache_bytes,
            heartbeat_interval_s=config.heartbeat_interval_s,
            frontend_timeout_s=config.frontend_timeout_s,
        )
        self._context = zmq.Context()
        self._outputs_address = f"inproc://outputs-{self.instance_id}"
        self._inbox = Inbox()  # what the engine thread must act on
        self._stopping = threading.Event()  # asked to stop: the engine loop ends
        # The engine thread sends nothing more, so the I/O thread may close: it must
        # outlive every send, as a PUSH whose inproc peer has closed blocks forever.
        self._engine_done = threading.Event()
        self._bound = threading.Event()
        self._io_error: ConfigError | None = None
        self._queue_full = Throttled(log, "refusals for a full queue")  # the engine thread's

    def stop(self) -> None:
        self._stopping.set()

    def serve_forever(self) -> None:
        """Serve until `stop`. Raises ConfigError if the endpoint cannot be bound; an
        unexpected exception in either thread ends the process (see `_exit_on_crash`)."""
        io_thread = threading.Thread(
            target=_exit_on_crash(self._io_loop), name="worker-io", daemon=True
        )
        io_thread.start()
        self._bound.wait()
        if self._io_error is not None:
            io_thread.join()  # it closes its sockets, then the context can end
            self._context.term()
            raise self._io_error
        _exit_on_crash(self._engine_loop)()
        io_thread.join(timeout=2)
        self._context.term()

    def _engine_loop(self) -> None:
        outputs_socket = self._context.socket(zmq.PUSH)
        outputs_socket.connect(self._outputs_address)

        def send(messages: list[RequestNews]) -> None:
            """Each under the id its sender gave it."""
            for message in messages:
                route = message.request_id
                final = isinstance(message, (GenerateResult, ErrorResult))
                reply = dataclasses.replace(message, request_id=sender_request_id(route))
                outputs_socket.send_multipart(
                    [route.encode(), _FINAL if final else _PARTIAL, encode(reply)]
                )

        curve = self.config.curve
        log.info(
            "worker %s serving %s on %s (capacity %d; %s)",
            self.instance_id[:8],
            self.hello.model,
            self.config.listen_endpoint,
            self.hello.capacity,
            f"CURVE on; client keys allowed: {len(curve.client_public_keys)}"
            if curve
            else "no CURVE: any process that reaches it may send requests",
        )
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
            send(self._hand_back(self.scheduler.held_request_ids() + self._requests_in_inbox()))
        finally:
            self._engine_done.set()
            outputs_socket.close(linger=_LAST_MESSAGES_MS)

    def _finish_running(self, send: Callable[[list[RequestNews]], None]) -> None:
        """Stopping: step the requests that run here for up to STOP_GRACE_S, or
        until none is left, taking nothing new (`_apply` hands it back). A signal
        to a whole process group (^C, systemd) stops the frontends with the
        workers: handed back at once, every request under way was answered 503,
        where the frontends had 5 s to let them finish."""
        deadline = time.monotonic() + self.config.stop_grace_s
        outputs = self._hand_back(self.scheduler.take_queued())
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

    def _hand_back(self, request_ids: list[str]) -> list[RequestNews]:
        """Stopping: these requests go back to their frontends unfinished, to run
        elsewhere (resumed where they stopped) as if never sent here, rather than
        be replayed as the requests of a worker that died."""
        if request_ids:
            log.info("stopping: handing %d requests back to their frontends", len(request_ids))
        return [_handed_back(request_id) for request_id in request_ids]

    def _requests_in_inbox(self) -> list[str]:
        """Take what waits in the inbox; the ids of the requests among it."""
        request_ids: list[str] = []

        def note(message: ToWorker, _: float) -> None:
            if isinstance(message, GenerateRequest):
                request_ids.append(message.request_id)

        self._inbox.drain(note)
        return request_ids

    def _take_input(self, outputs: list[RequestNews], block: bool) -> None:
        timeout = _PREPARING_POLL_S if self.scheduler.has_work() else _IDLE_POLL_S
        self._inbox.drain(
            lambda message, received_at: self._apply(message, received_at, outputs),
            timeout if block else None,
        )

    def _apply(self, message: ToWorker, received_at: float, outputs: list[RequestNews]) -> None:
        if isinstance(message, GenerateRequest) and self._stopping.is_set():
            outputs.append(_handed_back(message.request_id))
        elif isinstance(message, GenerateRequest):
            try:
                self.scheduler.submit(message, received_at)
            except QueueFull as full:
                self._queue_full.warn(f"request {message.request_id:.64} refused: {full}")
                outputs.append(ErrorResult(message.request_id, ErrorCode.QUEUE_FULL, str(full)))
        elif isinstance(message, AbortRequest):
            outputs.extend(self.scheduler.abort([message.request_id]))

    # --- I/O thread -------------------------------------------------------------------

    def _io_loop(self) -> None:
        _seed_routing_ids()
        router = self._context.socket(zmq.ROUTER)
        # A peer that sends a larger message is disconnected by ZMQ before any of it
        # is decoded; frontends learn the limit from the hello and never send one.
        router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        # Bounded queues both ways, per peer: past them ZMQ stops reading a peer
        # that floods the socket (TCP pushes back on it) and drops what a peer that
        # never reads would otherwise pile up in this process.
        router.setsockopt(zmq.SNDHWM, MAX_QUEUED_PER_PEER)
        router.setsockopt(zmq.RCVHWM, _MAX_RECEIVED_PER_PEER)
        # A send to a peer that is gone or not reading fails rather than vanishing, so
        # that its requests are aborted instead of silently losing their tokens.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        stop_authenticator = secure_server(router, self.config.curve)
        outputs = self._context.socket(zmq.PULL)
        try:
            router.bind(self.config.listen_endpoint)
            outputs.bind(self._outputs_address)
        except zmq.ZMQError as exc:
            self._io_error = ConfigError(_bind_failure(self.config, exc))
            self._bound.set()
            router.close(linger=0)
            outputs.close(linger=0)
            stop_authenticator()
            return
        self._bound.set()
        # Requests in flight are bounded by queue and slots, so busy peers can never
        # fill the table: room stays for the frontends and probes that send none.
        max_peers = self.scheduler.max_queue_depth + self.hello.capacity + _IDLE_PEER_ROOM
        peers = Peers(router, self.hello, self.limits, self.config.frontend_timeout_s, max_peers)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outputs, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        watchdog = Watchdog(self.scheduler, self.config.engine_watchdog_s)
        is_stop_announced = False
        try:
            while not self._engine_done.is_set():
                if self._stopping.is_set() and not is_stop_announced:
                    # Told at once, the frontends send nothing more, and see the
                    # connection close as a stop, not a death.
                    next_heartbeat = time.monotonic()
                    is_stop_announced = True
                timeout_ms = max(0.0, next_heartbeat - time.monotonic()) * 1000
                events = dict(poller.poll(int(min(timeout_ms, _IDLE_POLL_S * 1000))))
                if router in events:
                    for message in _receive_turn(router, peers):
                        self._inbox.put(message)
                if outputs in events:
                    _forward(outputs, peers)
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
                    peers.heartbeat(self._heartbeat(is_stop_announced))
                    peers.expire()
                    watchdog.check()
                elif pinged := peers.pings_due():
                    peers.answer_pings(pinged, self._heartbeat(is_stop_announced))
                for route in peers.take_orphans():
                    self._inbox.put(AbortRequest(route))
            self._close(router, outputs, peers)
        finally:
            router.close(linger=_LAST_MESSAGES_MS)
            outputs.close(linger=0)
            stop_authenticator()

    def _heartbeat(self, is_stopping: bool) -> Heartbeat:
        return Heartbeat(
            instance_id=self.instance_id,
            num_steps=self.scheduler.num_steps,
            # Requests wait in the inbox while a step runs: a frontend that counted
            # only the scheduler's would think a slot free that one of them takes.
            # Read in the order requests move (inbox, queue, batch), so none is missed.
            num_queued=self._inbox.num_requests + self.scheduler.num_queued,
            num_active=self.scheduler.num_busy,
            num_finished=self.scheduler.num_finished,
            rss_bytes=resident_bytes(),
            num_matmul_shapes=self.scheduler.engine.num_matmul_shapes(),
            is_stopping=is_stopping,
        )

    def _close(self, router: zmq.Socket[bytes], outputs: zmq.Socket[bytes], peers: Peers) -> None:
        """The engine is done: a last heartbeat says this worker is stopping (one
        that stopped at once, before the next, had told no one), its last messages
        (a stopping worker's hand-backs) go out, and for _CLOSING_S every request a
        peer still sends, or that the engine left in the inbox, is handed back at
        once too. Lost in the closing socket, each would cost its request a death
        in the frontend."""
        peers.heartbeat(self._heartbeat(is_stopping=True))

        def hand_back(route: str) -> None:
            peers.send(route, True, encode(_handed_back(sender_request_id(route))))

        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outputs, zmq.POLLIN)
        closes_at = time.monotonic() + _CLOSING_S
        while (left_s := closes_at - time.monotonic()) > 0:
            events = dict(poller.poll(int(left_s * 1000) + 1))
            if outputs in events:
                _forward(outputs, peers)
            if router in events:
                for message in _receive_turn(router, peers):
                    if isinstance(message, GenerateRequest):
                        hand_back(message.request_id)
            for route in self._requests_in_inbox():
                hand_back(route)


def _bind_failure(config: WorkerConfig, exc: zmq.ZMQError) -> str:
    """Why the worker cannot bind its endpoint, and what to set (`check_endpoint_free`
    finds most of these before the model loads)."""
    if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV):  # ENODEV: ZMQ's, for a name
        return f"{not_this_machines(config)} ({exc})"
    return (
        f"cannot bind {config.listen_endpoint}: {exc}; is another program listening there? "
        f"Set {config.listen_setting} to a free address"
    )


def _handed_back(request_id: str) -> ErrorResult:
    """A stopping worker's answer to a request it will not run: the frontend sends
    it to another worker, and counts no death."""
    return ErrorResult(request_id, ErrorCode.SHUTTING_DOWN, _HANDED_BACK)


def _receive_turn(router: zmq.Socket[bytes], peers: Peers) -> Iterator[ToWorker]:
    """The messages of one turn's frames: a batch bounded in count and time, so
    that a peer flooding the socket cannot hold up outputs or heartbeats."""
    turn_ends_at = time.monotonic() + _MAX_TURN_S
    for _ in range(_MAX_FRAMES_PER_TURN):
        if time.monotonic() > turn_ends_at:
            return
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        yield from peers.receive(frames)


def _forward(outputs: zmq.Socket[bytes], peers: Peers) -> None:
    """Send each output the engine thread has written to its peer."""
    while outputs.poll(0):
        route_bytes, final, payload = outputs.recv_multipart()
        peers.send(route_bytes.decode(), final == _FINAL, payload)


def _seed_routing_ids() -> None:
    """Make the ROUTER's routing ids for peers that set none unguessable.

    libzmq numbers such peers from a counter that starts at libc's rand(), and
    nothing seeds rand(): every worker would hand out 00 6b8b4567, 00 6b8b4568,
    and so on. A peer that takes the next of those ids for itself first makes
    libzmq abort the whole process when the next peer arrives, since its id is
    already taken. Seeding rand() from the OS, in this process, before the socket
    is made, leaves nothing to guess from."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no C library to load by that name: libzmq seeds nothing there either
        log.warning("could not seed libc's rand(): ZMQ routing ids stay guessable")
        return
    libc.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))


class EngineBroken(RuntimeError):
    """The engine fails whatever it is given: only a new process can recover."""


def _exit_on_crash(body: Callable[[], None]) -> Callable[[], None]:
    """Run ``body``; if it raises, log the traceback and end the process at once.

    A worker with a dead thread would otherwise stay half alive: heartbeats
    without an engine, or an engine nobody can reach. Ending the process lets the
    supervisor (or Docker) replace it, and the frontend replays its requests."""

    def run() -> None:
        try:
            body()
        except EngineBroken as broken:  # its own decision: said in one line
            log.critical("%s", broken)
            logging.shutdown()
            os._exit(ExitCode.ENGINE_BROKEN)
        except BaseException:
            log.critical(
                "thread %s failed; exiting so that a new worker replaces this one",
                threading.current_thread().name,
                exc_info=True,
            )
            logging.shutdown()
            os._exit(ExitCode.THREAD_DIED)

    return run
