"""A worker's answers the frontend cannot read (from a bug, or from a stranger
posing as a worker) fail their request cleanly, and fill no log."""

from __future__ import annotations

import dataclasses
import json
import math
from array import array
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import psutil
import pytest

from frontend.errors import MAX_WORKER_MESSAGE_CHARS
from protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
)
from protocol.wire import MAX_WORKER_MESSAGE_BYTES
from tests.sse import sse_events
from tests.stack import Stack, running_stack
from tests.stand_in_worker import StandInWorker, stand_in_hello


def _result_frame(request: GenerateRequest, **fields: object) -> bytes:
    payload: dict[str, object] = {"v": PROTOCOL_VERSION, "type": "result"}
    payload |= {"request_id": request.request_id, "text": "ab", "token_ids": _ids([1, 2])}
    payload |= {"finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2}
    payload |= {"queue_wait_ms": 0.0, "generate_ms": 1.0}
    return msgpack.packb(payload | fields)


def _ids(token_ids: list[int]) -> bytes:
    return array("I", token_ids).tobytes()


def _delta_frame(request: GenerateRequest, token_ids: list[int], **fields: object) -> bytes:
    payload: dict[str, object] = {"v": PROTOCOL_VERSION, "type": "delta"}
    payload |= {"request_id": request.request_id, "text": "a" * len(token_ids)}
    return msgpack.packb(payload | {"token_ids": _ids(token_ids)} | fields)


def _logprobs(logprobs: list[float], num_top: int = 0, **fields: object) -> dict[str, object]:
    """A result's logprobs map as the wire carries it (lists packed), for one
    token per logprob, each of one character and one byte."""
    num_entries = len(logprobs) * (1 + num_top)
    payload: dict[str, object] = {
        "num_top": num_top,
        "token_ids": array("I", [5] * len(logprobs)).tobytes(),
        "logprobs": array("f", logprobs).tobytes(),
        "top_token_ids": array("I", [6] * len(logprobs) * num_top).tobytes(),
        "top_logprobs": array("f", [-2.0] * len(logprobs) * num_top).tobytes(),
        "texts": "a" * num_entries,
        "text_lens": array("I", [1] * num_entries).tobytes(),
        "token_bytes": b"a" * num_entries,
        "byte_lens": array("I", [1] * num_entries).tobytes(),
    }
    return payload | fields


def _error_frame(request: GenerateRequest, code: str, message: str) -> bytes:
    payload = {"v": PROTOCOL_VERSION, "type": "error", "request_id": request.request_id}
    return msgpack.packb(payload | {"code": code, "message": message})


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[StandInWorker, Stack]]:
    """A stand-in worker, whose ``answer`` each test sets, and a frontend. It says
    what a real worker says of its tokens: at most 8 characters each."""
    hello = stand_in_hello(capacity=2, vocab_size=1000)
    hello = dataclasses.replace(hello, max_token_chars=8, max_token_bytes=32)
    with StandInWorker(lambda request: [], capacity=2, hello=hello) as worker:
        overrides = {"WORKER_ENDPOINT": worker.endpoint}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_live()
            yield worker, stack


def _generate(stack: Stack) -> httpx.Response:
    body = {"prompt": "hi", "max_new_tokens": 2}
    return httpx.post(f"{stack.url}/generate", json=body, timeout=30)


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        # Counted into /metrics, a negative count raised and the client got a
        # 500 with a traceback in the log.
        (lambda r: _result_frame(r, completion_tokens=-1), "completion_tokens must be at least 0"),
        (lambda r: _error_frame(r, "teapot", "I am one"), "unknown code 'teapot'"),
        # Text that is not UTF-8: its request waited REQUEST_TIMEOUT_S for another answer.
        (
            lambda r: _result_frame(r, text="\x00BAD").replace(b"\x00BAD", b"\xff\xfe\xfd\xfc"),
            "not valid msgpack",
        ),
        # A finish reason is a /metrics label: one per request would grow it unbounded.
        (lambda r: _result_frame(r, finish_reason="exploded"), "unknown finish_reason 'exploded'"),
        (
            lambda r: _result_frame(r, logprobs=_logprobs([-0.5, -1.0], text_lens=b"")),
            "logprobs of 2 tokens whose lists do not agree",
        ),
        # +inf went out in a stream as the bare word Infinity, which no JSON parser takes.
        (
            lambda r: _result_frame(r, logprobs=_logprobs([-0.5, math.inf])),
            "logprobs above 0",
        ),
        # A NaN time made /metrics's queue-time sum NaN until the frontend restarted.
        (
            lambda r: _result_frame(r, queue_wait_ms=math.nan),
            "queue_wait_ms must be a finite time of at least 0, got nan",
        ),
        (
            lambda r: _result_frame(r, generate_ms=-5.0),
            "generate_ms must be a finite time of at least 0, got -5.0",
        ),
        # Usage and the token counters said whatever a worker said.
        (
            lambda r: _result_frame(r, completion_tokens=1),
            "completion_tokens 1 for 2 token ids",
        ),
        (
            lambda r: _result_frame(r, looked_up_tokens=2, cached_tokens=3),
            "cached_tokens 3, looked_up_tokens 2 and prompt_tokens 3: each must be at most",
        ),
        (
            lambda r: _result_frame(r, prompt_tokens=2**62),
            f"{2**62 + 2} tokens in all, past the worker's context window",
        ),
        (
            lambda r: _result_frame(r, token_ids=_ids([1, 2, 3]), completion_tokens=3),
            "3 tokens for max_new_tokens 2",
        ),
        (
            lambda r: _result_frame(r, logprobs=_logprobs([-0.5, -0.5, -0.5])),
            "logprobs of 3 tokens for 2 output tokens",
        ),
        # /tokenize and echo answered with whatever prompt a worker claimed.
        (
            lambda r: _result_frame(r, prompt_token_ids=_ids([1] * 100_000)),
            "prompt_token_ids of 100000 tokens for prompt_tokens 3",
        ),
        (
            lambda r: _result_frame(r, prompt_text="x" * 1000),
            "a prompt text longer than 3 tokens can write",
        ),
        (lambda r: _result_frame(r, text="x" * 17), "17 characters of text for 2 tokens"),
    ],
)
def test_an_answer_the_frontend_cannot_read_fails_its_request_with_500(
    stand_in: tuple[StandInWorker, Stack], answer: object, problem: str
) -> None:
    worker, stack = stand_in
    worker.answer = lambda request: [answer(request)]  # type: ignore[operator]
    response = _generate(stack)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == ErrorCode.INTERNAL
    assert "the worker sent an answer this frontend cannot take" in error["message"]
    assert problem in error["message"]
    # Not sent again by clients (x-should-retry: false), nor advised to be.
    assert response.headers["x-should-retry"] == "false"
    assert "retry" not in error["message"], error["message"]
    assert "Traceback" not in stack.log("frontend")
    # The worker is told to stop running it.
    (sent,) = [m.request_id for m in worker.received if isinstance(m, GenerateRequest)]
    worker.wait_for(
        lambda: [m.request_id for m in worker.received if isinstance(m, AbortRequest)] == [sent],
        "the request aborted in the worker",
    )


@pytest.mark.parametrize(
    ("frames", "problem"),
    [
        # A 5-token request streamed 40 MB: the frontend took every delta.
        (
            lambda r: [_delta_frame(r, [1]), _delta_frame(r, [2]), _delta_frame(r, [3])],
            "3 tokens for max_new_tokens 2",
        ),
        (
            lambda r: [_delta_frame(r, [1, 2]), _result_frame(r, token_ids=_ids([7, 8]))],
            "a result whose tokens are not the ones it streamed",
        ),
        # 60 MB of text in deltas of no tokens, for a 1-token answer, all taken.
        (lambda r: [_delta_frame(r, [], text="x" * 100)], "100 characters of text for 0 tokens"),
        # A delta's usage claimed 2**62 prompt tokens to a client reading usage.
        (
            lambda r: [_delta_frame(r, [1], prompt_tokens=2**62)],
            f"{2**62 + 1} tokens in all, past the worker's context window",
        ),
        # Each token's logprobs come once, on a delta or in the result: here twice.
        (
            lambda r: [
                _delta_frame(r, [1, 2], logprobs=_logprobs([-0.5, -0.5])),
                _result_frame(r, logprobs=_logprobs([-0.5, -0.5])),
            ],
            "logprobs of 4 tokens for 2 output tokens",
        ),
    ],
)
def test_answers_that_disagree_with_their_request_fail_it(
    stand_in: tuple[StandInWorker, Stack], frames: object, problem: str
) -> None:
    worker, stack = stand_in
    worker.answer = frames  # type: ignore[assignment]
    body = {"prompt": "hi", "max_new_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=30) as response:
        if response.headers["content-type"] == "application/json":  # failed before a token
            response.read()
            assert response.status_code == 500
            assert problem in response.json()["error"]["message"]
            return
        events = list(sse_events(response))
    assert events[-1][0] == "error", events
    assert problem in events[-1][1]
    # What streamed before the answer went wrong stays: two tokens' text.
    assert "".join(json.loads(data)["text"] for name, data in events if name == "token") == "aa"


@pytest.mark.parametrize(
    "logprobs",
    [
        {},  # none at all, though asked for
        {"logprobs": _logprobs([-0.5], token_ids=_ids([1]))},  # one token's of two
        {"logprobs": _logprobs([-0.5, -0.5], token_ids=_ids([9, 9]))},  # other tokens'
    ],
)
def test_logprobs_that_are_not_the_outputs_fail_the_request(
    stand_in: tuple[StandInWorker, Stack], logprobs: dict[str, object]
) -> None:
    """A client that asks for logprobs gets one per output token, in order, or a 500."""
    worker, stack = stand_in
    worker.answer = lambda request: [_result_frame(request, **logprobs)]  # type: ignore[assignment]
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "logprobs": 0}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 500, response.text
    assert "logprobs that are not one for each output token" in response.json()["error"]["message"]


def test_a_worker_message_reaches_the_client_bounded(
    stand_in: tuple[StandInWorker, Stack],
) -> None:
    worker, stack = stand_in
    long = ErrorCode.UNSUPPORTED, "top_k: " + "x" * 100_000
    worker.answer = lambda request: [ErrorResult(request.request_id, *long)]
    response = _generate(stack)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("top_k: xxx") and message.endswith("...")
    assert len(message) == MAX_WORKER_MESSAGE_CHARS


def test_a_frame_too_large_drops_the_worker_not_the_frontends_memory(tmp_path: Path) -> None:
    """A peer posing as a worker sent 200 MB in one frame: the frontend held 670
    MB. Past MAX_WORKER_MESSAGE_BYTES the connection is dropped unread, as a dead
    worker's; the request waits for a live one, within its deadline."""
    huge = b"\x00" * (MAX_WORKER_MESSAGE_BYTES + 1)
    with StandInWorker(lambda request: [huge], capacity=2) as worker:
        overrides = {"WORKER_ENDPOINT": worker.endpoint, "REQUEST_TIMEOUT_S": "5"}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            stack.wait_live()
            response = _generate(stack)
            assert response.status_code == 504, response.text
            assert "declared dead: its connection closed" in stack.log("frontend")
            rss = psutil.Process(stack.processes["frontend"].pid).memory_info().rss
            assert rss < MAX_WORKER_MESSAGE_BYTES


def test_a_flood_of_garbage_frames_is_logged_once_a_second(
    stand_in: tuple[StandInWorker, Stack],
) -> None:
    """One error line per frame: a worker, or whoever took its address, could
    fill the disk. The request itself is still answered."""
    worker, stack = stand_in

    def garbage_then_result(request: GenerateRequest) -> list[object]:
        frames: list[object] = [b"\xc1 not msgpack"] * 500
        return [*frames, GenerateResult(request.request_id, "ab", [1, 2], "length", 3, 2, 0, 1)]

    worker.answer = garbage_then_result  # type: ignore[assignment]
    response = _generate(stack)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == "ab"
    log = stack.log("frontend")
    assert 1 <= log.count("malformed frame from worker") <= 2, log


def test_a_worker_of_another_protocol_version_is_named_in_health_and_timeouts(
    tmp_path: Path,
) -> None:
    """It greets in its own version: this frontend sends it nothing, and says why
    in /health and in each request's 504, not only "no hello yet"."""
    other = msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "hello", "instance_id": "new"})
    with StandInWorker(lambda request: [], capacity=2, hello=other) as worker:
        overrides = {"WORKER_ENDPOINT": worker.endpoint, "REQUEST_TIMEOUT_S": "1"}
        with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
            expected = (
                f"{worker.endpoint} speaks another protocol version (the peer speaks protocol "
                f"version {PROTOCOL_VERSION + 1} and this process version {PROTOCOL_VERSION}: "
                "upgrade the older one)"
            )
            stack.wait_for_health("the mismatch named", lambda health: health["reason"] == expected)
            response = _generate(stack)
            assert response.status_code == 504
            assert expected in response.json()["error"]["message"]
            assert worker.received == []
