"""The worker's inbox counts the requests in it, and only those."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from protocol import AbortRequest, GenerateRequest, ToWorker
from worker.serve.inbox import Inbox


def test_only_requests_count_and_each_until_it_is_applied() -> None:
    inbox = Inbox()
    inbox.put(GenerateRequest("r", "hi", 4))
    for i in range(100):  # a burst of client disconnects
        inbox.put(AbortRequest(f"gone{i}"))
    assert inbox.num_requests == 1
    counted_while_applied: list[int] = []

    def apply(message: ToWorker, received_at: float) -> None:
        assert received_at > 0
        if isinstance(message, GenerateRequest):
            counted_while_applied.append(inbox.num_requests)

    inbox.drain(apply)
    # Until the scheduler has it, a heartbeat must still count it here.
    assert counted_while_applied == [1]
    assert inbox.num_requests == 0
    inbox.drain(apply, timeout_s=0.01)  # nothing waits: returns after the timeout
    assert inbox.num_requests == 0


def test_a_wait_that_a_slow_signal_handler_outlives_still_ends() -> None:
    """A handler (the worker's stop signal's logs a line) that ran past the wait's
    timeout left SimpleQueue's wait waiting forever: an idle worker told to stop
    never looked at its stop flag again, and hung until SIGKILL."""
    code = textwrap.dedent(
        """
        import signal, time
        from worker.serve.inbox import Inbox
        signal.signal(signal.SIGALRM, lambda *_: time.sleep(0.3))
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        Inbox().drain(lambda *_: None, timeout_s=0.1)
        """
    )
    subprocess.run([sys.executable, "-c", code], timeout=10, check=True)
