"""A worker's note to its supervisor that it came up (`worker.launch.readiness`)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest

from worker.launch.readiness import READY_SOCKET_ENV, ReadyListener, note_ready


def test_a_note_is_heard_once_for_the_process_that_sent_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener = ReadyListener()
    try:
        monkeypatch.setenv(READY_SOCKET_ENV, listener.name)
        note_ready()
        assert not listener.came_up(os.getpid() + 1)
        assert listener.came_up(os.getpid())
        assert not listener.came_up(os.getpid())  # asked once: a reused id starts afresh
    finally:
        listener.close()


def test_a_child_process_is_heard_by_its_own_id_and_garbage_is_not() -> None:
    listener = ReadyListener()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
            other.sendto(b"not a pid", b"\0" + listener.name.removeprefix("@").encode())
        script = "from worker.launch.readiness import note_ready; note_ready()"
        env = {**os.environ, READY_SOCKET_ENV: listener.name}
        child = subprocess.Popen([sys.executable, "-c", script], env=env)
        assert child.wait(timeout=30) == 0
        assert listener.came_up(child.pid)
    finally:
        listener.close()


def test_a_worker_without_a_supervisor_or_with_a_gone_one_sends_nothing_and_serves_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(READY_SOCKET_ENV, raising=False)
    note_ready()
    monkeypatch.setenv(READY_SOCKET_ENV, "@minibatch-ready-nobody-listens")
    with caplog.at_level(logging.WARNING, logger="worker.launch.readiness"):
        note_ready()
    assert "could not tell the supervisor this worker is up" in caplog.text
