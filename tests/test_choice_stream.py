"""Streams of several choices (`frontend/choice_stream.py`): chunks interleaved
as they arrive, each with its index; usage and [DONE] once every choice has
finished; an error in one choice ends the stream and aborts the others."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol import (
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    ToFrontend,
    TokenDelta,
)
from tests.sse import sse_events
from tests.stack import Stack, live_stack, running_stack
from tests.stand_in_worker import StandInWorker
from worker.engine.fake_engine import expected_text

CHAT_PROMPT = "User: Hi\n\nAssistant:"  # the default template's


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with live_stack(tmp_path_factory.mktemp("stack"), {"FAKE_STEP_DELAY_S": "0.005"}) as stack:
        yield stack


def _stream(url: str, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        return [data for _, data in sse_events(response)]


def _chunks(events: list[str]) -> list[dict[str, Any]]:
    assert events[-1] == "[DONE]"
    return [json.loads(data) for data in events[:-1]]


def test_choices_interleave_each_with_its_index_and_done_follows_the_last(stack: Stack) -> None:
    body = {
        "model": "fake",
        "prompt": "hello",
        "max_tokens": 6,
        "n": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    *chunks, usage = _chunks(_stream(stack.url, "/v1/completions", body))
    texts, finishes, indexes = ["", "", "", ""], [None] * 4, []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert finishes[choice["index"]] is None  # nothing after a choice's finish
        indexes.append(choice["index"])
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"]
    assert texts == [expected_text("hello", 6)] * 4
    assert finishes == ["length"] * 4
    assert indexes != sorted(indexes)  # as they arrive, not one choice after another
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 24,
        "total_tokens": 29,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_continuous_usage_counts_every_choices_tokens_so_far(stack: Stack) -> None:
    body = {
        "model": "fake",
        "prompt": "hello",
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *chunks, final = _chunks(_stream(stack.url, "/v1/completions", body))
    so_far = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert so_far == sorted(so_far) and so_far[-1] == 6
    assert {chunk["usage"]["prompt_tokens"] for chunk in chunks} == {5}  # counted once
    assert final["usage"]["completion_tokens"] == 6


def test_chat_choices_each_name_the_assistant_first(stack: Stack) -> None:
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    *chunks, usage = _chunks(_stream(stack.url, "/v1/chat/completions", body))
    deltas: list[list[dict[str, str]]] = [[], [], []]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        deltas[choice["index"]].append(choice["delta"])
    for choice_deltas in deltas:
        assert choice_deltas[0]["role"] == "assistant"
        assert all("role" not in delta for delta in choice_deltas[1:])
        content = "".join(delta.get("content", "") for delta in choice_deltas)
        assert content == expected_text(CHAT_PROMPT, 4)
    assert usage["usage"]["completion_tokens"] == 12


def test_a_streamed_echo_starts_every_choice(stack: Stack) -> None:
    body = {"model": "fake", "prompt": "echo", "max_tokens": 2, "n": 2, "echo": True}
    chunks = _chunks(_stream(stack.url, "/v1/completions", {**body, "stream": True}))
    texts = ["", ""]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == ["echo" + expected_text("echo", 2)] * 2


# --- one choice failing, on a stand-in worker -------------------------------------------


def _result(request: GenerateRequest, text: str) -> GenerateResult:
    return GenerateResult(
        request.request_id, text, [ord(c) for c in text], "stop", 3, len(text), 0, 1
    )


def _failing_second_choice(request: GenerateRequest) -> list[ToFrontend | bytes]:
    """The first choice streams a token and keeps running; the second streams
    one and fails; the third finishes."""
    wire_id = request.request_id
    delta = TokenDelta(wire_id, [ord("a")], "a", prompt_tokens=3)
    if wire_id.endswith("-0.1"):
        return [delta]
    if wire_id.endswith("-1.1"):
        return [delta, ErrorResult(wire_id, ErrorCode.INTERNAL, "the engine failed on it")]
    return [_result(request, "done")]


@pytest.fixture
def failing_worker(tmp_path: Path) -> Iterator[tuple[StandInWorker, Stack]]:
    # One slot, to show that all of a request's choices go anyway, back to back.
    with StandInWorker(_failing_second_choice, capacity=1) as worker:
        overrides = {"WORKER_ENDPOINT": worker.endpoint}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_live()
            yield worker, stack


def _sent(worker: StandInWorker) -> list[str]:
    return [m.request_id for m in worker.received if isinstance(m, GenerateRequest)]


def _aborted(worker: StandInWorker) -> list[str]:
    return [m.request_id for m in worker.received if isinstance(m, AbortRequest)]


def test_one_choice_failing_mid_stream_ends_it_with_an_error_event(
    failing_worker: tuple[StandInWorker, Stack],
) -> None:
    worker, stack = failing_worker
    body = {"model": "fake", "prompt": "abc", "max_tokens": 8, "n": 2, "stream": True}
    events = _stream(stack.url, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["message"]) == ("internal", "the engine failed on it")
    shown = [json.loads(data)["choices"][0]["index"] for data in events[:-2]]
    assert sorted(shown) == [0, 1]
    sent = _sent(worker)
    assert [wire_id.partition("-")[2] for wire_id in sent] == ["0.1", "1.1"]
    # The choice still running is aborted in the worker.
    worker.wait_for(lambda: _aborted(worker) == [sent[0]], "the first choice aborted")


def test_one_choice_failing_fails_a_request_that_does_not_stream(
    failing_worker: tuple[StandInWorker, Stack],
) -> None:
    worker, stack = failing_worker
    body = {"model": "fake", "prompt": "abc", "max_tokens": 8, "n": 3}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 500, response.text
    assert response.json()["error"]["message"] == "the engine failed on it"
    # All three went, past the one free slot; the third may reach the stand-in
    # after the second's failure has answered the client.
    worker.wait_for(lambda: len(_sent(worker)) == 3, "all three choices sent")
    sent = _sent(worker)
    # The first choice, still running, is aborted (the third too, if its result
    # came in after the error); the one that failed has nothing left to abort.
    worker.wait_for(lambda: sent[0] in _aborted(worker), "the first choice aborted")
    assert sent[1] not in _aborted(worker)
    assert stack.health().json()["inflight"] == 0


def _queue_full_at_first(request: GenerateRequest) -> list[ToFrontend]:
    """As a worker whose queue another frontend filled: the first attempt is
    refused, the next answered."""
    if request.request_id.endswith(".1"):
        return [ErrorResult(request.request_id, ErrorCode.QUEUE_FULL, "the queue is full")]
    return [_result(request, "done")]


def test_a_request_refused_for_a_full_queue_waits_for_room_instead_of_failing(
    tmp_path: Path,
) -> None:
    """The frontend accepted it: another client filling the worker's queue first
    is no reason to answer it 503."""
    with StandInWorker(_queue_full_at_first, capacity=2) as worker:
        overrides = {"WORKER_ENDPOINT": worker.endpoint}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_live()
            body = {"model": "fake", "prompt": "abc", "max_tokens": 8, "n": 2}
            response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert [choice["text"] for choice in response.json()["choices"]] == ["done"] * 2
            # Each choice once refused, once sent again after a heartbeat: no storm.
            attempts = sorted(wire_id.partition("-")[2] for wire_id in _sent(worker))
            assert attempts == ["0.1", "0.2", "1.1", "1.2"]
            assert stack.health().json()["inflight"] == 0
