"""A process that `minibatch-serve` started ends when the supervisor does.

The supervisor stops its children when it is told to stop, but one that is
SIGKILLed (by hand, by the kernel's OOM killer, by a service manager's last
resort) can stop nobody: its frontend and workers served on unsupervised, held
their ports, and made the next start fail. So the supervisor names itself in
MINIBATCH_SUPERVISOR_PID, and each child it starts, forked workers included,
watches that process through a pidfd and, once it is gone, sends itself SIGTERM:
the usual graceful stop. A process started by hand has no such variable, and
lives on its own.

A child stopped (SIGSTOP) when the supervisor dies cannot watch anything: it
stayed, stopped, holding its port, until someone sent it SIGCONT. Linux sends it
that SIGCONT itself when its parent dies (`resume_when_parent_dies`), and it then
stops as above.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading

SUPERVISOR_PID_ENV = "MINIBATCH_SUPERVISOR_PID"

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = logging.getLogger(__name__)


def name_supervisor() -> None:
    """In the supervisor, before it starts anything: its children inherit this."""
    os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())


def is_supervised() -> bool:
    """Whether `minibatch-serve` started this process."""
    return os.environ.get(SUPERVISOR_PID_ENV, "").isdigit()


def follow_supervisor(process: str) -> None:
    """In a child: stop ``process`` (SIGTERM to itself) once the supervisor named
    in the environment is gone; nothing when none is named."""
    raw = os.environ.get(SUPERVISOR_PID_ENV, "")
    if not raw.isdigit() or not hasattr(os, "pidfd_open"):
        return
    resume_when_parent_dies()
    pid = int(raw)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        _stop(process, pid)
        return
    except OSError as exc:  # no pidfds here (Linux before 5.3): live on alone
        log.warning("%s cannot watch its supervisor (pid %d): %s", process, pid, exc)
        return
    watcher = threading.Thread(
        target=_stop_once_gone, args=(process, pid, pidfd), name="lifeline", daemon=True
    )
    watcher.start()


def resume_when_parent_dies() -> None:
    """Have Linux send this process SIGCONT when its parent dies (a forked worker's
    parent is the fork server, which follows the supervisor too): a stopped
    process resumes, to stop itself. Harmless to one that runs."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGCONT), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))


def _stop_once_gone(process: str, pid: int, pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once the process has exited
    os.close(pidfd)
    _stop(process, pid)


def _stop(process: str, pid: int) -> None:
    log.warning("%s: its supervisor (pid %d) is gone; stopping", process, pid)
    os.kill(os.getpid(), signal.SIGTERM)
