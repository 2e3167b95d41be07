"""Small synthetic GPT-2s for the model tests, and the reference they are held to.

Random weights give nearly flat logits, where float noise between a batched and
a single run can flip an argmax. The test model's output scale is multiplied up
so that the top token leads by a wide margin and parity is a stable check. Its LM
head is untied from the input embedding: a random tied model mostly predicts its
own input token, and a run of one repeated token would prove little.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import GPT2LMHeadModel

from protocol import GenerateRequest
from worker.engine.interface import FinishedSequence
from worker.engine.torch_engine import TorchEngine
from worker.model import gpt2, projection
from worker.model.decode_step import Buckets, Capture, DecodeStep, eager
from worker.model.loader import LoadedModel, synthetic_config, synthetic_model
from worker.model.precision import MODES, Precision

VOCAB_SIZE = 256
EOS = VOCAB_SIZE - 1
CONTEXT_WINDOW = 128
LOGIT_SCALE = 20.0


def request(
    request_id: str, prompt_ids: list[int], max_new_tokens: int, **kwargs: object
) -> GenerateRequest:
    """A request whose prompt is token ids."""
    return GenerateRequest(
        request_id,
        "",
        max_new_tokens,
        prompt_token_ids=prompt_ids,
        **kwargs,  # type: ignore[arg-type]
    )


def random_prompt(rng: random.Random, low: int = 1, high: int = 24) -> list[int]:
    # EOS is left out of prompts so that a prompt never looks finished.
    return [rng.randrange(VOCAB_SIZE - 1) for _ in range(rng.randint(low, high))]


@dataclass(frozen=True)
class Schedule:
    """The parity workload: requests, when each arrives and when some are aborted
    (in steps), for ``run_schedule``."""

    requests: list[GenerateRequest]
    arrivals: dict[int, list[GenerateRequest]]
    aborts: dict[int, list[str]]


def random_schedule(seed: int = 5) -> Schedule:
    """56 requests of up to 40 prompt tokens and 25 new ones, half ignoring EOS,
    arriving over 60 steps; about 15% are aborted a few steps after arriving."""
    rng = random.Random(seed)
    requests = [
        request(
            f"r{i}", random_prompt(rng, 1, 40), rng.randint(1, 25), ignore_eos=rng.random() < 0.5
        )
        for i in range(56)
    ]
    arrivals: dict[int, list[GenerateRequest]] = {}
    aborts: dict[int, list[str]] = {}
    for r in requests:
        arrival = rng.randrange(60)
        arrivals.setdefault(arrival, []).append(r)
        if rng.random() < 0.15:
            aborts.setdefault(arrival + rng.randint(0, 6), []).append(r.request_id)
    return Schedule(requests, arrivals, aborts)


def tiny_model(seed: int = 0, eos_scale: float = 1.0) -> LoadedModel:
    """A 2-layer, 64-wide GPT-2 with peaked outputs; ``eos_scale`` > 1 makes EOS likelier."""
    config = synthetic_config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=CONTEXT_WINDOW,
        vocab_size=VOCAB_SIZE,
        eos_token_id=EOS,
        bos_token_id=EOS,
        tie_word_embeddings=False,
    )
    loaded = synthetic_model(config, seed=seed)
    with torch.no_grad():
        loaded.model.transformer.ln_f.weight.mul_(LOGIT_SCALE)
        loaded.model.lm_head.weight[EOS].mul_(eos_scale)
    return loaded


def tiny_engine(
    capacity: int,
    seed: int = 0,
    eos_scale: float = 1.0,
    mode: str = "float32",
    prefill_chunk_tokens: int = 0,
    prefix_cache: bool = True,
    block_tokens: int = 0,
) -> TorchEngine:
    """On the CPU, in one of worker.model.precision's MODES (the prefix cache is
    on only with chunked prefill; ``block_tokens``: see `SlotEngine`)."""
    precision = Precision.for_device(torch.device("cpu"), *MODES[mode])
    return TorchEngine(
        tiny_model(seed, eos_scale),
        capacity,
        precision=precision,
        prefill_chunk_tokens=prefill_chunk_tokens,
        prefix_cache=prefix_cache,
        block_tokens=block_tokens,
    )


def with_graph_buckets(engine: TorchEngine, capture: Capture = eager) -> TorchEngine:
    """``engine``, decoding as on CUDA: each step padded up to a bucket (1, 2, 4 ...
    rows; 16, 32, 64 or 128 positions) and run by ``capture``'s replay, by default
    `eager`, the CPU's stand-in for a CUDA graph."""
    buckets = Buckets.doubling(engine.capacity, CONTEXT_WINDOW, shortest_length=16)
    graphs = buckets, capture
    engine.decode_step = DecodeStep(engine.gpt2, engine.cache, engine.capacity, graphs)
    return engine


def force_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built from now on decode every projection through the skinny kernel,
    whether or not it is the faster path on this machine, so that tests cover it."""
    monkeypatch.setattr(projection, "decode_path", lambda _: "kernel")


def disable_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built from now on decode through oneDNN and SDPA, as on a machine
    that cannot build the decode kernels."""
    for module in (gpt2, projection):
        monkeypatch.setattr(module, "load_kernels", lambda: None)


@dataclass(frozen=True)
class PrefillCall:
    """One call into `GPT2.prefill`: each chunk's start and length, which chunks
    it scores (keeps every position of), and whether a decode step ran in the
    same pass."""

    starts: list[int]
    lengths: list[int]
    scored: list[int]
    with_decode: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_scored(self) -> int:
        return sum(self.lengths[i] for i in self.scored)


def record_prefills(monkeypatch: pytest.MonkeyPatch) -> list[PrefillCall]:
    """Every call into `GPT2.prefill` from now on, in order."""
    calls: list[PrefillCall] = []
    prefill = gpt2.GPT2.prefill

    def recording(self, token_ids, lengths, slots, cache, keep_all=(), starts=None, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(
            PrefillCall(
                list(starts or [0] * len(lengths)),
                list(lengths),
                sorted(keep_all),
                kwargs.get("beside") is not None,
            )
        )
        return prefill(self, token_ids, lengths, slots, cache, keep_all, starts, **kwargs)

    monkeypatch.setattr(gpt2.GPT2, "prefill", recording)
    return calls


def reference_ids(model: GPT2LMHeadModel, request: GenerateRequest) -> list[int]:
    """Standalone HF greedy generate for one request, cut where the engine stops."""
    assert request.prompt_token_ids is not None
    stop_ids = list(request.stop_token_ids)
    if not request.ignore_eos:
        stop_ids.append(model.config.eos_token_id)
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([request.prompt_token_ids]),
            attention_mask=torch.ones(1, len(request.prompt_token_ids), dtype=torch.long),
            max_new_tokens=request.max_new_tokens,
            do_sample=False,
            eos_token_id=stop_ids or None,
            pad_token_id=0,
        )
    new_ids: list[int] = output[0, len(request.prompt_token_ids) :].tolist()
    for i, token_id in enumerate(new_ids):
        if token_id in stop_ids:
            return new_ids[: i + 1]
    return new_ids


def run_schedule(
    engine: TorchEngine,
    arrivals: dict[int, list[GenerateRequest]],
    aborts: dict[int, list[str]] | None = None,
) -> dict[str, FinishedSequence]:
    """Drive ``engine`` like the scheduler: before step s, abort ``aborts[s]`` (queued
    or active) and queue ``arrivals[s]``; admit FCFS into free slots; step until all
    are done."""
    aborts = aborts or {}
    queue: list[GenerateRequest] = []
    finished: dict[str, FinishedSequence] = {}
    last_event = max([*arrivals, *aborts, 0])
    step = 0
    while step <= last_event or queue or engine.num_active():
        for request_id in aborts.get(step, []):
            queued = [r for r in queue if r.request_id == request_id]
            for r in queued:
                queue.remove(r)
                finished[request_id] = FinishedSequence(request_id, [], "", "abort", 0)
        for seq in engine.abort(aborts.get(step, [])):
            finished[seq.request_id] = seq
        queue.extend(arrivals.get(step, []))
        num_free = engine.capacity - engine.num_active()
        if queue and num_free:
            engine.admit(queue[:num_free])
            del queue[:num_free]
        for seq in engine.step().finished:
            finished[seq.request_id] = seq
        step += 1
    return finished
