"""Warm starts: the supervisor forks each worker from a server that has already
imported torch and loaded the model.

A worker started from scratch spends seconds importing torch and transformers and
loading the model: about 7 s of one core for the synthetic distilgpt2. While a
replacement loads, the requests of the worker it replaces crowd the survivors, or
wait. multiprocessing's fork server imports `worker.launch.preload` once, at the first
start; each worker forked from it shares what that loaded, copy-on-write, and is
serving within a second of its predecessor's death.

Should the fork server die, the workers it forked serve on, and the next start
brings up a new one (a cold start, once), unless the supervisor is stopping. One
that is stuck is killed and replaced (`ForkServer`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

import psutil
from setproctitle import setproctitle

from protocol.exit_codes import ExitCode

log = logging.getLogger("supervisor")

_FORK_SERVER = multiprocessing.get_context("forkserver")
_FORK_SERVER.set_forkserver_preload(["worker.launch.preload"])

# The command line of a forked worker, then its endpoint; `minibatch-worker` is
# also the console script that starts one from scratch.
WORKER_TITLE = "minibatch-worker"
FORK_SERVER_TITLE = "minibatch-fork-server"

# A fork server reports a worker's exit within milliseconds; one that has not
# this long after the exit is stuck, stopped or not.
_EXIT_REPORT_TIMEOUT_S = 5.0
# A fork takes milliseconds once the server is up; one that takes this long waits
# on a server that is stuck.
_FORK_TIMEOUT_S = 10.0
# Fork servers that may die before they are up (preloading catches its own
# errors: killed from outside, by the OOM killer, a crash) before warm starts
# are given up.
_MAX_BRING_UPS = 3
# How long a fork server that died may take to end, its threads with it.
_DEATH_TIMEOUT_S = 5.0


class ForkServer:
    """Brings the fork server up on a thread of its own. Preloading takes seconds
    (minutes for a first download, or forever if it hangs), and the supervisor
    must go on tending its other children and its signals meanwhile: it starts a
    forked worker only once the server is ready.

    A fork server that stops answering, stopped (SIGSTOP) or otherwise stuck,
    would hold the supervisor in a fork for ever, or leave a worker's death
    unreported: it is killed and replaced (`replace`)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._warming: threading.Thread | None = None
        self._generation = 0  # of the fork server being brought up; a replacement's is next
        self.failure: str | None = None  # why it could not be brought up
        # The supervisor is stopping: a signal to its whole process group (systemd,
        # ^C in a terminal) kills the fork server too, and that is no loss.
        self.is_shutting_down = False

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def check_up(self) -> bool:
        """Ready, and its process still there. If it is gone, another is brought
        up, and this says False until it is ready. A fork server that dies with no
        worker of its own to report it (a replacement that has forked none yet)
        is noticed here, before a fork, and another is brought up on its thread:
        else the next fork brought one up itself, holding the supervisor's loop
        5 to 28 s (2-core Xeon, idle to loaded) with no worker and no frontend
        tended."""
        if self.is_ready and self.process() is None:
            log.warning("the fork server is gone; bringing up another")
            self.on_lost()
        return self.is_ready

    def warm_up(self) -> None:
        """Bring the fork server up, unless that is under way or done, given up on,
        or the supervisor is shutting down."""
        if self.is_shutting_down or self.is_ready or self.failure is not None:
            return
        if self._warming is not None and self._warming.is_alive():
            return
        self._warming = threading.Thread(
            target=self._bring_up, args=(self._generation,), name="warm-up", daemon=True
        )
        self._warming.start()

    def stop_replacing(self) -> None:
        """Bring up no other fork server from now on."""
        self.is_shutting_down = True

    def stop(self) -> None:
        """At the supervisor's own stop, once the workers have: end the fork server
        now (killed, if stopped: it would outlive this process), rather than leave
        it to find its supervisor gone, which it reports as a warning, as it should
        when the supervisor was killed."""
        self.replace_if_stopped()
        process = self.process()
        if process is None:
            return
        with contextlib.suppress(psutil.Error):
            process.terminate()
            process.wait(timeout=_DEATH_TIMEOUT_S)

    def on_lost(self) -> None:
        """The fork server died: bring up another before the next fork."""
        self._ready.clear()
        self.warm_up()

    @staticmethod
    def process() -> psutil.Process | None:
        """The fork server process now running (preloading or ready), if any: a
        child of this process, named FORK_SERVER_TITLE once it preloads, and
        running multiprocessing's fork server before that."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    command = " ".join(child.cmdline())
                    is_named = command.split() == [FORK_SERVER_TITLE]
                    is_fork_server = is_named or "multiprocessing.forkserver import main" in command
                    if is_fork_server and child.status() != psutil.STATUS_ZOMBIE:
                        return child
        return None

    def replace_if_stopped(self) -> bool:
        """Replace the fork server if it is stopped; whether it was."""
        server = self.process()
        if server is None or not is_stopped(server):
            return False
        self.replace("it is stopped (SIGSTOP): it can neither fork nor report a death")
        return True

    def replace(self, why: str) -> None:
        """Kill the fork server, and bring up another unless the supervisor stops."""
        # First: the killed one's warm-up, failing at the kill, is no news.
        self._generation += 1
        server = self.process()
        if server is not None:
            log.error("killing the fork server (pid %d): %s", server.pid, why)
            with contextlib.suppress(psutil.NoSuchProcess):
                server.kill()  # psutil checks first that the pid is still its
                # multiprocessing brings up another only once it can reap this one.
                deadline = time.monotonic() + 5.0
                while server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
                    time.sleep(0.01)
        self.on_lost()

    def fork(self, env: Mapping[str, str]) -> ForkedWorker | None:
        """A worker forked with ``env``; None if the fork server died or is stuck
        (it is being brought up again: ask later). The fork runs on a thread of its
        own, so that a fork server stopped in the middle of it cannot hold the
        supervisor: after _FORK_TIMEOUT_S it is killed, which ends the fork."""
        if self.replace_if_stopped():
            return None
        outcome: list[ForkedWorker | BaseException] = []

        def fork_now() -> None:
            try:
                outcome.append(ForkedWorker(env, fork_server=self))
            except BaseException as exc:  # reported on the supervisor's thread
                outcome.append(exc)

        forking = threading.Thread(target=fork_now, name="fork", daemon=True)
        forking.start()
        forking.join(_FORK_TIMEOUT_S)
        if forking.is_alive():
            self.replace(f"a fork took more than {_FORK_TIMEOUT_S:g} s")
            forking.join(_FORK_TIMEOUT_S)  # the kill ends it
            if not outcome:
                return None
        (result,) = outcome
        if not isinstance(result, BaseException):
            return result
        if isinstance(result, (OSError, EOFError)):
            log.error("the fork server failed to fork a worker (%s); bringing up another", result)
            self.on_lost()
            return None
        raise result

    def _bring_up(self, generation: int) -> None:
        for attempt in range(1, _MAX_BRING_UPS + 1):
            # The first fork returns once the server has preloaded.
            probe = _FORK_SERVER.Process(target=_exit_at_once, daemon=True)
            try:
                probe.start()
            except Exception as exc:  # it could not start, or died preloading
                if generation != self._generation:
                    return  # a fork server killed as stuck: its replacement is on its way
                if self.is_shutting_down:
                    return  # ended by the supervisor's stop (or its group's signal)
                if attempt < _MAX_BRING_UPS:
                    log.error(
                        "the fork server died before it was up (%s: %s); bringing up "
                        "another (%d of %d)",
                        type(exc).__name__,
                        exc,
                        attempt + 1,
                        _MAX_BRING_UPS,
                    )
                    self._wait_until_gone()
                    continue
                log.exception("the fork server could not be brought up; giving up on it")
                self.failure = f"{type(exc).__name__}: {exc}"
                return
            probe.join()
            if generation == self._generation:
                self._ready.set()
            return

    def _wait_until_gone(self) -> None:
        """Until the fork server that died can be reaped. Its socket closes first,
        and multiprocessing, asked for a fork server before then, takes the dead
        one for alive (its waitpid finds nothing yet, while the threads of a
        process that imported torch still exit) and connects to it in vain: a
        single kill used up every try in a millisecond."""
        # multiprocessing's own record of its fork server's pid, as it checks it.
        pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        deadline = time.monotonic() + _DEATH_TIMEOUT_S
        while pid is not None and time.monotonic() < deadline:
            try:
                # WNOWAIT: left to be reaped by multiprocessing, which then starts anew.
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                    return
            except ChildProcessError:  # reaped already
                return
            time.sleep(0.01)


def _exit_at_once() -> None:
    pass


def is_stopped(process: psutil.Process) -> bool:
    """Whether ``process`` is stopped (SIGSTOP, a debugger)."""
    try:
        return process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.NoSuchProcess:
        return False


class ForkedWorker:
    """A worker forked from the fork server, behind the part of `subprocess.Popen`
    the supervisor uses. The fork server reports its exit; should the fork server
    die first, the worker serves on and is watched directly (a pidfd), though its
    exit status is then lost."""

    def __init__(self, env: Mapping[str, str], fork_server: ForkServer) -> None:
        # Daemonic: a supervisor that exits takes its workers with it.
        self._process = _FORK_SERVER.Process(target=_serve, args=(dict(env),), daemon=True)
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        self._fork_server = fork_server
        # Its exit, seen directly, in case its fork server cannot report it.
        self._pidfd: int | None = None
        with contextlib.suppress(ProcessLookupError):  # it is gone already
            self._pidfd = os.pidfd_open(self.pid)
        self._exited_at: float | None = None
        self._is_orphan = False  # its fork server died before it
        self._code: int | None = None

    def poll(self) -> int | None:
        """The exit code (minus the signal that killed it), or None while it runs.
        Once its fork server is gone or stuck, its exit status is lost and
        reported as 255."""
        if self._code is not None:
            return self._code
        reported = self._process.exitcode
        has_exited = self._has_exited()
        if reported is not None and (reported != ExitCode.UNKNOWN or has_exited):
            self._set_code(reported)
        elif reported is not None and not self._is_orphan:
            self._is_orphan = True
            if not self._fork_server.is_shutting_down:
                log.error(
                    "the fork server is gone; worker pid %d serves on, watched directly "
                    "(its exit status will be unknown, reported as %d)",
                    self.pid,
                    ExitCode.UNKNOWN,
                )
            self._fork_server.on_lost()
        elif has_exited and reported is None:
            self._on_exit_unreported()
        return self._code

    def _has_exited(self) -> bool:
        if self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def _on_exit_unreported(self) -> None:
        now = time.monotonic()
        if self._exited_at is None:
            self._exited_at = now
        fork_server = self._fork_server.process()
        is_fork_server_stopped = fork_server is not None and is_stopped(fork_server)
        if not is_fork_server_stopped and now - self._exited_at < _EXIT_REPORT_TIMEOUT_S:
            return
        how = "it is stopped" if is_fork_server_stopped else f"for {_EXIT_REPORT_TIMEOUT_S:g} s"
        self._fork_server.replace(
            f"worker pid {self.pid} exited, and its fork server did not report how ({how}); "
            f"its exit status is unknown, reported as {ExitCode.UNKNOWN}"
        )
        self._set_code(ExitCode.UNKNOWN)

    def _set_code(self, code: int) -> None:
        self._code = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker (pid {self.pid})", timeout or 0.0)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)


def _serve(env: dict[str, str]) -> None:
    """The forked worker's main: its own environment, then the usual worker."""
    os.environ.clear()
    os.environ.update(env)
    # Its command line is the fork server's until renamed (ps, top, pkill -f).
    setproctitle(f"{WORKER_TITLE} {env.get('WORKER_ENDPOINT', '')}".rstrip())
    from worker.serve.main import main

    main([])


# The one fork server of this process: multiprocessing keeps one per process.
FORK_SERVER = ForkServer()
