"""A client that hangs up, streaming or not, aborts its request in the worker and
frees its slot within a step or two (the worker's counts come from /health)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.metrics_scrape import scrape, value
from tests.sse import sse_events
from tests.stack import Stack, running_stack

STEP_DELAY_S = 0.05
CAPACITY = 2
LONG = 400  # tokens: 20 s of generation, far longer than any test waits
FREED_WITHIN_S = 1.0  # a few steps plus a heartbeat interval


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {"FAKE_STEP_DELAY_S": str(STEP_DELAY_S), "MAX_BATCH_SIZE": str(CAPACITY)}
    with running_stack(tmp_path_factory.mktemp("stack"), overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


@pytest.fixture(autouse=True)
def starts_idle(stack: Stack) -> None:
    stack.wait_for_health("idle", lambda h: h["active"] == 0 and h["queued"] == 0)


def hang_up_after_first_token(stack: Stack, prompt: str) -> None:
    body = {"prompt": prompt, "max_new_tokens": LONG, "stream": True}
    with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=10) as response:
        event, _ = next(sse_events(response))
        assert event == "token"
    # Leaving the block closes the connection mid-stream.


def test_streaming_client_hanging_up_frees_its_slot(stack: Stack) -> None:
    hang_up_after_first_token(stack, "stream")
    # All three at once: a client that hangs up within a heartbeat interval of its
    # first token leaves /health on the heartbeat from before the request ran
    # (active 0, queued 1) until the next one comes.
    stack.wait_for_health(
        "freed",
        lambda h: h["active"] == 0 and h["inflight"] == 0 and h["queued"] == 0,
        FREED_WITHIN_S,
    )


def test_non_streaming_client_hanging_up_frees_its_slot(stack: Stack) -> None:
    body = {"prompt": "plain", "max_new_tokens": LONG}
    hang_up = threading.Thread(target=post_and_hang_up, args=(stack, body, 0.5))
    hang_up.start()
    stack.wait_for_health("running", lambda h: h["active"] == 1)
    hang_up.join()
    stack.wait_for_health(
        "freed", lambda h: h["active"] == 0 and h["inflight"] == 0, FREED_WITHIN_S
    )


def post_and_hang_up(stack: Stack, body: dict[str, object], after_s: float) -> None:
    # The read timeout makes httpx give up and close the connection.
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/generate", json=body, timeout=httpx.Timeout(5, read=after_s))
        raise AssertionError("the request finished before the client hung up")


def test_hanging_up_while_queued_removes_the_request_from_the_queue(stack: Stack) -> None:
    with contextlib.ExitStack() as streams:
        readers = []  # a dropped reader would close its stream: keep each one
        for i in range(CAPACITY):
            body = {"prompt": f"busy {i}", "max_new_tokens": LONG, "stream": True}
            response = streams.enter_context(
                httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=10)
            )
            readers.append(sse_events(response))
            next(readers[-1])
        queued = {"prompt": "waiting", "max_new_tokens": LONG}
        hang_up = threading.Thread(target=post_and_hang_up, args=(stack, queued, 0.5))
        hang_up.start()
        stack.wait_for_health("queued", lambda h: h["queued"] == 1)
        hang_up.join()
        health = stack.wait_for_health("dequeued", lambda h: h["queued"] == 0, FREED_WITHIN_S)
        assert health["active"] == CAPACITY
    stack.wait_for_health("freed", lambda h: h["active"] == 0, FREED_WITHIN_S)


def test_slots_freed_by_hang_ups_serve_the_next_request_at_once(stack: Stack) -> None:
    for i in range(CAPACITY):
        hang_up_after_first_token(stack, f"full {i}")
    answer = httpx.post(
        f"{stack.url}/generate", json={"prompt": "next", "max_new_tokens": 3}, timeout=10
    ).json()
    assert answer["finish_reason"] == "length"
    # Had the hung-up requests kept their slots, this one would queue for ~20 s.
    assert answer["metrics"]["e2e_ms"] < 2000


def test_hang_ups_are_counted_as_aborted_requests(stack: Stack) -> None:
    labels = {"endpoint": "/generate", "finish_reason": "abort", "status": "499"}
    before = value(scrape(stack.url), "minibatch_requests_total", **labels)
    hang_up_after_first_token(stack, "counted")
    stack.wait_for_health("freed", lambda h: h["active"] == 0, FREED_WITHIN_S)
    assert value(scrape(stack.url), "minibatch_requests_total", **labels) == before + 1


def test_many_hang_ups_leave_no_pending_task_behind(stack: Stack) -> None:
    """A hang-up used to leave the wait for the request's next event pending, and
    asyncio logged 'Task was destroyed but it is pending!' when it was collected."""
    for i in range(8):
        hang_up_after_first_token(stack, f"leak {i}")
        post_and_hang_up(stack, {"prompt": f"leak {i}", "max_new_tokens": LONG}, 0.2)
        body = {"model": "fake", "prompt": f"leak {i}", "max_tokens": LONG, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as response:
            next(response.iter_lines())
    stack.wait_for_health("freed", lambda h: h["inflight"] == 0, FREED_WITHIN_S * 5)
    for _ in range(20):  # new requests make garbage, so that the collector runs
        httpx.post(f"{stack.url}/generate", json={"prompt": "x" * 500, "max_new_tokens": 1})
    assert "Task was destroyed" not in stack.log("frontend")
