"""A local stack of real processes, for tests and benchmarks alike: a worker and
a frontend on free loopback ports, started alone or under the supervisor, and
always killed afterwards, with every child."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from worker.launch.warm_start import WORKER_TITLE

REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = {
    "supervisor": "worker.launch.supervisor",
    "worker": "worker.serve.main",
    "frontend": "frontend.main",
}


def free_port() -> int:
    return first_of_free_ports(1)


def first_of_free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports (a stack of several workers or
    frontends takes the port it is given and the ones after it), below the
    kernel's ephemeral range: a client that connects to a port in that range
    before anything listens there, as a frontend does to a worker still starting,
    can be given that very port as its own (a TCP self-connect), and the worker
    then cannot bind it."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral_low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    while True:
        first = random.randrange(10_000, ephemeral_low - count)
        if are_free(range(first, first + count)):
            return first


def are_free(ports: Iterable[int]) -> bool:
    """Whether nothing listens on any of ``ports`` (this host's loopback)."""
    with contextlib.ExitStack() as held:
        try:
            for port in ports:
                sock = held.enter_context(socket.socket())
                sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path | None = None

    @property
    def worker_endpoint(self) -> str:
        return self.env["WORKER_ENDPOINT"]

    def child(self, module: str) -> psutil.Process:
        """The running ``worker.serve.main`` or ``frontend.main`` process. A worker
        forked from the fork server (warm starts) runs under the title
        ``minibatch-worker <endpoint>`` rather than its module's name."""
        (pid,) = (
            self.worker_pids() if module == ENTRY_POINTS["worker"] else self._pids_running(module)
        )
        return psutil.Process(pid)

    def start(self, name: str, module: str) -> subprocess.Popen[bytes]:
        return self.start_command(name, [sys.executable, "-m", module], self.env)

    def start_command(
        self, name: str, command: list[str], env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,  # so that a test can kill the whole group
            )
        self.processes[name] = process
        return process

    def kill(self, name: str) -> None:
        """SIGKILL the process ``name`` and all its children; it is no longer tracked."""
        process = self.processes.pop(name)
        for member in _family(process.pid):
            try:
                member.send_signal(signal.SIGCONT)  # a stopped process cannot die
                member.kill()
            except psutil.NoSuchProcess:
                pass
        process.wait(timeout=10)

    def kill_pid(self, pid: int) -> None:
        """SIGKILL one process of the stack, such as one of a supervisor's workers."""
        os.kill(pid, signal.SIGKILL)

    def log(self, name: str) -> str:
        assert self.log_dir is not None
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=5)

    def wait_answering(self, timeout_s: float = 10.0) -> None:
        """Wait until the frontend answers HTTP, with a worker or without one."""

        def answers() -> bool:
            try:
                self.health()
            except httpx.TransportError:
                return False
            return True

        self.wait_until(answers, "the frontend's start", timeout_s)

    def wait_live(self, timeout_s: float = 30.0, instance_not: str | None = None) -> dict[str, Any]:
        """Wait until /health says ok (with a worker other than ``instance_not``)."""
        return self.wait_for_health(
            "live",
            lambda health: health["status"] == "ok" and health["instance_id"] != instance_not,
            timeout_s,
        )

    def wait_for_health(
        self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
    ) -> dict[str, Any]:
        """Poll /health until ``predicate(body)`` holds; return that body. Fails at once
        if a process of the stack has exited: nothing would answer for it then."""
        last: dict[str, Any] = {}

        def holds() -> bool:
            nonlocal last
            for name, process in self.processes.items():
                code = process.poll()
                assert code is None, f"{name} exited with {code}\n{self.logs()}"
            try:
                last = self.health().json()
            except httpx.TransportError:
                return False
            return predicate(last)

        try:
            self.wait_until(holds, what, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nlast /health: {last}") from None
        return last

    def wait_until(self, check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.05)
        raise AssertionError(f"{what} did not happen within {timeout_s} s\n{self.logs()}")

    def worker_pids(self) -> list[int]:
        """Every live worker process started by this stack: from scratch, or under a
        supervisor forked from its fork server and named for its endpoint."""
        return self._pids_running("worker.serve.main") + self._pids_running(f"{WORKER_TITLE} ")

    def worker_pid(self, endpoint: str) -> int:
        """The live worker process serving ``endpoint`` (several may run)."""
        for pid in self.worker_pids():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if " ".join(process.cmdline()).split() == [WORKER_TITLE, endpoint]:
                    return pid  # forked: its environment is the fork server's
                if process.environ().get("WORKER_ENDPOINT") == endpoint:
                    return pid
        raise AssertionError(f"no worker serves {endpoint}\n{self.logs()}")

    def workers(self) -> dict[str, dict[str, Any]]:
        """/health's view of each worker, by endpoint."""
        return {worker["endpoint"]: worker for worker in self.health().json()["workers"]}

    def frontend_pid(self) -> int:
        (pid,) = self._pids_running("frontend.main")
        return pid

    def _pids_running(self, module: str) -> list[int]:
        pids = []
        for process in self.processes.values():
            for member in _family(process.pid):
                try:
                    alive = member.status() != psutil.STATUS_ZOMBIE
                    if alive and module in " ".join(member.cmdline()):
                        pids.append(member.pid)
                except psutil.NoSuchProcess:
                    continue
        return pids

    def signal_worker(self, sig: signal.Signals) -> int:
        (pid,) = self.worker_pids()
        os.kill(pid, sig)
        return pid

    def logs(self) -> str:
        if self.log_dir is None:
            return ""
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> None:
        for name in list(self.processes):
            self.kill(name)


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []


def stack_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a stack on free ports; ``overrides`` win. Room for
    NUM_FRONTENDS and NUM_WORKERS of up to 4 each, in one run of free ports: two
    runs looked for apart could overlap, and minibatch-serve refuses ranges
    that share a port."""
    first = first_of_free_ports(8)
    env = {
        **os.environ,
        "HOST": "127.0.0.1",
        "PORT": str(first),
        "WORKER_ENDPOINT": f"tcp://127.0.0.1:{first + 4}",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.update(overrides or {})
    return env


@contextmanager
def running_stack(
    log_dir: Path,
    env: Mapping[str, str],
    supervised: bool = True,
    start: tuple[str, ...] = ("worker", "frontend"),
) -> Iterator[Stack]:
    """The stack under the supervisor, or its processes started alone, with
    ``env`` (see `stack_env`) and a log per process in ``log_dir``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(url=f"http://127.0.0.1:{env['PORT']}", env=dict(env), log_dir=log_dir)
    try:
        for name in ("supervisor",) if supervised else start:
            stack.start(name, ENTRY_POINTS[name])
        yield stack
    finally:
        stack.stop()
