"""Sampling: greedy and sampled rows mixed in one batch, seeds, top_k and top_p."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from protocol import ErrorCode, GenerateRequest  # noqa: E402
from tests.model_fixtures import VOCAB_SIZE, run_schedule, tiny_engine  # noqa: E402
from worker.engine import RequestRejected  # noqa: E402
from worker.sampler import Sampler  # noqa: E402

CPU = torch.device("cpu")


def request(request_id: str, prompt_ids: list[int], **kwargs: object) -> GenerateRequest:
    return GenerateRequest(
        request_id, "", 20, prompt_token_ids=prompt_ids, ignore_eos=True, **kwargs
    )  # type: ignore[arg-type]


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(VOCAB_SIZE - 1) for _ in range(rng.randint(2, 20))] for _ in range(count)
    ]


def sample_many(logits: list[float], num_draws: int, **kwargs: object) -> set[int]:
    sampler = Sampler(CPU)
    req = request("x", [0], seed=1, **kwargs)
    generator = sampler.generator_for(req)
    rows = torch.tensor([logits] * num_draws)
    return set(sampler.sample(rows, [req] * num_draws, [generator] * num_draws))


def test_top_k_keeps_only_the_k_likeliest() -> None:
    drawn = sample_many([0.0, 3.0, 1.0, 2.9, 2.8], 400, temperature=5.0, top_k=2)
    assert drawn == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: p = 0.7 needs the first two.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert sample_many(logits, 400, temperature=1.0, top_p=0.7) == {0, 1}
    assert sample_many(logits, 400, temperature=1.0) == {0, 1, 2, 3}


@pytest.mark.model
def test_invalid_sampling_parameters_are_rejected() -> None:
    engine = tiny_engine(capacity=2)
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([request("bad", [1, 2], temperature=0.7, top_p=0.0)])
    assert rejected.value.code == ErrorCode.INVALID_REQUEST and "top_p" in rejected.value.message
    assert engine.num_active() == 0


@pytest.mark.model
def test_seeded_request_is_the_same_alone_and_in_a_batch() -> None:
    prompt, *others = prompts(seed=1, count=4)
    seeded = request("seeded", prompt, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = run_schedule(tiny_engine(capacity=4), {0: [seeded]})["seeded"]
    batchmates = [
        request("greedy", others[0]),
        request("sampled", others[1], temperature=1.5),
        request("other-seed", others[2], temperature=0.8, seed=99),
    ]
    crowded = run_schedule(tiny_engine(capacity=4), {0: batchmates[:2], 3: [seeded, batchmates[2]]})
    assert crowded["seeded"].token_ids == alone.token_ids
    greedy = run_schedule(tiny_engine(capacity=4), {0: [request("seeded", prompt)]})["seeded"]
    assert alone.token_ids != greedy.token_ids  # it really sampled


@pytest.mark.model
def test_top_k_one_and_temperature_zero_are_greedy() -> None:
    batch = prompts(seed=2, count=3)
    greedy = run_schedule(
        tiny_engine(capacity=3), {0: [request(f"r{i}", p) for i, p in enumerate(batch)]}
    )
    top_one = run_schedule(
        tiny_engine(capacity=3),
        {0: [request(f"r{i}", p, temperature=1.3, top_k=1) for i, p in enumerate(batch)]},
    )
    for request_id, seq in greedy.items():
        assert top_one[request_id].token_ids == seq.token_ids
