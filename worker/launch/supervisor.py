"""`minibatch-serve`: run workers and frontends, and keep them running.

The local twin of the compose file. NUM_WORKERS workers listen on
WORKER_ENDPOINT's port and the ones after it, each with an even share of the
cores (TORCH_THREADS), and NUM_FRONTENDS frontends on PORT and the ones after
it, each connected to every worker. A child that exits is restarted at once if
it had served, else after a backoff (`Child.restart_delay_s`). Workers fork from
a process that has loaded the model (`worker.launch.warm_start`), so a
replacement serves within a second. A worker that stops sending heartbeats, or
sends them without making progress on pending work, is killed and replaced: the
supervisor watches it over ZMQ exactly as the frontend does, and so is a worker
that has not said hello within WORKER_START_TIMEOUT_S. A child that keeps dying
before it comes up (a start that never finishes; a frontend, before it serves; a
worker that ends itself as broken) is a crash loop: while another child of its
kind serves, it is still retried (with its backoff); else the supervisor says so
and exits instead of retrying forever. A worker that came up
(`worker.serve.readiness`) and then died is retried however often: a request
that kills every worker that runs it is the frontends' to fail. One that refuses
its configuration (exit code ExitCode.CONFIG_ERROR: a bad MODEL_ID, a mode the
CPU cannot run, a port in use) ends it at once, with that exit code.
Configuration comes from the environment, which both children inherit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from protocol.endpoints import MAX_IPC_PATH_BYTES, MAX_PORT, TcpEndpoint
from protocol.lifeline import name_supervisor
from protocol.liveness import PauseWatch, WorkerState
from protocol.logs import log_as
from protocol.settings import ConfigError, exit_refusing, flag_settings, load
from worker.launch.child import KILL_AFTER_S, Child, CrashLoop, stop_together
from worker.launch.config import SupervisorConfig
from worker.launch.preflight import check_before_start
from worker.launch.warm_start import FORK_SERVER
from worker.launch.worker_watch import WorkerWatch
from worker.serve.readiness import READY_SOCKET_ENV, ReadyListener

log = logging.getLogger("supervisor")

_TICK_S = 0.1
# A child has served (its crash-loop count starts again) once it answered a
# request or stayed up this long. A worker's hello is not enough: a request that
# kills each worker that runs it is replayed on the next one right after its hello.
_FRONTEND_SERVED_AFTER_S = 5.0
_WORKER_SERVED_AFTER_S = 10.0
# A worker forked warm has its model loaded: only a fault keeps it from saying
# hello this long after its start (a deadlock, a freeze), however large the model.
_FORKED_START_TIMEOUT_S = 60.0
# A worker told to stop (by anyone) that has nothing left to run stops sending
# heartbeats at once, and exits; one whose heartbeats go on saying so this long is
# stuck in its stop, live to every judge while it takes nothing: killed, and so
# replaced. (One that runs requests lets them go on for STOP_GRACE_S, judged by
# its steps as ever.)
_IDLE_STOPPING_KILL_AFTER_S = KILL_AFTER_S


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        endpoints = worker_endpoints(config.worker_endpoint, config.num_workers)
        # WORKER_BIND, a worker's setting they inherit, is numbered as the endpoints.
        bind = os.environ.get("WORKER_BIND", "")
        binds = (
            worker_endpoints(bind, config.num_workers, "WORKER_BIND")
            if bind
            else [""] * config.num_workers
        )
        self.workers: list[tuple[Child, WorkerWatch]] = []
        for i, endpoint in enumerate(endpoints):
            name = "worker" if len(endpoints) == 1 else f"worker-{i}"
            is_one_of_several = len(endpoints) > 1
            env = _worker_env(endpoint, binds[i], config) if is_one_of_several else dict(os.environ)
            child = Child(
                name,
                "worker.serve.main",
                config,
                _WORKER_SERVED_AFTER_S,
                env=env,
                is_forked=config.warm_start,
                is_worker=True,
            )
            self.workers.append((child, WorkerWatch(config, endpoint)))
        self.frontends: list[Child] = []
        for i in range(config.num_frontends):
            name = "frontend" if config.num_frontends == 1 else f"frontend-{i}"
            env = {**os.environ, "PORT": str(config.port + i)}
            env["WORKER_ENDPOINTS"] = ",".join(endpoints)
            child = Child(name, "frontend.main", config, _FRONTEND_SERVED_AFTER_S, env=env)
            self.frontends.append(child)
        self._stopping = False
        self._ready: ReadyListener | None = None  # where workers say they came up: `run`
        self._pause = PauseWatch("supervisor", config.heartbeat_timeout_s, _TICK_S)

    def stop(self) -> None:
        """From a signal handler: the loop ends at its next turn, and starts nothing
        meanwhile. A signal to the whole process group reaches every child at the
        same moment, so the deaths seen from now on are this shutdown's own."""
        self._stopping = True
        FORK_SERVER.stop_replacing()

    def run(self) -> None:
        self._ready = ReadyListener()
        for child, _ in self.workers:
            assert child.env is not None
            child.env[READY_SOCKET_ENV] = self._ready.name
        try:
            while not self._stopping:
                for _, watch in self.workers:
                    watch.poll(_TICK_S / len(self.workers))
                self._ready.poll(self._worker_pids())
                for child in self.frontends:
                    self._tend(child, self.frontends)
                    if child.process is not None:
                        child.on_up()
                        self._judge_frontend(child)
                workers = [child for child, _ in self.workers]
                for child, watch in self.workers:
                    self._tend(child, workers, watch)
                    self._judge(child, watch)
        finally:
            log.info("stopping: the frontends, then the workers")
            FORK_SERVER.stop_replacing()
            stop_together(self.frontends)
            stop_together([child for child, _ in self.workers])
            for _, watch in self.workers:
                watch.close()
            FORK_SERVER.stop()
            self._ready.close()
            log.info("stopped")

    def _worker_pids(self) -> set[int]:
        return {child.process.pid for child, _ in self.workers if child.process is not None}

    def _said_ready(self, worker: Child) -> bool:
        """The worker, now dead, had told this supervisor it came up, though no
        hello of its own was heard here; and no verdict of this supervisor's
        killed it (one killed for never saying hello did not come up)."""
        if self._ready is None or worker.process is None:
            return False
        self._ready.poll(self._worker_pids())
        return self._ready.came_up(worker.process.pid) and worker.kill_reason is None

    def _notice_own_pause(self) -> None:
        """Before each verdict: a supervisor that did not run would kill a live
        worker whose heartbeats it did not hear (past FRONTEND_TIMEOUT_S the worker
        stops sending them)."""
        if self._pause.was_paused():
            for _, watch in self.workers:
                watch.on_own_pause()

    def _tend(self, child: Child, kind: list[Child], watch: WorkerWatch | None = None) -> None:
        """Start ``child`` when due, or schedule its restart if it ended; ``kind``
        is every child of its kind, whose serving keeps one crash loop from
        ending the stack."""
        if self._stopping:
            return
        if child.process is None:
            if child.is_due_to_start():
                child.start()
            return
        cause = child.exit_cause()
        if cause is not None:
            if watch is not None:
                watch.poll(0)  # a hello it sent before it died: it had come up
                if watch.liveness.hello is not None or self._said_ready(child):
                    child.on_up()
                watch.forget_worker()
            others_serve = any(other.serves for other in kind if other is not child)
            child.schedule_restart(cause, others_serve)

    def _judge(self, worker: Child, watch: WorkerWatch) -> None:
        self._notice_own_pause()
        if self._stopping or worker.process is None:
            return
        liveness = watch.liveness
        verdict = liveness.verdict()
        if not verdict.is_live:
            # Read what waits first: after this process was paused (SIGSTOP, a
            # starved CPU), the worker's heartbeats wait unread, and the verdict
            # would take this process's own deafness for the worker's silence.
            watch.poll(0)
            verdict = liveness.verdict()
        stuck_s = watch.idle_stopping_for_s()
        if verdict.is_live and stuck_s > _IDLE_STOPPING_KILL_AFTER_S:
            worker.kill(
                f"its heartbeats have said for {stuck_s:.1f} s that it is stopping with "
                "nothing left to run, and it has not exited (one stops sending them at once)"
            )
        elif verdict.is_live:
            heartbeat = liveness.last_heartbeat
            worker.on_up(
                heartbeat is not None and (heartbeat.num_finished > 0 or heartbeat.num_steps > 0)
            )
        elif verdict.state in (WorkerState.DEAD, WorkerState.HUNG):
            worker.kill(verdict.reason)
        elif (mute_s := watch.mute_s()) > watch.client.heartbeat_timeout_s and worker.is_stopped():
            # Its model is loaded (its socket took the connection), and it was frozen
            # before it could greet anyone: no need to wait out its start timeout. A
            # stopped process only: the socket may be another program's, the worker
            # still loading, to fail its own bind and say so.
            worker.kill(
                f"it is stopped (SIGSTOP), and its socket took this supervisor's connection "
                f"{mute_s:.1f} s ago with no hello since "
                f"(HEARTBEAT_TIMEOUT_S={watch.client.heartbeat_timeout_s:g})"
            )
        elif worker.running_for_s() > self._start_timeout_s(worker):
            # Still connecting: a model that never finishes loading, a deadlock at
            # start, or a worker this supervisor's keys cannot talk to.
            worker.kill(
                f"no hello within {self._start_timeout_s(worker):g} s of its start "
                f"(WORKER_START_TIMEOUT_S={self.config.worker_start_timeout_s:g}, at most "
                f"{_FORKED_START_TIMEOUT_S:g} s for a worker forked with its model loaded); "
                "raise it if loading the model takes longer, or check WORKER_ENDPOINT and "
                "the CURVE keys if the worker log says it is serving"
            )

    def _judge_frontend(self, frontend: Child) -> None:
        """A frontend sends no heartbeat to be judged by, but one that is stopped
        (SIGSTOP, a debugger) holds its port and answers nobody, for ever: it is
        replaced after HEARTBEAT_TIMEOUT_S, as a frozen worker is. The requests
        it held are lost with it, as with any frontend that dies."""
        if self._stopping:
            return
        stopped_s = frontend.stopped_for_s()
        if stopped_s > self.config.heartbeat_timeout_s:
            frontend.kill(
                f"it has been stopped (SIGSTOP) for {stopped_s:.1f} s, holding its port and "
                f"answering nothing (HEARTBEAT_TIMEOUT_S={self.config.heartbeat_timeout_s:g})"
            )

    def _start_timeout_s(self, worker: Child) -> float:
        if worker.is_forked:
            return min(self.config.worker_start_timeout_s, _FORKED_START_TIMEOUT_S)
        return self.config.worker_start_timeout_s


def worker_endpoints(first: str, num_workers: int, setting: str = "WORKER_ENDPOINT") -> list[str]:
    """``first`` (``setting``'s value) and the endpoints after it: the next ports,
    or numbered ipc paths."""
    if num_workers == 1:
        return [first]
    if first.startswith("ipc://"):
        endpoints = [first] + [f"{first}-{i}" for i in range(1, num_workers)]
        if len(endpoints[-1].removeprefix("ipc://").encode()) > MAX_IPC_PATH_BYTES:
            raise ConfigError(
                f"{setting}={first} with NUM_WORKERS={num_workers} makes socket paths "
                f"such as {endpoints[-1]}, longer than the system's {MAX_IPC_PATH_BYTES} "
                "bytes: choose a shorter path"
            )
        return endpoints
    tcp = TcpEndpoint.parse(first)
    if tcp is None:
        raise ConfigError(
            f"NUM_WORKERS={num_workers} needs {setting} as tcp://host:port (the workers "
            f"take that port and the ones after it) or ipc://path, got {first!r}"
        )
    if tcp.port + num_workers - 1 > MAX_PORT:
        raise ConfigError(
            f"{setting}={first} with NUM_WORKERS={num_workers} takes ports up to "
            f"{tcp.port + num_workers - 1}, past {MAX_PORT}: give it a lower port"
        )
    return [tcp.at(port=tcp.port + i) for i in range(num_workers)]


def _worker_env(endpoint: str, bind: str, config: SupervisorConfig) -> dict[str, str]:
    """One of several workers: its own endpoint (and where it binds, if that is
    not its endpoint), its share of the cores, and how many share the memory
    (each checks that all their KV caches fit)."""
    threads = config.torch_threads or max(1, len(os.sched_getaffinity(0)) // config.num_workers)
    env = {**os.environ, "WORKER_ENDPOINT": endpoint, "TORCH_THREADS": str(threads)}
    env["NUM_WORKERS"] = str(config.num_workers)
    env["WORKER_BIND"] = bind
    return env


def main(argv: Sequence[str] | None = None) -> None:
    log_as("supervisor")
    name_supervisor()  # before any child starts: each inherits it
    try:
        config = load(SupervisorConfig, argv, description=__doc__.splitlines()[0])
        # The children read their settings from the environment, so a flag given
        # here is set there too: `--torch-threads 1` had reached no worker.
        os.environ.update(flag_settings(SupervisorConfig, argv))
        check_before_start(config, os.environ)
        supervisor = Supervisor(config)
    except ConfigError as exc:
        exit_refusing("supervisor", exc, SupervisorConfig, argv)
    # SIGHUP too (a closed terminal): its default ended the stack with no stop at all.
    for stop_signal in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop_signal, lambda *_: supervisor.stop())
    try:
        supervisor.run()
    except CrashLoop as exc:
        print(f"supervisor: giving up: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
