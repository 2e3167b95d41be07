"""`minibatch-serve`: run workers and frontends, and keep them running.

The local twin of the compose file. NUM_WORKERS workers listen on
WORKER_ENDPOINT's port and the ones after it, each with an even share of the
cores (TORCH_THREADS), and NUM_FRONTENDS frontends on PORT and the ones after
it, each connected to every worker. A child that exits is restarted after a
backoff that doubles with each crash in a row (capped); one that had served, at
once. Workers fork from a process that has loaded the model (`worker.launch.warm_start`),
so a replacement serves within a second. A worker that stops
sending heartbeats, or sends them without making progress on pending work, is
killed and replaced: the supervisor watches it over ZMQ exactly as the frontend
does, and so is a worker that has not said hello within WORKER_START_TIMEOUT_S.
A child that keeps dying before it ever serves (a start that never finishes, a
request that kills every worker that runs it) is a crash loop: while another
child of its kind serves, it is still retried (with its backoff); else the
supervisor says so and exits instead of retrying forever. One that refuses its
configuration (exit code CONFIG_ERROR_EXIT_CODE: a bad MODEL_ID, a mode the CPU
cannot run, a port in use) ends it at once, with that exit code. Configuration
comes from the environment, which both children inherit.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import parse_monitor_message

from protocol import Heartbeat, Hello, ProtocolError, decode_to_frontend
from protocol.client_config import WorkerClientConfig
from protocol.lifeline import (
    FRONTEND_ANSWERS_LEFT_BEFORE_S,
    FRONTEND_STOP_GRACE_S,
    name_supervisor,
)
from protocol.liveness import Liveness, PauseWatch, WorkerState
from protocol.peer import ping, worker_socket
from protocol.settings import (
    MAX_IPC_PATH_BYTES,
    MAX_PORT,
    ConfigError,
    exit_refusing,
    flag_settings,
    load,
    setting_of_flag,
    unknown_flags,
)
from worker.launch.child import KILL_AFTER_S, Child, CrashLoop, stop_together
from worker.launch.config import SupervisorConfig
from worker.launch.warm_start import FORK_SERVER
from worker.serve.config import WorkerConfig, is_listened_on, tcp_bind_address

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


class WorkerWatch:
    """Hears one worker's hellos and heartbeats, as a frontend would, and sees
    when the worker's socket takes its connection: a worker binds once its model
    is loaded, so from then on a hello is due within HEARTBEAT_TIMEOUT_S."""

    def __init__(self, client: WorkerClientConfig, endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint
        self.liveness = self._new_liveness()
        self.connected_at: float | None = None  # the worker's socket took this connection
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

    def mute_s(self) -> float:
        """How long the worker's socket has held this connection with no hello
        from it (0 before the connection, or once it said hello)."""
        if self.connected_at is None or self.liveness.hello is not None:
            return 0.0
        return time.monotonic() - self.connected_at

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
                    for problem in self.client.timing_problems(
                        message.heartbeat_interval_s, message.frontend_timeout_s
                    ):
                        log.error("worker at %s: %s", self.endpoint, problem)
            elif isinstance(message, Heartbeat):
                self.liveness.on_heartbeat(message)

    def close(self) -> None:
        self._close_sockets()
        self._context.term()

    def _close_sockets(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        endpoints = worker_endpoints(config.worker_endpoint, config.num_workers)
        self.workers: list[tuple[Child, WorkerWatch]] = []
        for i, endpoint in enumerate(endpoints):
            name = "worker" if len(endpoints) == 1 else f"worker-{i}"
            env = _worker_env(endpoint, config) if len(endpoints) > 1 else None
            child = Child(
                name,
                "worker.serve.main",
                config,
                _WORKER_SERVED_AFTER_S,
                env=env,
                is_forked=config.warm_start,
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
        self._pause = PauseWatch("supervisor", config.heartbeat_timeout_s, _TICK_S)

    def stop(self) -> None:
        """From a signal handler: the loop ends at its next turn, and starts nothing
        meanwhile. A signal to the whole process group reaches every child at the
        same moment, so the deaths seen from now on are this shutdown's own."""
        self._stopping = True
        FORK_SERVER.shut_down()

    def run(self) -> None:
        try:
            while not self._stopping:
                for _, watch in self.workers:
                    watch.poll(_TICK_S / len(self.workers))
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
            FORK_SERVER.shut_down()
            stop_together(self.frontends)
            stop_together([child for child, _ in self.workers])
            for _, watch in self.workers:
                watch.close()
            FORK_SERVER.stop()
            log.info("stopped")

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
            if time.monotonic() >= child.start_at:
                child.start()
            return
        cause = child.exit_cause()
        if cause is not None:
            if watch is not None:
                watch.poll(0)  # a hello it sent before it died: it had come up
                if watch.liveness.hello is not None:
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
        if verdict.is_live:
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
        elif time.monotonic() - worker.started_at > self._start_timeout_s(worker):
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


def worker_endpoints(first: str, num_workers: int) -> list[str]:
    """``first`` and the endpoints after it: the next ports, or numbered ipc paths."""
    if num_workers == 1:
        return [first]
    if first.startswith("ipc://"):
        endpoints = [first] + [f"{first}-{i}" for i in range(1, num_workers)]
        if len(endpoints[-1].removeprefix("ipc://").encode()) > MAX_IPC_PATH_BYTES:
            raise ConfigError(
                f"WORKER_ENDPOINT={first} with NUM_WORKERS={num_workers} makes socket paths "
                f"such as {endpoints[-1]}, longer than the system's {MAX_IPC_PATH_BYTES} "
                "bytes: choose a shorter path"
            )
        return endpoints
    parts = urlsplit(first)
    if parts.scheme != "tcp" or parts.port is None:
        raise ConfigError(
            f"NUM_WORKERS={num_workers} needs WORKER_ENDPOINT as tcp://host:port (the workers "
            f"take that port and the ones after it) or ipc://path, got {first!r}"
        )
    if parts.port + num_workers - 1 > MAX_PORT:
        raise ConfigError(
            f"WORKER_ENDPOINT={first} with NUM_WORKERS={num_workers} takes ports up to "
            f"{parts.port + num_workers - 1}, past {MAX_PORT}: give it a lower port"
        )
    host = parts.netloc.rsplit(":", 1)[0]
    return [f"tcp://{host}:{parts.port + i}" for i in range(num_workers)]


def _workers_bind(config: SupervisorConfig, environ: Mapping[str, str]) -> tuple[str, str]:
    """The setting and endpoint the first worker binds: several workers each bind
    their own endpoint; a lone one, WORKER_BIND if set."""
    bind = environ.get("WORKER_BIND", "") if config.num_workers == 1 else ""
    return ("WORKER_BIND", bind) if bind else ("WORKER_ENDPOINT", config.worker_endpoint)


def check_ports_apart(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Refuse frontend ports (PORT and the next NUM_FRONTENDS - 1) that overlap the
    workers' (WORKER_ENDPOINT's, or a lone worker's WORKER_BIND, and the next
    NUM_WORKERS - 1) on one address: whichever binds second fails, and the first,
    taken for the other kind, made the frontends give CURVE advice and a worker
    blame "another program". Hosts are looked up only for ports in common."""
    name, endpoint = _workers_bind(config, environ)
    first = urlsplit(endpoint)
    if first.scheme != "tcp" or first.port is None:
        return
    http_ports = range(config.port, config.port + config.num_frontends)
    worker_ports = range(first.port, first.port + config.num_workers)
    shared = sorted(set(http_ports) & set(worker_ports))
    http_host = environ.get("HOST", "127.0.0.1")  # the frontends' own setting
    if shared and _same_address(first.hostname or "", http_host):
        raise ConfigError(
            f"the frontends' ports (PORT={config.port}, NUM_FRONTENDS={config.num_frontends}: "
            f"{http_ports.start}-{http_ports.stop - 1}) and the workers' "
            f"({name}={endpoint}, NUM_WORKERS={config.num_workers}: "
            f"{worker_ports.start}-{worker_ports.stop - 1}) share port {shared[0]}: move "
            "one range clear of the other"
        )


def check_worker_ports_free(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Refuse worker ports another program listens on before anything starts: the
    frontends, which start at once, served through another stack's worker there
    for the 8 s until this stack's own worker failed to bind."""
    name, endpoint = _workers_bind(config, environ)
    first = tcp_bind_address(endpoint)
    if first is None:
        return
    host, first_port = first
    for port in range(first_port, first_port + config.num_workers):
        if is_listened_on(host, port):
            raise ConfigError(
                f"port {port} of the workers' ({name}={endpoint}, NUM_WORKERS="
                f"{config.num_workers}) is taken by another program, perhaps another "
                f"stack's worker: set {name} to a free address"
            )


def _same_address(worker_host: str, http_host: str) -> bool:
    """Whether listeners on these hosts could want one socket: an address in
    common, or a wildcard of the other's family. Each is read as binding reads it
    (``127.1``, ``0``, ``::0``; a ZMQ ``*`` is IPv4's wildcard); a host that does
    not resolve is left for binding to refuse."""
    worker = _bind_addresses("0.0.0.0" if worker_host in ("", "*") else worker_host)
    http = _bind_addresses(http_host)
    return any(
        a.version == b.version and (a == b or a.is_unspecified or b.is_unspecified)
        for a in worker
        for b in http
    )


def _bind_addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        # No host (HOST=""): every interface, as a listener reads it.
        name = host.strip("[]") or None
        infos = socket.getaddrinfo(name, 0, flags=socket.AI_PASSIVE, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    addresses = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        addresses.append(address)
    return addresses


def _worker_env(endpoint: str, config: SupervisorConfig) -> dict[str, str]:
    """One of several workers: its own endpoint, its share of the cores, and how
    many share the memory (each checks that all their KV caches fit)."""
    threads = config.torch_threads or max(1, len(os.sched_getaffinity(0)) // config.num_workers)
    env = {**os.environ, "WORKER_ENDPOINT": endpoint, "TORCH_THREADS": str(threads)}
    env["NUM_WORKERS"] = str(config.num_workers)
    env["WORKER_BIND"] = ""  # each binds its own endpoint
    return env


# When frontends stopped alongside the workers answer what is left themselves.
_FRONTENDS_ANSWER_LEFT_AT_S = FRONTEND_STOP_GRACE_S - FRONTEND_ANSWERS_LEFT_BEFORE_S
# The longest STOP_GRACE_S: a worker's hand-back at its end (a step may run a
# second past it) must reach those frontends before then, and the worker must
# not be killed (KILL_AFTER_S) before it is sent.
MAX_STOP_GRACE_S = _FRONTENDS_ANSWER_LEFT_AT_S - 1.0


def check_worker_timing(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Refuse timing the workers' settings, in this same environment, make
    unworkable with the supervisor's: it would declare a live worker dead between
    two heartbeats, again and again. A worker setting that is wrong in itself is
    left for the worker to refuse, naming it."""
    try:
        worker = load(WorkerConfig, [], environ)
    except ConfigError:
        return
    problems = config.timing_problems(worker.heartbeat_interval_s, worker.frontend_timeout_s)
    if worker.stop_grace_s > MAX_STOP_GRACE_S:
        problems.append(
            f"STOP_GRACE_S={worker.stop_grace_s:g} is more than {MAX_STOP_GRACE_S:g}: "
            "frontends stopped with the workers answer what is left "
            f"{_FRONTENDS_ANSWER_LEFT_AT_S:g} s into their stop, "
            f"and minibatch-serve kills a worker {KILL_AFTER_S:g} s after asking it to stop, "
            "so what it hands back later is lost; lower STOP_GRACE_S"
        )
    if problems:
        raise ConfigError("; ".join(problems))


NO_WORKER_ENDPOINTS = (
    "WORKER_ENDPOINTS is for a frontend run alone (minibatch-frontend): "
    "minibatch-serve tells its frontends the endpoints of the workers it starts, "
    "on WORKER_ENDPOINT and the ports after it (NUM_WORKERS); unset it"
)


def check_no_worker_endpoints(config: SupervisorConfig) -> None:
    """WORKER_ENDPOINTS, which --help lists among a frontend's settings, was
    silently overridden: refused, saying where the workers are."""
    if config.worker_endpoints.strip():
        raise ConfigError(NO_WORKER_ENDPOINTS)


def check_own_flags(argv: Sequence[str]) -> None:
    """Refuse a flag that is not minibatch-serve's (`--max-batch-size 16`, a
    worker's), saying where that setting goes instead: argparse's bare
    "unrecognized arguments" left the user guessing."""
    for flag in unknown_flags(SupervisorConfig, argv):
        if setting_of_flag(SupervisorConfig, flag) == "WORKER_ENDPOINTS":
            raise ConfigError(NO_WORKER_ENDPOINTS)
        env = setting_of_flag(WorkerConfig, flag)
        if env is not None:
            raise ConfigError(
                f"{flag.split('=', 1)[0]} is a worker's flag, not minibatch-serve's: set "
                f"{env} in its environment instead (`{env}=... minibatch-serve`), which "
                "the workers it starts inherit"
            )
        raise ConfigError(
            f"{flag.split('=', 1)[0]} is not a flag of minibatch-serve (--help lists them); "
            "the workers and frontends it starts read their own settings from its "
            "environment (`minibatch-frontend --help` names the variable of each of its flags)"
        )


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s supervisor %(levelname)s: %(message)s"
    )
    name_supervisor()  # before any child starts: each inherits it
    try:
        check_own_flags(sys.argv[1:] if argv is None else argv)
        config = load(SupervisorConfig, argv, description=__doc__.splitlines()[0])
        # The children read their settings from the environment, so a flag given
        # here is set there too: `--torch-threads 1` had reached no worker.
        os.environ.update(flag_settings(SupervisorConfig, argv))
        check_worker_timing(config, os.environ)
        check_ports_apart(config, os.environ)
        check_no_worker_endpoints(config)
        check_worker_ports_free(config, os.environ)
        supervisor = Supervisor(config)
    except ConfigError as exc:
        exit_refusing("supervisor", exc)
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
