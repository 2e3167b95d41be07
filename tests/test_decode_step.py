"""The decode hot loop (`worker.model.decode_step`): staged inputs, buckets, captured
steps. Parity over the random schedule in buckets is in test_torch_engine.py.

The tests marked ``cuda`` need a GPU and are skipped without one; on the CPU the
same code runs with `eager` standing in for CUDA graph capture."""

from __future__ import annotations

import random
import warnings

import pytest

pytest.importorskip("torch")

import torch

from tests.model_fixtures import (
    CONTEXT_WINDOW,
    random_prompt,
    random_schedule,
    reference_ids,
    request,
    run_schedule,
    tiny_engine,
    tiny_model,
    with_graph_buckets,
)
from worker.engine.torch_engine import TorchEngine
from worker.model.decode_step import Buckets, Replay
from worker.model.gpt2 import GPT2

pytestmark = pytest.mark.model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_buckets_double_up_to_the_capacity_and_the_window() -> None:
    buckets = Buckets.doubling(capacity=8, context_window=1024, shortest_length=64)
    assert buckets.rows == (1, 2, 4, 8)
    assert buckets.lengths == (64, 128, 256, 512, 1024)
    odd = Buckets.doubling(capacity=6, context_window=100, shortest_length=64)
    assert odd.rows == (1, 2, 4, 6) and odd.lengths == (64, 100)
    assert [odd.rows_for(n) for n in (1, 3, 5, 6)] == [1, 4, 6, 6]
    assert [odd.length_for(n) for n in (1, 64, 65, 100)] == [64, 64, 100, 100]


class DecodeCalls:
    """Records what each `GPT2.decode` call was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[
            tuple[int, int, int, int]
        ] = []  # ids and positions' addresses, rows, length
        decode = GPT2.decode

        def recording(self_: GPT2, token_ids, positions, attend_len, cache):  # type: ignore[no-untyped-def]
            self.calls.append(
                (token_ids.data_ptr(), positions.data_ptr(), token_ids.shape[0], attend_len)
            )
            return decode(self_, token_ids, positions, attend_len, cache)

        monkeypatch.setattr(GPT2, "decode", recording)


def test_every_step_reads_its_inputs_from_the_buffers_made_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = tiny_engine(capacity=4)
    calls = DecodeCalls(monkeypatch)
    rng = random.Random(1)
    arrivals = {
        step: [request(f"r{step}", random_prompt(rng), 6, ignore_eos=True)] for step in range(5)
    }
    run_schedule(engine, arrivals)
    assert len(calls.calls) > 5
    assert len({(ids, positions) for ids, positions, _, _ in calls.calls}) == 1
    # On the CPU each step runs at its own size: 1 to 4 rows, as many positions as needed.
    assert {rows for _, _, rows, _ in calls.calls} == {1, 2, 3, 4}


def test_each_bucket_is_captured_once_at_start_and_steps_pad_up_to_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captured: list[Replay] = []

    def counting_capture(step: Replay) -> Replay:
        captured.append(step)
        return step

    engine = with_graph_buckets(tiny_engine(capacity=3), counting_capture)
    assert len(captured) == 3 * 4  # rows 1, 2, 3 by lengths 16, 32, 64, 128
    calls = DecodeCalls(monkeypatch)
    rng = random.Random(2)
    prompts = [random_prompt(rng, 17, 20), random_prompt(rng, 2, 4), random_prompt(rng, 2, 4)]
    requests = [request(f"r{i}", prompt, 5, ignore_eos=True) for i, prompt in enumerate(prompts)]
    finished = run_schedule(engine, {0: requests})
    assert len(captured) == 3 * 4
    assert {(rows, length) for _, _, rows, length in calls.calls} == {(3, 32)}
    for r in requests:
        assert finished[r.request_id].token_ids == reference_ids(engine.model, r)


def test_a_step_with_a_free_slot_inside_returns_the_wanted_rows_only() -> None:
    engine = with_graph_buckets(tiny_engine(capacity=4))
    rng = random.Random(3)
    requests = [request(f"r{i}", random_prompt(rng), 8, ignore_eos=True) for i in range(3)]
    engine.admit(requests)
    engine.step()
    engine.abort(["r1"])  # slot 1 is free: rows 0..2 decode, 0 and 2 are wanted
    finished = run_schedule(engine, {})
    for r in (requests[0], requests[2]):
        assert finished[r.request_id].token_ids == reference_ids(engine.model, r)


# --- on a GPU ---------------------------------------------------------------------


def cuda_engine(capacity: int, cuda_graphs: bool = True) -> TorchEngine:
    loaded = tiny_model(eos_scale=1.5)
    loaded.model.to("cuda")
    return TorchEngine(loaded, capacity, cuda_graphs=cuda_graphs)


@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_cuda_decode_matches_generate_over_the_random_schedule(cuda_graphs: bool) -> None:
    schedule = random_schedule()
    engine = cuda_engine(capacity=8, cuda_graphs=cuda_graphs)
    assert bool(engine.decode_step.buckets) == cuda_graphs
    finished = run_schedule(engine, schedule.arrivals, schedule.aborts)
    model = tiny_model(eos_scale=1.5).model  # the reference, on the CPU
    for r in schedule.requests:
        seq = finished[r.request_id]
        expected = reference_ids(model, r)
        if seq.finish_reason == "abort":
            assert seq.token_ids == expected[: len(seq.token_ids)], r.request_id
        else:
            assert seq.token_ids == expected, r.request_id


@needs_cuda
def test_a_cuda_decode_step_waits_for_the_device_once() -> None:
    """Streams past their prefill, greedy, sampled with top-k and top-p, penalised,
    and held off their stop token by min_tokens: a step's only wait is reading
    the sampled ids."""
    engine = cuda_engine(capacity=4)
    rng = random.Random(4)
    kinds: list[dict[str, object]] = [
        {},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.5},
        {"min_tokens": 25},
    ]
    engine.admit(
        [
            request(f"r{i}", random_prompt(rng), 30, ignore_eos=i != 3, **kind)
            for i, kind in enumerate(kinds)
        ]
    )
    engine.step()  # the prefill, which may wait more
    torch.cuda.synchronize()
    num_steps = 10
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(num_steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == num_steps, [str(w.message) for w in syncs]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_decode_attention_runs_on_a_fused_sdpa_kernel(dtype: torch.dtype) -> None:
    """With SDPA allowed only its flash and memory-efficient kernels, decode and
    prefill still run: their attention never falls back to the plain one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    loaded = tiny_model()
    loaded.model.to("cuda", dtype)
    engine = TorchEngine(loaded, 4, cuda_graphs=False)
    rng = random.Random(5)
    long_prompt = random_prompt(rng, CONTEXT_WINDOW // 2, CONTEXT_WINDOW // 2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        run_schedule(engine, {0: [request("r", long_prompt, 10, ignore_eos=True)]})
