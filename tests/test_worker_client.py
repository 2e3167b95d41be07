"""The frontend's worker link: a background task that dies ends the frontend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.stack import free_port


@pytest.mark.parametrize("loop", ["_tick_loop", "_receive_loop"])
def test_a_background_task_that_raises_ends_the_frontend_loudly(loop: str) -> None:
    script = (
        "import frontend.main, frontend.worker_client as wc\n"
        "async def broken(self):\n"
        "    raise RuntimeError('injected')\n"
        f"setattr(wc.WorkerClient, {loop!r}, broken)\n"
        "frontend.main.main([])\n"
    )
    env = {
        **os.environ,
        "PORT": str(free_port()),
        "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 4
    assert "background task worker-" in done.stderr
    assert "RuntimeError: injected" in done.stderr
