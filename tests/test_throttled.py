"""Log throttles: a peer that triggers a warning at will gets one line a second."""

from __future__ import annotations

import logging

import pytest

from protocol import throttled
from protocol.throttled import ThrottleWarnings
from tests.fake_clock import FakeClock


def test_a_repeated_warning_passes_once_a_second_with_a_count_of_those_left_out(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("test_throttled.repeated")
    logger.addFilter(ThrottleWarnings())
    with caplog.at_level(logging.INFO, logger=logger.name):
        for _ in range(50):
            logger.warning("Invalid HTTP request received.")
            logger.warning("peer %s sent %d bytes", "a", 3)
            logger.info("started")  # below warnings: never throttled
        clock.now += 1.0
        logger.warning("Invalid HTTP request received.")
        logger.warning("peer %s sent %d bytes", "b", 4)
    lines = [record.getMessage() for record in caplog.records]
    assert lines.count("started") == 50
    assert [line for line in lines if line != "started"] == [
        "Invalid HTTP request received.",
        "peer a sent 3 bytes",
        "Invalid HTTP request received. (49 more not logged)",
        "peer b sent 4 bytes (49 more not logged)",
    ]


def test_a_logger_of_ever_new_texts_keeps_a_bounded_table(clock: FakeClock) -> None:
    throttle = ThrottleWarnings()
    logger = logging.getLogger("test_throttled.new_texts")
    for i in range(10_000):
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, f"t{i}", None, None)
        assert throttle.filter(record)
    assert len(throttle.rules) <= throttled._MAX_TEMPLATES


def test_what_is_logged_need_not_be_text(clock: FakeClock) -> None:
    throttle = ThrottleWarnings()
    logger = logging.getLogger("test_throttled.objects")
    for msg in ({"a": 1}, {"b": 2}):  # unhashable; the second within the second
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, msg, None, None)
        assert throttle.filter(record) is (msg == {"a": 1})


def test_what_was_left_out_is_counted_at_exit(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopping frontend's 503s were one line: the count of the rest waited
    for a next line that never came."""
    logger = logging.getLogger("test_throttled.at_exit")
    refused = throttled.Throttled(logger, "failed requests")
    with caplog.at_level(logging.INFO, logger=logger.name):
        for _ in range(6):
            refused.warn("POST /generate: 503 shutting_down")
        throttled.flush_every_throttle()
        throttled.flush_every_throttle()  # counted once
    # Its own lines: every throttle alive is flushed, other tests' too.
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == [
        "POST /generate: 503 shutting_down",
        "5 more failed requests not logged",
    ]


def test_a_throttled_failure_keeps_its_traceback_once_a_second(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure that repeats every engine step logs one traceback a second."""
    failures = throttled.Throttled(logging.getLogger("test_throttled.failures"), "failures")
    with caplog.at_level(logging.WARNING, logger="test_throttled.failures"):
        for _ in range(100):
            try:
                raise RuntimeError("broken")
            except RuntimeError:
                failures.warn("it failed", exc_info=True)
    assert len(caplog.records) == 1
    assert caplog.records[0].exc_info is not None
    assert "RuntimeError: broken" in caplog.text
