"""How a worker that `minibatch-serve` started tells it that it came up (its model
loaded, about to bind its socket), whichever peer hears its hello first.

A replacement worker's first request can kill it before the supervisor's own
ping is answered: a frontend sends it the instant the worker says hello to it.
That death is most likely the request's doing (a poison request, which the
frontends fail after MAX_WORKER_DEATHS), not a start that fails; counted as
one, five such requests in a row ended the whole stack as a crash loop.

So the supervisor listens on a datagram socket of its own (Linux's abstract
namespace: no file to leave behind, whatever ends the supervisor), named in
MINIBATCH_READY_SOCKET, and each worker sends it its process id once it has come
up, as systemd's NOTIFY_SOCKET does.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket

READY_SOCKET_ENV = "MINIBATCH_READY_SOCKET"

log = logging.getLogger(__name__)


def note_ready() -> None:
    """The worker's side: tell the supervisor that started it, if one did."""
    name = os.environ.get(READY_SOCKET_ENV)
    if not name:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(str(os.getpid()).encode(), _address(name))
    except OSError as exc:  # the supervisor then counts a death as a failed start
        log.warning("could not tell the supervisor this worker is up (%s): %s", name, exc)


class ReadyListener:
    """The supervisor's side: which of its workers' processes said they came up."""

    def __init__(self) -> None:
        self.name = f"@minibatch-ready-{os.getpid()}-{secrets.token_hex(8)}"
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(_address(self.name))
        self._socket.setblocking(False)
        self._pids: set[int] = set()

    def came_up(self, pid: int) -> bool:
        """Whether the process ``pid`` said it came up; asked once, at its death
        (so that a later process given the same id starts afresh)."""
        while True:
            try:
                note = self._socket.recv(64)
            except BlockingIOError:
                break
            if note.isdigit():
                self._pids.add(int(note))
        if pid in self._pids:
            self._pids.remove(pid)
            return True
        return False

    def close(self) -> None:
        self._socket.close()


def _address(name: str) -> bytes:
    """``@name`` as the abstract address it stands for (a NUL, then the name)."""
    return b"\0" + name.removeprefix("@").encode()
