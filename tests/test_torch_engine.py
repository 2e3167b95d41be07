"""Continuous batching on the slot cache gives, token for token, what standalone
Hugging Face greedy generate gives for each request alone."""

from __future__ import annotations

import dataclasses
import random

import pytest

pytest.importorskip("torch")

import torch

from bench.static_baseline import StaticBatchRunner
from protocol import ErrorCode, GenerateRequest
from tests.model_fixtures import (
    CONTEXT_WINDOW,
    EOS,
    Schedule,
    disable_kernels,
    force_kernels,
    random_prompt,
    random_schedule,
    reference_ids,
    request,
    run_schedule,
    tiny_engine,
    tiny_model,
    with_graph_buckets,
)
from tests.resume import assert_every_resume_is_exact
from worker.engine.interface import RequestRejected
from worker.engine.torch_engine import TorchEngine
from worker.model.sampler import Sampler

pytestmark = pytest.mark.model


def assert_parity(engine: TorchEngine, requests: list[GenerateRequest], finished: dict) -> None:
    for r in requests:
        assert finished[r.request_id].token_ids == reference_ids(engine.model, r), r.request_id


def test_default_eos_matches_generate_and_static_runner() -> None:
    engine = tiny_engine(capacity=4, eos_scale=1.5)
    rng = random.Random(1)
    requests = [request(f"r{i}", random_prompt(rng), 40) for i in range(10)]
    finished = run_schedule(engine, {0: requests})
    assert_parity(engine, requests, finished)
    reasons = [finished[r.request_id].finish_reason for r in requests]
    assert "stop" in reasons and "length" in reasons
    static = [
        seq
        for chunk in StaticBatchRunner(engine.model, engine.tokenizer, 4).run(requests)
        for seq in chunk
    ]
    for seq in static:
        assert seq.token_ids == finished[seq.request_id].token_ids
        assert seq.text == finished[seq.request_id].text
        assert seq.finish_reason == finished[seq.request_id].finish_reason


def test_rows_leave_at_their_own_max_new_tokens() -> None:
    engine = tiny_engine(capacity=4)
    rng = random.Random(2)
    budgets = [3, 7, 12, 20]
    requests = [request(f"r{i}", random_prompt(rng), n) for i, n in enumerate(budgets)]
    engine.admit(requests)
    finished = {}
    num_active_after_step = []
    while engine.num_active():
        for seq in engine.step().finished:
            finished[seq.request_id] = seq
        num_active_after_step.append(engine.num_active())
    assert_parity(engine, requests, finished)
    # The prefill makes token 1, so step s (from 0) makes token s + 2.
    expected = [sum(n > s + 2 for n in budgets) for s in range(max(budgets) - 1)]
    assert num_active_after_step == expected


def test_pinned_stop_token_fires_mid_batch() -> None:
    engine = tiny_engine(capacity=3)
    rng = random.Random(3)
    prompts = [random_prompt(rng) for _ in range(3)]
    free_run = reference_ids(engine.model, request("x", prompts[1], 30, ignore_eos=True))
    # The first token that does not occur earlier in the output, some steps in.
    index = next(i for i in range(5, 30) if free_run[i] not in free_run[:i])
    stop_id = free_run[index]
    requests = [
        request("a", prompts[0], 30),
        request("b", prompts[1], 30, stop_token_ids=[stop_id], ignore_eos=True),
        request("c", prompts[2], 30),
    ]
    finished = run_schedule(engine, {0: requests})
    assert_parity(engine, requests, finished)
    assert finished["b"].finish_reason == "stop"
    assert finished["b"].token_ids == free_run[: index + 1]


def test_short_sequence_joins_late_and_leaves_first() -> None:
    engine = tiny_engine(capacity=3)
    rng = random.Random(4)
    long_ones = [request(f"long{i}", random_prompt(rng, 10, 30), 30) for i in range(2)]
    short = request("short", random_prompt(rng, 2, 5), 4)
    engine.admit(long_ones)
    finished = {}
    order = []
    for step in range(40):
        if step == 6:
            engine.admit([short])
        for seq in engine.step().finished:
            finished[seq.request_id] = seq
            order.append(seq.request_id)
    assert_parity(engine, [*long_ones, short], finished)
    assert order[0] == "short" and len(order) == 3


@pytest.fixture(scope="module")
def schedule() -> Schedule:
    return random_schedule()


@pytest.fixture(scope="module")
def schedule_references(schedule: Schedule) -> dict[str, list[int]]:
    model = tiny_model(eos_scale=1.5).model
    return {r.request_id: reference_ids(model, r) for r in schedule.requests}


@pytest.mark.parametrize(
    ("capacity", "uses_kernels", "prefill_chunk_tokens", "graph_buckets"),
    [
        (1, True, 0, False),
        (3, True, 0, False),
        (8, True, 0, False),
        (8, False, 0, False),
        # Chunks shorter than most prompts, and one that mostly fits them whole.
        (3, True, 7, False),
        (8, True, 16, False),
        (8, False, 64, False),
        # Steps padded to CUDA's graph buckets (run eagerly here).
        (6, True, 0, True),
        (8, False, 16, True),
    ],
)
def test_random_schedule_with_aborts(
    capacity: int,
    uses_kernels: bool,
    prefill_chunk_tokens: int,
    graph_buckets: bool,
    schedule: Schedule,
    schedule_references: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if uses_kernels:
        force_kernels(monkeypatch)
    else:
        disable_kernels(monkeypatch)
    engine = tiny_engine(capacity, eos_scale=1.5, prefill_chunk_tokens=prefill_chunk_tokens)
    if graph_buckets:
        with_graph_buckets(engine)
    assert uses_kernels or engine.gpt2.decode_attention is None
    requests = schedule.requests
    finished = run_schedule(engine, schedule.arrivals, schedule.aborts)
    assert set(finished) == {r.request_id for r in requests}
    reasons = {seq.finish_reason for seq in finished.values()}
    assert {"stop", "length", "abort"} <= reasons
    for request_id, seq in finished.items():
        expected = schedule_references[request_id]
        if seq.finish_reason == "abort":
            assert seq.token_ids == expected[: len(seq.token_ids)], request_id
        else:
            assert seq.token_ids == expected, request_id


def test_first_token_that_finishes_is_drained_without_a_decode() -> None:
    engine = tiny_engine(capacity=2)
    prompt = random_prompt(random.Random(6))
    first = reference_ids(engine.model, request("x", prompt, 1, ignore_eos=True))[0]
    engine.admit([request("done", prompt, 10, stop_token_ids=[first], ignore_eos=True)])
    decoded = []
    engine._decode = lambda active: decoded.append(active) or []  # type: ignore[method-assign]
    output = engine.step()
    assert [seq.request_id for seq in output.finished] == ["done"]
    assert decoded == [] and engine.num_active() == 0


def test_context_overflow_is_rejected_and_the_batch_is_untouched() -> None:
    engine = tiny_engine(capacity=3)
    rng = random.Random(7)
    live = request("live", random_prompt(rng), 20)
    engine.admit([live])
    engine.step()
    too_long = request("too-long", random_prompt(rng, 100, 100), CONTEXT_WINDOW - 99)
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([request("fits", random_prompt(rng), 5), too_long])
    assert rejected.value.code == ErrorCode.CONTEXT_OVERFLOW
    assert "100 tokens and 29 to generate, more than the context window of 128 " in (
        rejected.value.message
    )
    assert engine.num_active() == 1
    finished = run_schedule(engine, {})
    assert_parity(engine, [live], finished)


def test_abort_frees_the_slot_before_the_next_step() -> None:
    engine = tiny_engine(capacity=1)
    rng = random.Random(8)
    first = request("first", random_prompt(rng), 20, ignore_eos=True)
    engine.admit([first])
    engine.step()
    [aborted] = engine.abort(["first"])
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 2
    second = request("second", random_prompt(rng), 6)
    finished = run_schedule(engine, {0: [second]})
    assert_parity(engine, [second], finished)


def test_unequal_prompts_in_one_prefill_do_not_leak_into_each_other() -> None:
    engine = tiny_engine(capacity=2)
    rng = random.Random(9)
    requests = [
        request("a", [*random_prompt(rng), EOS], 8, ignore_eos=True),
        request("b", random_prompt(rng, 30, 30), 8, ignore_eos=True),
    ]
    assert_parity(engine, requests, run_schedule(engine, {0: requests}))


def test_computing_in_bfloat16_matches_generate_in_bfloat16() -> None:
    """A model computing in its own dtype, as DTYPE does on CUDA (on CPU, DTYPE
    chooses storage only): oneDNN's bfloat16 products and SDPA, no kernels."""
    loaded = tiny_model()
    loaded.model.to(torch.bfloat16)
    engine = TorchEngine(loaded, capacity=4)
    assert engine.gpt2.decode_attention is None and engine.cache.kv.dtype == torch.bfloat16
    rng = random.Random(1)
    requests = [request(f"r{i}", random_prompt(rng, 2, 30), 12, ignore_eos=True) for i in range(8)]
    finished = run_schedule(engine, {0: requests[:4], 3: requests[4:]})
    assert_parity(engine, requests, finished)


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1234}],
    ids=["greedy", "seeded"],
)
def test_a_resumed_stream_continues_as_the_uninterrupted_run(sampling: dict) -> None:
    prompt = random_prompt(random.Random(10))
    stream = request("r", prompt, 14, stream=True, ignore_eos=True, **sampling)
    result = assert_every_resume_is_exact(lambda: tiny_engine(capacity=1), stream)
    greedy = reference_ids(tiny_model().model, request("g", prompt, 14, ignore_eos=True))
    assert (result.token_ids == greedy) == (not sampling)  # the seeded run really sampled


@pytest.mark.parametrize("chunk_tokens", [0, 8])
@pytest.mark.parametrize("prompt_tokens", [(2, 8), (9, 24)])
@pytest.mark.parametrize("paths", ["rule", "kernel"])
def test_a_resumed_stream_draws_from_the_uninterrupted_runs_logits_bit_for_bit(
    paths: str,
    prompt_tokens: tuple[int, int],
    chunk_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a near-tie any difference in the last bits is another draw: resumed at
    every cut, beside other streams, a seeded stream must see at each position
    the logits its uninterrupted run saw alone: whatever its prompt's length,
    chunked (PREFILL_CHUNK_TOKENS) or not, alone or beside others' prompts."""
    if paths == "kernel":
        force_kernels(monkeypatch)
    seen: dict[int, torch.Tensor] = {}  # the stream's logits, by output position
    sample = Sampler.sample

    def recording(self: Sampler, logits: torch.Tensor, requests, seeds, positions):  # type: ignore[no-untyped-def]
        for row, (r, position) in enumerate(zip(requests, positions, strict=True)):
            if r.request_id == "r":
                seen[position] = logits[row].clone()
        return sample(self, logits, requests, seeds, positions)

    monkeypatch.setattr(Sampler, "sample", recording)
    rng = random.Random(12)
    sampling = {"temperature": 0.9, "top_p": 0.95, "stream": True, "ignore_eos": True}
    stream = request(
        "r",
        random_prompt(rng, *prompt_tokens),
        20,
        seed=7,
        presence_penalty=0.5,
        min_tokens=4,
        **sampling,
    )
    others = [
        request(f"o{i}", random_prompt(rng, 1, 30), rng.randint(5, 25), seed=i, **sampling)
        for i in range(3)
    ]

    def engine() -> TorchEngine:
        return tiny_engine(capacity=4, prefill_chunk_tokens=chunk_tokens)

    fault_free = run_schedule(engine(), {0: [stream]})["r"]
    alone = dict(seen)
    assert len(alone) == 20
    for cut in range(1, 20):
        seen.clear()
        resumed = dataclasses.replace(stream, resume_token_ids=fault_free.token_ids[:cut])
        # The others first: they decode while the resumed prompt goes in, in chunks.
        finished = run_schedule(engine(), {0: others[:1], 1: [resumed, *others[1:]]})
        assert finished["r"].token_ids == fault_free.token_ids, f"cut after {cut}"
        assert sorted(seen) == list(range(cut, 20))
        assert all(torch.equal(seen[p], alone[p]) for p in seen), f"cut after {cut}"
    # Not resumed, but arriving while another decodes: its prompt goes in chunks.
    seen.clear()
    run_schedule(engine(), {0: others[:1], 1: [stream, *others[1:]]})
    assert sorted(seen) == list(range(20))
    assert all(torch.equal(seen[p], alone[p]) for p in seen)


def test_more_slots_than_context_positions() -> None:
    """Decode's row indices are cut from a preallocated range as long as the context
    window; more slots than that must still index every row."""
    capacity = CONTEXT_WINDOW + 2
    engine = tiny_engine(capacity)
    rng = random.Random(11)
    requests = [
        request(f"r{i}", random_prompt(rng, 1, 3), 3, ignore_eos=True) for i in range(capacity)
    ]
    finished = run_schedule(engine, {0: requests})
    assert_parity(engine, requests[-3:], finished)
