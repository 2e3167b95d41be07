"""The exit codes the serving processes (worker, frontend, supervisor) end with
on purpose, in one place. docs/operations.md's table lists the same codes
(tests/test_exit_codes.py holds them equal): a supervisor, systemd or Docker
reads them to decide what to do next. The tools keep their own: a health probe
exits 1 for any failure, and the kernels' build 128 + the signal that stopped it."""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    STOPPED = 0  # stopped as asked
    GAVE_UP = 1  # the supervisor, in a crash loop with none of its kind serving
    BAD_FLAG = 2  # argparse's, for a flag the process does not take
    ENGINE_WEDGED = 3  # the worker's watchdog: no progress with work waiting
    THREAD_DIED = 4  # one of the process's own threads or background tasks failed
    ENGINE_BROKEN = 5  # the worker's engine failed every try: a new worker replaces it
    FAKE_CRASH = 70  # MODEL_ID=fake admitted FAKE_CRASH_PROMPT
    # sysexits.h's EX_CONFIG: a refused setting, so the supervisor does not start
    # the process again, as the same settings fail the same way.
    CONFIG_ERROR = 78
    INTERRUPTED = 128 + signal.SIGINT  # what shells report for a ^C
    # What multiprocessing reports for a child whose fork server went away, and
    # what is reported for a worker whose exit its fork server could not report.
    UNKNOWN = 255
