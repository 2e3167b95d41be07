"""Under the supervisor, workers fork from a fork server that has loaded the
model, so that a replacement starts with it in memory; with WARM_START=0 each
starts from scratch. A fork server that dies takes its workers with it, and the
next start brings up a new one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import psutil
import pytest

from tests.stack import Stack, running_stack
from worker.fake_engine import expected_text
from worker.warm_start import FORK_SERVER_TITLE, WORKER_TITLE


def _fork_server(stack: Stack) -> psutil.Process:
    supervisor = psutil.Process(stack.processes["supervisor"].pid)
    (server,) = [
        child
        for child in supervisor.children()
        if " ".join(child.cmdline()).split() == [FORK_SERVER_TITLE]
    ]
    return server


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
        assert _generate(stack, "Hello") != ""


def test_with_warm_start_off_each_worker_starts_from_scratch(tmp_path: Path) -> None:
    with running_stack(tmp_path, {"WARM_START": "0"}) as stack:
        stack.wait_live()
        (pid,) = stack.worker_pids()
        worker = psutil.Process(pid)
        assert "worker.main" in " ".join(worker.cmdline())
        assert worker.ppid() == stack.processes["supervisor"].pid
        assert _generate(stack, "hi") == expected_text("hi", 3)


def test_a_dead_fork_server_takes_its_workers_with_it_and_a_new_one_serves(
    tmp_path: Path,
) -> None:
    with running_stack(tmp_path) as stack:
        first = stack.wait_live()
        (old_worker,) = stack.worker_pids()
        server = _fork_server(stack)
        os.kill(server.pid, signal.SIGKILL)
        stack.wait_live(instance_not=str(first["instance_id"]))
        assert not psutil.pid_exists(old_worker) or (
            psutil.Process(old_worker).status() == psutil.STATUS_ZOMBIE
        )
        assert _fork_server(stack).pid != server.pid
        assert _generate(stack, "hi") == expected_text("hi", 3)
