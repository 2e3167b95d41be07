"""Warm starts: the supervisor forks each worker from a server that has already
imported torch and loaded the model.

A worker started from scratch spends seconds importing torch and transformers and
loading the model: about 7 s of one core for the synthetic distilgpt2. While a
replacement loads, the requests of the worker it replaces crowd the survivors, or
wait. multiprocessing's fork server imports `worker.preload` once, at the first
start; each worker forked from it shares what that loaded, copy-on-write, and is
serving within a second of its predecessor's death.

Should the fork server die, the workers it forked are killed with it, and the
next start brings up a new one (a cold start, once).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
from collections.abc import Mapping

from setproctitle import setproctitle

_FORK_SERVER = multiprocessing.get_context("forkserver")
_FORK_SERVER.set_forkserver_preload(["worker.preload"])

# The command line of a forked worker, then its endpoint; `minibatch-worker` is
# also the console script that starts one from scratch.
WORKER_TITLE = "minibatch-worker"
FORK_SERVER_TITLE = "minibatch-fork-server"

# What multiprocessing reports for a child whose fork server went away.
_LOST_BY_FORK_SERVER = 255


class ForkedWorker:
    """A worker forked from the fork server, behind the part of `subprocess.Popen`
    the supervisor uses."""

    def __init__(self, env: Mapping[str, str]) -> None:
        # Daemonic: a supervisor that exits takes its workers with it.
        self._process = _FORK_SERVER.Process(target=_serve, args=(dict(env),), daemon=True)
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    def poll(self) -> int | None:
        """The exit code (minus the signal that killed it), or None while it runs."""
        code = self._process.exitcode
        if code == _LOST_BY_FORK_SERVER:
            # Either the worker exited with 255, or the fork server died and can
            # no longer say: then the worker may still run, holding its endpoint.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        return code

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"worker (pid {self.pid})", timeout or 0.0)
        return code

    def kill(self) -> None:
        self._process.kill()

    def terminate(self) -> None:
        self._process.terminate()


def _serve(env: dict[str, str]) -> None:
    """The forked worker's main: its own environment, then the usual worker."""
    os.environ.clear()
    os.environ.update(env)
    # Its command line is the fork server's until renamed (ps, top, pkill -f).
    setproctitle(f"{WORKER_TITLE} {env.get('WORKER_ENDPOINT', '')}".rstrip())
    from worker.main import main

    main([])
