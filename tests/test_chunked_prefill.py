"""Chunked prefill (PREFILL_CHUNK_TOKENS): a long context goes into its slot a chunk
per step, between decode steps, and nothing about the output changes. Parity with
Hugging Face over the random schedule in chunks is in test_torch_engine.py."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

pytest.importorskip("torch")

from protocol import ErrorResult, GenerateResult
from tests.model_fixtures import (
    CONTEXT_WINDOW,
    force_kernels,
    random_prompt,
    record_prefills,
    reference_ids,
    request,
    run_schedule,
    tiny_engine,
    tiny_model,
)
from worker.engine import slot_engine
from worker.engine.torch_engine import TorchEngine
from worker.model import gpt2, projection
from worker.serve.scheduler import Scheduler

pytestmark = pytest.mark.model

CHUNK = 16


def test_a_long_prompt_goes_in_a_chunk_a_step_while_the_streams_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = tiny_engine(capacity=3, prefill_chunk_tokens=CHUNK)
    calls = record_prefills(monkeypatch)
    rng = random.Random(3)
    streams = [request(f"s{i}", random_prompt(rng, 4, 8), 30, ignore_eos=True) for i in range(2)]
    engine.admit(streams)
    engine.step()  # the streams' prompts, then their first decode
    long_prompt = random_prompt(rng, 100, 100)
    engine.admit([request("long", long_prompt, 5, ignore_eos=True)])
    steps_to_first_token = 0
    while not engine._by_id["long"].output_token_ids:
        before = [len(engine._by_id[s.request_id].output_token_ids) for s in streams]
        calls.clear()
        engine.step()
        steps_to_first_token += 1
        # Every step prefills at most one chunk, and decodes each stream.
        assert calls and max(call.num_tokens for call in calls) <= CHUNK
        after = [len(engine._by_id[s.request_id].output_token_ids) for s in streams]
        assert after == [n + 1 for n in before]
    assert steps_to_first_token == -(-len(long_prompt) // CHUNK)  # ceil(100 / 16) = 7


@pytest.mark.parametrize("paths", ["rule", "kernel", "onednn"])
def test_beside_streams_a_chunk_and_their_decode_share_one_pass_and_change_no_bit(
    paths: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that prefills while streams decode runs both in one pass over the
    model, which reads the weights once: each such pass takes the place of a
    decode pass, and every token, logprob and scored prompt token is what the
    two passes one after the other give, to the last bit, on either path."""
    if paths == "kernel":
        force_kernels(monkeypatch)
    elif paths == "onednn":
        monkeypatch.setattr(projection, "decode_path", lambda _: "onednn")
    rng = random.Random(21)
    sampling = {"temperature": 0.9, "logprobs": 2, "ignore_eos": True}
    streams = [
        request(f"s{i}", random_prompt(rng, 3, 10), 30, seed=i, **sampling) for i in range(2)
    ]
    newcomers = [
        request(f"n{i}", random_prompt(rng, 5, 40), 10, seed=10 + i, **sampling) for i in range(3)
    ]
    newcomers.append(request("scored", random_prompt(rng, 20, 30), 6, prompt_logprobs=1))
    schedule = {0: streams, 2: newcomers[:2], 6: newcomers[2:]}

    apart_engine = tiny_engine(capacity=5, prefill_chunk_tokens=CHUNK)
    apart_engine._prefill_beside_decode = lambda chunks, decoding: None  # type: ignore[method-assign]
    decodes = _count_decode_passes(monkeypatch)
    apart = run_schedule(apart_engine, schedule)
    num_decodes_apart = len(decodes)

    decodes.clear()
    calls = record_prefills(monkeypatch)
    together = run_schedule(tiny_engine(capacity=5, prefill_chunk_tokens=CHUNK), schedule)
    num_shared = sum(call.with_decode for call in calls)
    assert num_shared >= 3
    assert len(decodes) == num_decodes_apart - num_shared
    assert together == apart


def _count_decode_passes(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """A list that grows by one at each call into `GPT2.decode` from now on."""
    calls: list[None] = []
    decode = gpt2.GPT2.decode

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(None)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(gpt2.GPT2, "decode", counting)
    return calls


def test_beside_streams_the_oldest_newcomer_takes_the_budget_and_the_others_a_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a budget of 16 tokens and blocks of 4: the oldest newcomer's whole
    6-token prompt, then a block of the next one's 30 and the third's 3-token
    prompt whole; the 30-token prompt, oldest now, takes the budget next, its
    chunk ending on a block."""
    engine = tiny_engine(capacity=4, prefill_chunk_tokens=CHUNK, block_tokens=4)
    calls = record_prefills(monkeypatch)
    rng = random.Random(13)
    engine.admit([request("stream", random_prompt(rng, 4, 4), 30, ignore_eos=True)])
    engine.step()
    calls.clear()
    engine.admit(
        [
            request(name, random_prompt(rng, length, length), 5)
            for name, length in (("oldest", 6), ("long", 30), ("short", 3))
        ]
    )
    for _ in range(3):
        engine.step()
    chunks = [list(zip(call.starts, call.lengths, strict=True)) for call in calls]
    assert chunks == [[(0, 6), (0, 4), (0, 3)], [(4, 16)], [(20, 10)]]


def test_a_resumed_request_goes_in_whole_beside_running_streams() -> None:
    """Its client is mid-stream already: chunks would only stretch the stall."""
    model = tiny_model().model
    engine = tiny_engine(capacity=3, prefill_chunk_tokens=CHUNK)
    rng = random.Random(8)
    engine.admit([request("stream", random_prompt(rng, 4, 8), 30, ignore_eos=True)])
    engine.step()
    fresh = request("fresh", random_prompt(rng, 60, 60), 10, ignore_eos=True)
    earlier = reference_ids(model, fresh)
    engine.admit([dataclasses.replace(fresh, request_id="resumed", resume_token_ids=earlier[:5])])
    engine.step()
    resumed = engine._by_id["resumed"]
    assert resumed.output_token_ids == earlier[: len(resumed.output_token_ids)]
    assert len(resumed.output_token_ids) > 5  # its context (65 tokens) went in at once


def test_with_no_stream_to_hold_up_prompts_go_in_whole() -> None:
    engine = tiny_engine(capacity=3, prefill_chunk_tokens=CHUNK)
    rng = random.Random(4)
    engine.admit([request(f"r{i}", random_prompt(rng, 50, 60), 5) for i in range(3)])
    engine.step()
    assert all(seq.output_token_ids for seq in engine.active_sequences())


@pytest.mark.parametrize("cost", [1.0, 1.9, 4.5])
def test_beside_streams_a_scored_token_takes_its_cost_of_the_budget(
    monkeypatch: pytest.MonkeyPatch, cost: float
) -> None:
    """The LM head runs at a scored position too (about 1.9 tokens' work for
    distilgpt2): chunks of scored prompts are shorter, so that a step stalls the
    streams about as long either way; the first still moves by a block."""
    engine = tiny_engine(capacity=3, prefill_chunk_tokens=64)
    monkeypatch.setattr(engine, "scored_token_cost", cost)
    calls = record_prefills(monkeypatch)
    rng = random.Random(11)
    engine.admit([request("stream", random_prompt(rng, 4, 4), 30, ignore_eos=True)])
    engine.step()
    engine.admit([request("score", random_prompt(rng, 100, 100), 1, prompt_logprobs=1)])
    calls.clear()
    engine.step()
    assert [call.lengths for call in calls] == [[max(16, int(64 / cost) // 16 * 16)]]


def test_a_resumed_newcomer_holds_up_the_others_as_a_stream_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a worker's death every request, its resumed streams too, comes to
    the next one as a newcomer: with nothing decoding, 25 scoring requests went
    in whole beside a resumed stream, which stalled 28 s (loaded Xeon)."""
    model = tiny_model().model
    engine = tiny_engine(capacity=3, prefill_chunk_tokens=CHUNK)
    calls = record_prefills(monkeypatch)
    rng = random.Random(9)
    fresh = request("fresh", random_prompt(rng, 20, 20), 10, ignore_eos=True)
    earlier = reference_ids(model, fresh)
    resumed = dataclasses.replace(fresh, request_id="resumed", resume_token_ids=earlier[:5])
    engine.admit([resumed, request("long", random_prompt(rng, 60, 60), 4, prompt_logprobs=1)])
    engine.step()
    # The resumed context (25 tokens) took the step's budget whole: the other
    # waits for the next step, and then goes in a chunk at a time.
    assert [call.lengths for call in calls] == [[20]]
    assert len(engine._by_id["resumed"].output_token_ids) > 5
    engine.step()
    assert calls[1].lengths == [CHUNK]


def test_with_no_stream_to_hold_up_a_step_scores_at_most_a_pass_of_prompt_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8 choices scoring a 1,024-token prompt, in one step on an idle worker,
    made steps of 14 s (loaded Xeon): a worker told to stop could not act on it,
    nor a newcomer start."""
    monkeypatch.setattr(slot_engine, "PREFILL_PASS_TOKENS", 64)
    engine = tiny_engine(capacity=3, prefill_chunk_tokens=CHUNK)
    calls = record_prefills(monkeypatch)
    calls_before_step: list[int] = []  # how many calls there were as each step began
    step = engine.step

    def stepping(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls_before_step.append(len(calls))
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", stepping)
    rng = random.Random(10)
    prompt = random_prompt(rng, 50, 50)
    scoring = [request(f"score{i}", prompt, 0, prompt_logprobs=2) for i in range(3)]
    results = run_schedule(engine, {0: scoring})
    bounds = [*calls_before_step, len(calls)]
    scored_per_step = [
        sum(call.num_scored for call in calls[start:end])
        for start, end in itertools.pairwise(bounds)
    ]
    assert max(scored_per_step) <= 64 and sum(scored_per_step) == 3 * 50
    alone = run_schedule(tiny_engine(capacity=1), {0: scoring[:1]})["score0"].prompt_logprobs
    for result in results.values():
        assert result.prompt_logprobs is not None and alone is not None
        assert result.prompt_logprobs.logprobs[1:] == pytest.approx(alone.logprobs[1:], abs=1e-5)


def test_chunked_outputs_match_hugging_face_for_prompts_and_resumes() -> None:
    model = tiny_model(eos_scale=1.5).model
    rng = random.Random(5)
    prompts = [random_prompt(rng, 40, 90) for _ in range(3)]
    requests = [request(f"r{i}", prompt, 20) for i, prompt in enumerate(prompts)]
    expected = {r.request_id: reference_ids(model, r) for r in requests}
    chunked = run_schedule(tiny_engine(3, eos_scale=1.5, prefill_chunk_tokens=CHUNK), {0: requests})
    assert {rid: seq.token_ids for rid, seq in chunked.items()} == expected
    # Resumed after some output: the context (prompt and output) goes in chunks too.
    resumed = [
        dataclasses.replace(r, resume_token_ids=expected[r.request_id][:7]) for r in requests
    ]
    engine = tiny_engine(3, eos_scale=1.5, prefill_chunk_tokens=CHUNK)
    again = run_schedule(engine, {0: resumed})
    assert {rid: seq.token_ids for rid, seq in again.items()} == expected


def test_an_abort_while_prefilling_frees_the_slot_and_spares_the_others() -> None:
    model = tiny_model().model
    engine = tiny_engine(capacity=2, prefill_chunk_tokens=CHUNK)
    rng = random.Random(7)
    stream = request("stream", random_prompt(rng, 4, 8), 20, ignore_eos=True)
    engine.admit([stream])
    engine.step()
    engine.admit([request("long", random_prompt(rng, 90, 90), 5)])
    engine.step()  # the long prompt's first chunk
    assert engine.num_active() == 2
    [aborted] = engine.abort(["long"])
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    assert engine.num_active() == 1
    # The slot is free for the next newcomer, and the stream is unharmed.
    newcomer = request("next", random_prompt(rng, 30, 30), 6)
    engine.admit([newcomer])
    finished = run_schedule(engine, {})
    assert finished["stream"].token_ids == reference_ids(model, stream)
    assert finished["next"].token_ids == reference_ids(model, newcomer)


def test_a_chunk_never_runs_past_the_context_window() -> None:
    """The last chunk of a prompt one short of the window ends at its last position,
    and a stream running beside it keeps its prompt in chunks all the way."""
    model = tiny_model().model
    engine = tiny_engine(capacity=2, prefill_chunk_tokens=CHUNK)
    rng = random.Random(9)
    stream = request("stream", random_prompt(rng, 4, 4), 30, ignore_eos=True)
    full = request("full", random_prompt(rng, CONTEXT_WINDOW - 1, CONTEXT_WINDOW - 1), 1)
    finished = run_schedule(engine, {0: [stream], 1: [full]})
    assert finished["full"].token_ids == reference_ids(model, full)
    assert finished["stream"].token_ids == reference_ids(model, stream)


def test_a_chunk_that_fails_fails_its_own_request_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """As at admission without chunks: the engine failing on one newcomer's prefill
    answers that request with an error, and every other request goes on, whether
    its chunk ran alone or in a pass beside the streams' decode."""
    model = tiny_model().model
    engine = tiny_engine(capacity=4, prefill_chunk_tokens=CHUNK)
    prefill_prompts = TorchEngine._prefill_prompts

    def failing_on_bad(self: TorchEngine, chunks: list, beside=None):  # type: ignore[no-untyped-def,type-arg]
        if any(seq.request_id == "bad" for seq, _, _ in chunks):
            raise RuntimeError("this prompt breaks the model")
        return prefill_prompts(self, chunks, beside)

    monkeypatch.setattr(TorchEngine, "_prefill_prompts", failing_on_bad)
    rng = random.Random(11)
    # Short enough for "bad" and "good" to share a step's chunks.
    requests = [request(rid, random_prompt(rng, 5, 7), 8) for rid in ("stream", "bad", "good")]
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(requests[0])
    outputs = scheduler.run_once()  # the stream alone: decoding before the others come
    scheduler.submit(requests[1])
    scheduler.submit(requests[2])
    while scheduler.has_work():
        outputs += scheduler.run_once()
    errors = {o.request_id: o for o in outputs if isinstance(o, ErrorResult)}
    results = {o.request_id: o for o in outputs if isinstance(o, GenerateResult)}
    assert set(errors) == {"bad"} and "this prompt breaks the model" in errors["bad"].message
    for r in (requests[0], requests[2]):
        assert results[r.request_id].token_ids == reference_ids(model, r)
    assert engine.num_active() == 0 and scheduler.num_failures_in_a_row == 0


def test_a_burst_on_an_idle_worker_prefills_in_passes_each_counted_and_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No stream waits, so every prompt goes in at once; but in passes, which
    heartbeats count: one pass of 64 prompts of 950 tokens outlasted STEP_TIMEOUT_S."""
    monkeypatch.setattr(slot_engine, "PREFILL_PASS_TOKENS", 40)
    model = tiny_model().model
    engine = tiny_engine(capacity=4, prefill_chunk_tokens=CHUNK)
    rng = random.Random(5)
    requests = [request(f"r{i}", random_prompt(rng, 30, 30), 6) for i in range(4)]
    scheduler = Scheduler(engine, max_queue_depth=10)
    for r in requests:
        scheduler.submit(r)
    outputs = scheduler.run_once()
    assert engine.num_extra_prefill_passes() == 3  # a pass for each prompt of 30
    assert scheduler.num_steps == 4
    while scheduler.has_work():
        outputs += scheduler.run_once()
    results = {o.request_id: o for o in outputs if isinstance(o, GenerateResult)}
    for r in requests:
        assert results[r.request_id].token_ids == reference_ids(model, r)


def test_beside_streams_a_prompt_to_score_goes_in_chunks_and_scores_as_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scored prompt went in whole: one of 1,020 tokens held every stream about
    1 s a step (quiet 2-core Xeon), and the 8 choices of one such request, in one
    step, 20 to 40 s loaded. Now each chunk scores its own positions."""
    engine = tiny_engine(capacity=4, prefill_chunk_tokens=CHUNK)
    calls = record_prefills(monkeypatch)
    rng = random.Random(21)
    stream = request("stream", random_prompt(rng, 4, 4), 60, ignore_eos=True)
    engine.admit([stream])
    engine.step()
    prompt = random_prompt(rng, 70, 70)
    scoring = [request(f"score{i}", prompt, 1, prompt_logprobs=3) for i in range(2)]
    engine.admit(scoring)
    calls.clear()
    results = {}
    while len(results) < len(scoring):
        before = len(engine._by_id["stream"].output_token_ids)
        output = engine.step()
        results.update((f.request_id, f) for f in output.finished)
        assert len(engine._by_id["stream"].output_token_ids) == before + 1
    assert max(call.num_tokens for call in calls) <= CHUNK
    assert sum(call.num_scored for call in calls) == 2 * len(prompt)  # each computed, in chunks
    alone = run_schedule(tiny_engine(capacity=1), {0: [scoring[0]]})["score0"]
    for result in results.values():
        chunked, whole = result.prompt_logprobs, alone.prompt_logprobs
        assert chunked is not None and whole is not None
        assert len(chunked.logprobs) == len(prompt)
        assert chunked.top_token_ids == whole.top_token_ids
        assert chunked.logprobs[1:] == pytest.approx(whole.logprobs[1:], abs=1e-5)
        assert chunked.top_logprobs == pytest.approx(whole.top_logprobs, abs=1e-5, nan_ok=True)
        assert result.token_ids == alone.token_ids
