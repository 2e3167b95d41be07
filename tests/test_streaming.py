"""POST /generate with stream=true: token events as they are produced, then one
final event; errors before the first token are plain HTTP errors."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from frontend import streaming
from frontend.accepted import Accepted
from frontend.errors import ApiError
from frontend.metrics import NO_FINISH_REASON
from protocol import TokenDelta
from tests.sse import sse_events
from tests.stack import Stack, running_stack
from worker.engine.fake_engine import FAKE_CONTEXT_WINDOW, expected_text

STEP_DELAY_S = 0.02
REQUEST_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    overrides = {
        "FAKE_STEP_DELAY_S": str(STEP_DELAY_S),
        "REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
    }
    with running_stack(tmp_path_factory.mktemp("stack"), overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


def stream(stack: Stack, body: dict[str, Any]) -> list[tuple[str | None, Any, float]]:
    """(event, decoded data, seconds since the request) for each event."""
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{stack.url}/generate", json={**body, "stream": True}, timeout=10
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [
            (event, json.loads(data), time.monotonic() - started)
            for event, data in sse_events(response)
        ]


def test_token_events_add_up_to_the_answer_and_end_with_done(stack: Stack) -> None:
    events = stream(stack, {"prompt": "hello", "max_new_tokens": 12})
    *tokens, (last_event, done, _) = events
    assert {event for event, _, _ in tokens} == {"token"}
    assert "".join(data["text"] for _, data, _ in tokens) == expected_text("hello", 12)
    assert sum(len(data["token_ids"]) for _, data, _ in tokens) == 12
    assert last_event == "done"
    assert done["finish_reason"] == "length"
    assert done["usage"] == {"prompt_tokens": 5, "completion_tokens": 12}
    assert done["model"] == "fake"
    assert set(done["metrics"]) == {"queue_wait_ms", "generate_ms", "e2e_ms"}


def test_tokens_arrive_as_they_are_produced(stack: Stack) -> None:
    num_tokens = 20
    events = stream(stack, {"prompt": "slow", "max_new_tokens": num_tokens})
    first_at = events[0][2]
    last_token_at = events[-2][2]
    # Generating takes ~num_tokens steps; the first token must not wait for them.
    assert last_token_at - first_at > (num_tokens - 5) * STEP_DELAY_S


def test_streamed_text_equals_the_non_streamed_text(stack: Stack) -> None:
    body = {"prompt": "the same, twice", "max_new_tokens": 9}
    events = stream(stack, body)
    plain = httpx.post(f"{stack.url}/generate", json=body, timeout=10).json()
    assert "".join(data["text"] for event, data, _ in events if event == "token") == plain["text"]


def test_stop_string_cuts_the_stream_and_no_part_of_it_is_sent(stack: Stack) -> None:
    full = expected_text("stop here", 16)
    stop = full[6:9]
    events = stream(stack, {"prompt": "stop here", "max_new_tokens": 16, "stop": stop})
    streamed = "".join(data["text"] for event, data, _ in events if event == "token")
    assert streamed == full[: full.index(stop)]
    assert events[-1][0] == "done"
    assert events[-1][1]["finish_reason"] == "stop"


def test_non_ascii_prompt_streams(stack: Stack) -> None:
    events = stream(stack, {"prompt": "héllo 😀 мир", "max_new_tokens": 4})
    assert "".join(d["text"] for e, d, _ in events if e == "token") == expected_text(
        "héllo 😀 мир", 4
    )


def test_error_after_the_first_token_is_an_error_event(stack: Stack) -> None:
    # Longer than REQUEST_TIMEOUT_S: the headers are out when the deadline passes.
    num_tokens = int(2 * REQUEST_TIMEOUT_S / STEP_DELAY_S)
    events = stream(stack, {"prompt": "too long", "max_new_tokens": num_tokens})
    assert events[0][0] == "token"
    last_event, error, _ = events[-1]
    assert last_event == "error"
    assert error["error"]["code"] == "timeout"
    assert "REQUEST_TIMEOUT_S" in error["error"]["message"]
    stack.wait_for_health("idle", lambda h: h["active"] == 0 and h["inflight"] == 0)


def test_refusal_before_the_first_token_is_a_plain_http_error(stack: Stack) -> None:
    body = {"prompt": "x" * FAKE_CONTEXT_WINDOW, "max_new_tokens": 8, "stream": True}
    response = httpx.post(f"{stack.url}/generate", json=body, timeout=10)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/json"
    assert "context window" in response.json()["error"]["message"]


def test_invalid_streaming_request_is_rejected_before_streaming(stack: Stack) -> None:
    body = {"prompt": "hi", "stream": True, "temperature": 3}
    response = httpx.post(f"{stack.url}/generate", json=body, timeout=10)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "temperature"


def test_a_stream_whose_formatting_fails_ends_with_an_error_event_counted_once() -> None:
    """A bug formatting a stream (after its 200 went out) ended the connection
    with no event at all, and the request was counted twice in /metrics."""

    class FailingFormat:
        def delta(self, index: int, delta: TokenDelta) -> str | None:
            raise RuntimeError("a bug")

        def error(self, error: ApiError) -> list[str]:
            return [f"error {error.status}: {error.message}"]

    cancelled: list[object] = []
    counted: list[tuple[str, int, str]] = []
    client = SimpleNamespace(cancel=cancelled.append)
    metrics = SimpleNamespace(count_request=lambda *args: counted.append(args))
    accepted = Accepted("r", [object()], time.monotonic(), "/generate", metrics, {})  # type: ignore[list-item,arg-type]
    event = (0, TokenDelta("r", [1], "a"))

    async def frames() -> list[str]:
        stream = streaming._frames(None, client, accepted, FailingFormat(), event)  # type: ignore[arg-type]
        return [frame async for frame in stream]

    assert asyncio.run(frames()) == [
        "error 500: this frontend failed to send the answer (its log says why)"
    ]
    assert counted == [("/generate", 500, NO_FINISH_REASON)]
    assert cancelled == [accepted.entries]  # the worker stops generating it
