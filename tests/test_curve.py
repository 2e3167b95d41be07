"""With CURVE on, only clients holding an allowed key can talk to the worker."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq

from bench import path_latency
from bench.stack import REPO_ROOT
from bench.zmq_load import client_keys
from frontend.config import FrontendConfig
from protocol import GenerateRequest, Ping, encode
from protocol.curve import ClientKeys, _AllowedKeys, main, secure_client
from protocol.settings import ConfigError, load
from tests.stack import running_stack, stack_env
from worker.engine.fake_engine import expected_text
from worker.launch.probe import ProbeFailed, probe
from worker.serve.config import WorkerConfig


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    assert main([str(directory)]) == 0
    return directory


def curve_env(keys: Path) -> dict[str, str]:
    return {
        "CURVE_SERVER_SECRET_KEY": str(keys / "worker.key_secret"),
        "CURVE_CLIENT_KEYS": str(keys / "client.key"),
        "CURVE_SERVER_PUBLIC_KEY": str(keys / "worker.key"),
        "CURVE_CLIENT_SECRET_KEY": str(keys / "client.key_secret"),
    }


def test_with_the_right_keys_the_frontend_supervisor_and_probe_reach_the_worker(
    tmp_path: Path, keys: Path
) -> None:
    # The supervisor kills a worker it has not heard say hello by this deadline.
    overrides = {**curve_env(keys), "WORKER_START_TIMEOUT_S": "3"}
    started = time.monotonic()
    with running_stack(tmp_path, overrides) as stack:
        live = stack.wait_live()
        body = {"prompt": "secret", "max_new_tokens": 4}
        response = httpx.post(f"{stack.url}/generate", json=body, timeout=30)
        assert response.json()["text"] == expected_text("secret", 4)
        curve = load(FrontendConfig, [], stack.env).curve
        with zmq.Context() as context:
            hello = probe(stack.env["WORKER_ENDPOINT"], 5, context, curve)
        assert hello.instance_id == live["instance_id"]
        time.sleep(max(0.0, started + 4 - time.monotonic()))
        assert stack.wait_live()["instance_id"] == live["instance_id"]
        log = stack.log("supervisor")
        assert "killing worker" not in log
        assert "(capacity 8; CURVE on; client keys allowed: 1)" in log
        assert "CURVE is on: workers are reached with the key in CURVE_CLIENT_SECRET_KEY" in log


def test_the_benchmarks_zmq_clients_take_the_environments_keys(
    tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench.path_latency connected without them: it waited 10 s for a hello, then raised."""
    with running_stack(tmp_path, curve_env(keys), supervised=False) as stack:
        stack.wait_live()
        for name, value in curve_env(keys).items():
            monkeypatch.setenv(name, value)
        with zmq.Context() as context:
            endpoint = stack.env["WORKER_ENDPOINT"]
            socket = path_latency.connect_worker(context, endpoint, client_keys())
            assert path_latency.zmq_overhead_ms(socket, max_new_tokens=2) > 0
            socket.close()


def test_a_peer_without_an_allowed_key_gets_nothing_and_the_worker_serves_on(
    tmp_path: Path, keys: Path
) -> None:
    with running_stack(tmp_path, curve_env(keys), supervised=False) as stack:
        stack.wait_live()
        endpoint = stack.env["WORKER_ENDPOINT"]
        curve = load(FrontendConfig, [], stack.env).curve
        assert curve is not None
        server_public_key = curve.server_public_key
        _, stranger_secret_key = zmq.curve_keypair()
        with zmq.Context() as context:
            for stranger in (None, ClientKeys(server_public_key, stranger_secret_key)):
                with context.socket(zmq.DEALER) as socket:
                    socket.setsockopt(zmq.LINGER, 0)
                    secure_client(socket, stranger)
                    socket.connect(endpoint)
                    # Not blocking: once the worker has refused the handshake, the
                    # socket has no connection left to queue a message on.
                    with contextlib.suppress(zmq.Again):
                        socket.send(encode(Ping("stranger")), zmq.NOBLOCK)
                        request = GenerateRequest("stranger-1", "hi", max_new_tokens=2)
                        socket.send(encode(request), zmq.NOBLOCK)
                    assert not socket.poll(1500), "the worker answered a stranger"
            # Each at once, saying what to set, rather than after its timeout.
            started = time.monotonic()
            with pytest.raises(ProbeFailed, match=r"no Hello.*CURVE is on at one end only"):
                probe(endpoint, 30, context)
            stranger = ClientKeys(server_public_key, stranger_secret_key)
            with pytest.raises(ProbeFailed, match=r"does not allow this client's CURVE key"):
                probe(endpoint, 30, context, stranger)
            # An allowed client that holds another worker's public key.
            other_worker_public_key, _ = zmq.curve_keypair()
            misled = ClientKeys(other_worker_public_key, curve.secret_key)
            with pytest.raises(ProbeFailed, match=r"CURVE_SERVER_PUBLIC_KEY is not that worker's"):
                probe(endpoint, 30, context, misled)
            assert time.monotonic() - started < 15
        assert "refused a CURVE client" in stack.log("worker")
        body = {"prompt": "still serving", "max_new_tokens": 3}
        response = httpx.post(f"{stack.url}/generate", json=body, timeout=30)
        assert response.json()["text"] == expected_text("still serving", 3)
        assert stack.processes["worker"].poll() is None


def test_a_frontend_refused_at_first_reaches_the_worker_restarted_with_its_key(
    tmp_path: Path, keys: Path
) -> None:
    other_keys = tmp_path / "other"
    assert main([str(other_keys)]) == 0
    overrides = {**curve_env(keys), "CURVE_CLIENT_KEYS": str(other_keys / "client.key")}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_until(
            lambda: "refused this frontend's handshake" in stack.log("frontend"),
            "the frontend to report the refusal",
        )
        assert "CURVE_CLIENT_KEYS" in stack.log("frontend")
        # /health says why, and the refusals are no deaths of a worker never live.
        health = stack.health().json()
        assert health["status"] != "ok"
        assert "does not allow this client's CURVE key" in health["workers"][0]["reason"]
        time.sleep(4)  # two more tries, 1 s and then 2 s after the first
        assert "declared dead" not in stack.log("frontend")
        stack.kill("worker")
        stack.env["CURVE_CLIENT_KEYS"] = str(keys / "client.key")
        stack.start("worker", "worker.serve.main")
        stack.wait_live(timeout_s=20)
        body = {"prompt": "let in", "max_new_tokens": 3}
        response = httpx.post(f"{stack.url}/generate", json=body, timeout=30)
        assert response.json()["text"] == expected_text("let in", 3)
        assert stack.log("frontend").count("refused this frontend's handshake") == 1


def test_a_worker_restarted_with_another_key_is_one_death_and_health_says_why(
    tmp_path: Path, keys: Path
) -> None:
    """It was live, then its replacement refused this frontend's key: every retry
    logged the worker "declared dead" again, and /health said only that its
    connection closed."""
    other_keys = tmp_path / "other"
    assert main([str(other_keys)]) == 0
    with running_stack(tmp_path, curve_env(keys), supervised=False) as stack:
        stack.wait_live()
        stack.kill("worker")
        stack.env["CURVE_CLIENT_KEYS"] = str(other_keys / "client.key")
        stack.start("worker", "worker.serve.main")
        stack.wait_until(
            lambda: "refused this frontend's handshake" in stack.log("frontend"),
            "the frontend to report the refusal",
        )
        reason = stack.health().json()["workers"][0]["reason"]
        assert "does not allow this client's CURVE key" in reason
        time.sleep(4)  # two more tries, 1 s and then 2 s after the first
        assert stack.log("frontend").count("declared dead") == 1


@pytest.mark.parametrize(
    ("module", "given", "missing"),
    [
        ("worker.serve.main", "CURVE_SERVER_SECRET_KEY", "CURVE_CLIENT_KEYS"),
        ("frontend.main", "CURVE_CLIENT_SECRET_KEY", "CURVE_SERVER_PUBLIC_KEY"),
    ],
)
def test_half_a_curve_configuration_is_refused_at_start(
    keys: Path, module: str, given: str, missing: str
) -> None:
    env = stack_env({given: curve_env(keys)[given]})
    result = subprocess.run(
        [sys.executable, "-m", module], env=env, cwd=REPO_ROOT, capture_output=True, timeout=30
    )
    assert result.returncode != 0
    assert f"{missing} is unset or empty, but {given} is set" in result.stderr.decode()


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("CURVE_CLIENT_KEYS", "{keys}/nobody.key", "no certificate file at"),
        ("CURVE_CLIENT_KEYS", "{keys}/empty", "holds no .key certificate files"),
        ("CURVE_CLIENT_KEYS", "short", "the value is 5 characters, not 40"),
        ("CURVE_SERVER_SECRET_KEY", "{keys}/worker.key", "holds only a public key"),
        ("CURVE_SERVER_SECRET_KEY", "~" * 40, "characters outside the Z85 alphabet"),
        (
            "CURVE_SERVER_SECRET_KEY",
            "{keys}/bad/short.key_secret",
            "the secret key in the certificate .*/short.key_secret is 3 characters, not 40",
        ),
        (
            "CURVE_SERVER_SECRET_KEY",
            "{keys}/bad/short.key",
            "the public key in the certificate .*/short.key is 3 characters",
        ),
        ("CURVE_CLIENT_KEYS", "{keys}/bad/short.key", "the public key in the certificate"),
        ("CURVE_CLIENT_KEYS", "{keys}/client.key,{keys}/bad/tilde.key", "outside the Z85 alphabet"),
        ("CURVE_CLIENT_KEYS", "{keys}/bad", "the public key in the certificate .*/bad/short.key"),
    ],
)
def test_a_bad_key_setting_is_refused_naming_its_variable(
    keys: Path, setting: str, value: str, message: str
) -> None:
    (keys / "empty").mkdir()
    write_malformed_certificates(keys / "bad")
    env = {
        "CURVE_SERVER_SECRET_KEY": str(keys / "worker.key_secret"),
        "CURVE_CLIENT_KEYS": str(keys / "client.key"),
        setting: value.format(keys=keys),
    }
    with pytest.raises(ConfigError, match=f"^{setting}: .*{message}"):
        load(WorkerConfig, [], env)


@pytest.mark.parametrize(
    ("setting", "file"),
    [("CURVE_SERVER_PUBLIC_KEY", "short.key"), ("CURVE_CLIENT_SECRET_KEY", "short.key_secret")],
)
def test_a_malformed_key_file_stops_a_client_at_start(keys: Path, setting: str, file: str) -> None:
    write_malformed_certificates(keys / "bad")
    env = {
        "CURVE_SERVER_PUBLIC_KEY": str(keys / "worker.key"),
        "CURVE_CLIENT_SECRET_KEY": str(keys / "client.key_secret"),
        setting: str(keys / "bad" / file),
    }
    with pytest.raises(ConfigError, match=f"^{setting}: the .* key in the certificate .*/{file} "):
        load(FrontendConfig, [], env)


def write_malformed_certificates(directory: Path) -> None:
    """short.key, whose public key is 3 characters; short.key_secret, whose public
    key is sound and secret key 3 characters; tilde.key, whose public key is 40
    characters outside the Z85 alphabet."""
    directory.mkdir()
    (directory / "short.key").write_text('curve\n    public-key = "abc"\n')
    (directory / "short.key_secret").write_text(
        f'curve\n    public-key = "{"x" * 40}"\n    secret-key = "abc"\n'
    )
    (directory / "tilde.key").write_text(f'curve\n    public-key = "{"~" * 40}"\n')


def test_keys_may_be_z85_strings_and_a_directory_of_public_keys(keys: Path) -> None:
    public_key = (keys / "client.key").read_text().split('public-key = "')[1][:40]
    by_value = load(
        WorkerConfig, [], {"CURVE_SERVER_SECRET_KEY": "x" * 40, "CURVE_CLIENT_KEYS": public_key}
    )
    by_directory = load(
        WorkerConfig, [], {"CURVE_SERVER_SECRET_KEY": "x" * 40, "CURVE_CLIENT_KEYS": str(keys)}
    )
    assert by_value.curve is not None and by_directory.curve is not None
    assert public_key.encode() in by_value.curve.client_public_keys
    assert by_value.curve.client_public_keys < by_directory.curve.client_public_keys


def test_minibatch_keys_never_overwrites_keys(keys: Path) -> None:
    before = (keys / "worker.key_secret").read_bytes()
    assert main([str(keys)]) == 1
    assert (keys / "worker.key_secret").read_bytes() == before


def test_a_worker_with_curve_on_still_stops_at_once_on_sigterm(tmp_path: Path, keys: Path) -> None:
    # Its authenticator thread must go first: the ZMQ context waits for it otherwise.
    with running_stack(tmp_path, curve_env(keys), supervised=False, start=("worker",)) as stack:
        curve = load(FrontendConfig, [], stack.env).curve
        with zmq.Context() as context:
            probe(stack.env["WORKER_ENDPOINT"], 10, context, curve)
        worker = stack.processes["worker"]
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=5) == 0


def test_refused_handshakes_are_logged_at_most_once_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """15,000 handshakes with random keys wrote 2 MB of warnings in 40 s."""
    allowed = _AllowedKeys(frozenset({zmq.curve_keypair()[0]}))
    with caplog.at_level(logging.WARNING):
        for _ in range(200):
            assert not allowed.callback("*", zmq.curve_keypair()[0])
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("refused a CURVE client whose public key")
