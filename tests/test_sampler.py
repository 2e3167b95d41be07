"""Sampling: greedy and sampled rows mixed in one batch, seeds, top_k and top_p."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from protocol import ErrorCode, GenerateRequest  # noqa: E402
from tests.model_fixtures import VOCAB_SIZE, run_schedule, tiny_engine  # noqa: E402
from worker.engine.interface import RequestRejected  # noqa: E402
from worker.model.sampler import Sampler, is_greedy  # noqa: E402

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
    """Draws for output positions 0 .. num_draws - 1 of one seeded request."""
    sampler = Sampler(CPU)
    req = request("x", [0], seed=1, **kwargs)
    rows = torch.tensor([logits] * num_draws)
    return set(sampler.sample(rows, [req] * num_draws, [1] * num_draws, list(range(num_draws))))


def test_top_k_keeps_only_the_k_likeliest() -> None:
    drawn = sample_many([0.0, 3.0, 1.0, 2.9, 2.8], 400, temperature=5.0, top_k=2)
    assert drawn == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: p = 0.7 needs the first two.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert sample_many(logits, 400, temperature=1.0, top_p=0.7) == {0, 1}
    assert sample_many(logits, 400, temperature=1.0) == {0, 1, 2, 3}


def test_a_draw_depends_only_on_the_seed_and_the_output_position() -> None:
    sampler = Sampler(CPU)
    req = request("x", [0], temperature=1.0)
    logits = torch.zeros(4, 1000)  # uniform: every draw is the noise alone
    first = sampler.sample(logits, [req] * 4, [7, 7, 8, 7], [0, 5, 5, 5])
    # The same (seed, position) in another row, batch and order draws the same.
    again = sampler.sample(logits[:3], [req] * 3, [None, 7, 7], [5, 5, 0])
    assert again[1:] == [first[1], first[0]]
    assert first[1] == first[3]
    assert len({first[0], first[1], first[2]}) == 3  # a new position or seed: new noise


def test_temperatures_below_1e_5_are_greedy() -> None:
    # Dividing logits by 1e-39 overflows to NaN, whose argmax is always token 0.
    for temperature, greedy in [(0.0, True), (1e-39, True), (9e-6, True), (1e-5, False)]:
        assert is_greedy(request("x", [0], temperature=temperature)) == greedy, temperature


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
def test_top_k_one_and_a_temperature_near_zero_are_greedy() -> None:
    batch = prompts(seed=2, count=3)
    greedy = run_schedule(
        tiny_engine(capacity=3), {0: [request(f"r{i}", p) for i, p in enumerate(batch)]}
    )
    top_one = run_schedule(
        tiny_engine(capacity=3),
        {0: [request(f"r{i}", p, temperature=1.3, top_k=1) for i, p in enumerate(batch)]},
    )
    tiny_temperature = run_schedule(
        tiny_engine(capacity=3),
        {0: [request(f"r{i}", p, temperature=1e-39) for i, p in enumerate(batch)]},
    )
    for request_id, seq in greedy.items():
        assert top_one[request_id].token_ids == seq.token_ids
        assert tiny_temperature[request_id].token_ids == seq.token_ids
