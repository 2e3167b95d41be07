"""The synthetic-model engine at several capacities, sharing one copy of the weights."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from protocol.config import WorkerConfig
from worker.model_loader import LoadedModel, TextTokenizer
from worker.torch_engine import TorchEngine, load_engine

MODEL_ID = "synthetic"


def engines_by_capacity(
    capacities: Sequence[int], device: str = "cpu"
) -> Iterator[tuple[int, TorchEngine]]:
    """``(capacity, engine)`` for each capacity in turn; each engine has its own slot
    cache, and the caller drops it before asking for the next."""
    first = load_engine(
        WorkerConfig(model_id=MODEL_ID, max_batch_size=capacities[0], device=device)
    )
    info = first.info
    assert isinstance(first.tokenizer, TextTokenizer)  # what load_engine gives a real model
    loaded = LoadedModel(info.name, first.model, first.tokenizer, info.is_random_weights)
    yield capacities[0], first
    del first
    for capacity in capacities[1:]:
        yield capacity, TorchEngine(loaded, capacity)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer around it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
