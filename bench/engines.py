"""The synthetic-model engine at several capacities, sharing one copy of the weights."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from worker.engine.torch_engine import TorchEngine
from worker.model.loader import LoadedModel, TextTokenizer
from worker.model.precision import MODES
from worker.serve.config import WorkerConfig
from worker.serve.load import load_engine

MODEL_ID = "synthetic"


def engines_by_capacity(
    capacities: Sequence[int], device: str = "cpu", mode: str = "float32"
) -> Iterator[tuple[int, TorchEngine]]:
    """``(capacity, engine)`` for each capacity in turn, in one of worker.model.precision's
    MODES; each engine has its own slot cache, and the caller drops it before
    asking for the next."""
    first = mode_engine(mode, capacities[0], device)
    info = first.info
    assert isinstance(first.tokenizer, TextTokenizer)  # what load_engine gives a real model
    loaded = LoadedModel(info.name, first.model, first.tokenizer, info.is_random_weights)
    first_precision = first.precision
    yield capacities[0], first
    del first
    for capacity in capacities[1:]:
        yield capacity, TorchEngine(loaded, capacity, precision=first_precision)


def mode_engine(mode: str, capacity: int, device: str = "cpu") -> TorchEngine:
    """The synthetic-model engine in one of worker.model.precision's MODES."""
    dtype, weights, bfloat16_products = MODES[mode]
    config = WorkerConfig(
        model_id=MODEL_ID,
        max_batch_size=capacity,
        device=device,
        dtype=dtype,
        weights=weights,
        bfloat16_products=bfloat16_products,
    )
    return load_engine(config)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer around it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
