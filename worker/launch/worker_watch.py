"""How the supervisor sees one worker: its hellos and heartbeats, heard over ZMQ
exactly as a frontend hears them, and the moment its socket takes the
connection."""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from protocol import Heartbeat, Hello, ProtocolError, decode_to_frontend
from protocol.client_config import WorkerClientConfig
from protocol.liveness import Liveness
from protocol.peer import ping, worker_socket

log = logging.getLogger("supervisor")


class WorkerWatch:
    """Hears one worker's hellos and heartbeats, as a frontend would, and sees
    when the worker's socket takes its connection: a worker binds once its model
    is loaded, so from then on a hello is due within HEARTBEAT_TIMEOUT_S."""

    def __init__(self, client: WorkerClientConfig, endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint
        self.liveness = self._new_liveness()
        self.connected_at: float | None = None  # the worker's socket took this connection
        # When the heartbeats in a row that say it stops with nothing to run began,
        # and the latest of them.
        self._idle_stopping_since: float | None = None
        self._idle_stopping_last = 0.0
        self._context = zmq.Context()
        self._socket, self._monitor = self._connect()
        self._ping = ping("supervisor")
        self._next_ping = 0.0

    def _new_liveness(self) -> Liveness:
        return Liveness(self.client.heartbeat_timeout_s, self.client.step_timeout_s)

    def _connect(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        socket = worker_socket(self._context, self.endpoint, self.client.curve, is_immediate=True)
        monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        socket.connect(self.endpoint)
        return socket, monitor

    def on_own_pause(self) -> None:
        """This supervisor did not run for a while: past FRONTEND_TIMEOUT_S the
        worker took it for gone and stopped its heartbeats, so ping it at once; its
        hello answers, and it has HEARTBEAT_TIMEOUT_S from now to be heard."""
        self.liveness.on_own_pause()
        self._next_ping = 0.0

    def forget_worker(self) -> None:
        # A new socket: a hello the dead worker sent just before it died, still
        # queued on the old one, would make its successor look live and served.
        self._close_sockets()
        self._socket, self._monitor = self._connect()
        self.liveness = self._new_liveness()
        self.connected_at = None
        self._idle_stopping_since = None

    def mute_s(self) -> float:
        """How long the worker's socket has held this connection with no hello
        from it (0 before the connection, or once it said hello)."""
        if self.connected_at is None or self.liveness.hello is not None:
            return 0.0
        return time.monotonic() - self.connected_at

    def idle_stopping_for_s(self) -> float:
        """For how long the worker's heartbeats went on saying it is stopping with
        nothing left to run (0 if its latest does not): from the first of them to
        the latest, so that a worker exiting, which sends none, is not counted."""
        if self._idle_stopping_since is None:
            return 0.0
        return self._idle_stopping_last - self._idle_stopping_since

    def poll(self, timeout_s: float) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected_at = self.connected_at or time.monotonic()
                # A worker binds once it is ready: ping it now, as a frontend does,
                # not up to PING_INTERVAL_S later. A worker killed in between had
                # said hello to its frontends but not here, and counted as a
                # failed start: five such kills in a row ended the stack.
                self._next_ping = 0.0
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected_at = None
        if time.monotonic() >= self._next_ping:
            try:
                self._socket.send(self._ping, flags=zmq.NOBLOCK)
            except zmq.Again:
                # No worker, or its connection is still in ZMTP's handshake (the
                # TCP connect comes first): the ping is due again at the next poll.
                pass
            else:
                self._next_ping = time.monotonic() + self.client.ping_interval_s
        while self._socket.poll(int(timeout_s * 1000)):
            timeout_s = 0
            try:
                message = decode_to_frontend(self._socket.recv())
            except ProtocolError as exc:
                log.error("malformed frame from the worker: %s", exc)
                continue
            if isinstance(message, Hello):
                if self.liveness.on_hello(message):
                    self._idle_stopping_since = None
                    for problem in self.client.timing_problems(
                        message.heartbeat_interval_s, message.frontend_timeout_s
                    ):
                        log.error("worker at %s: %s", self.endpoint, problem)
            elif isinstance(message, Heartbeat):
                self.liveness.on_heartbeat(message)
                if self.liveness.last_heartbeat is message:  # its own, not a stale one's
                    self._on_own_heartbeat(message)

    def _on_own_heartbeat(self, heartbeat: Heartbeat) -> None:
        is_idle = heartbeat.num_active == 0 and heartbeat.num_queued == 0
        if not (heartbeat.is_stopping and is_idle):
            self._idle_stopping_since = None
            return
        self._idle_stopping_last = time.monotonic()
        if self._idle_stopping_since is None:
            self._idle_stopping_since = self._idle_stopping_last

    def close(self) -> None:
        self._close_sockets()
        self._context.term()

    def _close_sockets(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
