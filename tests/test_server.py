"""The worker's ZMQ server, in-process with FakeEngine, over real loopback sockets."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import llguidance
import msgpack
import psutil
import pytest
import zmq

from protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    Hello,
    Ping,
    ToFrontend,
    decode_to_frontend,
    encode,
)
from protocol.peer import ping, wait_for_hello, worker_socket
from protocol.settings import ConfigError
from tests.stack import free_port
from worker.engine.fake_engine import (
    FAKE_VOCAB_SIZE,
    FakeEngine,
    expected_text,
    fake_grammar_tokenizer,
)
from worker.engine.grammar import Grammars
from worker.engine.sequence import Sequence
from worker.serve.config import MIN_MESSAGE_BYTES, WorkerConfig, check_endpoint_free
from worker.serve.scheduler import Scheduler
from worker.serve.server import WorkerServer


@contextmanager
def serving(
    engine: FakeEngine, max_queue_depth: int = 64, **config: object
) -> Iterator[WorkerServer]:
    settings = {"worker_endpoint": f"tcp://127.0.0.1:{free_port()}", "heartbeat_interval_s": 0.05}
    settings.update(config)
    worker_config = WorkerConfig(model_id="fake", **settings)  # type: ignore[arg-type]
    server = WorkerServer(Scheduler(engine, max_queue_depth), worker_config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=5)
        assert not thread.is_alive()


class Frontend:
    """A bare DEALER speaking the protocol, as the frontend does."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def send(self, frame: bytes) -> None:
        self.socket.send(frame)

    def receive_until(
        self, done: type | tuple[type, ...], timeout_s: float = 5.0
    ) -> list[ToFrontend]:
        """Messages up to and including the first of type ``done``."""
        received: list[ToFrontend] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.socket.poll(50):
                message = decode_to_frontend(self.socket.recv())
                received.append(message)
                if isinstance(message, done):
                    return received
        raise AssertionError(f"no {done} within {timeout_s} s; got {received}")


Connect = Callable[[WorkerServer], Frontend]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """Make frontends; every socket is closed before the context ends."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    made: list[Frontend] = []

    def make(server: WorkerServer) -> Frontend:
        made.append(Frontend(context, server.config.worker_endpoint))
        return made[-1]

    yield make
    for frontend in made:
        frontend.socket.close(linger=0)
    context.term()


def test_a_new_frontend_is_greeted_and_its_requests_are_answered(connect: Connect) -> None:
    with serving(FakeEngine(4)) as server:
        frontend = connect(server)
        frontend.send(encode(Ping("f1")))
        (hello,) = frontend.receive_until(Hello)
        assert isinstance(hello, Hello)
        assert (hello.instance_id, hello.model, hello.capacity) == (server.instance_id, "fake", 4)
        timing = (server.config.heartbeat_interval_s, server.config.frontend_timeout_s)
        assert (hello.heartbeat_interval_s, hello.frontend_timeout_s) == timing  # for clients
        frontend.send(encode(GenerateRequest("r1", "hello", 5)))
        result = frontend.receive_until(GenerateResult)[-1]
        assert isinstance(result, GenerateResult)
        assert result.text == expected_text("hello", 5)


def test_each_result_goes_to_the_frontend_that_sent_the_request(connect: Connect) -> None:
    with serving(FakeEngine(4, step_delay_s=0.01)) as server:
        frontends = [connect(server) for _ in range(3)]
        for i, frontend in enumerate(frontends):
            for j in range(3):
                frontend.send(encode(GenerateRequest(f"f{i}-r{j}", f"prompt {i} {j}", 4)))
        for i, frontend in enumerate(frontends):
            results: list[GenerateResult] = []
            while len(results) < 3:
                last = frontend.receive_until(GenerateResult)[-1]
                assert isinstance(last, GenerateResult)
                results.append(last)
            assert sorted(r.request_id for r in results) == [f"f{i}-r{j}" for j in range(3)]


def test_a_malformed_frame_is_answered_when_it_names_a_request_and_never_stops_the_loop(
    connect: Connect,
) -> None:
    with serving(FakeEngine(2)) as server:
        frontend = connect(server)
        frontend.send(b"\xc1 not msgpack")
        bad = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": "bad", "prompt": 3}
        bad["max_new_tokens"] = 4
        frontend.send(msgpack.packb(bad))
        error = frontend.receive_until(ErrorResult)[-1]
        assert isinstance(error, ErrorResult)
        assert (error.request_id, error.code) == ("bad", ErrorCode.INVALID_REQUEST)
        assert "prompt must be str" in error.message
        frontend.send(encode(GenerateRequest("good", "still serving", 3)))
        result = frontend.receive_until(GenerateResult)[-1]
        assert isinstance(result, GenerateResult) and result.request_id == "good"


def test_a_ping_is_answered_with_a_heartbeat_at_once(connect: Connect) -> None:
    """A frontend that saw another worker die asks this one whether it lives: the
    answer comes in a round trip, not at the timer's next turn (here 30 s)."""
    with serving(FakeEngine(1), heartbeat_interval_s=30.0) as server:
        frontend = connect(server)
        frontend.send(encode(Ping("f1")))
        frontend.receive_until(Hello)
        frontend.receive_until(Heartbeat)  # the timer's first, at start
        for _ in range(2):
            frontend.send(encode(Ping("f1")))
            (beat,) = frontend.receive_until(Heartbeat, timeout_s=1)
            assert isinstance(beat, Heartbeat) and beat.instance_id == server.instance_id


def test_heartbeats_keep_coming_during_a_long_step(connect: Connect) -> None:
    with serving(FakeEngine(1, step_delay_s=1.0)) as server:
        frontend = connect(server)
        frontend.send(encode(GenerateRequest("slow", "x", 2)))
        frontend.receive_until(Hello)
        beats = [m for m in frontend.receive_until(GenerateResult) if isinstance(m, Heartbeat)]
        # One step of 1 s at a 0.05 s interval: a starved timer would send ~1.
        assert len(beats) >= 8
        assert any(b.num_active == 1 for b in beats)


def test_heartbeats_count_a_request_that_arrived_during_a_step(connect: Connect) -> None:
    # The engine thread takes new requests only between steps; until then they
    # wait in the inbox, and a frontend routing by heartbeats must see them.
    with serving(FakeEngine(2, step_delay_s=1.0)) as server:
        frontend = connect(server)
        frontend.send(encode(GenerateRequest("first", "x", 2)))
        frontend.receive_until(Hello)
        frontend.receive_until(Heartbeat)  # its step has begun
        frontend.send(encode(GenerateRequest("second", "x", 2)))
        beat = None
        deadline = time.monotonic() + 0.8  # within the step, which lasts 1 s
        while time.monotonic() < deadline:
            beat = frontend.receive_until(Heartbeat)[-1]
            assert isinstance(beat, Heartbeat)
            if beat.num_queued + beat.num_active == 2:
                break
        assert beat is not None and beat.num_queued + beat.num_active == 2, beat
        assert beat.num_steps == 0, "counted only once the step had ended"


def test_a_slow_grammar_compile_holds_up_neither_the_steps_nor_the_heartbeats(
    connect: Connect,
) -> None:
    released = threading.Event()

    def slow_tokenizer() -> llguidance.LLTokenizer:
        assert released.wait(10)
        return fake_grammar_tokenizer()

    engine = FakeEngine(2, step_delay_s=0.01)
    engine.grammars = Grammars(slow_tokenizer)
    regex = llguidance.LLMatcher.grammar_from_regex("[0-9]{4}")
    with serving(engine) as server:
        frontend = connect(server)
        frontend.send(encode(GenerateRequest("slow", "x", 8, grammar_kind="regex", grammar=regex)))
        frontend.send(encode(GenerateRequest("free", "hello", 20)))
        received = frontend.receive_until(GenerateResult)
        assert received[-1].request_id == "free"  # while "slow" compiles
        beats = [m for m in received if isinstance(m, Heartbeat)]
        assert len(beats) >= 2 and beats[-1].num_steps >= beats[0].num_steps + 5, beats
        assert beats[-1].num_queued == 1
        released.set()
        result = frontend.receive_until(GenerateResult)[-1]
        assert isinstance(result, GenerateResult)
        assert (result.request_id, result.finish_reason) == ("slow", "stop")
        assert len(result.text) == 4 and result.text.isdigit()


def test_the_requests_of_a_silent_frontend_are_aborted(connect: Connect) -> None:
    engine = FakeEngine(2, step_delay_s=0.01)
    with serving(engine, frontend_timeout_s=0.5) as server:
        gone = connect(server)
        gone.send(encode(GenerateRequest("orphan", "x", 900)))
        deadline = time.monotonic() + 2
        while engine.num_active() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_active() == 1
        deadline = time.monotonic() + 5
        while engine.num_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_active() == 0
        assert not server.scheduler.has_work()


def test_a_full_queue_answers_queue_full_and_says_so_in_the_log(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    with serving(FakeEngine(1, step_delay_s=0.05), max_queue_depth=1) as server:
        frontend = connect(server)
        for i in range(4):
            frontend.send(encode(GenerateRequest(f"r{i}", "x", 50)))
        error = frontend.receive_until(ErrorResult)[-1]
        assert isinstance(error, ErrorResult) and error.code == ErrorCode.QUEUE_FULL
    assert "refused: the worker's queue is full" in caplog.text


def test_requests_flooded_in_during_a_step_are_refused_at_once_not_held(
    connect: Connect,
) -> None:
    """The engine thread takes the inbox only between steps: a peer that sends
    thousands of requests during one would have the worker hold every one."""
    with serving(FakeEngine(1, step_delay_s=1.0), max_queue_depth=4) as server:
        frontend = connect(server)
        frontend.send(encode(GenerateRequest("first", "x", 2)))
        frontend.receive_until(Hello)
        frontend.receive_until(Heartbeat)  # its step has begun
        for i in range(500):
            frontend.send(encode(GenerateRequest(f"r{i}", "y" * 500, 2)))
        refused = [
            m
            for m in frontend.receive_until(ErrorResult, timeout_s=1.0)
            if isinstance(m, ErrorResult)
        ]
        assert refused[0].code == ErrorCode.QUEUE_FULL, refused
        assert server.scheduler.num_steps == 0  # refused during the step, not after
        while len(refused) < 500 - 5:
            received = frontend.receive_until(ErrorResult, timeout_s=1.0)
            refused += [m for m in received if isinstance(m, ErrorResult)]
        assert [m.request_id for m in refused] == [f"r{i}" for i in range(5, 500)]


class StopsMidStep(FakeEngine):
    """Asks its server to stop during a decode step, then finishes the step after
    the I/O thread's idle poll, so that the step's outputs are sent after the stop."""

    server: WorkerServer | None = None

    def _decode(self, active: list[Sequence]) -> list[int]:
        if self.server is not None:
            self.server.stop()
            time.sleep(0.3)
        return super()._decode(active)


def test_a_stop_during_a_step_still_ends_the_server(connect: Connect) -> None:
    """The engine thread sends that step's outputs after the stop; the I/O thread
    must still be there to take them, or the send blocks and the worker never exits
    (``serving`` checks that the server thread ends)."""
    engine = StopsMidStep(1)
    with serving(engine) as server:
        frontend = connect(server)
        engine.server = server
        frontend.send(encode(GenerateRequest("r", "x", 5, stream=True)))
        deadline = time.monotonic() + 5
        while not server.scheduler.num_steps and time.monotonic() < deadline:
            time.sleep(0.05)
    assert engine.num_decode_steps >= 1  # the stop came during a step, not before one


def test_two_peers_may_use_the_same_request_id(connect: Connect) -> None:
    with serving(FakeEngine(4, step_delay_s=0.01)) as server:
        first, second = connect(server), connect(server)
        first.send(encode(GenerateRequest("same", "first prompt", 30)))
        second.send(encode(GenerateRequest("same", "second prompt", 4)))
        answers = {}
        for frontend in (first, second):
            result = frontend.receive_until(GenerateResult)[-1]
            assert isinstance(result, GenerateResult) and result.request_id == "same"
            answers[frontend] = result.text
        assert answers[first] == expected_text("first prompt", 30)
        assert answers[second] == expected_text("second prompt", 4)


def test_a_peer_cannot_abort_another_peers_request(connect: Connect) -> None:
    with serving(FakeEngine(2, step_delay_s=0.01)) as server:
        owner, stranger = connect(server), connect(server)
        owner.send(encode(GenerateRequest("r", "x", 40)))
        stranger.send(encode(GenerateRequest("other", "y", 2)))
        stranger.receive_until(GenerateResult)
        stranger.send(encode(AbortRequest("r")))
        result = owner.receive_until(GenerateResult)[-1]
        assert isinstance(result, GenerateResult)
        assert (result.finish_reason, result.text) == ("length", expected_text("x", 40))


def test_a_request_repeated_while_in_flight_runs_once(connect: Connect) -> None:
    with serving(FakeEngine(2, step_delay_s=0.01)) as server:
        frontend = connect(server)
        for _ in range(3):
            frontend.send(encode(GenerateRequest("r", "x", 10)))
        frontend.receive_until(GenerateResult)
        frontend.send(encode(GenerateRequest("after", "y", 2)))
        trailing = frontend.receive_until(GenerateResult)
        assert [m.request_id for m in trailing if isinstance(m, GenerateResult)] == ["after"]


def test_messages_of_any_frame_count_are_dropped_and_serving_goes_on(connect: Connect) -> None:
    with serving(FakeEngine(2)) as server:
        frontend = connect(server)
        good = encode(GenerateRequest("r", "x", 3))
        frontend.socket.send_multipart([good, good, good])
        frontend.socket.send_multipart([b"", b"\x00" * 1000])
        frontend.socket.send(b"")
        frontend.send(good)
        result = frontend.receive_until(GenerateResult)[-1]
        assert isinstance(result, GenerateResult) and result.text == expected_text("x", 3)


def test_a_message_over_max_message_bytes_disconnects_only_its_sender(connect: Connect) -> None:
    with serving(FakeEngine(2), max_message_bytes=MIN_MESSAGE_BYTES) as server:
        bystander, sender = connect(server), connect(server)
        bystander.send(encode(Ping("bystander")))
        bystander.receive_until(Hello)
        sender.send(encode(GenerateRequest("huge", "x" * (MIN_MESSAGE_BYTES + 1), 3)))
        bystander.send(encode(GenerateRequest("r", "fine", 3)))
        result = bystander.receive_until(GenerateResult)[-1]
        assert isinstance(result, GenerateResult) and result.request_id == "r"
        assert server.scheduler.num_finished == 1  # "huge" never reached the scheduler
        assert not sender.socket.poll(100) or isinstance(
            decode_to_frontend(sender.socket.recv()), Hello
        )


def test_an_invalid_request_is_answered_alone_and_its_batchmates_run(connect: Connect) -> None:
    engine = FakeEngine(4, step_delay_s=0.05)
    with serving(engine) as server:
        frontend = connect(server)
        frontend.send(encode(GenerateRequest("a", "x", 5)))
        frontend.send(encode(GenerateRequest("oov", "", 5, prompt_token_ids=[FAKE_VOCAB_SIZE])))
        frontend.send(encode(GenerateRequest("nan", "x", 5, temperature=float("nan"))))
        frontend.send(encode(GenerateRequest("b", "y", 5)))
        finals: dict[str, ToFrontend] = {}
        while len(finals) < 4:
            last = frontend.receive_until((GenerateResult, ErrorResult))[-1]
            finals[last.request_id] = last  # type: ignore[union-attr]
        assert (
            isinstance(finals["oov"], ErrorResult) and "prompt_token_ids" in finals["oov"].message
        )
        assert isinstance(finals["nan"], ErrorResult) and "temperature" in finals["nan"].message
        for request_id, prompt in (("a", "x"), ("b", "y")):
            result = finals[request_id]
            assert isinstance(result, GenerateResult) and result.text == expected_text(prompt, 5)
        assert engine.num_resets == 0


@pytest.mark.parametrize(
    ("patch", "thread"),
    [
        ("worker.serve.peers.Peers.heartbeat", "worker-io"),
        ("worker.serve.scheduler.Scheduler.has_work", "MainThread"),
    ],
)
def test_a_thread_that_raises_ends_the_worker_loudly(patch: str, thread: str) -> None:
    module, cls, method = patch.rsplit(".", 2)
    script = (
        f"import {module}, worker.serve.main\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('injected')\n"
        f"setattr({module}.{cls}, {method!r}, broken)\n"
        "worker.serve.main.main([])\n"
    )
    env = {**os.environ, "MODEL_ID": "fake", "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 4
    assert f"thread {thread} failed" in done.stderr
    assert "RuntimeError: injected" in done.stderr


def test_an_engine_that_fails_everything_ends_the_worker_with_its_own_exit_code() -> None:
    """Three failed requests with none finished between: the worker exits 5 and
    says why in one line, not as a crashed thread's traceback (exit 4)."""
    script = (
        "import worker.engine.fake_engine as fake, worker.serve.main\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('injected')\n"
        "fake.FakeEngine.step = broken\n"
        "worker.serve.main.main([])\n"
    )
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "MODEL_ID": "fake", "WORKER_ENDPOINT": endpoint}
    worker = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True
    )
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    frontend = Frontend(context, endpoint)
    try:
        for i in range(2):
            frontend.send(encode(GenerateRequest(f"r{i}", "a prompt", 4)))
            failed = frontend.receive_until(ErrorResult, timeout_s=30)[-1]
            assert isinstance(failed, ErrorResult) and failed.code == ErrorCode.INTERNAL
            # Its 500 says not to retry (x-should-retry): three in a row end the worker.
            assert "retry" not in failed.message
        # The third's failure may not leave before the worker ends: the frontend
        # sends it to another worker, as it does any request of a worker that died.
        frontend.send(encode(GenerateRequest("r2", "a prompt", 4)))
        _, log = worker.communicate(timeout=10)
    finally:
        worker.kill()
        frontend.socket.close(linger=0)
        context.term()
    assert worker.returncode == 5
    assert "CRITICAL worker.serve.server: the engine failed 3 times in a row" in log
    assert "thread MainThread failed" not in log


def test_a_flood_of_connections_past_the_open_file_limit_leaves_the_worker_serving() -> None:
    """Raw TCP connections to its port (no handshake, no key needed) took every
    file it could open: its heartbeat's memory reading failed, and the worker
    ended, again and again while the flood lasted."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "MODEL_ID": "fake", "WORKER_ENDPOINT": endpoint}
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker.serve.main"], env=env, stderr=subprocess.PIPE, text=True
    )
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    frontend = Frontend(context, endpoint)
    flood: list[socket.socket] = []
    try:
        frontend.send(encode(Ping("f1")))
        frontend.receive_until(Hello, timeout_s=30)
        process = psutil.Process(worker.pid)
        limit = process.num_fds() + 8
        process.rlimit(psutil.RLIMIT_NOFILE, (limit, limit))
        host, port = endpoint.removeprefix("tcp://").split(":")
        for _ in range(3 * limit):
            flood.append(socket.create_connection((host, int(port))))
        time.sleep(1)  # heartbeats at 0.5 s, each at the limit
        for _ in range(3):
            frontend.send(encode(Ping("f1")))
            frontend.receive_until(Heartbeat, timeout_s=2)
        assert worker.poll() is None
    finally:
        for connection in flood:
            connection.close()
        worker.kill()
        _, log = worker.communicate(timeout=10)
        frontend.socket.close(linger=0)
        context.term()
    assert "Too many open files" not in log, log


# Where the kernel lets a process bind any address (ip_nonlocal_bind), every
# address is this machine's.
_BINDS_ANY_ADDRESS = Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() == "1"


@pytest.mark.skipif(_BINDS_ANY_ADDRESS, reason="this kernel binds any address")
@pytest.mark.parametrize(
    "host", ["192.0.2.1", "host.invalid"], ids=["address", "name"]
)  # TEST-NET-1 and a reserved name: no machine's own
@pytest.mark.parametrize("setting", ["worker_endpoint", "worker_bind"])
def test_an_endpoint_of_another_machine_is_refused_before_the_model_loads(
    host: str, setting: str
) -> None:
    """WORKER_ENDPOINT is where clients connect; a worker behind NAT or in a
    container cannot bind that address, and was asked, after its model loaded,
    whether another program listened there."""
    config = WorkerConfig(model_id="fake", **{setting: f"tcp://{host}:{free_port()}"})
    advice = "; set WORKER_BIND to one that is (tcp://*:PORT binds them all)"
    with pytest.raises(ConfigError, match=re.escape(f"no address of this machine{advice}")):
        check_endpoint_free(config)
    server = WorkerServer(Scheduler(FakeEngine(1), 8), config)  # the bind says the same
    with pytest.raises(ConfigError, match=re.escape(f"no address of this machine{advice}")):
        server.serve_forever()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_a_worker_serves_on_an_ipv6_address() -> None:
    """Its socket lacked ZMQ's IPV6 option: binding tcp://[::1]:PORT failed as "no
    address of this machine (No such device)", exit 78."""
    endpoint = f"tcp://[::1]:{free_port()}"
    with serving(FakeEngine(1), worker_endpoint=endpoint), zmq.Context() as context:
        client = worker_socket(context, endpoint)
        try:
            client.connect(endpoint)
            client.send(ping("test"))
            hello = wait_for_hello(client, 5.0)
        finally:
            client.close(linger=0)
    assert hello is not None and hello.model == "fake"


def test_a_taken_port_is_refused_naming_the_setting_that_gave_it() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    taken = context.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = WorkerConfig(
            model_id="fake",
            worker_endpoint="tcp://127.0.0.1:5555",
            worker_bind=f"tcp://127.0.0.1:{port}",
        )
        server = WorkerServer(Scheduler(FakeEngine(1), 8), config)
        with pytest.raises(ConfigError, match="another program listening there\\? Set WORKER_BIND"):
            server.serve_forever()
    finally:
        taken.close(linger=0)
        context.term()
