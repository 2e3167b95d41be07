"""The worker's I/O thread: it owns the ROUTER (`WorkerServer` starts it beside
the engine thread, `engine_loop`).

It takes any frames a peer sends, decodes and checks them (`peers`, with
`protocol.request_checks`: a bad request is answered at once and never queued),
greets new peers with `Hello`, puts requests and aborts in the engine thread's
inbox (refusing at once a request past what the engine's queue would take),
routes the engine's outputs back, sends heartbeats on a timer (a long
step cannot starve them: the engine runs on the other thread and torch releases
the GIL), and aborts the requests of a peer whose pings stopped. When the engine
thread is done, it hands back whatever still arrives before the socket closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator

import psutil
import zmq

from protocol import (
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    Heartbeat,
    Hello,
    ToWorker,
    encode,
)
from protocol.curve import secure_server
from protocol.endpoints import TcpEndpoint
from protocol.request_checks import RequestLimits
from protocol.settings import ConfigError
from protocol.throttled import Throttled
from worker.engine.memory_limit import resident_bytes
from worker.serve.config import WorkerConfig, not_this_machines
from worker.serve.inbox import Inbox
from worker.serve.outputs import LAST_MESSAGES_MS, forward_outputs, handed_back
from worker.serve.peers import MAX_QUEUED_PER_PEER, Peers, sender_request_id
from worker.serve.scheduler import Scheduler
from worker.serve.watchdog import Watchdog

log = logging.getLogger(__name__)

_MAX_POLL_S = 0.1  # the longest wait between two looks at the engine thread's state
_MAX_FRAMES_PER_TURN = 256
_MAX_TURN_S = 0.05
_IDLE_PEER_ROOM = 64  # peers with no request in flight, beyond those that can have one
_MAX_RECEIVED_PER_PEER = 8  # messages read from a peer and not yet decoded
# How long a stopping worker hands back at once what peers still send: those that
# have not heard it is stopping go on sending until its connection closes.
_CLOSING_S = 0.5


class IoLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        config: WorkerConfig,
        hello: Hello,
        limits: RequestLimits,
        inbox: Inbox,
        stopping: threading.Event,
        engine_done: threading.Event,
        context: zmq.Context[zmq.Socket[bytes]],
        outputs_address: str,
    ) -> None:
        """Serves until ``engine_done``; puts what peers send in ``inbox``, and
        forwards what the engine thread sends to ``outputs_address``. ``stopping``
        set, the next heartbeat says so. Its scheduler is read, never changed: for
        heartbeats, and to refuse requests past what its queue would take."""
        self.scheduler = scheduler
        self.config = config
        self.hello = hello
        self.limits = limits
        self._inbox = inbox
        self._stopping = stopping
        self._engine_done = engine_done
        self._context = context
        self._outputs_address = outputs_address
        self._queue_full = Throttled(log, "refusals for a full queue")
        self._rss_bytes = 0  # as the last heartbeat said it (`_resident_bytes`)
        # Set once the endpoint is bound, or could not be (`bind_error`).
        self.bound = threading.Event()
        self.bind_error: ConfigError | None = None

    def run(self) -> None:
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
        # Without it, binding an IPv6 address fails as "No such device".
        listen = TcpEndpoint.parse(self.config.listen_endpoint)
        if listen is not None and listen.is_ipv6:
            router.setsockopt(zmq.IPV6, 1)
        stop_authenticator = secure_server(router, self.config.curve)
        outputs = self._context.socket(zmq.PULL)
        try:
            router.bind(self.config.listen_endpoint)
            outputs.bind(self._outputs_address)
        except zmq.ZMQError as exc:
            self.bind_error = ConfigError(_bind_failure(self.config, exc))
            self.bound.set()
            router.close(linger=0)
            outputs.close(linger=0)
            stop_authenticator()
            return
        self.bound.set()
        try:
            self._serve(router, outputs)
        finally:
            router.close(linger=LAST_MESSAGES_MS)
            outputs.close(linger=0)
            stop_authenticator()

    def _serve(self, router: zmq.Socket[bytes], outputs: zmq.Socket[bytes]) -> None:
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
        while not self._engine_done.is_set():
            if self._stopping.is_set() and not is_stop_announced:
                # Told at once, the frontends send nothing more, and see the
                # connection close as a stop, not a death.
                next_heartbeat = time.monotonic()
                is_stop_announced = True
            timeout_ms = max(0.0, next_heartbeat - time.monotonic()) * 1000
            events = dict(poller.poll(int(min(timeout_ms, _MAX_POLL_S * 1000))))
            if router in events:
                for message in _receive_turn(router, peers):
                    if isinstance(message, GenerateRequest) and self._is_inbox_full():
                        self._refuse(peers, message)
                    else:
                        self._inbox.put(message)
            if outputs in events:
                forward_outputs(outputs, peers)
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

    def _is_inbox_full(self) -> bool:
        """So many requests wait for the engine thread that it would refuse one
        more for its full queue anyway. Refused here, at once, a flood sent
        during a long step is not held past MAX_QUEUE_DEPTH + slots (the engine
        thread takes the inbox only between steps, and refuses what of those its
        queue cannot take then)."""
        # The scheduler first: a request applied between the two reads is then
        # missed, not counted twice; missed, the engine thread refuses it itself.
        num_queued = self.scheduler.num_queued
        # As if every slot were free by then: only what it would surely refuse.
        return self.scheduler.is_full(num_queued + self._inbox.num_requests, num_active=0)

    def _refuse(self, peers: Peers, request: GenerateRequest) -> None:
        full = self.scheduler.queue_full_error()
        self._queue_full.warn(f"request {request.request_id:.64} refused: {full}")
        sender_id = sender_request_id(request.request_id)
        peers.send(
            request.request_id,
            True,
            encode(ErrorResult(sender_id, ErrorCode.QUEUE_FULL, str(full))),
        )

    def _heartbeat(self, is_stopping: bool) -> Heartbeat:
        return Heartbeat(
            instance_id=self.hello.instance_id,
            num_steps=self.scheduler.num_steps,
            # Requests wait in the inbox while a step runs: a frontend that counted
            # only the scheduler's would think a slot free that one of them takes.
            # Read in the order requests move (inbox, queue, batch), so none is missed.
            num_queued=self._inbox.num_requests + self.scheduler.num_queued,
            num_active=self.scheduler.num_busy,
            num_finished=self.scheduler.num_finished,
            rss_bytes=self._resident_bytes(),
            num_matmul_shapes=self.scheduler.engine.num_matmul_shapes(),
            is_stopping=is_stopping,
        )

    def _resident_bytes(self) -> int:
        """This worker's resident set, or the last one read where it cannot be read
        now: at its open-file limit (a flood of connections to its port, each a
        file) psutil cannot open /proc, and a failed heartbeat ended the worker."""
        with contextlib.suppress(OSError, psutil.Error):
            self._rss_bytes = resident_bytes()
        return self._rss_bytes

    def _close(self, router: zmq.Socket[bytes], outputs: zmq.Socket[bytes], peers: Peers) -> None:
        """The engine is done: a last heartbeat says this worker is stopping (one
        that stopped at once, before the next, had told no one), its last messages
        (a stopping worker's hand-backs) go out, and for _CLOSING_S every request a
        peer still sends, or that the engine left in the inbox, is handed back at
        once too. Lost in the closing socket, each would cost its request a death
        in the frontend."""
        peers.heartbeat(self._heartbeat(is_stopping=True))

        def hand_back(route: str) -> None:
            peers.send(route, True, encode(handed_back(sender_request_id(route))))

        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outputs, zmq.POLLIN)
        closes_at = time.monotonic() + _CLOSING_S
        while (left_s := closes_at - time.monotonic()) > 0:
            events = dict(poller.poll(int(left_s * 1000) + 1))
            if outputs in events:
                forward_outputs(outputs, peers)
            if router in events:
                for message in _receive_turn(router, peers):
                    if isinstance(message, GenerateRequest):
                        hand_back(message.request_id)
            for route in self._inbox.take_request_ids():
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
