"""Warnings about what a peer sends, at most one a second: a peer that floods a
socket with garbage must not flood the log too. Both sides read frames from
peers they do not trust."""

from __future__ import annotations

import atexit
import logging
import time
import weakref


class _OnceASecond:
    """The rule both throttles keep: one line a second, the next one counting the
    lines left out meanwhile."""

    def __init__(self) -> None:
        self.next_at = 0.0
        self.num_suppressed = 0

    def admit(self) -> int | None:
        """None if a line now is to be left out; else how many were left out since
        the last one admitted."""
        now = time.monotonic()
        if now < self.next_at:
            self.num_suppressed += 1
            return None
        num_suppressed, self.num_suppressed = self.num_suppressed, 0
        self.next_at = now + 1.0
        return num_suppressed


class Throttled:
    """One kind of warning, logged at most once a second, with a count of those
    left out since the last one."""

    def __init__(self, logger: logging.Logger, what: str, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.what = what
        self.level = level
        self.rule = _OnceASecond()

        _every_throttle.add(self)

    def warn(self, message: str, exc_info: bool = False) -> None:
        """``exc_info``: with the traceback of the exception being handled."""
        num_suppressed = self.rule.admit()
        if num_suppressed is None:
            return
        more = f" ({num_suppressed} more {self.what} not logged)" if num_suppressed else ""
        self.logger.log(self.level, "%s%s", message, more, exc_info=exc_info)

    def flush(self) -> None:
        """Log how many lines were left out since the last one, if any."""
        num_suppressed, self.rule.num_suppressed = self.rule.num_suppressed, 0
        if num_suppressed:
            self.logger.log(self.level, "%d more %s not logged", num_suppressed, self.what)


_every_throttle: weakref.WeakSet[Throttled] = weakref.WeakSet()


@atexit.register
def flush_every_throttle() -> None:
    """At exit, the count of each throttle's lines left out since its last one: a
    stopping frontend's 503s were logged as one line, the count to follow with
    a next line that never came. (Registered after `logging`'s own exit
    handler, so it runs before that one shuts the handlers.)"""
    for throttle in list(_every_throttle):
        throttle.flush()


_MAX_TEMPLATES = 256


class ThrottleWarnings(logging.Filter):
    """For a library's logger whose warnings a peer triggers at will (uvicorn's
    "Invalid HTTP request received." for each malformed request): each warning
    (or error) of the same message template passes at most once a second, with a
    count of those left out. Lower levels pass untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.rules: dict[object, _OnceASecond] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        # A template is a library's constant text; anything else logged (an
        # exception, a dict) is throttled by its type.
        key = record.msg if isinstance(record.msg, str) else type(record.msg)
        if key not in self.rules and len(self.rules) >= _MAX_TEMPLATES:
            self.rules.clear()  # a library that logs ever new texts, not templates
        rule = self.rules.setdefault(key, _OnceASecond())
        num_suppressed = rule.admit()
        if num_suppressed is None:
            return False
        if num_suppressed:
            # rstrip: uvicorn's "Exception in ASGI application\n" put the count on
            # a line of its own.
            record.msg = f"{record.getMessage().rstrip()} ({num_suppressed} more not logged)"
            record.args = None
        return True
