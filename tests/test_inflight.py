"""What each attempt of an accepted request sends to a worker."""

from __future__ import annotations

from frontend.inflight import InFlight
from protocol import GenerateRequest, TokenDelta


def test_a_replayed_stream_resumes_after_what_the_client_saw_with_its_whole_budget() -> None:
    entry = InFlight(GenerateRequest("r", "prompt", 20, stream=True, stop=["\n\n"]), deadline=0.0)
    first = entry.next_attempt()
    assert (first.request_id, first.resume_token_ids, first.resume_text_len) == ("r.1", [], 0)
    # "\n" was held back: it may begin the stop string.
    entry.record(TokenDelta("r.1", [1, 2], "Hi"))
    entry.record(TokenDelta("r.1", [3], ""))
    second = entry.next_attempt()
    assert second.request_id == "r.2"
    assert second.resume_token_ids == [1, 2, 3]
    assert second.resume_text_len == len("Hi")
    assert second.max_new_tokens == 20


def test_every_attempt_streams_so_that_a_non_streaming_request_resumes_too() -> None:
    # A worker tracks the text of streaming requests only, and refuses to resume
    # shown text it does not track: a client's non-streaming request streams from
    # the worker, and its replay resumes after what it streamed.
    entry = InFlight(GenerateRequest("r", "prompt", 20), deadline=0.0)
    assert entry.next_attempt().stream
    entry.record(TokenDelta("r.1", [1, 2], "Hi"))
    resumed = entry.next_attempt()
    assert (resumed.stream, resumed.resume_token_ids, resumed.resume_text_len) == (True, [1, 2], 2)


def test_a_replay_samples_as_the_first_attempt_did() -> None:
    request = GenerateRequest(
        "r",
        "prompt",
        20,
        temperature=0.8,
        seed=5,
        logit_bias_token_ids=[7, 9],
        logit_bias_values=[-100.0, 2.5],
    )
    entry = InFlight(request, deadline=0.0)
    entry.next_attempt()
    entry.record(TokenDelta("r.1", [1], "H"))
    resumed = entry.next_attempt()
    assert (resumed.temperature, resumed.seed) == (0.8, 5)
    assert (resumed.logit_bias_token_ids, resumed.logit_bias_values) == ([7, 9], [-100.0, 2.5])
