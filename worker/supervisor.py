"""`minibatch-serve`: run a worker and a frontend, and keep them running.

The local twin of the compose file. A child that exits is restarted after a
backoff that doubles with each crash in a row (capped). A worker that stops
sending heartbeats, or sends them without making progress on pending work, is
killed and replaced: the supervisor watches it over ZMQ exactly as the frontend
does. A child that keeps dying before it ever serves (a bad MODEL_ID, a port in
use) is a crash loop: the supervisor says so and exits instead of retrying
forever. Configuration comes from the environment, which both children inherit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

import zmq

from protocol import Heartbeat, Hello, Ping, ProtocolError, decode_to_frontend, encode
from protocol.config import ConfigError, FrontendConfig, SupervisorConfig, load
from protocol.liveness import Liveness, WorkerState

log = logging.getLogger("supervisor")

_TICK_S = 0.1
_STOP_GRACE_S = 5.0
# A frontend that stayed up this long started fine; a worker started fine once it
# said hello.
_FRONTEND_SERVED_AFTER_S = 5.0


class CrashLoop(Exception):
    """A child died before serving CRASH_LOOP_LIMIT times in a row."""


class Child:
    """One supervised process and its restart policy."""

    def __init__(self, name: str, module: str, config: SupervisorConfig) -> None:
        self.name = name
        self.argv = [sys.executable, "-m", module]
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.num_restarts = 0
        self.num_failed_starts = 0  # in a row, died before serving
        self.has_served = False
        self.started_at = 0.0
        self.start_at = 0.0  # when a stopped child may start again

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv)
        self.has_served = False
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.process.pid)

    def exit_cause(self) -> str | None:
        """Why the process ended, or None while it runs."""
        if self.process is None or (code := self.process.poll()) is None:
            return None
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def schedule_restart(self, cause: str) -> None:
        self.process = None
        self.num_failed_starts = 0 if self.has_served else self.num_failed_starts + 1
        if self.num_failed_starts >= self.config.crash_loop_limit:
            raise CrashLoop(
                f"{self.name} died before serving {self.num_failed_starts} times in a row "
                f"(last: {cause}); its log above says why. Fix that (for a worker, "
                "often MODEL_ID or WORKER_ENDPOINT) and start again"
            )
        delay = min(
            self.config.restart_backoff_max_s,
            self.config.restart_backoff_s * 2 ** max(0, self.num_failed_starts - 1),
        )
        self.num_restarts += 1
        self.start_at = time.monotonic() + delay
        log.warning(
            "%s stopped (%s); restart #%d in %.1f s", self.name, cause, self.num_restarts, delay
        )

    def kill(self, reason: str) -> None:
        if self.process is not None and self.process.poll() is None:
            log.error("killing %s (pid %d): %s", self.name, self.process.pid, reason)
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class WorkerWatch:
    """Hears the worker's hellos and heartbeats, as a frontend would."""

    def __init__(self, frontend: FrontendConfig) -> None:
        self.frontend = frontend
        self.liveness = self._new_liveness()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(frontend.worker_endpoint)
        self._ping = encode(Ping(f"supervisor-{uuid.uuid4().hex}"))
        self._next_ping = 0.0

    def _new_liveness(self) -> Liveness:
        return Liveness(self.frontend.heartbeat_timeout_s, self.frontend.step_timeout_s)

    def forget_worker(self) -> None:
        self.liveness = self._new_liveness()

    def poll(self, timeout_s: float) -> None:
        if time.monotonic() >= self._next_ping:
            self._next_ping = time.monotonic() + self.frontend.ping_interval_s
            with contextlib.suppress(zmq.Again):  # no worker connected yet
                self._socket.send(self._ping, flags=zmq.NOBLOCK)
        while self._socket.poll(int(timeout_s * 1000)):
            timeout_s = 0
            try:
                message = decode_to_frontend(self._socket.recv())
            except ProtocolError as exc:
                log.error("malformed frame from the worker: %s", exc)
                continue
            if isinstance(message, Hello):
                self.liveness.on_hello(message)
            elif isinstance(message, Heartbeat):
                self.liveness.on_heartbeat(message)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class Supervisor:
    def __init__(self, config: SupervisorConfig, frontend: FrontendConfig) -> None:
        self.worker = Child("worker", "worker.main", config)
        self.frontend = Child("frontend", "frontend.main", config)
        self.watch = WorkerWatch(frontend)
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True

    def run(self) -> None:
        try:
            while not self._stopping:
                self.watch.poll(_TICK_S)
                self._tend(self.frontend)
                self._tend(self.worker)
                self._judge_worker()
                if time.monotonic() - self.frontend.started_at > _FRONTEND_SERVED_AFTER_S:
                    self.frontend.has_served = True
        finally:
            self.frontend.stop()
            self.worker.stop()
            self.watch.close()

    def _tend(self, child: Child) -> None:
        if child.process is None:
            if time.monotonic() >= child.start_at:
                child.start()
            return
        cause = child.exit_cause()
        if cause is not None:
            if child is self.worker:
                self.watch.forget_worker()
            child.schedule_restart(cause)

    def _judge_worker(self) -> None:
        if self.worker.process is None:
            return
        verdict = self.watch.liveness.verdict()
        if verdict.is_live:
            self.worker.has_served = True
        elif verdict.state in (WorkerState.DEAD, WorkerState.HUNG):
            self.worker.kill(verdict.reason)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s supervisor %(levelname)s: %(message)s"
    )
    try:
        config = load(SupervisorConfig, argv, description=__doc__.splitlines()[0])
        frontend = load(FrontendConfig, [], os.environ)
    except ConfigError as exc:
        sys.exit(f"supervisor: configuration error: {exc}")
    supervisor = Supervisor(config, frontend)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop())
    signal.signal(signal.SIGINT, lambda *_: supervisor.stop())
    try:
        supervisor.run()
    except CrashLoop as exc:
        sys.exit(f"supervisor: giving up: {exc}")


if __name__ == "__main__":
    main()
