"""How a worker that `minibatch-serve` started tells it that it came up (its model
loaded and its socket bound), whichever peer hears its hello first.

A replacement worker's first request can kill it before the supervisor's own
ping is answered: a frontend sends it the instant the worker says hello to it.
That death is most likely the request's doing (a poison request, which the
frontends fail after MAX_WORKER_DEATHS), not a start that fails; counted as
one, five such requests in a row ended the whole stack as a crash loop.

So the supervisor listens on a datagram socket of its own (Linux's abstract
namespace: no file to leave behind, whatever ends the supervisor), named in
MINIBATCH_READY_SOCKET, and each worker sends it a note once it has come up, as
systemd's NOTIFY_SOCKET does. The kernel attaches the sender's process id
(SO_PASSCRED), so a note speaks only for the process that sent it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct

READY_SOCKET_ENV = "MINIBATCH_READY_SOCKET"

_NOTE = b"READY=1"
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid

log = logging.getLogger(__name__)


def note_ready() -> None:
    """The worker's side: tell the supervisor that started it, if one did. Never
    waits: a note that finds the supervisor's queue full is dropped, with a
    warning (a death then counts as a failed start)."""
    name = os.environ.get(READY_SOCKET_ENV)
    if not name:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(_NOTE, socket.MSG_DONTWAIT, _address(name))
    except OSError as exc:
        log.warning("could not tell the supervisor this worker is up (%s): %s", name, exc)


class ReadyListener:
    """The supervisor's side: which of its workers' processes said they came up."""

    def __init__(self) -> None:
        self.name = f"@minibatch-ready-{os.getpid()}-{secrets.token_hex(8)}"
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._socket.bind(_address(self.name))
        self._socket.setblocking(False)
        self._pids: set[int] = set()

    def poll(self, workers: set[int]) -> None:
        """Read every note waiting (at each turn: the queue holds only a few), and
        keep those of the processes in ``workers``, the workers running now."""
        while True:
            try:
                _, ancillary, _, _ = self._socket.recvmsg(16, socket.CMSG_SPACE(_CREDENTIALS.size))
            except BlockingIOError:
                break
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid, _, _ = _CREDENTIALS.unpack(data[: _CREDENTIALS.size])
                    if pid in workers:
                        self._pids.add(pid)
        self._pids &= workers

    def came_up(self, pid: int) -> bool:
        """Whether the process ``pid``, a worker that just died, said it came up."""
        if pid in self._pids:
            self._pids.remove(pid)
            return True
        return False

    def close(self) -> None:
        self._socket.close()


def _address(name: str) -> bytes:
    """``@name`` as the abstract address it stands for (a NUL, then the name)."""
    return b"\0" + name.removeprefix("@").encode()
