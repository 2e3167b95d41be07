"""A frontend told to stop (SIGTERM) lets its requests go on while a worker is
live, for uvicorn's graceful-shutdown timeout; what is left is answered, a 503
to retry elsewhere or a stream's error event, never a connection cut."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from frontend.main import GRACEFUL_SHUTDOWN_S
from protocol.stop_timing import FRONTEND_ANSWERS_LEFT_BEFORE_S
from tests.sse import sse_events
from tests.stack import Stack, free_port, running_stack

STEP_DELAY_S = 0.05
CAPACITY = 2
SHORT = 20  # tokens: 1 s of generation
LONG = 400  # tokens: 20 s, longer than the grace
OVERRIDES = {"FAKE_STEP_DELAY_S": str(STEP_DELAY_S), "MAX_BATCH_SIZE": str(CAPACITY)}

Events = list[tuple[str | None, str]]


class Background:
    """A call on a thread of its own, and what it returned."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.answer: Any = None
        self._thread = threading.Thread(target=self._run, args=(call,))
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        self.answer = call()

    def result(self) -> Any:
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "no answer within 30 s"
        return self.answer


def _stream(stack: Stack, num_tokens: int) -> Events:
    body = {"prompt": "stream", "max_new_tokens": num_tokens, "stream": True}
    with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=30) as response:
        return list(sse_events(response))


def _plain(stack: Stack, num_tokens: int) -> httpx.Response:
    body = {"prompt": "plain", "max_new_tokens": num_tokens}
    return httpx.post(f"{stack.url}/generate", json=body, timeout=30)


def _error_code(events: Events) -> str | None:
    event, data = events[-1]
    return str(json.loads(data)["error"]["code"]) if event == "error" else None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stopping_frontend_finishes_what_runs_and_what_waits(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """As minibatch-serve stops: the frontends first, their workers still live.
    SIGHUP (a closed terminal) stops it the same way; it cut every request."""
    with running_stack(tmp_path, OVERRIDES, supervised=False) as stack:
        stack.wait_live()
        streams = [Background(lambda: _stream(stack, SHORT)) for _ in range(CAPACITY)]
        stack.wait_for_health("running", lambda h: h["active"] == CAPACITY)
        waiting = [Background(lambda: _plain(stack, SHORT)) for _ in range(2)]
        stack.wait_for_health("waiting", lambda h: h["queued"] == 2)
        stack.processes["frontend"].send_signal(sig)
        for stream in streams:
            events = stream.result()
            assert [event for event, _ in events].count("token") == SHORT
            assert events[-1][0] == "done", events[-1]
        for plain in waiting:
            assert plain.result().status_code == 200, plain.result().text
        stack.processes["frontend"].wait(timeout=GRACEFUL_SHUTDOWN_S)


def _long_streams_and_one_waiting(stack: Stack) -> tuple[list[Background], Background]:
    """Every slot streaming longer than a stop's grace, and a plain request queued."""
    streams = [Background(lambda: _stream(stack, LONG)) for _ in range(CAPACITY)]
    stack.wait_for_health("running", lambda h: h["active"] == CAPACITY)
    waiting = Background(lambda: _plain(stack, LONG))
    stack.wait_for_health("waiting", lambda h: h["queued"] == 1)
    return streams, waiting


def test_what_is_left_when_the_grace_ends_is_answered_not_cut(tmp_path: Path) -> None:
    with running_stack(tmp_path, OVERRIDES, supervised=False) as stack:
        stack.wait_live()
        streams, waiting = _long_streams_and_one_waiting(stack)
        stopped_at = time.monotonic()
        stack.processes["frontend"].send_signal(signal.SIGTERM)
        for stream in streams:
            assert _error_code(stream.result()) == "shutting_down"
        refused = waiting.result()
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        # Answered a second before the cut, and saying so: not the whole grace.
        left_s = GRACEFUL_SHUTDOWN_S - FRONTEND_ANSWERS_LEFT_BEFORE_S
        assert (
            f"did not finish in the {left_s:g} s this frontend's stop left it"
            in (refused.json()["error"]["message"])
        )
        assert time.monotonic() - stopped_at < GRACEFUL_SHUTDOWN_S
        stack.processes["frontend"].wait(timeout=GRACEFUL_SHUTDOWN_S)
        assert "shutting down: ending 3 requests that did not finish" in stack.log("frontend")


def test_a_second_ctrl_c_answers_every_request_at_once_and_cuts_none(tmp_path: Path) -> None:
    """uvicorn's "force quit" on a second ^C cut every answer under way: streams
    with no end, a plain-text 500, tracebacks. Each is answered now instead."""
    with running_stack(tmp_path, OVERRIDES, supervised=False) as stack:
        stack.wait_live()
        streams, waiting = _long_streams_and_one_waiting(stack)
        frontend = stack.processes["frontend"]
        frontend.send_signal(signal.SIGINT)
        time.sleep(0.5)
        stopped_at = time.monotonic()
        frontend.send_signal(signal.SIGINT)
        for stream in streams:
            assert _error_code(stream.result()) == "shutting_down"
        refused = waiting.result()
        assert refused.status_code == 503, refused.text
        assert "a second ^C ended it at once" in refused.json()["error"]["message"]
        # Its exit code is ^C's (130) only where ^C's default action was not
        # ignored where it started (a test runner's background job ignores it).
        frontend.wait(timeout=GRACEFUL_SHUTDOWN_S)
        assert time.monotonic() - stopped_at < GRACEFUL_SHUTDOWN_S - FRONTEND_ANSWERS_LEFT_BEFORE_S
        assert "Traceback" not in stack.log("frontend")


def test_stopped_with_its_frontend_a_worker_finishes_what_it_can_within_its_grace(
    tmp_path: Path,
) -> None:
    """As a signal to the whole process group stops them (systemd, ^C). The
    worker handed everything back at once, and every request under way was
    answered 503; it now lets what it runs go on for STOP_GRACE_S (3 s), while
    the frontend waits for a live worker: the short stream finishes, the long
    one ends with an error when the grace does, and the waiting request is
    answered at once."""
    with running_stack(tmp_path, OVERRIDES, supervised=False) as stack:
        stack.wait_live()
        streams = [Background(lambda n=n: _stream(stack, n)) for n in (SHORT, LONG)]
        stack.wait_for_health("running", lambda h: h["active"] == CAPACITY)
        waiting = Background(lambda: _plain(stack, SHORT))
        stack.wait_for_health("waiting", lambda h: h["queued"] == 1)
        stopped_at = time.monotonic()
        for name in ("frontend", "worker"):
            stack.processes[name].send_signal(signal.SIGTERM)
        refused = waiting.result()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        short, long = (stream.result() for stream in streams)
        assert short[-1][0] == "done", short[-1]
        assert _error_code(long) == "shutting_down"
        assert time.monotonic() - stopped_at < GRACEFUL_SHUTDOWN_S - 0.5
        worker_log = stack.log("worker")
        assert "letting 2 requests run for up to 3 s" in worker_log
        # The long stream came back from the worker: the frontend's own end at
        # its grace found nothing left.
        stack.processes["frontend"].wait(timeout=GRACEFUL_SHUTDOWN_S)
        assert "ending" not in stack.log("frontend")


def test_requests_waiting_for_a_first_worker_are_answered_503_when_it_stops(
    tmp_path: Path,
) -> None:
    """A native request waits in the table, an OpenAI one for a hello to check its
    model against: neither will run, so each is told at once to retry."""
    with running_stack(tmp_path, OVERRIDES, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        native = Background(lambda: _plain(stack, SHORT))
        openai_body = {"model": "fake", "prompt": "early", "max_tokens": 3}
        openai = Background(
            lambda: httpx.post(f"{stack.url}/v1/completions", json=openai_body, timeout=30)
        )
        stack.wait_for_health("waiting", lambda h: h["inflight"] == 1)
        time.sleep(0.5)  # the OpenAI request is read and waits for a hello
        stopped_at = time.monotonic()
        stack.processes["frontend"].send_signal(signal.SIGTERM)
        for answer in (native.result(), openai.result()):
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "shutting_down"
        assert time.monotonic() - stopped_at < GRACEFUL_SHUTDOWN_S / 2
        stack.processes["frontend"].wait(timeout=GRACEFUL_SHUTDOWN_S)


@pytest.mark.parametrize(
    ("stop_signal", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0), (signal.SIGHUP, 0)]
)
def test_a_frontend_stopped_by_a_signal_shuts_down_quietly_with_its_exit_code(
    stop_signal: signal.Signals, exit_code: int
) -> None:
    """^C: the graceful shutdown, then exit 130 as a shell reports it, without the
    traceback of the KeyboardInterrupt uvicorn raises again once it is done.
    SIGTERM or SIGHUP: exit 0, as the worker and the supervisor do; uvicorn's
    raising it again had ended the process as killed by it (143 under Docker)."""
    env = {"PORT": str(free_port()), "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"}
    frontend, output = _stopped_once(
        "frontend.main", env, b"Application startup complete", [stop_signal]
    )
    assert frontend.returncode == exit_code
    assert b"Finished server process" in output
    assert b"Traceback" not in output
    # uvicorn's own lines too: with several frontends, each says whose it is.
    lines = output.splitlines()
    assert all(f" frontend[{frontend.pid}] ".encode() in line for line in lines if line), lines


@pytest.mark.parametrize(
    "stop_signal", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name
)
def test_a_worker_told_to_stop_while_its_model_loads_stops_quietly(
    stop_signal: signal.Signals,
) -> None:
    """Before it served, ^C gave a KeyboardInterrupt's traceback and SIGTERM killed
    it (exit -2, -15); stopped as asked, it exits 0 as it does once serving, even
    told twice (a double ^C)."""
    env = {
        "MODEL_ID": "fake",
        "FAKE_START_DELAY_S": "30",  # its model loads that long
        "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
    }
    twice = [stop_signal, stop_signal]
    worker, output = _stopped_once("worker.serve.main", env, b"worker loading fake", twice)
    assert worker.returncode == 0, output
    assert f"told to stop ({stop_signal.name}) while starting; stopped".encode() in output
    assert b"Traceback" not in output


def test_an_idle_worker_told_to_stop_says_so_and_exits_0() -> None:
    """A standalone worker stopped while idle exited without a word."""
    env = {"MODEL_ID": "fake", "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"}
    worker, output = _stopped_once("worker.serve.main", env, b"serving fake", [signal.SIGTERM])
    assert worker.returncode == 0, output
    assert b"worker told to stop (SIGTERM); stopping" in output


def _stopped_once(
    module: str, env: dict[str, str], ready: bytes, stop_signals: list[signal.Signals]
) -> tuple[subprocess.Popen[bytes], bytes]:
    """Start ``module`` as from a terminal, send it ``stop_signals`` (20 ms apart)
    once it writes a line holding ``ready``; the process, ended, and its output."""
    process = subprocess.Popen(
        [sys.executable, "-m", module],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # As from a terminal: ^C's default action, whatever this test runner ignores.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: list[bytes] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if ready in line:
                break
        for i, stop_signal in enumerate(stop_signals):
            time.sleep(0.02 if i else 0)
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(stop_signal)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    return process, b"".join(lines) + output
