"""The supervisor replaces every worker that dies or hangs, before or after its
hello, and gives up on a crash loop instead of retrying forever."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from protocol import GenerateRequest, Heartbeat, encode
from protocol.exit_codes import ExitCode
from protocol.settings import ConfigError, load
from tests.fake_clock import FakeClock
from tests.stack import Stack, free_port, running_stack
from tests.stand_in_worker import stand_in_hello
from worker.engine.fake_engine import expected_text
from worker.launch import child as child_module
from worker.launch import supervisor as supervisor_module
from worker.launch.child import Child, CrashLoop
from worker.launch.config import SupervisorConfig
from worker.launch.preflight import (
    check_no_worker_endpoints,
    check_ports_apart,
    check_worker_bind_reachable,
    check_worker_ports_free,
)
from worker.launch.supervisor import Supervisor, _worker_env
from worker.launch.warm_start import FORK_SERVER_TITLE
from worker.launch.worker_watch import WorkerWatch
from worker.serve.config import WorkerConfig

SIGRTMIN_PLUS_3 = 37  # a real-time signal: signal.Signals has no member for it


class _FakeProcess:
    """Stands in for a child process; ``returncode`` None while it runs."""

    pid = 4242

    def __init__(self, *_: object, **__: object) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL

    def wait(self) -> int | None:
        return self.returncode


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A clock for the `Child` under test (time itself runs on), whose processes
    are stand-ins."""
    monkeypatch.setattr(child_module.subprocess, "Popen", _FakeProcess)
    return FakeClock()


def _worker(clock: FakeClock, crash_loop_limit: int) -> Child:
    config = SupervisorConfig(crash_loop_limit=crash_loop_limit)
    return Child(
        "worker", "worker.serve.main", config, served_after_s=10.0, clock=clock, is_worker=True
    )


def _run_and_die(
    child: Child, clock: FakeClock, *num_finished: int, code: int = 1, others_serve: bool = False
) -> None:
    """Start ``child``, see it up once per ``num_finished`` (a second apart), then let
    it die (by default a crash: exit code 1) and schedule its restart."""
    child.start()
    for finished in num_finished:
        child.on_up(finished > 0)
        clock.now += 1
    assert isinstance(child.process, _FakeProcess)
    child.process.returncode = code
    child.schedule_restart(str(child.exit_cause()), others_serve)


def test_a_restart_is_due_by_the_childs_own_clock(clock: FakeClock) -> None:
    """The supervisor asks the child; it read time.monotonic against a restart
    time, beside a start time read from the child's clock."""
    worker = _worker(clock, crash_loop_limit=5)
    assert worker.is_due_to_start()  # the first start: at once
    _run_and_die(worker, clock)  # died before coming up: a backoff
    delay = worker.restart_delay_s()
    assert delay > 0 and not worker.is_due_to_start()
    clock.now += delay
    assert worker.is_due_to_start()
    worker.start()
    clock.now += 7
    assert worker.running_for_s() == 7


def test_each_of_several_workers_is_told_its_endpoint_cores_and_how_many_share_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given as a flag, NUM_WORKERS is in no environment: each worker's KV-cache
    check must still count the others."""
    monkeypatch.delenv("NUM_WORKERS", raising=False)
    config = load(SupervisorConfig, ["--num-workers", "3"], {})
    env = _worker_env("tcp://127.0.0.1:5557", "", config)
    worker = load(WorkerConfig, [], env)
    assert (worker.num_workers, worker.worker_endpoint, worker.worker_bind) == (
        3,
        "tcp://127.0.0.1:5557",
        "",
    )
    assert worker.torch_threads == max(1, len(os.sched_getaffinity(0)) // 3)


def test_several_workers_bind_worker_bind_numbered_as_their_endpoints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WORKER_BIND was dropped, without a word, once NUM_WORKERS was past 1: the
    workers bound their endpoints' address, loopback, not every address."""
    monkeypatch.setenv("WORKER_BIND", "tcp://*:19041")
    config = SupervisorConfig(
        worker_endpoint="tcp://127.0.0.1:19041", num_workers=2, warm_start=False
    )
    supervisor = Supervisor(config)
    try:
        envs = [child.env or {} for child, _ in supervisor.workers]
        assert [(e["WORKER_ENDPOINT"], e["WORKER_BIND"]) for e in envs] == [
            ("tcp://127.0.0.1:19041", "tcp://*:19041"),
            ("tcp://127.0.0.1:19042", "tcp://*:19042"),
        ]
    finally:
        for _, watch in supervisor.workers:
            watch.close()


@pytest.mark.parametrize(
    ("endpoint", "bind", "fix"),
    [
        ("tcp://127.0.0.1:19410", "tcp://*:19420", r"tcp://\*:19410 binds it on every address"),
        ("tcp://127.0.0.1:19410", "ipc:///tmp/w", r"tcp://\*:19410 binds it"),
        ("ipc:///tmp/w", "ipc:///tmp/v", r"set it to ipc:///tmp/w, or unset it"),
        ("ipc://@w", "ipc://@v", r"set it to ipc://@w, or unset it"),
        ("ipc:///tmp/w", "tcp://*:19410", r"set it to ipc:///tmp/w"),
        # the same port, but not reached there: another address, another family
        ("tcp://127.0.0.1:19410", "tcp://127.0.0.2:19410", r"tcp://\*:19410 binds it"),
        ("tcp://[::1]:19410", "tcp://*:19410", r"tcp://\[::\]:19410 binds it"),
        ("tcp://127.0.0.1:19410", "tcp://[::1]:19410", r"tcp://\*:19410 binds it"),
    ],
)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_worker_bind_the_stacks_frontends_cannot_reach_is_refused(
    endpoint: str, bind: str, fix: str, num_workers: int
) -> None:
    """Workers bound there, frontends connected to WORKER_ENDPOINT: the stack
    never became ready, and said nothing."""
    config = SupervisorConfig(worker_endpoint=endpoint, num_workers=num_workers)
    with pytest.raises(ConfigError, match=rf"WORKER_BIND={re.escape(bind)} is not where .*\({fix}"):
        check_worker_bind_reachable(config, {"WORKER_BIND": bind})


@pytest.mark.parametrize(
    ("bind", "message"),
    [
        ("tcp://*:99999", "WORKER_BIND must end in a port from 1 to 65535"),
        ("inproc://x", "inproc:// reaches only threads of one process"),
        ("tcp://[]:19410", "has brackets around no IPv6 address"),
    ],
)
def test_a_worker_bind_that_is_no_endpoint_is_refused_as_such(bind: str, message: str) -> None:
    """Not as one the frontends cannot reach, nor only by the worker once started."""
    config = SupervisorConfig(worker_endpoint="tcp://127.0.0.1:19410")
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_worker_bind_reachable(config, {"WORKER_BIND": bind})


@pytest.mark.parametrize(
    ("endpoint", "bind"),
    [
        ("tcp://127.0.0.1:19410", "tcp://*:19410"),
        ("tcp://10.0.0.5:19410", "tcp://0.0.0.0:19410"),
        ("ipc:///tmp/w", "ipc:///tmp/w"),
        ("ipc:///tmp/w", "ipc:///tmp/./w"),
        ("ipc://@w", "ipc://@w"),
        ("tcp://127.0.0.1:19410", ""),
        ("tcp://[::1]:19410", "tcp://[::]:19410"),
        ("tcp://localhost:19410", "tcp://*:19410"),
        ("tcp://127.0.0.1:19410", "tcp://127.0.0.1:19410"),
    ],
)
def test_a_worker_bind_on_the_endpoints_port_or_path_is_taken(endpoint: str, bind: str) -> None:
    config = SupervisorConfig(worker_endpoint=endpoint, num_workers=2)
    check_worker_bind_reachable(config, {"WORKER_BIND": bind})


def test_a_worker_bind_through_a_linked_directory_is_taken_but_a_linked_socket_is_not(
    tmp_path: Path,
) -> None:
    """ZMQ binds an ipc path by replacing its last part: a link to the endpoint's
    socket file became a socket of its own, and the stack was never ready."""
    (tmp_path / "run").mkdir()
    (tmp_path / "linked-run").symlink_to(tmp_path / "run")
    (tmp_path / "run" / "alias.sock").symlink_to(tmp_path / "run" / "w.sock")
    config = SupervisorConfig(worker_endpoint=f"ipc://{tmp_path}/run/w.sock")
    check_worker_bind_reachable(config, {"WORKER_BIND": f"ipc://{tmp_path}/linked-run/w.sock"})
    with pytest.raises(ConfigError, match="is not where this stack's frontends connect"):
        check_worker_bind_reachable(config, {"WORKER_BIND": f"ipc://{tmp_path}/run/alias.sock"})
    # Connecting follows a link: an endpoint that is one reaches the bind's socket;
    # but not the numbered paths beside it, where several workers bind.
    bind = {"WORKER_BIND": f"ipc://{tmp_path}/run/w.sock"}
    linked = SupervisorConfig(worker_endpoint=f"ipc://{tmp_path}/run/alias.sock")
    check_worker_bind_reachable(linked, bind)
    with pytest.raises(ConfigError, match="is not where this stack's frontends connect"):
        check_worker_bind_reachable(dataclasses.replace(linked, num_workers=2), bind)


def test_a_worker_bind_with_no_room_for_several_workers_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_BIND", "tcp://*:65535")
    config = SupervisorConfig(num_workers=2, warm_start=False)
    with pytest.raises(ConfigError, match=r"WORKER_BIND=tcp://\*:65535 with NUM_WORKERS=2 takes"):
        Supervisor(config)


@pytest.mark.parametrize(
    ("settings", "http_host", "shared_port"),
    [
        (
            {"PORT": "18111", "NUM_WORKERS": "2", "WORKER_ENDPOINT": "tcp://127.0.0.1:18110"},
            "127.0.0.1",
            18111,
        ),
        (
            {"PORT": "18100", "NUM_FRONTENDS": "2", "WORKER_ENDPOINT": "tcp://localhost:18101"},
            "127.0.0.1",
            18101,
        ),
        # Hosts as binding reads them, not as written.
        ({"PORT": "8000", "WORKER_ENDPOINT": "tcp://127.0.0.1:8000"}, "127.1", 8000),
        ({"PORT": "8000", "WORKER_ENDPOINT": "tcp://127.0.0.1:8000"}, "0", 8000),
        ({"PORT": "8000", "WORKER_ENDPOINT": "tcp://[::1]:8000"}, "::0", 8000),
        # Workers bind WORKER_BIND, where it is set, and the ports after it.
        (
            {
                "PORT": "8001",
                "NUM_WORKERS": "2",
                "WORKER_ENDPOINT": "tcp://192.0.2.2:8000",
                "WORKER_BIND": "tcp://*:8000",
            },
            "127.0.0.1",
            8001,
        ),
        # A lone worker binds WORKER_BIND, where it is set.
        (
            {
                "PORT": "8000",
                "WORKER_ENDPOINT": "tcp://192.0.2.2:8000",
                "WORKER_BIND": "tcp://*:8000",
            },
            "127.0.0.1",
            8000,
        ),
        # Another address, or another family (asyncio binds IPv6 alone).
        ({"PORT": "8000", "WORKER_ENDPOINT": "tcp://127.0.0.1:8000"}, "127.0.0.2", None),
        ({"PORT": "8000", "WORKER_ENDPOINT": "tcp://127.0.0.1:8000"}, "::1", None),
        ({"PORT": "8000", "WORKER_ENDPOINT": "tcp://[::1]:8000"}, "0.0.0.0", None),
        ({"PORT": "5555", "WORKER_ENDPOINT": "tcp://10.0.0.2:5555"}, "0.0.0.0", 5555),
        (
            {"PORT": "8000", "NUM_WORKERS": "4", "WORKER_ENDPOINT": "tcp://127.0.0.1:8001"},
            "127.0.0.1",
            None,
        ),
        ({"PORT": "5555", "WORKER_ENDPOINT": "tcp://10.0.0.2:5555"}, "10.0.0.3", None),
        # HOST="", refused by the frontend naming it, is not an overlap.
        ({"PORT": "8000", "WORKER_ENDPOINT": "tcp://127.0.0.1:8000"}, "", None),
        (
            {"PORT": "5555", "NUM_WORKERS": "2", "WORKER_ENDPOINT": "ipc:///tmp/w"},
            "127.0.0.1",
            None,
        ),
    ],
)
def test_frontend_and_worker_ports_that_overlap_are_refused_naming_both(
    settings: dict[str, str], http_host: str, shared_port: int | None
) -> None:
    """Whichever bound second failed, and the first was taken for the other kind:
    the frontend gave CURVE advice, the worker blamed "another program"."""
    config = load(SupervisorConfig, [], settings)
    environ = {"HOST": http_host, "WORKER_BIND": settings.get("WORKER_BIND", "")}
    if shared_port is None:
        check_ports_apart(config, environ)
        return
    with pytest.raises(ConfigError, match=f"share port {shared_port}") as caught:
        check_ports_apart(config, environ)
    assert "PORT=" in str(caught.value) and "WORKER_" in str(caught.value)


@contextlib.contextmanager
def _listening_on_one_of_two_free_ports(taken: int) -> Iterator[int]:
    """The first of two neighbouring free ports, with a listener on the one at
    ``taken`` (0 or 1) past it."""
    for _ in range(20):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            listener, other = (second, first) if taken else (first, second)
            listener.listen()
            other.close()  # free again: only the listener holds its port
            yield port
            return
    raise AssertionError("no two neighbouring free ports")


@pytest.mark.parametrize("taken", [0, 1])
def test_a_worker_port_another_program_listens_on_is_refused_before_anything_starts(
    taken: int,
) -> None:
    """The frontends served through another stack's worker there until this
    stack's own worker failed to bind."""
    with _listening_on_one_of_two_free_ports(taken) as port:
        endpoint = f"tcp://127.0.0.1:{port}"
        config = load(SupervisorConfig, [], {"WORKER_ENDPOINT": endpoint, "NUM_WORKERS": "2"})
        with pytest.raises(ConfigError, match=f"port {port + taken} of the workers'"):
            check_worker_ports_free(config, {})
    check_worker_ports_free(config, {})  # closed: free again


def test_worker_endpoints_are_refused_where_the_supervisor_places_the_workers() -> None:
    """Listed by --help, and overridden without a word."""
    config = load(SupervisorConfig, [], {"WORKER_ENDPOINTS": "tcp://127.0.0.1:18641"})
    with pytest.raises(ConfigError, match="WORKER_ENDPOINTS is for a frontend run alone"):
        check_no_worker_endpoints(config)
    check_no_worker_endpoints(load(SupervisorConfig, [], {}))


def test_hosts_are_looked_up_only_for_ports_in_common(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow name server cost 12 s of a silent start for ports apart anyway."""

    def no_lookup(*_: object, **__: object) -> None:
        raise AssertionError("looked a host up")

    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    config = load(
        SupervisorConfig, [], {"PORT": "8000", "WORKER_ENDPOINT": "tcp://wk.example:8001"}
    )
    check_ports_apart(config, {"HOST": "fe.example"})


def test_workers_that_die_after_hello_before_serving_back_off_and_are_no_crash_loop(
    clock: FakeClock,
) -> None:
    # Poison requests: each worker says hello, takes one and dies at once. The
    # frontends fail each after MAX_WORKER_DEATHS; the stack must stay up.
    child = _worker(clock, crash_loop_limit=3)
    for _ in range(6):
        _run_and_die(child, clock, 0)
        assert child.restart_delay_s() == child.config.restart_backoff_s  # never growing
    assert (child.num_failed_starts, child.num_restarts) == (6, 6)


@pytest.mark.parametrize("code", [ExitCode.ENGINE_BROKEN, ExitCode.THREAD_DIED])
def test_workers_that_end_themselves_as_broken_after_hello_are_a_crash_loop(
    clock: FakeClock, code: int
) -> None:
    child = _worker(clock, crash_loop_limit=3)
    _run_and_die(child, clock, 0, code=code)
    _run_and_die(child, clock, 0, code=code)
    with pytest.raises(CrashLoop, match="3 times in a row"):
        _run_and_die(child, clock, 0, code=code)


def test_frontends_that_die_before_serving_are_a_crash_loop(clock: FakeClock) -> None:
    """A frontend is seen up as soon as it runs: requests are no excuse for it."""
    child = Child(
        "frontend", "frontend.main", SupervisorConfig(crash_loop_limit=2), 5.0, clock=clock
    )
    _run_and_die(child, clock, 0)
    with pytest.raises(CrashLoop, match="frontend died before serving 2 times in a row"):
        _run_and_die(child, clock, 0)


def test_workers_that_die_before_hello_are_a_crash_loop(clock: FakeClock) -> None:
    child = _worker(clock, crash_loop_limit=3)
    _run_and_die(child, clock)
    _run_and_die(child, clock, 0)  # it came up: the count starts again
    _run_and_die(child, clock)
    _run_and_die(child, clock)
    with pytest.raises(CrashLoop, match="died before coming up 3 times in a row"):
        _run_and_die(child, clock)


def test_a_crash_loop_while_other_workers_serve_is_retried_at_the_longest_backoff(
    clock: FakeClock,
) -> None:
    child = _worker(clock, crash_loop_limit=2)
    for _ in range(6):
        _run_and_die(child, clock, others_serve=True)
    assert (child.num_failed_starts, child.num_restarts) == (6, 6)
    assert child.restart_delay_s() == child.config.restart_backoff_max_s
    with pytest.raises(CrashLoop, match="7 times in a row"):  # the others stopped serving
        _run_and_die(child, clock)


@contextlib.contextmanager
def _watching_a_stand_in() -> Iterator[tuple[Supervisor, Child, WorkerWatch, zmq.Socket[bytes]]]:
    """A supervisor of one worker whose endpoint is a ROUTER the test speaks for,
    with HEARTBEAT_TIMEOUT_S 0.3."""
    with zmq.Context() as context, context.socket(zmq.ROUTER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        config = SupervisorConfig(
            worker_endpoint=f"tcp://127.0.0.1:{port}", heartbeat_timeout_s=0.3, warm_start=False
        )
        supervisor = Supervisor(config)
        ((worker, watch),) = supervisor.workers
        try:
            yield supervisor, worker, watch, socket
        finally:
            watch.close()


def _started_and_pinged(
    worker: Child, watch: WorkerWatch, worker_socket: zmq.Socket[bytes]
) -> bytes:
    """Start the worker (a stand-in's process) and poll until the supervisor's
    ping reaches the stand-in's socket; the supervisor's routing id there."""
    worker.start()
    while not worker_socket.poll(100):
        watch.poll(0.01)  # pings until one reaches the stand-in
    peer, _ = worker_socket.recv_multipart()
    return peer


@pytest.mark.parametrize("is_stopped", [True, False])
def test_a_stopped_worker_whose_socket_took_the_connection_is_killed_soon(
    clock: FakeClock, is_stopped: bool
) -> None:
    """Frozen right after binding, before the supervisor heard its hello: replaced
    after HEARTBEAT_TIMEOUT_S, not WORKER_START_TIMEOUT_S. A worker that is not
    stopped is left to its start: the socket may be another program's, and the
    worker will refuse its bind itself, naming the setting."""
    with _watching_a_stand_in() as (supervisor, worker, watch, _):
        worker.is_stopped = lambda: is_stopped  # type: ignore[method-assign]
        worker.start()
        started = time.monotonic()
        while worker.kill_reason is None and time.monotonic() - started < 2:
            watch.poll(0.05)
            supervisor._judge(worker, watch)
    if is_stopped:
        assert worker.kill_reason is not None
        assert "it is stopped (SIGSTOP)" in worker.kill_reason
        assert "no hello since (HEARTBEAT_TIMEOUT_S=0.3)" in worker.kill_reason
    else:
        assert worker.kill_reason is None


def _bind_when_free(socket: zmq.Socket[bytes], endpoint: str) -> None:
    """ZMQ lets go of a closed socket's port on its own thread, a moment later."""
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.bind(endpoint)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_restarted_worker_is_pinged_as_it_binds_and_its_hello_counts_after_its_death(
    clock: FakeClock,
) -> None:
    """Killed within PING_INTERVAL_S of binding, a worker that had said hello to its
    frontends had not been asked here: five such kills in a row ended the stack
    as a crash loop."""
    with _watching_a_stand_in() as (supervisor, worker, watch, first_socket):
        port = int(watch.endpoint.rsplit(":", 1)[1])
        watch.client = dataclasses.replace(watch.client, ping_interval_s=30.0)
        while not first_socket.poll(100):
            watch.poll(0.01)  # the first ping
        first_socket.close(linger=0)  # the worker dies
        watch.forget_worker()
        with zmq.Context() as context, context.socket(zmq.ROUTER) as replacement:
            replacement.setsockopt(zmq.LINGER, 0)
            _bind_when_free(replacement, f"tcp://127.0.0.1:{port}")  # its replacement binds
            worker.start()
            deadline = time.monotonic() + 5  # well within PING_INTERVAL_S (30 s)
            while not replacement.poll(10) and time.monotonic() < deadline:
                watch.poll(0.01)
            assert replacement.poll(0), "no ping as the replacement bound"
            peer, _ = replacement.recv_multipart()
            replacement.send_multipart([peer, encode(stand_in_hello(instance_id="w"))])
            time.sleep(0.2)  # the hello is on its way; the worker is killed before it is read
            assert isinstance(worker.process, _FakeProcess)
            worker.process.returncode = -signal.SIGKILL
            supervisor._tend(worker, [worker], watch)
    assert worker.num_failed_starts == 0 and worker.restart_delay_s() == 0


@contextlib.contextmanager
def _held_relay(target_port: int) -> Iterator[tuple[int, threading.Event]]:
    """A TCP port that accepts one connection at once and relays it to
    ``target_port`` only once the event is set: the connect is seen, its ZMTP
    handshake is held back meanwhile."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    release = threading.Event()

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def relay() -> None:
        with contextlib.suppress(TimeoutError), listener.accept()[0] as client:
            release.wait()
            with socket.create_connection(("127.0.0.1", target_port)) as upstream:
                back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
                back.start()
                pump(client, upstream)
                back.join(5)

    relaying = threading.Thread(target=relay, daemon=True)
    relaying.start()
    try:
        yield listener.getsockname()[1], release
    finally:
        release.set()
        relaying.join(10)
        listener.close()


def test_a_ping_refused_during_the_handshake_is_sent_once_the_handshake_is_done() -> None:
    """The connect comes before ZMTP's handshake, and until the handshake is done a
    send is refused: the ping tried then was dropped and not due again for
    PING_INTERVAL_S, so a worker killed meanwhile counted as a failed start."""
    with zmq.Context() as context, context.socket(zmq.ROUTER) as worker_socket:
        worker_socket.setsockopt(zmq.LINGER, 0)
        port = worker_socket.bind_to_random_port("tcp://127.0.0.1")
        with _held_relay(port) as (relay_port, release):
            client = dataclasses.replace(SupervisorConfig(), ping_interval_s=30.0)
            watch = WorkerWatch(client, f"tcp://127.0.0.1:{relay_port}")
            try:
                deadline = time.monotonic() + 5
                while watch.connected_at is None:
                    assert time.monotonic() < deadline, "the relay's connect was not seen"
                    watch.poll(0.01)
                watch.poll(0.01)  # its ping is tried, and refused
                release.set()
                deadline = time.monotonic() + 5  # well within PING_INTERVAL_S (30 s)
                while not worker_socket.poll(10) and time.monotonic() < deadline:
                    watch.poll(0.01)
                assert worker_socket.poll(0), "no ping once the handshake was done"
            finally:
                watch.close()


def test_children_are_stopped_together_not_one_after_another(tmp_path: Path) -> None:
    """Each frontend stopped in turn waited for the one before: three took 17 s, and
    the last served new requests meanwhile. Each child here takes 1 s to stop."""
    code = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1] + '.term', 'w').write(repr(time.time()))\n"
        "    time.sleep(1)\n"
        "    open(sys.argv[1] + '.exit', 'w').write(repr(time.time()))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(sys.argv[1] + '.up', 'w').close()\n"
        "time.sleep(60)\n"
    )
    children = []
    for i in range(3):
        child = Child(f"frontend-{i}", "frontend.main", SupervisorConfig(), served_after_s=1.0)
        child.process = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / str(i))])
        children.append(child)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"{i}.up").exists() for i in range(3)):
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)
    child_module.stop_together(children)
    first_exit = float((tmp_path / "0.exit").read_text())
    assert all(float((tmp_path / f"{i}.term").read_text()) < first_exit for i in range(3))


def _ignores_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(
        next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16
    )
    return bool(ignored & (1 << (signal.SIGTERM - 1)))


def test_a_child_that_does_not_stop_in_time_is_killed_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(child_module, "KILL_AFTER_S", 0.5)
    child = Child("worker", "worker.serve.main", SupervisorConfig(), served_after_s=1.0)
    child.process = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 30"])
    deadline = time.monotonic() + 10
    while not _ignores_sigterm(child.process.pid):
        assert time.monotonic() < deadline, "the child never ignored SIGTERM"
        time.sleep(0.01)
    child_module.stop_together([child])
    assert child.process.returncode == -signal.SIGKILL
    assert f"worker (pid {child.process.pid}) did not stop within 0.5 s: killed" in caplog.text


def test_a_stopped_process_is_told_from_a_running_one() -> None:
    config = SupervisorConfig()
    child = Child("sleeper", "worker.serve.main", config, 10.0)
    child.process = subprocess.Popen(["sleep", "30"])
    try:
        assert not child.is_stopped()
        child.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not child.is_stopped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert child.is_stopped()
    finally:
        child.process.kill()
        child.process.wait()


def test_a_worker_killed_after_serving_still_serves_while_it_restarts(clock: FakeClock) -> None:
    """So that a kill of the healthy worker, while another crash-loops, does not
    make the supervisor give up on the stack."""
    child = _worker(clock, crash_loop_limit=5)
    assert not child.serves  # never started
    _run_and_die(child, clock, 0, 2)
    assert child.serves
    child.start()  # not seen up yet
    assert child.serves
    assert isinstance(child.process, _FakeProcess)
    child.process.returncode = -9
    child.schedule_restart("killed")  # before it served again
    assert not child.serves


def test_a_supervisor_that_was_paused_reads_the_heartbeats_before_judging(
    clock: FakeClock,
) -> None:
    """Paused past HEARTBEAT_TIMEOUT_S (SIGSTOP) while the worker went on sending
    heartbeats: they wait unread, and the live worker is not killed for silence."""
    with _watching_a_stand_in() as (supervisor, worker, watch, worker_socket):
        peer = _started_and_pinged(worker, watch, worker_socket)
        heartbeat = encode(Heartbeat("w", num_steps=1, num_queued=0, num_active=0))
        worker_socket.send_multipart([peer, encode(stand_in_hello(instance_id="w"))])
        worker_socket.send_multipart([peer, heartbeat])
        while not watch.liveness.verdict().is_live:
            watch.poll(0.01)
        time.sleep(0.5)  # paused, past HEARTBEAT_TIMEOUT_S; the worker goes on
        worker_socket.send_multipart([peer, heartbeat])
        time.sleep(0.1)
        supervisor._judge(worker, watch)
    assert worker.kill_reason is None


@pytest.mark.parametrize(
    ("is_stopping", "num_active", "is_killed"),
    [(True, 0, True), (True, 2, False), (False, 0, False)],
    ids=["stopping-idle", "stopping-running-requests", "serving"],
)
def test_a_worker_stuck_in_its_stop_is_killed_and_one_stopping_or_serving_is_not(
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    is_stopping: bool,
    num_active: int,
    is_killed: bool,
) -> None:
    """A worker told to stop with nothing to run that heartbeats on, live (an
    engine thread stuck while idle), took nothing for ever and was never
    replaced. One that lets its requests run out their STOP_GRACE_S (its steps
    judge it, as ever), or that does not say it stops, is left alone."""
    monkeypatch.setattr(supervisor_module, "_IDLE_STOPPING_KILL_AFTER_S", 0.5)
    with _watching_a_stand_in() as (supervisor, worker, watch, worker_socket):
        peer = _started_and_pinged(worker, watch, worker_socket)
        worker_socket.send_multipart([peer, encode(stand_in_hello(instance_id="w"))])
        started = time.monotonic()
        num_steps = 0
        while worker.kill_reason is None and time.monotonic() - started < 1.5:
            num_steps += 1  # progress: its steps do not judge it hung
            heartbeat = Heartbeat("w", num_steps, num_queued=0, num_active=num_active)
            heartbeat = dataclasses.replace(heartbeat, is_stopping=is_stopping)
            worker_socket.send_multipart([peer, encode(heartbeat)])
            watch.poll(0.05)
            supervisor._judge(worker, watch)
    if is_killed:
        assert worker.kill_reason is not None
        assert "that it is stopping with nothing left to run" in worker.kill_reason
        assert "has not exited" in worker.kill_reason
        assert 0.5 <= time.monotonic() - started < 1.5
    else:
        assert worker.kill_reason is None


def test_a_supervisor_paused_past_the_workers_frontend_timeout_asks_before_judging(
    clock: FakeClock,
) -> None:
    """Paused past FRONTEND_TIMEOUT_S, the worker took the supervisor for gone and
    stopped its heartbeats: on resuming, the supervisor pings at once and gives the
    worker HEARTBEAT_TIMEOUT_S (0.3 s here) to answer, not a kill for silence."""
    with _watching_a_stand_in() as (supervisor, worker, watch, worker_socket):
        peer = _started_and_pinged(worker, watch, worker_socket)
        worker_socket.send_multipart([peer, encode(stand_in_hello(instance_id="w"))])
        while not watch.liveness.verdict().is_live:
            watch.poll(0.01)
        supervisor._judge(worker, watch)
        time.sleep(0.5)  # paused; the worker sends nothing more
        supervisor._judge(worker, watch)
        assert worker.kill_reason is None
        watch.poll(0.01)
        assert worker_socket.poll(1000), "no ping after the pause"
        answer_by = time.monotonic() + 0.4
        while time.monotonic() < answer_by:  # verdicts on time, and no answer
            supervisor._judge(worker, watch)
            watch.poll(0.05)
        supervisor._judge(worker, watch)
    assert worker.kill_reason is not None and "no heartbeat" in worker.kill_reason


def test_a_worker_forked_warm_has_a_minute_to_say_hello_however_long_the_timeout(
    clock: FakeClock,
) -> None:
    config = SupervisorConfig(worker_start_timeout_s=300, warm_start=False)
    supervisor = Supervisor(config)
    ((worker, watch),) = supervisor.workers
    try:
        worker.start()
        worker.is_forked = True  # as if forked: its model is loaded already
        worker.started_at -= 61
        supervisor._judge(worker, watch)
    finally:
        watch.close()
    assert worker.kill_reason is not None and "no hello within 60 s" in worker.kill_reason


def test_a_worker_killed_after_answering_a_request_is_not_a_failed_start(
    clock: FakeClock,
) -> None:
    # The fault drill: SIGKILL a worker that has served, again and again.
    child = _worker(clock, crash_loop_limit=1)
    for _ in range(3):
        _run_and_die(child, clock, 0, 2)
    assert (child.num_failed_starts, child.num_restarts) == (0, 3)


def test_a_worker_that_served_restarts_at_once_and_failed_starts_back_off(
    clock: FakeClock,
) -> None:
    child = _worker(clock, crash_loop_limit=10)
    _run_and_die(child, clock, 0, 2)
    assert child.restart_delay_s() == 0.0
    backoff = child.config.restart_backoff_s
    for num_failed in range(1, 4):
        _run_and_die(child, clock)  # before it came up
        assert child.restart_delay_s() == backoff * 2 ** (num_failed - 1)


def test_a_fork_server_that_never_comes_up_is_given_up_on_for_a_start_from_scratch(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Preloading hangs (a stalled download, say): the supervisor's loop goes on,
    # and after WORKER_START_TIMEOUT_S the worker starts the old way.
    monkeypatch.setattr(child_module.FORK_SERVER, "warm_up", lambda: None)
    config = SupervisorConfig(worker_start_timeout_s=30)
    child = Child("worker", "worker.serve.main", config, 10.0, clock=clock, is_forked=True)
    for _ in range(4):
        child.start()
        assert child.process is None
        clock.now += 10
    child.start()
    assert not child.is_forked
    child.start()
    assert isinstance(child.process, _FakeProcess)


def test_a_worker_live_for_a_while_has_served_even_without_requests(clock: FakeClock) -> None:
    child = _worker(clock, crash_loop_limit=1)
    child.start()
    child.on_up()
    clock.now += 9.9
    child.on_up()
    assert not child.has_served
    clock.now += 0.1
    child.on_up()
    assert child.has_served


def test_a_worker_that_ran_a_step_has_served(clock: FakeClock) -> None:
    child = _worker(clock, crash_loop_limit=1)
    child.start()
    child.on_up(has_worked=True)
    assert child.has_served


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_kills_from_outside_after_hello_are_no_crash_loop(
    clock: FakeClock, sig: signal.Signals
) -> None:
    """An operator's drill, or the OOM killer, killing the worker every few seconds
    before it had served ended the whole stack as a crash loop."""
    child = _worker(clock, crash_loop_limit=2)
    for _ in range(5):
        _run_and_die(child, clock, 0, code=-sig)
    assert child.num_failed_starts == 0 and child.restart_delay_s() == 0


def test_kills_before_hello_and_crashes_after_it_are_failed_starts(clock: FakeClock) -> None:
    child = _worker(clock, crash_loop_limit=2)
    _run_and_die(child, clock, code=-signal.SIGKILL)  # never came up
    _run_and_die(child, clock, 0, code=-signal.SIGSEGV)
    _run_and_die(child, clock, 0)  # exit code 1
    assert child.num_failed_starts == 3
    assert child.restart_delay_s() == child.config.restart_backoff_s
    _run_and_die(child, clock, code=-signal.SIGKILL)
    with pytest.raises(CrashLoop):  # killed before hello twice in a row
        _run_and_die(child, clock, code=-signal.SIGKILL)


def test_a_child_killed_by_a_real_time_signal_is_named_by_its_number(clock: FakeClock) -> None:
    child = _worker(clock, crash_loop_limit=5)
    child.start()
    assert isinstance(child.process, _FakeProcess)
    child.process.returncode = -SIGRTMIN_PLUS_3
    assert child.exit_cause() == "killed by signal 37"


def _exit_code(stack: Stack, timeout_s: float = 20) -> int:
    try:
        return stack.processes["supervisor"].wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the supervisor is still retrying\n{stack.logs()}") from None


def test_a_child_that_refuses_its_configuration_is_given_up_on_at_its_first_exit(
    clock: FakeClock,
) -> None:
    child = _worker(clock, crash_loop_limit=5)
    with pytest.raises(CrashLoop, match="worker refused its configuration") as caught:
        _run_and_die(child, clock, code=ExitCode.CONFIG_ERROR, others_serve=True)
    assert child.num_restarts == 0
    assert caught.value.exit_code == ExitCode.CONFIG_ERROR  # the supervisor's own


def test_a_child_that_had_come_up_and_then_refuses_its_configuration_is_retried(
    clock: FakeClock,
) -> None:
    """Its port, held by another program for a moment when it was restarted: the
    first exit 78 ended the whole stack, the workers that served included."""
    child = _worker(clock, crash_loop_limit=3)
    _run_and_die(child, clock, 0, code=-signal.SIGKILL)  # came up, killed from outside
    _run_and_die(child, clock, code=ExitCode.CONFIG_ERROR)
    _run_and_die(child, clock, code=ExitCode.CONFIG_ERROR)
    assert child.num_restarts == 3 and child.restart_delay_s() > 0  # with its backoff
    with pytest.raises(CrashLoop, match="died before coming up 3 times in a row"):
        _run_and_die(child, clock, code=ExitCode.CONFIG_ERROR)


def test_a_worker_without_hello_by_the_start_deadline_is_replaced_then_given_up_on(
    tmp_path: Path,
) -> None:
    overrides = {
        "WORKER_START_TIMEOUT_S": "1",
        "FAKE_START_DELAY_S": "30",
        "CRASH_LOOP_LIMIT": "2",
        "RESTART_BACKOFF_S": "0.1",
    }
    with running_stack(tmp_path, overrides) as stack:
        assert _exit_code(stack) != 0
        log = stack.log("supervisor")
        assert log.count("killing worker") == 2, log
        assert "no hello within 1 s of its start (WORKER_START_TIMEOUT_S=1," in log
        assert "restart #1" in log
        assert "giving up: worker died before coming up 2 times in a row" in log


def test_a_worker_killed_by_signal_37_is_restarted_and_the_supervisor_lives_on(
    tmp_path: Path,
) -> None:
    with running_stack(tmp_path) as stack:
        first = stack.wait_live()
        (pid,) = stack.worker_pids()
        os.kill(pid, SIGRTMIN_PLUS_3)
        stack.wait_live(instance_not=str(first["instance_id"]))
        assert "worker stopped (killed by signal 37)" in stack.log("supervisor")


def test_a_worker_whose_port_is_held_for_a_moment_at_its_restart_is_retried(
    tmp_path: Path,
) -> None:
    """Its replacement refused the port (exit 78) that another program had taken
    between the kill and the restart, and the supervisor took that for settings
    that can never work: it gave up, stopping every process of the stack."""
    with running_stack(tmp_path, {"RESTART_BACKOFF_S": "0.2"}) as stack:
        first = stack.wait_live()
        port = int(stack.env["WORKER_ENDPOINT"].rpartition(":")[2])
        (pid,) = stack.worker_pids()
        with socket.socket() as holder:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while True:  # taken as soon as the dead worker lets go of it
                try:
                    holder.bind(("127.0.0.1", port))
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the port never came free"
                    time.sleep(0.001)
            holder.listen()
            deadline = time.monotonic() + 10
            while "refused at a restart" not in stack.log("supervisor"):
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.05)
        stack.wait_live(instance_not=str(first["instance_id"]), timeout_s=30)
        assert stack.processes["supervisor"].poll() is None
        body = {"prompt": "back", "max_new_tokens": 3}
        answer = httpx.post(f"{stack.url}/generate", json=body, timeout=30)
        assert answer.json()["text"] == expected_text("back", 3)


def test_the_supervisors_flags_reach_the_processes_it_starts(tmp_path: Path) -> None:
    """A flag set only the supervisor's view: the worker, reading the environment,
    bound the endpoint that the environment named, and no frontend found it."""
    with running_stack(tmp_path, start=(), supervised=False) as stack:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "worker.launch.supervisor", "--worker-endpoint", endpoint]
        stack.start_command("supervisor", command, stack.env)
        stack.wait_live()
        assert f"serving fake on {endpoint} (capacity 8; no CURVE: any process" in stack.log(
            "supervisor"
        )


@contextlib.contextmanager
def _poison_sent(endpoint: str, request_id: str) -> Iterator[None]:
    """Hand the worker at ``endpoint`` a request with the crash prompt, straight over
    ZMQ, so that it kills that one worker and no frontend replays it on the next.
    The sender stays connected until the block ends (the worker dead by then): a
    worker drops the requests of a peer that has left, and its greeting may die
    with it."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(endpoint)
        socket.send(encode(GenerateRequest(request_id, "poison", max_new_tokens=1)))
        yield


def test_workers_that_die_taking_their_first_request_after_hello_are_retried(
    tmp_path: Path,
) -> None:
    overrides = {"FAKE_CRASH_PROMPT": "poison", "CRASH_LOOP_LIMIT": "2"}
    overrides["RESTART_BACKOFF_S"] = "0.1"
    with running_stack(tmp_path, overrides) as stack:
        live = stack.wait_live()
        for attempt in (1, 2, 3):
            # At once: the worker's note says it came up, whether or not the
            # supervisor has heard its hello yet.
            with _poison_sent(stack.env["WORKER_ENDPOINT"], f"poison-{attempt}"):
                live = stack.wait_live(instance_not=str(live["instance_id"]))
        assert stack.processes["supervisor"].poll() is None
        log = stack.log("supervisor")
        assert "worker died after coming up, before serving (3 times in a row" in log
        assert f"worker stopped (exit code {ExitCode.FAKE_CRASH:d})" in log
        response = httpx.post(
            f"{stack.url}/generate", json={"prompt": "hi", "max_new_tokens": 3}, timeout=30
        )
        assert response.json()["text"] == expected_text("hi", 3)


def test_poison_requests_in_a_row_over_http_fail_alone_and_the_stack_serves_on(
    tmp_path: Path,
) -> None:
    """Each killed the two workers that ran it before the frontend failed it, so
    five in a row made the supervisor give up on the stack as a crash loop."""
    overrides = {"NUM_WORKERS": "2", "FAKE_CRASH_PROMPT": "poison", "CRASH_LOOP_LIMIT": "2"}
    overrides["RESTART_BACKOFF_S"] = "0.1"
    with running_stack(tmp_path, overrides) as stack:
        stack.wait_for_health("both workers live", lambda h: h["workers_live"] == 2, 30)
        for attempt in range(4):
            body = {"prompt": f"poison {attempt}", "max_new_tokens": 2}
            poisoned = httpx.post(f"{stack.url}/generate", json=body, timeout=60)
            assert poisoned.status_code == 500, f"{poisoned.text}\n{stack.log('supervisor')}"
            assert poisoned.json()["error"]["code"] == "workers_died"
        assert stack.processes["supervisor"].poll() is None, stack.log("supervisor")
        response = httpx.post(
            f"{stack.url}/generate", json={"prompt": "hi", "max_new_tokens": 3}, timeout=60
        )
        assert response.json()["text"] == expected_text("hi", 3)


def test_killing_a_worker_that_answered_requests_is_not_a_crash_loop(tmp_path: Path) -> None:
    """Each kill is a restart, counted in /health, and its replacement serves."""
    with running_stack(tmp_path, {"CRASH_LOOP_LIMIT": "1"}) as stack:
        live = stack.wait_live()
        for restarts in (1, 2):
            response = httpx.post(
                f"{stack.url}/generate", json={"prompt": "hi", "max_new_tokens": 3}, timeout=30
            )
            assert response.json()["text"] == expected_text("hi", 3)
            time.sleep(1)  # heartbeats (every 0.1 s) tell the supervisor it answered
            stack.signal_worker(signal.SIGKILL)
            live = stack.wait_live(instance_not=str(live["instance_id"]))
            assert live["worker_restarts"] == restarts
        assert "worker stopped (killed by SIGKILL); restart #1" in stack.log("supervisor")


def test_a_supervisor_killed_outright_takes_its_frontend_and_workers_with_it(
    tmp_path: Path,
) -> None:
    # SIGKILL (the OOM killer, kill -9) lets the supervisor stop nobody: its
    # children must notice, or they serve on unsupervised and hold the ports.
    with running_stack(tmp_path, {"NUM_WORKERS": "2"}) as stack:
        stack.wait_for_health("both workers live", lambda h: h["workers_live"] == 2, 30)
        supervisor = stack.processes["supervisor"]
        children = psutil.Process(supervisor.pid).children(recursive=True)
        assert len(children) >= 3  # the frontend and two workers, and helpers
        supervisor.kill()
        supervisor.wait()
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"still running: {[p.pid for p in alive]}\n{stack.logs()}"
        assert "its supervisor" in stack.log("supervisor")  # the children's stderr


def test_a_supervisor_told_to_stop_ends_everything_it_started_saying_so(
    tmp_path: Path,
) -> None:
    """Each child's warning that its supervisor is gone is for a supervisor that
    was killed; a stop asked for ended with the fork server's, as if it had been."""
    with running_stack(tmp_path, {}) as stack:
        stack.wait_live()
        supervisor = stack.processes["supervisor"]
        children = psutil.Process(supervisor.pid).children(recursive=True)
        (fork_server,) = [
            c for c in children if " ".join(c.cmdline()).split() == [FORK_SERVER_TITLE]
        ]
        supervisor.terminate()
        assert supervisor.wait(timeout=30) == 0
        # Ended by the supervisor before it exits, not left to find it gone.
        assert not fork_server.is_running()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"still running: {[p.pid for p in alive]}\n{stack.logs()}"
        log = stack.log("supervisor")
        assert "stopping: the frontends, then the workers" in log
        last_line = log.rstrip().splitlines()[-1]
        assert re.search(r"supervisor\[\d+\] INFO supervisor: stopped$", last_line)
        assert "its supervisor" not in log


def test_a_stopped_frontend_is_replaced(tmp_path: Path) -> None:
    """Stopped (SIGSTOP), a frontend held its port and answered nobody, for ever:
    the supervisor had no heartbeat of it to judge by."""
    with running_stack(tmp_path) as stack:
        stack.wait_live()
        frozen = stack.frontend_pid()
        os.kill(frozen, signal.SIGSTOP)
        try:
            stack.wait_until(lambda: stack._pids_running("frontend.main") != [frozen], "a new one")
            stack.wait_live()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)
        assert stack.frontend_pid() != frozen
        assert f"killing frontend (pid {frozen}): it has been stopped (SIGSTOP)" in stack.log(
            "supervisor"
        )


def test_a_supervisor_killed_outright_while_its_children_are_stopped_leaves_none(
    tmp_path: Path,
) -> None:
    """Stopped (SIGSTOP), a child cannot watch its supervisor: it stayed, stopped,
    holding its port, and the next start failed. Linux resumes it when its parent
    dies, and it stops itself; a forked worker's parent, the fork server, ends
    with the supervisor though the workers it forked hold its pipe open."""
    with running_stack(tmp_path, {"MODEL_ID": "synthetic"}) as stack:
        stack.wait_live(timeout_s=120)
        supervisor = stack.processes["supervisor"]
        children = psutil.Process(supervisor.pid).children(recursive=True)
        fork_server = [child for child in children if child.pid not in stack.worker_pids()]
        stopped = [stack.frontend_pid(), *(p.pid for p in fork_server if "fork" in p.name())]
        assert len(stopped) == 2, [p.cmdline() for p in children]
        stopped += stack.worker_pids()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        supervisor.kill()
        supervisor.wait()
        _, alive = psutil.wait_procs(children, timeout=30)
        for process in alive:  # out of the stack's reach now: not left behind
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        assert not alive, f"still there: {[p.pid for p in alive]}\n{stack.logs()}"


@pytest.mark.parametrize("code", [0, 130, 255])
def test_a_graceful_exit_after_hello_is_no_failed_start(clock: FakeClock, code: int) -> None:
    """SIGTERM, SIGHUP or ^C stop a worker gracefully (exit 0, 130), and a worker
    whose stuck fork server was replaced has no known status (255): five such in
    a row ended the stack as a crash loop."""
    child = _worker(clock, crash_loop_limit=2)
    for _ in range(5):
        _run_and_die(child, clock, 0, code=code)
    assert child.num_failed_starts == 0


def test_a_child_killed_because_it_was_stopped_did_not_fail_its_start(clock: FakeClock) -> None:
    """Stopped from outside (SIGSTOP, a debugger), then killed by the supervisor."""
    child = _worker(clock, crash_loop_limit=1)
    child.start()
    child.is_stopped = lambda: True  # type: ignore[method-assign]
    child.kill("it has been stopped (SIGSTOP) for 3.0 s")
    child.schedule_restart(str(child.exit_cause()))
    assert child.num_failed_starts == 0
