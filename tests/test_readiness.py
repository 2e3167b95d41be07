"""A worker's note to its supervisor that it came up (`worker.serve.readiness`)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest

from worker.serve.readiness import READY_SOCKET_ENV, ReadyListener, note_ready


def test_a_note_is_heard_once_for_the_process_that_sent_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener = ReadyListener()
    try:
        monkeypatch.setenv(READY_SOCKET_ENV, listener.name)
        note_ready()
        listener.poll({os.getpid()})
        assert not listener.came_up(os.getpid() + 1)
        assert listener.came_up(os.getpid())
        assert not listener.came_up(os.getpid())  # asked once: a reused id starts afresh
    finally:
        listener.close()


def test_a_note_speaks_for_its_sender_whatever_it_says() -> None:
    """The kernel names the sender: another process cannot speak for a worker,
    and notes from processes that are no workers are not kept."""
    listener = ReadyListener()
    try:
        script = "from worker.serve.readiness import note_ready; note_ready()"
        env = {**os.environ, READY_SOCKET_ENV: listener.name}
        child = subprocess.Popen([sys.executable, "-c", script], env=env)
        assert child.wait(timeout=30) == 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as forger:
            address = b"\0" + listener.name.removeprefix("@").encode()
            forger.sendto(str(child.pid + 1).encode(), address)
        listener.poll({child.pid, child.pid + 1})
        assert not listener.came_up(child.pid + 1)
        assert listener.came_up(child.pid)
    finally:
        listener.close()


def test_notes_past_a_full_queue_are_dropped_never_waited_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel queues a handful of datagrams (net.unix.max_dgram_qlen, 10 by
    default): a blocking send would have held the twelfth worker's start."""
    listener = ReadyListener()
    try:
        monkeypatch.setenv(READY_SOCKET_ENV, listener.name)
        with caplog.at_level(logging.WARNING, logger="worker.serve.readiness"):
            for _ in range(100):
                note_ready()
        assert "could not tell the supervisor this worker is up" in caplog.text
    finally:
        listener.close()


def test_a_worker_with_no_supervisor_sends_nothing_and_one_whose_is_gone_serves_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(READY_SOCKET_ENV, raising=False)
    sent: list[object] = []
    monkeypatch.setattr(socket, "socket", lambda *args: sent.append(args))
    note_ready()
    assert sent == []
    monkeypatch.undo()
    monkeypatch.setenv(READY_SOCKET_ENV, "@minibatch-ready-nobody-listens")
    with caplog.at_level(logging.WARNING, logger="worker.serve.readiness"):
        note_ready()
    assert "could not tell the supervisor this worker is up" in caplog.text
