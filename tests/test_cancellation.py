"""A client that hangs up, streaming or not, aborts its request in the worker and
frees its slot within a step or two (the worker's counts come from /health)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.api_stack import ApiStack, api_stack, sse_events

STEP_DELAY_S = 0.05
CAPACITY = 2
LONG = 400  # tokens: 20 s of generation, far longer than any test waits
FREED_WITHIN_S = 1.0  # a few steps plus a heartbeat interval


@pytest.fixture(scope="module")
def stack() -> Iterator[ApiStack]:
    with api_stack(FAKE_STEP_DELAY_S=STEP_DELAY_S, MAX_BATCH_SIZE=CAPACITY) as stack:
        yield stack


@pytest.fixture(autouse=True)
def starts_idle(stack: ApiStack) -> None:
    stack.wait_until("idle", lambda h: h["active"] == 0 and h["queued"] == 0)


def hang_up_after_first_token(stack: ApiStack, prompt: str) -> None:
    body = {"prompt": prompt, "max_new_tokens": LONG, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/generate", json=body, timeout=10) as response:
        event, _ = next(sse_events(response))
        assert event == "token"
    # Leaving the block closes the connection mid-stream.


def test_streaming_client_hanging_up_frees_its_slot(stack: ApiStack) -> None:
    hang_up_after_first_token(stack, "stream")
    health = stack.wait_until(
        "freed", lambda h: h["active"] == 0 and h["inflight"] == 0, FREED_WITHIN_S
    )
    assert health["queued"] == 0


def test_non_streaming_client_hanging_up_frees_its_slot(stack: ApiStack) -> None:
    body = {"prompt": "plain", "max_new_tokens": LONG}
    hang_up = threading.Thread(target=post_and_hang_up, args=(stack, body, 0.5))
    hang_up.start()
    stack.wait_until("running", lambda h: h["active"] == 1)
    hang_up.join()
    stack.wait_until("freed", lambda h: h["active"] == 0 and h["inflight"] == 0, FREED_WITHIN_S)


def post_and_hang_up(stack: ApiStack, body: dict[str, object], after_s: float) -> None:
    # The read timeout makes httpx give up and close the connection.
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{stack.base_url}/generate", json=body, timeout=httpx.Timeout(5, read=after_s))
        raise AssertionError("the request finished before the client hung up")


def test_hanging_up_while_queued_removes_the_request_from_the_queue(stack: ApiStack) -> None:
    with contextlib.ExitStack() as streams:
        readers = []  # a dropped reader would close its stream: keep each one
        for i in range(CAPACITY):
            body = {"prompt": f"busy {i}", "max_new_tokens": LONG, "stream": True}
            response = streams.enter_context(
                httpx.stream("POST", f"{stack.base_url}/generate", json=body, timeout=10)
            )
            readers.append(sse_events(response))
            next(readers[-1])
        queued = {"prompt": "waiting", "max_new_tokens": LONG}
        hang_up = threading.Thread(target=post_and_hang_up, args=(stack, queued, 0.5))
        hang_up.start()
        stack.wait_until("queued", lambda h: h["queued"] == 1)
        hang_up.join()
        health = stack.wait_until("dequeued", lambda h: h["queued"] == 0, FREED_WITHIN_S)
        assert health["active"] == CAPACITY
    stack.wait_until("freed", lambda h: h["active"] == 0, FREED_WITHIN_S)


def test_slots_freed_by_hang_ups_serve_the_next_request_at_once(stack: ApiStack) -> None:
    for i in range(CAPACITY):
        hang_up_after_first_token(stack, f"full {i}")
    answer = httpx.post(
        f"{stack.base_url}/generate", json={"prompt": "next", "max_new_tokens": 3}, timeout=10
    ).json()
    assert answer["finish_reason"] == "length"
    # Had the hung-up requests kept their slots, this one would queue for ~20 s.
    assert answer["metrics"]["e2e_ms"] < 2000


def test_hang_ups_are_counted_as_aborted_requests(stack: ApiStack) -> None:
    hang_up_after_first_token(stack, "counted")
    stack.wait_until("freed", lambda h: h["active"] == 0, FREED_WITHIN_S)
    metrics = httpx.get(f"{stack.base_url}/metrics", timeout=5).text
    assert 'minibatch_requests_total{endpoint="/generate",finish_reason="abort",status="499"}' in (
        metrics
    )
