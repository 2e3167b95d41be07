"""One supervised process and its restart policy: start it (from scratch or forked
warm), notice it died, back off before a restart, and give up on a crash loop."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import psutil

from protocol.exit_codes import ExitCode
from worker.launch.config import SupervisorConfig
from worker.launch.warm_start import FORK_SERVER, ForkedWorker, is_stopped

log = logging.getLogger("supervisor")

# How long a child told to stop (SIGTERM) has before it is killed.
KILL_AFTER_S = 5.0

# How a process ends when stopped from outside, not failing: killed by a signal no
# process sends itself, or exiting after a graceful stop on one (0; 130, as after
# ^C), or with a status its fork server could not report. A crash is SIGSEGV,
# SIGABRT, another exit code.
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
_STOPPED_EXIT_CODES = frozenset({ExitCode.STOPPED, ExitCode.INTERRUPTED, ExitCode.UNKNOWN})


class CrashLoop(Exception):
    """A child died before coming up CRASH_LOOP_LIMIT times in a row while no other
    of its kind served, or refused its configuration once; ``exit_code`` is the
    supervisor's."""

    def __init__(self, message: str, exit_code: int = ExitCode.GAVE_UP) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Child:
    """One supervised process and its restart policy."""

    def __init__(
        self,
        name: str,
        module: str,
        config: SupervisorConfig,
        served_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        env: Mapping[str, str] | None = None,
        is_forked: bool = False,
        is_worker: bool = False,
    ) -> None:
        """``is_forked``: a worker forked from the warm fork server
        (`worker.launch.warm_start`) rather than started from scratch as ``module``.
        ``is_worker``: a worker, which requests may kill once it came up."""
        self.name = name
        self.argv = [sys.executable, "-m", module]
        self.env = None if env is None else dict(env)
        self.is_forked = is_forked
        self.is_worker = is_worker
        self.awaiting_fork_server_since: float | None = None
        self.config = config
        self.served_after_s = served_after_s
        self.process: subprocess.Popen[bytes] | ForkedWorker | None = None
        self.num_restarts = 0
        self.num_failed_starts = 0  # in a row, died before serving
        self.num_starts_never_up = 0  # in a row, died before coming up (its backoff grows)
        self.has_served = False
        # Since this supervisor started, seen working (a worker: its hello; a
        # frontend: serving): its settings work.
        self.has_ever_come_up = False
        self.started_at = 0.0
        self.up_since: float | None = None  # first seen working (a worker: its hello)
        self.kill_reason: str | None = None
        self.was_frozen = False  # killed by this supervisor while stopped (SIGSTOP)
        self.restart_at = 0.0  # when a stopped child may start again, by its clock
        self._stopped_since: float | None = None  # seen stopped (SIGSTOP) since
        self._clock = clock

    def start(self) -> None:
        if self.is_forked:
            forked = self._is_fork_server_ready() and FORK_SERVER.fork(
                os.environ if self.env is None else self.env
            )
            if not forked:
                return  # not started: the supervisor asks again next tick
            self.process = forked
        else:
            self.process = subprocess.Popen(self.argv, env=self.env)
        self.has_served = False
        self.started_at = self._clock()
        self.up_since = None
        self.kill_reason = None
        self.was_frozen = False
        self._stopped_since = None
        log.info("started %s (pid %d)", self.name, self.process.pid)

    def is_due_to_start(self) -> bool:
        """Not running, and past its restart's delay (at once the first time)."""
        return self.process is None and self._clock() >= self.restart_at

    def running_for_s(self) -> float:
        """How long since its process started."""
        return self._clock() - self.started_at

    def _is_fork_server_ready(self) -> bool:
        """True once the fork server can fork this worker. One that is not up within
        WORKER_START_TIMEOUT_S is given up on: this worker starts from scratch."""
        if FORK_SERVER.check_up():
            self.awaiting_fork_server_since = None
            return True
        FORK_SERVER.replace_if_stopped()  # else it would be waited for until the timeout
        FORK_SERVER.warm_up()  # unless given up on: then no fork server is brought up
        now = self._clock()
        if self.awaiting_fork_server_since is None:
            self.awaiting_fork_server_since = now
        if FORK_SERVER.failure is not None:
            why = f"it could not start ({FORK_SERVER.failure})"
        elif now - self.awaiting_fork_server_since > self.config.worker_start_timeout_s:
            why = (
                f"it is not up {self.config.worker_start_timeout_s:g} s after it started "
                "(WORKER_START_TIMEOUT_S): is preloading the model stuck?"
            )
        else:
            return False
        log.error("no warm starts: %s; %s starts from scratch from now on", why, self.name)
        self.is_forked = False
        return False

    def on_up(self, has_worked: bool = False) -> None:
        """The child is seen working; ``has_worked``: it has run a step or answered
        a request (a worker's heartbeat says so)."""
        now = self._clock()
        if self.up_since is None:
            self.up_since = now
        if has_worked or now - self.up_since >= self.served_after_s:
            self.has_served = True
        # A frontend is taken for up as soon as it runs: only serving shows that
        # it took its settings (its port among them).
        self.has_ever_come_up |= self.is_worker or self.has_served

    def exit_cause(self) -> str | None:
        """Why the process ended, or None while it runs."""
        if self.process is None or (code := self.process.poll()) is None:
            return None
        if code >= 0:
            return f"exit code {code}"
        cause = f"killed by {_signal_name(-code)}"
        return cause if self.kill_reason is None else f"{cause}: {self.kill_reason}"

    def is_stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, a debugger)."""
        if self.process is None:
            return False
        try:
            return is_stopped(psutil.Process(self.process.pid))
        except psutil.NoSuchProcess:
            return False

    def stopped_for_s(self) -> float:
        """How long the process has been seen stopped without a break; 0 if it is
        not stopped now."""
        if not self.is_stopped():
            self._stopped_since = None
            return 0.0
        now = self._clock()
        if self._stopped_since is None:
            self._stopped_since = now
        return now - self._stopped_since

    @property
    def serves(self) -> bool:
        """It is seen working since it started, or it is being restarted after a run
        that served (a kill of a healthy child does not make it a failing one)."""
        is_up = self.process is not None and self.up_since is not None
        return is_up or (self.num_failed_starts == 0 and self.num_restarts > 0)

    def schedule_restart(self, cause: str, others_serve: bool = False) -> None:
        """Restart after a backoff (`restart_delay_s`). Raises CrashLoop when the
        child refused its configuration, or died before coming up (a worker: before
        its hello, or its note to `readiness`) CRASH_LOOP_LIMIT times in a row while
        no other child of its kind serves (``others_serve``): with one that does,
        the stack still serves, and this one is retried with its backoff.

        A worker that came up and then died before serving is retried however
        often: its start works, and what kills it is most likely a request (its
        first, run right after its hello), which the frontends fail after
        MAX_WORKER_DEATHS. Counted as a crash loop, five such requests in a row
        ended the whole stack. Unless it ended itself as broken (exit 4 or 5).

        A child that refused its configuration at its first start is given up on
        at once; one that had come up before with the same settings refused what
        they name for now (its port, taken by another program for a moment): a
        start that failed, retried as any other."""
        if self.process is not None and self.process.poll() == ExitCode.CONFIG_ERROR:
            if not self.has_ever_come_up:
                raise CrashLoop(
                    f"{self.name} refused its configuration ({cause}), which would fail "
                    "the same way at every start; its log above names the setting. Fix it "
                    "and start again",
                    ExitCode.CONFIG_ERROR,
                )
            log.error(
                "%s refused at a restart the settings it had come up with (%s): most likely "
                "what they name is not to be had for now (a port another program holds); "
                "its log above says which; retried",
                self.name,
                cause,
            )
        is_failed_start = not self.has_served and not self._was_stopped_from_outside()
        never_came_up = is_failed_start and (
            not self.is_worker or self.up_since is None or self._judged_itself_broken()
        )
        self.process = None
        self.num_failed_starts = self.num_failed_starts + 1 if is_failed_start else 0
        self.num_starts_never_up = self.num_starts_never_up + 1 if never_came_up else 0
        if self.num_starts_never_up >= self.config.crash_loop_limit:
            before = "coming up" if self.is_worker else "serving"
            why = (
                f"{self.name} died before {before} {self.num_starts_never_up} times in a "
                f"row (last: {cause}); its log above says why"
            )
            if not others_serve:
                raise CrashLoop(
                    f"{why}. Fix that (for a worker, often a model that cannot load, or a "
                    "start slower than WORKER_START_TIMEOUT_S) and start again"
                )
            log.error("%s; the others serve meanwhile, and it is retried", why)
        elif is_failed_start and not never_came_up:
            log.error(
                "%s died after coming up, before serving (%d times in a row; retried): "
                "for a worker, most likely a request that crashes each worker "
                "that runs it, which the frontends fail after MAX_WORKER_DEATHS; its log "
                "above says why",
                self.name,
                self.num_failed_starts,
            )
        delay = self.restart_delay_s()
        self.num_restarts += 1
        self.restart_at = self._clock() + delay
        log.warning(
            "%s stopped (%s); restart #%d in %.1f s", self.name, cause, self.num_restarts, delay
        )

    def _judged_itself_broken(self) -> bool:
        """A worker that ended itself as broken: its engine failed whatever it
        was given, or one of its threads died. No request's doing: a start that
        fails, however far it got."""
        code = self.process.poll() if self.process is not None else None
        return code in (ExitCode.ENGINE_BROKEN, ExitCode.THREAD_DIED)

    def _was_stopped_from_outside(self) -> bool:
        """Its start did not fail: it had come up and was ended from outside (a
        kill, an operator's drill, the OOM killer) rather than by this
        supervisor's verdict, or this supervisor killed it because someone had
        stopped it (SIGSTOP). Such kills, every few seconds, ended the stack as
        a crash loop."""
        if self.process is None:
            return False
        if self.was_frozen:
            return True
        if self.up_since is None or self.kill_reason is not None:
            return False
        code = self.process.poll()
        return code is not None and (-code in _OUTSIDE_SIGNALS or code in _STOPPED_EXIT_CODES)

    def restart_delay_s(self) -> float:
        """No wait after a child that had served: its death says nothing of the next
        start, and its share of the work waits meanwhile. RESTART_BACKOFF_S after
        one that came up and died before serving: most likely a request's doing,
        and a growing wait would let a stream of such requests keep every worker
        down (after eight in a row, the next request waited 10 s). After one that
        died before coming up, RESTART_BACKOFF_S doubling with each such death in a
        row."""
        if self.num_failed_starts == 0:
            return 0.0
        if self.num_starts_never_up == 0:
            return self.config.restart_backoff_s
        return min(
            self.config.restart_backoff_max_s,
            self.config.restart_backoff_s * 2.0 ** (self.num_starts_never_up - 1),
        )

    def kill(self, reason: str) -> None:
        if self.process is not None and self.process.poll() is None:
            log.error("killing %s (pid %d): %s", self.name, self.process.pid, reason)
            self.kill_reason = reason
            self.was_frozen = self.is_stopped()
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        stop_together([self])


def stop_together(children: Sequence[Child]) -> None:
    """SIGTERM to every one of ``children`` at once, then SIGKILL to those still
    running KILL_AFTER_S later: stopped one after another, three frontends each
    finishing their streams took 17 s, and the last served new requests meanwhile."""
    running = [c.process for c in children if c.process is not None and c.process.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + KILL_AFTER_S
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            name = next(c.name for c in children if c.process is process)
            log.warning(
                "%s (pid %d) did not stop within %g s: killed", name, process.pid, KILL_AFTER_S
            )
            process.kill()
            process.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals (SIGRTMIN+n) have no name of their own
        return f"signal {number}"
