"""The worker process's transport: a ZMQ ROUTER around the scheduler, served by
two threads, each owning its sockets:
- the I/O thread (`io_loop`) owns the ROUTER: it greets, checks and routes what
  peers send, puts requests in the engine thread's inbox, and sends heartbeats;
- the engine thread (`engine_loop`) runs the busy loop: take input, admit +
  step, send outputs (over an inproc pair, `outputs`, for the I/O thread to route).

Told to stop (SIGTERM, SIGINT, SIGHUP), the engine thread finishes or hands back
what it holds, then the I/O thread hands back whatever still arrives before the
socket closes.

If either thread raises, the process ends: nothing stays half alive. So does an
engine that fails whatever it is given (`EngineBroken`): a new worker replaces it.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable

import zmq

from protocol import Hello
from protocol.exit_codes import ExitCode
from protocol.request_checks import RequestLimits
from worker.serve.config import WorkerConfig
from worker.serve.engine_loop import EngineBroken, EngineLoop
from worker.serve.inbox import Inbox
from worker.serve.io_loop import IoLoop
from worker.serve.readiness import note_ready
from worker.serve.scheduler import Scheduler

log = logging.getLogger(__name__)


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
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        outputs_address = f"inproc://outputs-{self.instance_id}"
        inbox = Inbox()  # what the engine thread must act on
        self._stopping = threading.Event()  # asked to stop: the engine loop ends
        self._engine = EngineLoop(
            scheduler, config, inbox, self._stopping, self._context, outputs_address
        )
        self._io = IoLoop(
            scheduler,
            config,
            self.hello,
            self.limits,
            inbox,
            self._stopping,
            self._engine.done,
            self._context,
            outputs_address,
        )

    def stop(self) -> None:
        self._stopping.set()

    def serve_forever(self) -> None:
        """Serve until `stop`. Raises ConfigError if the endpoint cannot be bound; an
        unexpected exception in either thread ends the process (see `_exit_on_crash`)."""
        io_thread = threading.Thread(
            target=_exit_on_crash(self._io.run), name="worker-io", daemon=True
        )
        io_thread.start()
        self._io.bound.wait()
        if self._io.bind_error is not None:
            io_thread.join()  # it closes its sockets, then the context can end
            self._context.term()
            raise self._io.bind_error
        note_ready()  # its model loaded, its socket bound: a death now is no failed start
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
        _exit_on_crash(self._engine.run)()
        io_thread.join(timeout=2)
        self._context.term()


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
