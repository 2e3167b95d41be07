"""What the worker's I/O thread hands its engine thread: each message with when
it was received (a request's queue time starts there, not when a long step lets
it in), and a count of the requests among them, which heartbeats report as
queued. Aborts and the like are no requests: counted, a burst of client
disconnects made a worker look full to every frontend until the next heartbeat."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from protocol import GenerateRequest, ToWorker


class Inbox:
    def __init__(self) -> None:
        # Not SimpleQueue: on CPython 3.11 its get(timeout=...) waits forever once a
        # signal handler runs past the timeout (it waits again for what is left,
        # below zero), and the engine thread, which runs the handlers, waits here:
        # an idle worker told to stop hung until SIGKILL.
        self._queue: queue.Queue[tuple[ToWorker, float]] = queue.Queue()
        self._lock = threading.Lock()  # put and drain run on different threads
        self._num_requests = 0

    @property
    def num_requests(self) -> int:
        """Requests in the inbox, or being applied: a request is counted before
        it goes in, and uncounted once applied (the scheduler counts it then),
        so a heartbeat that reads this and then the scheduler's queue never
        misses one."""
        return self._num_requests

    def put(self, message: ToWorker) -> None:
        if isinstance(message, GenerateRequest):
            with self._lock:
                self._num_requests += 1
        self._queue.put((message, time.monotonic()))

    def drain(
        self, apply: Callable[[ToWorker, float], None], timeout_s: float | None = None
    ) -> None:
        """``apply`` each message waiting, in order, with when it was received;
        with ``timeout_s``, wait that long for the first."""
        try:
            item = (
                self._queue.get_nowait()
                if timeout_s is None
                else self._queue.get(timeout=timeout_s)
            )
            while True:
                try:
                    apply(*item)
                finally:
                    if isinstance(item[0], GenerateRequest):
                        with self._lock:
                            self._num_requests -= 1
                item = self._queue.get_nowait()
        except queue.Empty:
            return

    def take_request_ids(self) -> list[str]:
        """Take everything waiting; the ids of the requests among it (a stopping
        worker hands them back)."""
        request_ids: list[str] = []

        def note(message: ToWorker, _: float) -> None:
            if isinstance(message, GenerateRequest):
                request_ids.append(message.request_id)

        self.drain(note)
        return request_ids
