"""The engine thread's watchdog: a wedged engine ends its process."""

from __future__ import annotations

import logging
import os
import time

from protocol.exit_codes import ExitCode
from worker.serve.scheduler import Scheduler

log = logging.getLogger(__name__)


class Watchdog:
    """Ends the process when the engine thread is wedged: heartbeats alone would
    keep a stuck worker looking alive to a restart policy that cannot see progress
    (Docker's), and its requests would wait forever instead of being replayed."""

    def __init__(self, scheduler: Scheduler, timeout_s: float) -> None:
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.last_steps = -1
        self.last_progress_at = time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if self.scheduler.num_steps != self.last_steps or not self.scheduler.has_work():
            self.last_steps = self.scheduler.num_steps
            self.last_progress_at = now
        elif now - self.last_progress_at > self.timeout_s:
            log.critical(
                "the engine made no progress for %.0f s with work pending "
                "(ENGINE_WATCHDOG_S=%g); exiting so that a new worker replaces this one",
                now - self.last_progress_at,
                self.timeout_s,
            )
            logging.shutdown()
            os._exit(ExitCode.ENGINE_WEDGED)
