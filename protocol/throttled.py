"""Warnings about what a peer sends, at most one a second: a peer that floods a
socket with garbage must not flood the log too. Both sides read frames from
peers they do not trust."""

from __future__ import annotations

import logging
import time


class Throttled:
    """One kind of warning, logged at most once a second, with a count of those
    left out since the last one."""

    def __init__(self, logger: logging.Logger, what: str, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.what = what
        self.level = level
        self.next_at = 0.0
        self.num_suppressed = 0

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.num_suppressed += 1
            return
        more = (
            f" ({self.num_suppressed} more {self.what} not logged)" if self.num_suppressed else ""
        )
        self.logger.log(self.level, "%s%s", message, more)
        self.next_at = now + 1.0
        self.num_suppressed = 0
