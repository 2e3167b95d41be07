"""A worker (FakeEngine) and a frontend as real processes, on free loopback ports.

`api_stack` starts both, waits until the frontend reports a live worker, and
always kills both on exit; their logs are printed if start-up fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ApiStack:
    base_url: str
    env: dict[str, str]
    log: IO[bytes]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, module: str) -> None:
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", module],
            env=self.env,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, name: str) -> None:
        process = self.processes.pop(name)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def health(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{self.base_url}/health", timeout=5).json()
        return answer

    def wait_until(self, condition: str, predicate: Any, timeout_s: float = 5.0) -> dict[str, Any]:
        """Poll /health until ``predicate(health)`` holds; return that health."""
        deadline = time.monotonic() + timeout_s
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                health = self.health()
                if predicate(health):
                    return health
            time.sleep(0.05)
        raise AssertionError(f"not {condition} within {timeout_s} s; last /health: {health}")

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


@contextlib.contextmanager
def api_stack(**settings: str | float) -> Iterator[ApiStack]:
    """Run a fake-model worker and a frontend; ``settings`` are extra environment
    variables (FAKE_STEP_DELAY_S=0.05, REQUEST_TIMEOUT_S=2, ...)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MODEL_ID": "fake",
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "HEARTBEAT_INTERVAL_S": "0.1",
        "PING_INTERVAL_S": "0.1",
        **{name: str(value) for name, value in settings.items()},
    }
    with tempfile.TemporaryFile() as log:
        stack = ApiStack(f"http://127.0.0.1:{port}", env, log)
        try:
            stack.start("worker", "worker.main")
            stack.start("frontend", "frontend.main")
            try:
                stack.wait_until(
                    "live", lambda h: h.get("status") == "ok", timeout_s=START_TIMEOUT_S
                )
            except AssertionError:
                print(stack.logs())
                raise
            yield stack
        finally:
            for name in list(stack.processes):
                stack.kill(name)


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event, data) for each server-sent event, as the SSE spec frames them."""
    event: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line.removeprefix("event:").removeprefix(" ")
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
