"""The frontend's links to its workers: a background task that dies ends the frontend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.stack import free_port


@pytest.mark.parametrize(
    ("cls", "loop"),
    [
        ("worker_client.WorkerClient", "_tick_loop"),
        ("worker_client.WorkerClient", "_discovery_loop"),
        ("worker_link.WorkerLink", "_receive_loop"),
        ("worker_link.WorkerLink", "_monitor_loop"),
    ],
)
def test_a_background_task_that_raises_ends_the_frontend_loudly(cls: str, loop: str) -> None:
    module = cls.partition(".")[0]
    script = (
        f"import frontend.main, frontend.{module}\n"
        "async def broken(self):\n"
        "    raise RuntimeError('injected')\n"
        f"setattr(frontend.{cls}, {loop!r}, broken)\n"
        "frontend.main.main([])\n"
    )
    env = {
        **os.environ,
        "PORT": str(free_port()),
        # A host name, so that the frontend looks it up again and again.
        "WORKER_ENDPOINT": f"tcp://localhost:{free_port()}",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 4
    assert "background task worker-" in done.stderr
    assert "RuntimeError: injected" in done.stderr
