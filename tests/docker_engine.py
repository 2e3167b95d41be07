"""A Docker engine for the tests that build and run the images: the one that is
running here, or else one started here (as root) for the tests and stopped after.
Where neither can be had, the tests skip and say why."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# Tried in turn until one starts: the defaults (overlay2, iptables), then without
# iptables (where the kernel has no netfilter), then also on vfs (where overlayfs
# cannot be mounted, as inside some containers). The tests need no outbound
# network from a container: builds run on the host's network.
DOCKERD_OPTIONS = ([], ["--iptables=false"], ["--iptables=false", "--storage-driver=vfs"])
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
# Where dockerd writes its pid (its default --pidfile).
DOCKERD_PID_FILE = Path("/var/run/docker.pid")

INSTALL_HINT = "`make test` installs docker.io where apt-get runs as root"


def engine_answers(timeout_s: float = 20.0) -> bool:
    """Whether `docker info` reaches an engine."""
    try:
        completed = subprocess.run(["docker", "info"], capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return completed.returncode == 0


def compose_command() -> list[str] | None:
    """The compose CLI here: the docker plugin, else the standalone docker-compose."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@contextlib.contextmanager
def docker_engine(log_dir: Path) -> Iterator[str]:
    """Yield a sentence that says which engine the tests use; skip if there is none."""
    if shutil.which("docker") is None:
        pytest.skip(f"no docker CLI here ({INSTALL_HINT})")
    if engine_answers():
        yield "the Docker engine that was running"
        return
    if os.environ.get("DOCKER_HOST"):
        pytest.skip(f"DOCKER_HOST={os.environ['DOCKER_HOST']} names an engine that does not answer")
    if shutil.which("dockerd") is None:
        pytest.skip(f"no Docker engine runs here and dockerd is not installed ({INSTALL_HINT})")
    if os.geteuid() != 0:
        pytest.skip("no Docker engine runs here, and starting dockerd needs root")
    _remove_stale_pid_file()
    failures = []
    for options in DOCKERD_OPTIONS:
        log = log_dir / f"dockerd{''.join(options).replace('-', '_')}.log"
        daemon = _start(options, log)
        if daemon is not None:
            try:
                yield f"dockerd {' '.join(options) or '(defaults)'}, started for these tests"
            finally:
                _stop(daemon)
            return
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        failures.append(f"dockerd {' '.join(options)}: {' / '.join(tail)}")
    pytest.skip("dockerd would not start here: " + "; ".join(failures))


def _remove_stale_pid_file() -> None:
    """dockerd refuses to start while its pid file names any pid ("pid file found,
    ensure docker is not running"), though that dockerd died without removing it
    (kill -9, the OOM killer): the tests then skipped. Here no engine answers, so a
    file naming no running dockerd is a dead one's."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        pid = int(DOCKERD_PID_FILE.read_text().strip())
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).name() == "dockerd":
                return
        DOCKERD_PID_FILE.unlink()


def _start(options: list[str], log: Path) -> subprocess.Popen[bytes] | None:
    """dockerd started with ``options`` once it answers; None if it does not."""
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            ["dockerd", *options], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and daemon.poll() is None:
        if engine_answers(timeout_s=5):
            return daemon
        time.sleep(0.5)
    _stop(daemon)
    return None


def _stop(daemon: subprocess.Popen[bytes]) -> None:
    """SIGTERM dockerd (it stops its containers and the containerd it started);
    SIGKILL it and what it started if it has not exited in time."""
    try:
        children = psutil.Process(daemon.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
    for child in children:  # containerd, if dockerd left it behind
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            child.wait(timeout=10)
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
