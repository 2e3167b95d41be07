"""A local stack for benchmarks: the supervisor, its worker and its frontend as
real processes on free loopback ports, stopped when the benchmark ends."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from worker.launch.warm_start import WORKER_TITLE

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class LocalStack:
    url: str
    worker_endpoint: str
    supervisor: subprocess.Popen[bytes]

    def child(self, module: str) -> psutil.Process:
        """The running ``worker.serve.main`` or ``frontend.main`` process. A worker forked
        from the fork server (warm starts) is its grandchild, and runs under the
        title ``minibatch-worker <endpoint>`` rather than its module's name."""
        marks = [module] + ([f"{WORKER_TITLE} "] if module == "worker.serve.main" else [])
        for process in psutil.Process(self.supervisor.pid).children(recursive=True):
            command = " ".join(process.cmdline())
            if any(mark in command for mark in marks):
                return process
        raise RuntimeError(f"no {module} process under the supervisor")


def stack_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """The environment for a stack on free ports; ``overrides`` win."""
    return {
        **os.environ,
        "HOST": "127.0.0.1",
        "PORT": str(free_port()),
        "WORKER_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "PYTHONPATH": str(REPO_ROOT),
        **overrides,
    }


@contextlib.contextmanager
def local_stack(env: Mapping[str, str], log_path: Path) -> Iterator[LocalStack]:
    """Run ``python -m worker.launch.supervisor`` with ``env`` (see `stack_env`), logging to
    ``log_path``; yield once it has started, and stop it on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "worker.launch.supervisor"],
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
        try:
            yield LocalStack(
                f"http://{env.get('HOST', '127.0.0.1')}:{env['PORT']}",
                env["WORKER_ENDPOINT"],
                process,
            )
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_live(url: str, timeout_s: float) -> dict[str, object]:
    """Wait until the stack's /health says ok; return that health."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return dict(response.json())
            last = f"{response.status_code} {response.text}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"the stack at {url} was not live within {timeout_s} s: {last}")
