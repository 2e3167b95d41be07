"""The worker's inbox counts the requests in it, and only those."""

from __future__ import annotations

import queue

import pytest

from protocol import AbortRequest, GenerateRequest
from worker.serve.inbox import Inbox


def test_only_requests_count_as_queued_and_each_until_it_is_taken() -> None:
    inbox = Inbox()
    inbox.put(GenerateRequest("r", "hi", 4))
    for i in range(100):  # a burst of client disconnects
        inbox.put(AbortRequest(f"gone{i}"))
    assert inbox.num_requests == 1
    message, received_at = inbox.get()
    assert isinstance(message, GenerateRequest) and received_at > 0
    assert inbox.num_requests == 0
    for _ in range(100):
        inbox.get(timeout_s=0.01)
    with pytest.raises(queue.Empty):
        inbox.get(timeout_s=0.01)
    assert inbox.num_requests == 0
