"""The worker's inbox counts the requests in it, and only those."""

from __future__ import annotations

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
