"""Slot bookkeeping shared by every engine: a request resumed after a worker restart
continues exactly as the uninterrupted run would have."""

from __future__ import annotations

import dataclasses

import pytest

from protocol import ErrorCode, GenerateRequest, TokenDelta
from tests.resume import assert_every_resume_is_exact, run
from tests.test_sequence import ByteTokenizer
from worker.engine.fake_engine import FakeEngine
from worker.engine.interface import FinishedSequence, ModelInfo, RequestRejected
from worker.engine.sequence import Sequence
from worker.engine.slot_engine import SlotEngine


class ScriptedEngine(SlotEngine):
    """Emits the bytes of a script, one per token, whatever the context: output
    position i is always ``script[i]``, as for a model that resumes exactly."""

    def __init__(self, script: bytes, capacity: int = 2) -> None:
        info = ModelInfo("scripted", True, 1024, vocab_size=256, max_token_chars=1)
        super().__init__(info, ByteTokenizer(), capacity)
        self.script = script
        self.num_prefilled = 0
        self.num_decoded = 0

    def _prefill(self, newcomers: list[Sequence]) -> list[int]:
        self.num_prefilled += len(newcomers)
        return [self.script[len(seq.output_token_ids)] for seq in newcomers]

    def _decode(self, active: list[Sequence]) -> list[int]:
        self.num_decoded += len(active)
        return [self.script[len(seq.output_token_ids)] for seq in active]


def streaming(max_new_tokens: int = 32, **fields: object) -> GenerateRequest:
    return GenerateRequest("r", "prompt", max_new_tokens, stream=True, **fields)  # type: ignore[arg-type]


def test_a_stop_string_spanning_the_resume_point_still_stops() -> None:
    # The first "\n" is held back: it may begin the stop string.
    result = assert_every_resume_is_exact(
        lambda: ScriptedEngine(b"Hi\n\nmore text"), streaming(stop=["\n\n"])
    )
    assert (result.text, result.finish_reason) == ("Hi", "stop")


def test_a_multi_byte_character_split_at_the_resume_point_is_whole() -> None:
    text = "añ€😀z"
    script = text.encode()
    result = assert_every_resume_is_exact(
        lambda: ScriptedEngine(script), streaming(max_new_tokens=len(script))
    )
    assert (result.text, result.finish_reason) == (text, "length")


def test_held_back_text_at_the_end_of_the_budget_comes_out_once() -> None:
    result = assert_every_resume_is_exact(
        lambda: ScriptedEngine(b"xyab"), streaming(max_new_tokens=4, stop=["abc"])
    )
    assert (result.text, result.finish_reason) == ("xyab", "length")


def test_fake_engine_resumes_exactly_with_a_stop_string() -> None:
    free_run = run(FakeEngine(capacity=1), streaming(max_new_tokens=40)).result.text
    # A stop string whose first occurrence is some tokens in.
    start = next(i for i in range(8, 38) if free_run[i : i + 3] not in free_run[: i + 2])
    stop = free_run[start : start + 3]
    result = assert_every_resume_is_exact(
        lambda: FakeEngine(capacity=1), streaming(max_new_tokens=40, stop=[stop])
    )
    assert (result.text, result.finish_reason) == (free_run[:start], "stop")


@pytest.mark.parametrize("prompt_chars", [1, 7, 8, 9, 30])
def test_the_fake_engine_in_chunks_answers_as_it_does_whole(prompt_chars: int) -> None:
    """A worker runs the fake with PREFILL_CHUNK_TOKENS as it runs a real model:
    chunks of 8 tokens give the same output, logprobs and prompt logprobs."""
    prompt = ("abcdefghij" * 3)[:prompt_chars]
    request = GenerateRequest("r", prompt, 12, logprobs=2, prompt_logprobs=2)
    whole = run(FakeEngine(capacity=1), request).result
    in_chunks_engine = FakeEngine(capacity=2, prefill_chunk_tokens=8)
    in_chunks_engine.admit([GenerateRequest("decoding", "z", 40)])
    in_chunks_engine.step()  # a prompt goes in beside a stream in chunks, else whole
    in_chunks = run(in_chunks_engine, request).result
    assert repr(in_chunks) == repr(whole)  # the first prompt token's logprob is NaN
    assert whole.prompt_logprobs is not None
    assert len(whole.prompt_logprobs.token_ids) == prompt_chars


def test_the_fake_engine_in_chunks_resumes_exactly() -> None:
    assert_every_resume_is_exact(
        lambda: FakeEngine(capacity=1, prefill_chunk_tokens=4),
        streaming(max_new_tokens=12, stop=["q"]),
    )


def test_a_resume_that_already_finished_is_answered_without_the_model() -> None:
    script = b"Hi\n\nmore"
    request = streaming(stop=["\n\n"], resume_token_ids=list(b"Hi\n\n"), resume_text_len=2)
    engine = ScriptedEngine(script)
    engine.admit([streaming(max_new_tokens=30)])
    live = dataclasses.replace(request, request_id="resumed")
    engine.admit([live])
    output = engine.step()
    [finished] = output.finished
    assert finished.request_id == "resumed"
    assert (finished.text, finished.finish_reason) == ("Hi", "stop")
    assert finished.token_ids == list(b"Hi\n\n")
    assert "resumed" not in [delta.request_id for delta in output.deltas]
    assert engine.num_prefilled == 1 and engine.num_decoded == 1  # only the live request's
    assert engine.num_active() == 1


def test_a_used_up_budget_is_answered_without_the_model() -> None:
    engine = ScriptedEngine(b"abc")
    request = streaming(max_new_tokens=3, resume_token_ids=list(b"abc"), resume_text_len=3)
    resumed = run(engine, request)
    assert (resumed.result.text, resumed.result.finish_reason) == ("abc", "length")
    assert resumed.delta_texts == []
    assert engine.num_prefilled == engine.num_decoded == 0


def test_resumed_tokens_count_against_max_new_tokens_not_the_context() -> None:
    # prompt 6 + max_new_tokens 26 fills the context exactly; the 10 resumed
    # tokens are part of the 26.
    engine = FakeEngine(capacity=1, context_window=32)
    free_run = run(engine, streaming(max_new_tokens=26)).result
    request = streaming(
        max_new_tokens=26,
        resume_token_ids=free_run.token_ids[:10],
        resume_text_len=10,
    )
    resumed = run(engine, request)
    assert resumed.result.token_ids == free_run.token_ids
    assert resumed.result.num_prompt_tokens == len("prompt")


@pytest.mark.parametrize(
    ("resume", "problem"),
    [
        ({"resume_token_ids": list(b"Hi\n\nmo"), "resume_text_len": 2}, "resume_token_ids"),
        ({"resume_token_ids": list(b"Hi\n"), "resume_text_len": 3}, "resume_text_len"),
        ({"resume_token_ids": list(b"Hi"), "resume_text_len": -1}, "resume_text_len"),
    ],
)
def test_output_the_run_could_not_have_streamed_is_rejected(
    resume: dict[str, object], problem: str
) -> None:
    engine = ScriptedEngine(b"Hi\n\nmore")
    engine.admit([dataclasses.replace(streaming(), request_id="live")])
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([dataclasses.replace(streaming(stop=["\n\n"]), **resume)])  # type: ignore[arg-type]
    assert rejected.value.code == ErrorCode.INVALID_REQUEST
    assert rejected.value.message.startswith(problem)
    assert engine.num_active() == 1 and engine.num_prefilled == 1


def _finished(engine: SlotEngine) -> list[FinishedSequence]:
    finished: list[FinishedSequence] = []
    while engine.num_active():
        finished += engine.step().finished
    return finished


def test_logprobs_are_delivered_once_each_on_deltas_or_the_result() -> None:
    engine = FakeEngine(capacity=2)
    streamed = streaming(max_new_tokens=5, logprobs=2, prompt_logprobs=1)
    plain = dataclasses.replace(streamed, request_id="plain", stream=False)
    engine.admit([streamed, plain])
    deltas: list[TokenDelta] = []
    finished: list[FinishedSequence] = []
    while engine.num_active():
        output = engine.step()
        deltas += output.deltas
        finished += output.finished
    by_id = {f.request_id: f for f in finished}
    assert by_id["r"].logprobs is None and by_id["r"].prompt_logprobs is None
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * 4
    streamed_ids = [t for d in deltas if d.logprobs for t in d.logprobs.token_ids]
    assert streamed_ids == by_id["r"].token_ids
    result = by_id["plain"]
    assert result.logprobs is not None and result.logprobs.token_ids == result.token_ids
    assert result.logprobs.num_top == 2 and len(result.logprobs.top_token_ids) == 10
    assert result.prompt_logprobs is not None
    assert result.prompt_logprobs.token_ids == [ord(c) for c in "prompt"]
    assert all(d.prompt_tokens == len("prompt") for d in deltas)


def test_a_resumed_request_sends_only_its_new_tokens_logprobs() -> None:
    request = streaming(max_new_tokens=6, logprobs=0, prompt_logprobs=0)
    fault_free = run(FakeEngine(capacity=1), request)
    resumed_request = dataclasses.replace(
        request,
        stream=False,
        resume_token_ids=fault_free.result.token_ids[:2],
    )
    engine = FakeEngine(capacity=1)
    engine.admit([resumed_request])
    [result] = _finished(engine)
    assert result.prompt_logprobs is None  # the first attempt's first delta carried them
    assert result.logprobs is not None
    assert result.logprobs.token_ids == fault_free.result.token_ids[2:]


def test_zero_new_tokens_tokenizes_without_the_model_and_echoes() -> None:
    engine = ScriptedEngine(b"unused")
    engine.admit([GenerateRequest("t", "hello", 0, echo=True)])
    [result] = _finished(engine)
    assert (result.token_ids, result.finish_reason) == ([], "length")
    assert result.prompt_token_ids == list(b"hello") and result.prompt_text == "hello"
    assert engine.num_prefilled == engine.num_decoded == 0


def test_fit_context_lowers_max_new_tokens_to_what_the_window_leaves() -> None:
    engine = FakeEngine(capacity=1, context_window=16)
    engine.admit([GenerateRequest("r", "ten chars!", 500, fit_context=True)])
    [result] = _finished(engine)
    assert len(result.token_ids) == 6 and result.finish_reason == "length"
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([GenerateRequest("full", "x" * 16, 500, fit_context=True)])
    assert rejected.value.code == ErrorCode.CONTEXT_OVERFLOW


def test_fit_context_that_leaves_fewer_tokens_than_min_tokens_is_refused() -> None:
    """Lowered to what the window left, max_new_tokens fell under min_tokens: the
    output ended there, and min_tokens went unmet without a word."""
    engine = FakeEngine(capacity=1, context_window=16)
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([GenerateRequest("r", "ten chars!", 500, min_tokens=7, fit_context=True)])
    assert rejected.value.code == ErrorCode.CONTEXT_OVERFLOW
    assert str(rejected.value) == (
        "prompt: 10 tokens leave room for 6 to generate in the context window of 16 "
        "tokens, fewer than min_tokens (7); shorten it or lower min_tokens"
    )
    engine.admit([GenerateRequest("r", "ten chars!", 500, min_tokens=6, fit_context=True)])
    [result] = _finished(engine)
    assert len(result.token_ids) == 6


def test_no_stop_ends_the_output_before_min_tokens() -> None:
    free = run(FakeEngine(capacity=1), streaming(max_new_tokens=20)).result
    stop_id = free.token_ids[1]
    stopped = run(FakeEngine(capacity=1), streaming(max_new_tokens=20, stop_token_ids=[stop_id]))
    assert stopped.result.finish_reason == "stop" and len(stopped.result.token_ids) == 2
    held = run(
        FakeEngine(capacity=1), streaming(max_new_tokens=20, stop_token_ids=[stop_id], min_tokens=4)
    ).result
    assert len(held.token_ids) > 4 and held.token_ids[:4] == free.token_ids[:4]
