"""Under the supervisor, workers fork from a fork server that has loaded the
model, so that a replacement starts with it in memory; with WARM_START=0 each
starts from scratch. A worker outlives a fork server that dies, and the next
start brings up a new one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.stack import Stack, running_stack
from worker.engine.fake_engine import expected_text
from worker.launch import warm_start
from worker.launch.warm_start import FORK_SERVER_TITLE, WORKER_TITLE


def _fork_server(stack: Stack) -> psutil.Process:
    supervisor = psutil.Process(stack.processes["supervisor"].pid)
    (server,) = [
        child
        for child in supervisor.children()
        if " ".join(child.cmdline()).split() == [FORK_SERVER_TITLE]
    ]
    return server


def _fork_servers(stack: Stack) -> list[int]:
    """The live fork servers (a killed one is a zombie until it is reaped)."""
    pids = []
    for child in psutil.Process(stack.processes["supervisor"].pid).children():
        with contextlib.suppress(psutil.Error):  # a zombie has no command line
            if " ".join(child.cmdline()).split() == [FORK_SERVER_TITLE]:
                pids.append(child.pid)
    return pids


@contextlib.contextmanager
def _killed_at_exit(pid: int) -> Iterator[None]:
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _generate(stack: Stack, prompt: str) -> str:
    response = httpx.post(
        f"{stack.url}/generate", json={"prompt": prompt, "max_new_tokens": 3}, timeout=30
    )
    assert response.status_code == 200, response.text
    return str(response.json()["text"])


@pytest.mark.model
def test_a_replacement_worker_is_forked_with_the_model_already_loaded(tmp_path: Path) -> None:
    with running_stack(tmp_path, {"MODEL_ID": "synthetic"}) as stack:
        first = stack.wait_live(timeout_s=120)
        stack.signal_worker(signal.SIGKILL)
        stack.wait_live(instance_not=str(first["instance_id"]))
        (pid,) = stack.worker_pids()
        worker = psutil.Process(pid)
        assert " ".join(worker.cmdline()).split() == [WORKER_TITLE, stack.env["WORKER_ENDPOINT"]]
        assert worker.parent() == _fork_server(stack)
        log = stack.log("supervisor")
        # Both the first worker and its replacement, and neither loaded it again.
        assert log.count("synthetic was loaded before this worker forked") == 2, log
        assert "worker loading" not in log  # as if it would load a model again
        assert _generate(stack, "Hello") != ""


def test_with_warm_start_off_each_worker_starts_from_scratch(tmp_path: Path) -> None:
    with running_stack(tmp_path, {"WARM_START": "0"}) as stack:
        stack.wait_live()
        (pid,) = stack.worker_pids()
        worker = psutil.Process(pid)
        assert "worker.serve.main" in " ".join(worker.cmdline())
        assert worker.ppid() == stack.processes["supervisor"].pid
        assert _generate(stack, "hi") == expected_text("hi", 3)


def test_a_worker_outlives_its_fork_server_and_its_replacement_brings_a_new_one(
    tmp_path: Path,
) -> None:
    with running_stack(tmp_path) as stack:
        first = stack.wait_live()
        (worker,) = stack.worker_pids()
        server = _fork_server(stack)
        os.kill(server.pid, signal.SIGKILL)
        # An orphan now, out of the supervisor's process tree, which the stack's
        # clean-up kills: killed here, whatever happens.
        with _killed_at_exit(worker):
            time.sleep(0.5)  # the supervisor looks at its workers every 0.1 s
            assert stack.health().json()["instance_id"] == first["instance_id"]
            assert _generate(stack, "hi") == expected_text("hi", 3)
            assert "the fork server is gone; worker pid" in stack.log("supervisor")
        # Watched directly now: its death is seen, and a new fork server forks the next.
        stack.wait_live(instance_not=str(first["instance_id"]))
        assert _fork_server(stack).pid != server.pid
        assert _generate(stack, "hi") == expected_text("hi", 3)


def test_a_fork_server_that_dies_with_no_worker_of_its_own_is_noticed_before_a_fork(
    tmp_path: Path,
) -> None:
    """No worker reports the death of a replacement fork server that has forked
    none: the next fork brought one up itself, holding the supervisor 5 to 28 s
    (2-core Xeon, idle to loaded)."""
    with running_stack(tmp_path) as stack:
        first = stack.wait_live()
        (worker,) = stack.worker_pids()
        with _killed_at_exit(worker):
            server = _fork_server(stack)
            os.kill(server.pid, signal.SIGKILL)
            stack.wait_until(
                lambda: _fork_servers(stack) not in ([], [server.pid]), "a replacement"
            )
            (replacement,) = _fork_servers(stack)
            time.sleep(1.0)  # up: the fake model preloads nothing
            os.kill(replacement, signal.SIGKILL)
            time.sleep(0.5)
            os.kill(worker, signal.SIGKILL)
            stack.wait_live(instance_not=str(first["instance_id"]))
        assert "the fork server is gone; bringing up another" in stack.log("supervisor")
        assert "did not run for" not in stack.log("supervisor")
        assert _generate(stack, "hi") == expected_text("hi", 3)


def test_a_fork_server_that_dies_while_forking_is_brought_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def dies_mid_fork(*_: object, **__: object) -> None:
        raise EOFError("unexpected EOF")

    server = warm_start.ForkServer()
    server._ready.set()
    warm_ups: list[bool] = []
    monkeypatch.setattr(warm_start, "ForkedWorker", dies_mid_fork)
    monkeypatch.setattr(server, "warm_up", lambda: warm_ups.append(True))
    assert server.fork({}) is None
    assert not server.is_ready
    assert warm_ups == [True]


class _DiesPreloading:
    """A fork server's first fork, when the fork server dies before it is up."""

    starts: list[int] = []  # noqa: RUF012 - counted across instances
    num_deaths = 0

    def __init__(self, **_: object) -> None:
        pass

    def start(self) -> None:
        _DiesPreloading.starts.append(1)
        if len(_DiesPreloading.starts) <= _DiesPreloading.num_deaths:
            raise EOFError("unexpected EOF")

    def join(self) -> None:
        pass


@pytest.mark.parametrize(("num_deaths", "is_up"), [(2, True), (3, False)])
def test_a_fork_server_killed_while_it_preloads_is_brought_up_again(
    monkeypatch: pytest.MonkeyPatch, num_deaths: int, is_up: bool
) -> None:
    """Killed while it loaded the model (SIGKILL by hand, the OOM killer), it
    turned warm starts off for good; and the next start of a worker brought up a
    fork server that nothing would use. Three deaths in a row give up on it."""
    monkeypatch.setattr(_DiesPreloading, "starts", [])
    monkeypatch.setattr(_DiesPreloading, "num_deaths", num_deaths)
    monkeypatch.setattr(warm_start._FORK_SERVER, "Process", _DiesPreloading)
    server = warm_start.ForkServer()
    server.warm_up()
    assert server._warming is not None
    server._warming.join(timeout=10)
    assert server.is_ready is is_up
    assert (server.failure is None) is is_up
    assert len(_DiesPreloading.starts) == min(num_deaths + 1, 3)
    server.warm_up()  # as the next worker's start asks
    assert server._warming is not None
    server._warming.join(timeout=10)
    assert len(_DiesPreloading.starts) == min(num_deaths + 1, 3)  # none brought up again


class _EndedBySupervisorStop(_DiesPreloading):
    """A fork server that dies preloading because the supervisor stops (a
    frontend refused its settings: exit 78, and the supervisor gave up)."""

    server: warm_start.ForkServer

    def start(self) -> None:
        _DiesPreloading.starts.append(1)
        self.server.stop_replacing()
        raise EOFError("unexpected EOF")


def test_a_fork_server_ended_by_the_supervisors_stop_is_not_brought_up_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each such stop logged "the fork server died before it was up" twice, then
    gave up on it with a traceback, after the line naming the setting to fix."""
    server = warm_start.ForkServer()
    monkeypatch.setattr(_DiesPreloading, "starts", [])
    monkeypatch.setattr(_EndedBySupervisorStop, "server", server, raising=False)
    monkeypatch.setattr(warm_start._FORK_SERVER, "Process", _EndedBySupervisorStop)
    server.warm_up()
    assert server._warming is not None
    server._warming.join(timeout=10)
    assert len(_DiesPreloading.starts) == 1 and not server.is_ready
    assert not [r for r in caplog.records if r.name == warm_start.log.name], caplog.text


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
    return members


@pytest.mark.parametrize(
    ("sig", "warm_start"),
    [(signal.SIGTERM, "1"), (signal.SIGINT, "1"), (signal.SIGHUP, "1"), (signal.SIGTERM, "0")],
)
def test_a_signal_to_the_whole_group_stops_it_and_starts_nothing_new(
    tmp_path: Path, sig: signal.Signals, warm_start: str
) -> None:
    """As systemd stops a service (KillMode=control-group), or a terminal's ^C:
    every process gets the signal at once, the fork server among them. Its death
    is then the supervisor's own shutdown, not a loss to make good."""
    with running_stack(tmp_path, {"WARM_START": warm_start}) as stack:
        stack.wait_live()
        supervisor = stack.processes["supervisor"]
        os.killpg(supervisor.pid, sig)
        assert supervisor.wait(timeout=15) == 0
        log = stack.log("supervisor")
        assert "died" not in log and "restart" not in log, log
        # Nothing outlives it: no fork server brought up again, no worker, no frontend.
        stack.wait_until(lambda: not _group_members(supervisor.pid), "the group to be gone")


def test_a_worker_that_dies_while_its_fork_server_is_stopped_is_replaced(tmp_path: Path) -> None:
    """A stopped fork server cannot report its worker's death, nor fork another:
    the supervisor waited on it for ever, and served nothing again."""
    with running_stack(tmp_path) as stack:
        first = stack.wait_live()
        server = _fork_server(stack)
        with _killed_at_exit(server.pid):
            server.suspend()
            stack.signal_worker(signal.SIGKILL)
            stack.wait_live(instance_not=str(first["instance_id"]), timeout_s=30)
            assert _fork_server(stack).pid != server.pid
            assert not psutil.pid_exists(server.pid)
            assert _generate(stack, "hi") == expected_text("hi", 3)
            log = stack.log("supervisor")
            assert f"killing the fork server (pid {server.pid})" in log, log


def test_the_supervisor_stops_in_time_with_its_fork_server_stopped(tmp_path: Path) -> None:
    with running_stack(tmp_path) as stack:
        stack.wait_live()
        supervisor = stack.processes["supervisor"]
        server = _fork_server(stack)
        with _killed_at_exit(server.pid):
            server.suspend()
            supervisor.send_signal(signal.SIGTERM)
            assert supervisor.wait(timeout=15) == 0
            # Nothing left behind, the stopped fork server included.
            stack.wait_until(lambda: not _group_members(supervisor.pid), "the group to be gone")


def test_a_fork_that_waits_on_a_stuck_fork_server_is_ended_by_replacing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped between the check and the fork, the fork server held the
    supervisor in the fork's read of the new pid, for ever."""
    killed = threading.Event()

    def waits_until_killed(*_: object, **__: object) -> None:
        killed.wait(10)
        raise EOFError("the fork server was killed")

    server = warm_start.ForkServer()
    server._ready.set()
    reasons: list[str] = []
    monkeypatch.setattr(warm_start, "ForkedWorker", waits_until_killed)
    monkeypatch.setattr(warm_start, "_FORK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(server, "replace", lambda why: (reasons.append(why), killed.set()))
    monkeypatch.setattr(server, "warm_up", lambda: None)
    started = time.monotonic()
    assert server.fork({}) is None
    assert time.monotonic() - started < 5
    assert reasons == ["a fork took more than 0.2 s"]


def test_a_stopped_fork_server_is_found_and_killed_even_while_it_preloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped while it loaded the model, the fork server was waited for until
    WORKER_START_TIMEOUT_S (5 minutes without a worker), and outlived the
    supervisor."""
    named = f"import setproctitle, time; setproctitle.setproctitle({FORK_SERVER_TITLE!r}); "
    stand_in = subprocess.Popen([sys.executable, "-c", named + "time.sleep(60)"])
    with _killed_at_exit(stand_in.pid):
        server = warm_start.ForkServer()
        warm_ups: list[bool] = []
        monkeypatch.setattr(server, "warm_up", lambda: warm_ups.append(True))
        deadline = time.monotonic() + 10
        while server.process() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has named itself
        assert server.process() is not None
        assert not server.replace_if_stopped()  # running: left alone
        stand_in.send_signal(signal.SIGSTOP)
        while not warm_start.is_stopped(psutil.Process(stand_in.pid)):
            time.sleep(0.01)
        assert server.replace_if_stopped()
        assert stand_in.wait(timeout=5) == -signal.SIGKILL
        assert warm_ups == [True]  # another is brought up
