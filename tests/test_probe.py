"""`minibatch-probe` against a stand-in worker (`tests.stand_in_worker`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from protocol import Heartbeat, encode
from tests.stack import free_port
from tests.stand_in_worker import StandInWorker, stand_in_hello
from worker.launch.probe import ProbeFailed, local_endpoint, main, probe
from worker.serve.config import WorkerConfig

REPO_ROOT = Path(__file__).resolve().parent.parent

HELLO = stand_in_hello(instance_id="stand-in-1", capacity=4)


@pytest.fixture
def stand_in(request: pytest.FixtureRequest) -> Iterator[StandInWorker]:
    """A stand-in worker that answers the first ping with ``request.param``'s frames."""
    with StandInWorker(lambda request: [], capacity=4, greeting=request.param) as worker:
        yield worker


@pytest.mark.parametrize("stand_in", [[encode(HELLO)]], indirect=True)
@pytest.mark.parametrize("flag", ["--worker-endpoint", "--endpoint"])
def test_hello_from_worker_exits_0(
    stand_in: StandInWorker, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--worker-endpoint as every other process names it; --endpoint as before."""
    assert main([flag, stand_in.endpoint, "--timeout-s", "5"]) == 0
    assert len(stand_in.pings) == 1
    assert stand_in.pings[0].frontend_id.startswith("probe-")
    out = capsys.readouterr().out
    assert f"worker ok at {stand_in.endpoint}" in out
    assert "model fake" in out


HEARTBEAT = Heartbeat(instance_id="stand-in-1", num_steps=3, num_queued=0, num_active=0)


@pytest.mark.parametrize("stand_in", [[encode(HEARTBEAT), encode(HELLO)]], indirect=True)
def test_heartbeat_before_hello_is_skipped(stand_in: StandInWorker) -> None:
    assert main(["--endpoint", stand_in.endpoint, "--timeout-s", "5"]) == 0


@pytest.mark.parametrize("stand_in", [[encode(HEARTBEAT)]], indirect=True)
def test_heartbeat_alone_is_not_health(
    stand_in: StandInWorker, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--endpoint", stand_in.endpoint, "--timeout-s", "0.5"]) == 1
    assert "no Hello from a worker" in capsys.readouterr().err


OTHER_VERSION_HELLO = msgpack.packb({"v": 999, "type": "hello", "instance_id": "x"})


@pytest.mark.parametrize("stand_in", [[OTHER_VERSION_HELLO]], indirect=True)
def test_worker_of_another_protocol_version_exits_1(
    stand_in: StandInWorker, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--endpoint", stand_in.endpoint, "--timeout-s", "5"]) == 1
    assert "the peer speaks protocol version 999" in capsys.readouterr().err


def test_no_worker_exits_1_quickly() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # not the ephemeral range's: no self-connect
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "worker.launch.probe", "--endpoint", endpoint, "--timeout-s", "1"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    elapsed_s = time.monotonic() - started
    assert completed.returncode == 1
    assert f"no Hello from a worker at {endpoint} within 1s" in completed.stderr
    assert elapsed_s < 10, f"probe took {elapsed_s:.1f}s to give up"


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://no-port-here", "--worker-endpoint must end in a port from 1 to 65535"),
        ("localhost:5555", "--worker-endpoint must be a ZMQ endpoint such as tcp://127.0.0.1:5555"),
        (
            "tcp://*:5555",
            "where a worker binds, on every address; connect to one of them, such as tcp://127.0.0.1:5555",
        ),
        ("ipc://", "--worker-endpoint names no socket path"),
    ],
)
def test_a_malformed_endpoint_exits_2_saying_what_an_endpoint_is(
    endpoint: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An argument it cannot use (exit 2, as its --help says), in the words every
    process uses for WORKER_ENDPOINT; it was a connect's 'Invalid argument', exit 1."""
    with pytest.raises(SystemExit) as exited:
        main(["--endpoint", endpoint, "--timeout-s", "1"])
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bind", "endpoint", "expected"),
    [
        ("tcp://*:5555", "tcp://worker:5555", "tcp://127.0.0.1:5555"),
        ("tcp://0.0.0.0:6000", "tcp://worker:5555", "tcp://127.0.0.1:6000"),
        ("", "tcp://127.0.0.1:7000", "tcp://127.0.0.1:7000"),
        ("ipc:///tmp/worker.sock", "tcp://worker:5555", "ipc:///tmp/worker.sock"),
    ],
)
def test_default_endpoint_is_the_workers_own_bind_on_loopback(
    bind: str, endpoint: str, expected: str
) -> None:
    assert local_endpoint(WorkerConfig(worker_endpoint=endpoint, worker_bind=bind)) == expected


@pytest.mark.parametrize("stand_in", [[encode(HELLO)]], indirect=True)
def test_endpoint_defaults_to_worker_environment(
    stand_in: StandInWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_ENDPOINT", "tcp://worker:5555")
    monkeypatch.setenv("WORKER_BIND", stand_in.endpoint.replace("127.0.0.1", "*"))
    assert main(["--timeout-s", "5"]) == 0


class _HandshakeFailsBeforeSend(zmq.Socket[bytes]):
    """A socket whose ``connect`` returns only after the worker has refused its
    handshake (as the probe's own monitor shows, left unread): the order a busy
    machine can produce between the probe's connect and its send. libzmq then
    drops the connection's pipe, and a DEALER without a pipe blocks in ``send``."""

    watch: zmq.Socket[bytes] | None = None  # declared: pyzmq takes others for options

    def get_monitor_socket(self, *args: Any, **kwargs: Any) -> zmq.Socket[bytes]:
        self.watch = super().get_monitor_socket(*args, **kwargs)
        return self.watch

    def connect(self, addr: str) -> None:  # type: ignore[override]
        super().connect(addr)
        if self.type != zmq.DEALER:
            return  # the monitor's own socket, of this class too
        assert self.watch is not None and self.watch.poll(5000), "the handshake did not fail"
        self.getsockopt(zmq.EVENTS)  # lets the socket see its pipe go


class _HandshakeFailsBeforeSendContext(zmq.Context[zmq.Socket[bytes]]):
    _socket_class = _HandshakeFailsBeforeSend


@pytest.mark.timeout(30)
def test_a_refused_handshake_before_the_ping_fails_the_probe_instead_of_hanging() -> None:
    _, secret_key = zmq.curve_keypair()
    with zmq.Context() as context, context.socket(zmq.ROUTER) as curve_worker:
        curve_worker.setsockopt(zmq.LINGER, 0)
        curve_worker.setsockopt(zmq.CURVE_SERVER, 1)
        curve_worker.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
        port = curve_worker.bind_to_random_port("tcp://127.0.0.1")
        # A plain probe against a CURVE worker: the mechanisms differ.
        with (
            _HandshakeFailsBeforeSendContext() as probe_context,
            pytest.raises(ProbeFailed, match="no Hello"),
        ):
            probe(f"tcp://127.0.0.1:{port}", 1, probe_context)
