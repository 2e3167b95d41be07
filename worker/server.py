"""The worker process's transport: a ZMQ ROUTER around the scheduler.

Two threads, each owning its sockets:
- the I/O thread owns the ROUTER. It decodes frames, greets new frontends with
  `Hello`, remembers which frontend sent each request, routes outputs back, sends
  heartbeats on a timer (a long step cannot starve them: the engine runs on the
  other thread and torch releases the GIL), and aborts the requests of a frontend
  whose pings stopped;
- the engine thread runs the busy loop: take input, admit + step, send outputs.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid

import zmq

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
    ToFrontend,
    ToWorker,
    decode_to_worker,
    encode,
)
from protocol.config import WorkerConfig
from protocol.curve import secure_server
from worker.scheduler import QueueFull, Scheduler

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.1  # how often an idle engine thread checks for shutdown
_WEDGED_EXIT_CODE = 3
_FINAL = b"1"
_PARTIAL = b"0"


class WorkerServer:
    def __init__(self, scheduler: Scheduler, config: WorkerConfig) -> None:
        self.scheduler = scheduler
        self.config = config
        self.instance_id = uuid.uuid4().hex
        info = scheduler.engine.info
        self.hello = Hello(
            instance_id=self.instance_id,
            model=info.name,
            is_random_weights=info.is_random_weights,
            capacity=scheduler.engine.capacity,
            context_window=info.context_window,
            max_queue_depth=scheduler.max_queue_depth,
        )
        self._context = zmq.Context()
        self._outputs_address = f"inproc://outputs-{self.instance_id}"
        # What the engine thread must act on, with when the I/O thread received it:
        # a request's queue time starts there, not when a long step lets it in.
        self._inbox: queue.SimpleQueue[tuple[ToWorker, float]] = queue.SimpleQueue()
        self._stopping = threading.Event()  # asked to stop: the engine loop ends
        # The engine thread sends nothing more, so the I/O thread may close: it must
        # outlive every send, as a PUSH whose inproc peer has closed blocks forever.
        self._engine_done = threading.Event()
        self._bound = threading.Event()
        self._io_error: BaseException | None = None

    def stop(self) -> None:
        self._stopping.set()

    def serve_forever(self) -> None:
        io_thread = threading.Thread(target=self._io_loop, name="worker-io", daemon=True)
        io_thread.start()
        self._bound.wait()
        if self._io_error is not None:
            raise self._io_error
        outputs_socket = self._context.socket(zmq.PUSH)
        outputs_socket.connect(self._outputs_address)
        log.info(
            "worker %s serving %s on %s (capacity %d)",
            self.instance_id[:8],
            self.hello.model,
            self.config.listen_endpoint,
            self.hello.capacity,
        )
        try:
            while not self._stopping.is_set():
                outputs: list[ToFrontend] = []
                # 1. take input; block only while there is nothing to run
                self._take_input(outputs, block=not self.scheduler.has_work())
                # 2. admit into free slots, 3. one step
                outputs.extend(self.scheduler.run_once())
                # 4. send every output at once
                for message in outputs:
                    final = isinstance(message, (GenerateResult, ErrorResult))
                    route = message.request_id.encode()  # type: ignore[union-attr]
                    outputs_socket.send_multipart(
                        [route, _FINAL if final else _PARTIAL, encode(message)]
                    )
        finally:
            self._engine_done.set()
            io_thread.join(timeout=2)
            outputs_socket.close(linger=0)
            self._context.term()

    def _take_input(self, outputs: list[ToFrontend], block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_POLL_S) if block else self._inbox.get_nowait()
            while True:
                self._apply(*item, outputs)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _apply(self, message: ToWorker, received_at: float, outputs: list[ToFrontend]) -> None:
        if isinstance(message, GenerateRequest):
            try:
                self.scheduler.submit(message, received_at)
            except QueueFull as full:
                outputs.append(ErrorResult(message.request_id, ErrorCode.QUEUE_FULL, str(full)))
        elif isinstance(message, AbortRequest):
            outputs.extend(self.scheduler.abort([message.request_id]))

    # --- I/O thread -------------------------------------------------------------------

    def _io_loop(self) -> None:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, 0)  # never drop outputs; the queue depth bounds them
        router.setsockopt(zmq.RCVHWM, 0)
        stop_authenticator = secure_server(router, self.config.curve)
        outputs = self._context.socket(zmq.PULL)
        try:
            router.bind(self.config.listen_endpoint)
            outputs.bind(self._outputs_address)
        except zmq.ZMQError as exc:
            self._io_error = RuntimeError(
                f"cannot bind {self.config.listen_endpoint}: {exc}; is another worker "
                "running there? Set WORKER_ENDPOINT (or WORKER_BIND) to a free address"
            )
            self._bound.set()
            router.close(linger=0)
            outputs.close(linger=0)
            stop_authenticator()
            return
        self._bound.set()
        io = _Routing(router, self.hello, self.config.frontend_timeout_s)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outputs, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        watchdog = _Watchdog(self.scheduler, self.config.engine_watchdog_s)
        try:
            while not self._engine_done.is_set():
                timeout_ms = max(0.0, next_heartbeat - time.monotonic()) * 1000
                events = dict(poller.poll(int(min(timeout_ms, _IDLE_POLL_S * 1000))))
                if router in events:
                    while router.poll(0):
                        identity, frame = router.recv_multipart()
                        for message in io.receive(identity, frame):
                            self._inbox.put((message, time.monotonic()))
                if outputs in events:
                    while outputs.poll(0):
                        route, final, payload = outputs.recv_multipart()
                        io.send(route.decode(), final == _FINAL, payload)
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
                    io.heartbeat(
                        Heartbeat(
                            instance_id=self.instance_id,
                            num_steps=self.scheduler.num_steps,
                            num_queued=self.scheduler.num_queued,
                            num_active=self.scheduler.engine.num_active(),
                            num_finished=self.scheduler.num_finished,
                        )
                    )
                    for request_id in io.expire_frontends():
                        self._inbox.put((AbortRequest(request_id), time.monotonic()))
                    watchdog.check()
        finally:
            router.close(linger=0)
            outputs.close(linger=0)
            stop_authenticator()


class _Watchdog:
    """Ends the process when the engine thread is wedged: heartbeats alone would
    keep a stuck worker looking alive to a restart policy that cannot see progress
    (Docker's), and its requests would wait forever instead of being replayed."""

    def __init__(self, scheduler: Scheduler, timeout_s: float) -> None:
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.last_steps = -1
        self.last_progress_at = time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if self.scheduler.num_steps != self.last_steps or not self.scheduler.has_work():
            self.last_steps = self.scheduler.num_steps
            self.last_progress_at = now
        elif now - self.last_progress_at > self.timeout_s:
            log.critical(
                "the engine made no progress for %.0f s with work pending "
                "(ENGINE_WATCHDOG_S=%g); exiting so that a new worker replaces this one",
                now - self.last_progress_at,
                self.timeout_s,
            )
            logging.shutdown()
            os._exit(_WEDGED_EXIT_CODE)


class _Routing:
    """Which frontends are connected, and which frontend each request came from.
    Used by the I/O thread alone."""

    def __init__(self, router: zmq.Socket[bytes], hello: Hello, frontend_timeout_s: float):
        self.router = router
        self.hello = encode(hello)
        self.frontend_timeout_s = frontend_timeout_s
        self.last_seen: dict[bytes, float] = {}
        self.routes: dict[str, bytes] = {}

    def receive(self, identity: bytes, frame: bytes) -> list[ToWorker]:
        """Decode one frame; return what the engine thread must act on."""
        if identity not in self.last_seen:
            # Debug level: health probes connect as short-lived frontends.
            log.debug("frontend %s connected", identity.hex())
            self.router.send_multipart([identity, self.hello])
        self.last_seen[identity] = time.monotonic()
        try:
            message = decode_to_worker(frame)
        except ProtocolError as exc:
            log.warning("malformed frame from frontend %s: %s", identity.hex(), exc)
            if exc.request_id is not None:
                error = ErrorResult(exc.request_id, ErrorCode.INVALID_REQUEST, str(exc))
                self.router.send_multipart([identity, encode(error)])
            return []
        if isinstance(message, Ping):
            return []
        if isinstance(message, GenerateRequest):
            self.routes[message.request_id] = identity
        return [message]

    def send(self, request_id: str, final: bool, payload: bytes) -> None:
        identity = self.routes.pop(request_id, None) if final else self.routes.get(request_id)
        if identity is not None:
            self.router.send_multipart([identity, payload])

    def heartbeat(self, heartbeat: Heartbeat) -> None:
        frame = encode(heartbeat)
        for identity in self.last_seen:
            self.router.send_multipart([identity, frame])

    def expire_frontends(self) -> list[str]:
        """Forget frontends whose pings stopped; return their requests to abort."""
        cutoff = time.monotonic() - self.frontend_timeout_s
        gone = {identity for identity, seen in self.last_seen.items() if seen < cutoff}
        if not gone:
            return []
        orphans = [rid for rid, identity in self.routes.items() if identity in gone]
        for identity in gone:
            num_orphans = sum(1 for rid in orphans if self.routes[rid] == identity)
            log.log(
                logging.WARNING if num_orphans else logging.DEBUG,
                "frontend %s sent nothing for %.0f s; aborting its %d requests",
                identity.hex(),
                self.frontend_timeout_s,
                num_orphans,
            )
            del self.last_seen[identity]
        for request_id in orphans:
            del self.routes[request_id]
        return orphans
