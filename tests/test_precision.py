"""DTYPE=float16/bfloat16 and WEIGHTS=int8 on CPU: what each costs in output against
the float32 engine, on the peaked test models and the random-schedule workload,
with and without the decode kernels. The README's table states these bounds."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from protocol.settings import ConfigError
from tests.model_fixtures import (
    disable_kernels,
    force_kernels,
    random_schedule,
    reference_ids,
    run_schedule,
    tiny_engine,
    tiny_model,
)
from tests.quality import Quality, forced_logits
from worker.model import precision as precision_module
from worker.model.precision import Precision, cpu_modes
from worker.serve.config import WorkerConfig

pytestmark = pytest.mark.model

# Per mode: the largest logit error, relative to the largest float32 logit (about
# 4x the measured 0.04%, 0.4%, 0.8% and, with bfloat16 products, 0.5%).
RELATIVE_ERROR = {
    "float16": 0.002,
    "bfloat16": 0.015,
    "int8": 0.03,
    "bfloat16-products": 0.02,
}


def _runnable(mode: str) -> object:
    """``mode`` as a parameter, skipped with the reason where this CPU cannot run it."""
    reason = "this CPU has no bfloat16 dot products (AVX512-BF16 or AMX)"
    return pytest.param(mode, marks=pytest.mark.skipif(mode not in cpu_modes(), reason=reason))


MODES = [_runnable(mode) for mode in RELATIVE_ERROR]
MIN_AGREEMENT = 0.98
# A greedy token may differ only where float32 itself nearly ties: its top two
# logits within 1% of the model's logit range (about 11 here).
MAX_TIED_GAP = 0.1


@pytest.fixture(scope="module")
def workload() -> tuple[list, dict[str, list[int]], torch.Tensor]:
    schedule = random_schedule()
    model = tiny_model(eos_scale=1.5).model
    references = {r.request_id: reference_ids(model, r) for r in schedule.requests}
    reference_logits = forced_logits(tiny_engine(8, eos_scale=1.5), schedule.requests, references)
    return schedule.requests, references, reference_logits


@pytest.mark.parametrize("uses_kernels", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_stays_within_its_stated_cost(
    mode: str, uses_kernels: bool, workload: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    if uses_kernels:
        force_kernels(monkeypatch)
    else:
        disable_kernels(monkeypatch)
    requests, references, reference_logits = workload
    engine = tiny_engine(8, eos_scale=1.5, mode=mode)
    assert (engine.gpt2.decode_attention is not None) == uses_kernels
    quality = Quality.of(forced_logits(engine, requests, references), reference_logits)
    assert quality.agreement >= MIN_AGREEMENT, quality
    assert quality.max_tied_gap <= MAX_TIED_GAP, quality
    assert quality.relative_error <= RELATIVE_ERROR[mode], quality


@pytest.mark.parametrize("mode", MODES)
def test_free_running_outputs_part_from_float32_only_at_near_ties(
    mode: str, workload: tuple
) -> None:
    """The random schedule run as served (continuous batching, aborts): each output
    follows float32's until a position where float32's top two logits nearly tie."""
    requests, references, reference_logits = workload
    schedule = random_schedule()
    finished = run_schedule(
        tiny_engine(8, eos_scale=1.5, mode=mode), schedule.arrivals, schedule.aborts
    )
    offset = 0
    for r in requests:
        got, expected = finished[r.request_id].token_ids, references[r.request_id]
        parted = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None
        )
        if parted is not None:
            top2 = reference_logits[offset + parted].topk(2).values
            assert float(top2[0] - top2[1]) <= MAX_TIED_GAP, (r.request_id, parted)
        offset += len(expected)


def test_int8_weights_on_a_gpu_fail_at_start_saying_what_to_set() -> None:
    with pytest.raises(ConfigError, match="WEIGHTS=int8 runs on CPU only"):
        Precision.for_device(torch.device("cuda"), "float16", "int8")


def test_bfloat16_products_are_refused_where_they_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match="needs DTYPE=bfloat16"):
        WorkerConfig(dtype="float16", bfloat16_products=True)
    with pytest.raises(ConfigError, match="on a GPU, DTYPE=bfloat16 already"):
        Precision.for_device(torch.device("cuda"), "bfloat16", "", bfloat16_products=True)
    monkeypatch.setattr(precision_module, "has_bfloat16_products", lambda: False)
    with pytest.raises(ConfigError, match="this one has none: unset BFLOAT16_PRODUCTS"):
        Precision.for_device(torch.device("cpu"), "bfloat16", "", bfloat16_products=True)
    assert "bfloat16-products" not in precision_module.cpu_modes()


def test_on_cpu_dtype_chooses_storage_and_arithmetic_stays_float32() -> None:
    precision = Precision.for_device(torch.device("cpu"), "bfloat16", "")
    assert precision == Precision(torch.float32, torch.bfloat16, "bfloat16")
    engine = tiny_engine(2, mode="bfloat16")
    assert engine.cache.kv.dtype == torch.bfloat16 and engine.gpt2.wte.dtype == torch.bfloat16
