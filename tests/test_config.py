from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frontend.config import FrontendConfig
from frontend.main import check_can_listen
from protocol import GenerateRequest, Hello, encode, variables
from protocol.exit_codes import ExitCode
from protocol.limits import (
    MAX_CHAT_MESSAGES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
)
from protocol.settings import ConfigError, flag_settings, load
from protocol.wire import MAX_REQUEST_ID_CHARS
from tests.stack import free_port
from worker.launch.config import SupervisorConfig
from worker.launch.preflight import check_cpu_settings, check_worker_timing
from worker.launch.supervisor import Supervisor
from worker.serve.config import MIN_MESSAGE_BYTES, WorkerConfig


def test_defaults_are_the_documented_ones() -> None:
    worker = load(WorkerConfig, [], {})
    frontend = load(FrontendConfig, [], {})
    assert (worker.max_batch_size, worker.model_to_load, worker.max_queue_depth) == (
        8,
        "distilgpt2",
        1024,
    )
    assert frontend.max_new_tokens_limit == 512
    assert frontend.worker_endpoint == worker.worker_endpoint == "tcp://127.0.0.1:5555"


def test_environment_sets_values_and_flags_override_them() -> None:
    env = {"MAX_BATCH_SIZE": "4", "MODEL_ID": "fake"}
    assert load(WorkerConfig, [], env).max_batch_size == 4
    config = load(WorkerConfig, ["--max-batch-size", "16"], env)
    assert (config.max_batch_size, config.model_id) == (16, "fake")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-batch-size", "0"], r"MAX_BATCH_SIZE must be > 0, got 0 \(--max-batch-size sets"),
        (
            ["--max-batch-size", "x"],
            r"MAX_BATCH_SIZE must be a whole number \(int\), got 'x' \(--max-batch-size",
        ),
        (["--prefix-cache", ""], r"PREFIX_CACHE must be 1 or 0 .* \(--prefix-cache sets PREF"),
    ],
)
def test_a_bad_value_given_by_a_flag_names_the_flag(argv: list[str], message: str) -> None:
    """The variable alone sent the user looking for a setting they never made."""
    with pytest.raises(ConfigError, match=message):
        load(WorkerConfig, argv, {"MODEL_ID": "fake"})


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--endpoint", "tcp://127.0.0.1:6000"], "did you mean --worker-endpoint?"),
        (["--threads=2"], "unrecognized argument --threads: did you mean --torch-threads?"),
        # nothing close: most often another process's setting, named as such
        (["--port", "8001"], "has no such flag, but PORT is read from the environment"),
        (["--fake-step-delay-s", "1"], "but FAKE_STEP_DELAY_S is read from the environment"),
        (["--colour", "red"], "unrecognized argument --colour: not a flag of"),
        (["--", "--torch-threads", "1"], "--torch-threads: after --, which ends the flags"),
    ],
)
def test_an_unknown_flag_is_refused_naming_the_flag_likely_meant(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        load(WorkerConfig, argv, {"MODEL_ID": "fake"})
    assert refused.value.code == 2  # a usage error, as argparse's
    assert hint in capsys.readouterr().err


def test_flag_settings_are_the_variables_the_flags_set() -> None:
    argv = ["--torch-threads", "1", "--heartbeat-timeout-s", "8"]
    assert flag_settings(SupervisorConfig, argv) == {
        "TORCH_THREADS": "1",
        "HEARTBEAT_TIMEOUT_S": "8",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-batch-size", "16"],
            r"--max-batch-size: minibatch-serve has no such flag, but MAX_BATCH_SIZE is read "
            r"from the environment: set it in minibatch-serve's environment "
            r"\(`MAX_BATCH_SIZE=\.\.\. minibatch-serve`\), which the processes it starts inherit",
        ),
        (["--model-id=synthetic"], r"--model-id: .*set it in minibatch-serve's env.*MODEL_ID="),
        # Cut short, as argparse takes it from the worker; after "--" too.
        (["--max-batch", "16"], r"--max-batch: .*`MAX_BATCH_SIZE=\.\.\. minibatch-serve`"),
        (["--", "--max-batch-size", "16"], r"--max-batch-size: .*MAX_BATCH_SIZE is read"),
        # Not a flag the worker takes either.
        (["--max_batch_size", "16"], r"--max_batch_size: .*MAX_BATCH_SIZE is read"),
        (["--worker-endpoints", "tcp://127.0.0.1:5556"], "WORKER_ENDPOINTS is for a frontend"),
        # A frontend's: the variable is named as for a worker's.
        (["--api-key", "k"], r"--api-key: .*set it in minibatch-serve's env.*`API_KEY="),
        (["--prot", "8080"], r"--prot: did you mean --port\?"),
        # Its own, misspelt: not told to set a variable of that name.
        (["--worker_endpoint", "tcp://127.0.0.1:1"], r"did you mean --worker-endpoint\?"),
        (["--PORT=1"], r"--PORT: did you mean --port\?"),
        (["--colour", "1"], r"--colour: not a flag of minibatch-serve, whose --help lists"),
    ],
)
def test_minibatch_serve_refuses_another_processs_flag_saying_where_it_goes(
    argv: list[str], message: str
) -> None:
    refused = _minibatch_serve(argv)
    assert refused.returncode == 2  # a usage error, as any process's unknown flag
    assert re.search(message, refused.stderr), refused.stderr


def test_a_refusal_of_several_settings_after_loading_names_the_flags_that_set_them() -> None:
    """The checks of several settings together run after `load`, whose own
    refusals name the flags: these named only the variables, never set."""
    argv = ["--num-workers=2", "--port", "18250", "--worker-endpoint", "tcp://127.0.0.1:18250"]
    refused = _minibatch_serve(argv)
    assert refused.returncode == 78
    assert refused.stderr.rstrip().endswith(
        "(--worker-endpoint sets WORKER_ENDPOINT; --num-workers sets NUM_WORKERS; --port sets PORT)"
    ), refused.stderr


def test_minibatch_serve_help_offers_only_the_flags_it_takes() -> None:
    shown = _minibatch_serve(["--help"])
    assert shown.returncode == 0
    assert "--num-workers" in shown.stdout and "--worker-endpoints" not in shown.stdout
    assert "MAX_BATCH_SIZE=16 minibatch-serve" in " ".join(shown.stdout.split())
    # --help beside a flag it would refuse still shows the help.
    assert _minibatch_serve(["--max-batch-size", "16", "-h"]).stdout == shown.stdout


def _minibatch_serve(argv: list[str]) -> subprocess.CompletedProcess[str]:
    # Its installed command, which its messages name.
    command = [str(Path(sys.executable).with_name("minibatch-serve")), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("module", "command"),
    [
        ("worker.launch.supervisor", "minibatch-serve"),
        ("worker.serve.main", "minibatch-worker"),
        ("frontend.main", "minibatch-frontend"),
        ("worker.launch.probe", "minibatch-probe"),
        ("protocol.curve", "minibatch-keys"),
    ],
)
def test_a_process_run_as_python_m_names_itself_by_its_command(module: str, command: str) -> None:
    """argparse named the file: "main.py has no such flag... set it in main.py's
    environment" said neither which process nor what to run."""
    refused = subprocess.run(
        [sys.executable, "-m", module, "--colour", "red"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"usage: {command} "), refused.stderr
    assert ".py" not in refused.stderr


def test_a_worker_run_as_python_m_logs_under_its_modules_name(tmp_path: Path) -> None:
    """Its lines read "INFO __main__: worker told to stop", a name found nowhere
    in the code, where the installed command's read "worker.serve.main"."""
    env = {**os.environ, "MODEL_ID": "fake", "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"}
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker.serve.main"], env=env, stdout=out, stderr=out
        )
        try:
            deadline = time.monotonic() + 60
            while "serving" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            worker.send_signal(signal.SIGINT)
            worker.wait(timeout=30)
    text = log.read_text()
    assert "INFO worker.serve.main: worker told to stop (SIGINT)" in text, text
    assert "__main__" not in text


def test_a_misspelt_variable_is_named_with_the_setting_it_likely_meant_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MAX_BACTH_SIZE=4 was ignored without a word. Another process's setting (a
    shared .env), the environment's own variables and other tools' words are no
    misspellings."""
    monkeypatch.setattr(variables, "_told_misspelt", set())
    environ = {
        "MAX_BACTH_SIZE": "4",  # two letters swapped
        "model_id": "fake",  # lower case
        "WEIGHT": "int8",  # one letter short
        "HEARTBEAT_TIMEOUT": "5",  # without its unit
        "WORKER_ENDPOINTS": "tcp://a:1",  # the frontend's, one letter from WORKER_ENDPOINT
        "CURVE_CLIENT_SECRET_KEY": "k",  # the frontend's, near the worker's CURVE_CLIENT_KEYS
        "MODEL_DIR": "/models",
        "DEVICE_ID": "0",
        "PORTS": "80",
        "device": "cpu",
        "PATH": "/bin",
        "HOSTNAME": "box",
        "WORKER_PORT": "tcp://10.0.0.1:5555",  # a Kubernetes service's
    }
    with caplog.at_level(logging.WARNING, logger="protocol.variables"):
        load(WorkerConfig, [], environ)
        load(WorkerConfig, [], environ)  # a second config of the same process
        # A process a supervisor started: the supervisor told its environment's.
        load(WorkerConfig, [], {"MAX_QUEUE_DEPHT": "9", "MINIBATCH_SUPERVISOR_PID": "1"})
    assert [record.getMessage() for record in caplog.records] == [
        "HEARTBEAT_TIMEOUT is no setting, and is ignored: did you mean HEARTBEAT_TIMEOUT_S?",
        "MAX_BACTH_SIZE is no setting, and is ignored: did you mean MAX_BATCH_SIZE?",
        "WEIGHT is no setting, and is ignored: did you mean WEIGHTS?",
        "model_id is no setting, and is ignored: did you mean MODEL_ID?",
    ]


def test_a_bad_value_from_the_environment_names_no_flag() -> None:
    with pytest.raises(ConfigError) as refused:
        load(WorkerConfig, ["--model-id", "fake"], {"MAX_BATCH_SIZE": "0"})
    assert str(refused.value) == "MAX_BATCH_SIZE must be > 0, got 0"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MAX_BATCH_SIZE": "eight"}, r"MAX_BATCH_SIZE must be a whole number \(int\)"),
        ({"MAX_BATCH_SIZE": "0"}, "MAX_BATCH_SIZE must be > 0"),
        ({"WORKER_ENDPOINT": "localhost:5555"}, "WORKER_ENDPOINT must be a ZMQ endpoint"),
        ({"WORKER_ENDPOINT": "tcp://127.0.0.1:99999"}, "WORKER_ENDPOINT must end in a port from"),
        ({"WORKER_ENDPOINT": "tcp://127.0.0.1"}, "WORKER_ENDPOINT must end in a port from"),
        ({"WORKER_BIND": "tcp://*:0"}, "WORKER_BIND must end in a port from 1 to 65535"),
        ({"WORKER_BIND": "tcp://*:*"}, "WORKER_BIND must end in a port from 1 to 65535"),
        ({"WORKER_BIND": "tcp://[::1]"}, "WORKER_BIND must end in a port from 1 to 65535"),
        ({"MAX_MESSAGE_BYTES": "200"}, "MAX_MESSAGE_BYTES must be at least 262,144"),
        ({"MAX_MESSAGE_BYTES": "0"}, "MAX_MESSAGE_BYTES must be at least 262,144"),
        ({"DTYPE": "float8"}, "DTYPE must be"),
        ({"DEVICE": "tpu"}, "DEVICE must be"),
        ({"HEARTBEAT_INTERVAL_S": "nan"}, "HEARTBEAT_INTERVAL_S must be a finite number"),
        ({"MAX_QUEUE_DEPTH": "9" * 23}, "MAX_QUEUE_DEPTH must be a finite number of at most"),
        ({"TORCH_THREADS": "-1"}, "TORCH_THREADS must be 0 .every core. to"),
        ({"HEARTBEAT_INTERVAL_S": "0"}, "HEARTBEAT_INTERVAL_S must be at least 0.01 s"),
        ({"TORCH_THREADS": "40000"}, "TORCH_THREADS must be 0 .every core. to"),
        # Empty read as off turned off, without a word, what is on by default.
        ({"PREFIX_CACHE": ""}, "PREFIX_CACHE must be 1 or 0 .* got ''; unset it for the default"),
        ({"PREFIX_CACHE": "maybe"}, "PREFIX_CACHE must be 1 or 0 .true or false, yes or no"),
        ({"CURVE_SERVER_SECRET_KEY": ""}, "CURVE_SERVER_SECRET_KEY is set but empty"),
        ({"STOP_GRACE_S": "-1"}, "STOP_GRACE_S must be >= 0"),
    ],
)
def test_a_bad_worker_value_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(WorkerConfig, [], env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PORT": "99999"}, "PORT must be at most 65535"),
        ({"WORKER_ENDPOINT": "tcp://worker:65536"}, "WORKER_ENDPOINT must end in a port from"),
        (
            {"WORKER_ENDPOINTS": "tcp://10.0.0.5:5555,tcp://10.0.0.6:70000"},
            "WORKER_ENDPOINTS must end in a port from 1 to 65535, .* got 'tcp://10.0.0.6:70000'",
        ),
        ({"WORKER_ENDPOINTS": "tcp://10.0.0.5"}, "WORKER_ENDPOINTS must end in a port from"),
        ({"WORKER_ENDPOINTS": "10.0.0.5:5555"}, "WORKER_ENDPOINTS must be a ZMQ endpoint"),
        ({"MAX_NEW_TOKENS_LIMIT": "-1"}, "MAX_NEW_TOKENS_LIMIT must be > 0"),
        ({"REQUEST_TIMEOUT_S": "soon"}, r"REQUEST_TIMEOUT_S must be a number \(float\)"),
        ({"REQUEST_TIMEOUT_S": "nan"}, "REQUEST_TIMEOUT_S must be a finite number"),
        ({"HEARTBEAT_TIMEOUT_S": "inf"}, "HEARTBEAT_TIMEOUT_S must be a finite number"),
        ({"MAX_NEW_TOKENS_LIMIT": "1e30"}, r"MAX_NEW_TOKENS_LIMIT must be a whole number \(int\)"),
        ({"MAX_NEW_TOKENS_LIMIT": str(2**31)}, "MAX_NEW_TOKENS_LIMIT must be a finite number"),
        ({"HOST": ""}, "HOST must not be empty"),
        ({"MAX_REQUEST_BYTES": "10"}, "MAX_REQUEST_BYTES must be at least 65,536"),
        ({"API_KEY": ""}, "API_KEY is set but empty, which would turn off what it guards"),
        ({"API_KEY": " "}, "API_KEY .1 characters. must be printable ASCII"),
        ({"API_KEY": "sk-key\n"}, "API_KEY .7 characters. must be printable ASCII"),
        ({"API_KEY": "clé"}, "API_KEY .3 characters. must be printable ASCII"),
        ({"WORKER_ENDPOINTS": ","}, "WORKER_ENDPOINTS=',' has an empty entry"),
        ({"WORKER_ENDPOINTS": "tcp://a:1,,tcp://b:1"}, "WORKER_ENDPOINTS=.* has an empty entry"),
        ({"PING_INTERVAL_S": "1e-9"}, "PING_INTERVAL_S must be at least 0.01 s"),
        ({"WORKER_RESOLVE_INTERVAL_S": "0.001"}, "WORKER_RESOLVE_INTERVAL_S must be at least"),
        ({"WORKER_ENDPOINT": "ipc:///tmp/" + "a" * 120}, "names a socket path of 125 bytes"),
        # Where a worker binds, which a connect refused as "Invalid argument" forever.
        (
            {"WORKER_ENDPOINT": "tcp://*:5555"},
            r"WORKER_ENDPOINT=tcp://\*:5555 is where a worker binds, on every address; "
            "connect to one of them, such as tcp://127.0.0.1:5555",
        ),
        ({"WORKER_ENDPOINTS": "tcp://a:1,tcp://*:2"}, r"WORKER_ENDPOINTS=tcp://\*:2 is where"),
    ],
)
def test_a_bad_frontend_value_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(FrontendConfig, [], env)


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://*:5555", "tcp://0.0.0.0:1", "tcp://[::1]:65535", "ipc:///tmp/worker"],
)
def test_every_endpoint_form_in_use_is_taken(endpoint: str) -> None:
    worker = load(WorkerConfig, [], {"WORKER_BIND": endpoint})
    assert worker.listen_endpoint == endpoint
    if not endpoint.startswith("tcp://*"):  # a client cannot connect to a wildcard
        frontend = load(FrontendConfig, [], {"WORKER_ENDPOINTS": f"tcp://worker:5555,{endpoint}"})
        assert frontend.endpoints == ["tcp://worker:5555", endpoint]


def test_the_smallest_max_message_bytes_holds_any_request_but_a_long_prompt() -> None:
    wide = "\U0001f600"  # 4 bytes in UTF-8
    every_field_at_its_limit = GenerateRequest(
        wide * MAX_REQUEST_ID_CHARS,
        "",
        2**31 - 1,
        stop_token_ids=[MAX_TOKEN_ID] * MAX_STOP_TOKEN_IDS,
        stop=[wide * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        seed=MAX_SEED,
        logit_bias_token_ids=[MAX_TOKEN_ID] * MAX_LOGIT_BIAS,
        logit_bias_values=[-100.0] * MAX_LOGIT_BIAS,
        chat_roles=["assistant"] * MAX_CHAT_MESSAGES,
        chat_contents=[""] * MAX_CHAT_MESSAGES,
        grammar_kind="json_schema",
        grammar=wide * MAX_GRAMMAR_CHARS,
    )
    assert len(encode(every_field_at_its_limit)) + 100 * 1024 <= MIN_MESSAGE_BYTES
    config = load(WorkerConfig, [], {"MAX_MESSAGE_BYTES": str(MIN_MESSAGE_BYTES)})
    assert config.max_message_bytes == MIN_MESSAGE_BYTES


def test_http_limits_default_to_the_documented_values() -> None:
    config = load(FrontendConfig, [], {})
    assert config.max_request_bytes == 1024 * 1024
    assert (config.body_timeout_s, config.header_timeout_s) == (30.0, 10.0)
    assert (config.keep_alive_timeout_s, config.max_connections) == (5, 2048)
    assert config.api_key == ""


def test_the_api_key_stays_out_of_the_config_repr() -> None:
    config = load(FrontendConfig, [], {"API_KEY": "sk-secret"})
    assert config.api_key == "sk-secret"
    assert "sk-secret" not in repr(config)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TORCH_THREADS": "40000"}, "TORCH_THREADS must be 0 .every core. to"),
        ({"NUM_WORKERS": "100000"}, "NUM_WORKERS must be at most 64"),
        ({"WORKER_ENDPOINT": "tcp://*:18170"}, r"WORKER_ENDPOINT=tcp://\*:18170 is where a"),
        ({"PORT": "0"}, "PORT must be > 0"),  # was left to the frontend, once started
        ({"NUM_FRONTENDS": "65"}, "NUM_FRONTENDS must be at most 64"),
        (
            {"RESTART_BACKOFF_S": "5", "RESTART_BACKOFF_MAX_S": "0.1"},
            "RESTART_BACKOFF_MAX_S=0.1 is below RESTART_BACKOFF_S=5",
        ),
        ({"PORT": "65535", "NUM_FRONTENDS": "2"}, "takes ports up to 65536, past 65535"),
        (
            {"WORKER_ENDPOINT": "tcp://127.0.0.1:65535", "NUM_WORKERS": "2"},
            "NUM_WORKERS=2 takes ports up to 65536, past 65535",
        ),
        (
            {"WORKER_ENDPOINT": "ipc:///tmp/" + "a" * 101, "NUM_WORKERS": "2"},
            "makes socket paths such as ipc:///tmp/a+-1, longer than the system's 107 bytes",
        ),
    ],
)
def test_a_bad_supervisor_value_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Supervisor(load(SupervisorConfig, [], env))


def _hello(heartbeat_interval_s: float, frontend_timeout_s: float) -> Hello:
    return Hello(
        "w",
        "fake",
        False,
        1,
        1024,
        16,
        1 << 20,
        heartbeat_interval_s=heartbeat_interval_s,
        frontend_timeout_s=frontend_timeout_s,
    )


@pytest.mark.parametrize(
    ("env", "hello", "problem"),
    [
        ({}, _hello(0.5, 10), None),  # the defaults
        ({"HEARTBEAT_TIMEOUT_S": "0.2"}, _hello(0.5, 10), "raise HEARTBEAT_TIMEOUT_S"),
        ({"PING_INTERVAL_S": "15"}, _hello(0.5, 10), "lower PING_INTERVAL_S"),
        ({"PING_INTERVAL_S": "15"}, _hello(0.5, 0), None),  # a worker that does not say
        ({"STEP_TIMEOUT_S": "0.6"}, _hello(0.5, 10), "raise STEP_TIMEOUT_S"),
    ],
)
def test_a_client_whose_timing_cannot_work_with_the_workers_is_told_what_to_change(
    env: dict[str, str], hello: Hello, problem: str | None
) -> None:
    problems = load(FrontendConfig, [], env).timing_problems(
        hello.heartbeat_interval_s, hello.frontend_timeout_s
    )
    assert problems == [] if problem is None else problem in problems[0]


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({}, None),
        ({"HEARTBEAT_TIMEOUT_S": "0.2"}, "raise HEARTBEAT_TIMEOUT_S"),
        ({"HEARTBEAT_INTERVAL_S": "3"}, "raise HEARTBEAT_TIMEOUT_S"),  # twice is 6 > 5
        ({"PING_INTERVAL_S": "15"}, "lower PING_INTERVAL_S"),
        ({"FRONTEND_TIMEOUT_S": "0.5"}, "lower PING_INTERVAL_S"),
        ({"STOP_GRACE_S": "3"}, None),
        ({"STOP_GRACE_S": "3.5"}, "lower STOP_GRACE_S"),  # its hand-back comes too late
        # An idle worker was killed as hung between heartbeats, a crash loop in 5 s.
        ({"STEP_TIMEOUT_S": "0.1"}, "raise STEP_TIMEOUT_S"),
        # Wrong in itself: the worker refuses it, naming it (test_restarts).
        ({"HEARTBEAT_TIMEOUT_S": "0.2", "MAX_BATCH_SIZE": "0"}, None),
    ],
)
def test_the_supervisor_refuses_timing_that_would_declare_live_workers_dead(
    env: dict[str, str], problem: str | None
) -> None:
    config = load(SupervisorConfig, [], env)
    if problem is None:
        check_worker_timing(config, env)
    else:
        with pytest.raises(ConfigError, match=problem):
            check_worker_timing(config, env)


def test_the_supervisor_refuses_a_kernel_isa_before_it_starts_anything() -> None:
    """The worker refused it, but 10 to 16 s after the frontend had come up."""
    started = time.monotonic()
    refused = subprocess.run(
        [str(Path(sys.executable).with_name("minibatch-serve"))],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PORT": str(free_port()), "MODEL_ID": "synthetic", "KERNEL_ISA": "avx9"},
    )
    assert refused.returncode == ExitCode.CONFIG_ERROR, refused.stderr
    assert "KERNEL_ISA=avx9 is not one of avx512_vnni" in refused.stderr
    assert "Uvicorn running" not in refused.stderr and time.monotonic() - started < 10


@pytest.mark.parametrize(
    "env",
    [
        {"KERNEL_ISA": "avx9", "MODEL_ID": "fake"},  # the fake engine has no kernels
        {"KERNEL_ISA": "avx9", "DEVICE": "cuda"},
        {"ATEN_CPU_CAPABILITY": "avx9"},  # torch ignores what it does not know
    ],
)
def test_cpu_settings_a_worker_would_not_use_are_left_to_it(env: dict[str, str]) -> None:
    check_cpu_settings(env)


def test_a_kernel_isa_on_a_host_with_a_gpu_is_left_to_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With DEVICE unset, a worker there may run on the GPU and read no KERNEL_ISA:
    a stray one, passed through by docker-compose.yml, would stop the stack."""
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/nvidiactl")
    check_cpu_settings({"KERNEL_ISA": "avx9"})
    with pytest.raises(ConfigError, match="KERNEL_ISA=avx9 is not one of"):
        check_cpu_settings({"KERNEL_ISA": "avx9", "DEVICE": "cpu"})


@pytest.mark.parametrize("host", ["a" * 64, "nowhere.invalid"])
def test_a_host_that_names_no_address_is_refused_naming_host(host: str) -> None:
    """A label past 63 characters failed IDNA encoding, a UnicodeError that went
    past the check: the supervisor took the frontend's traceback for a crash."""
    with pytest.raises(ConfigError, match="is not an address to listen on") as refused:
        check_can_listen(host, 18999)
    assert "set HOST to an address" in str(refused.value)
