"""Sampling: greedy and sampled rows mixed in one batch, seeds, top_k, top_p,
min_p and logit_bias."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from protocol import ErrorCode, GenerateRequest  # noqa: E402
from tests.model_fixtures import EOS, VOCAB_SIZE, run_schedule, tiny_engine  # noqa: E402
from worker.engine.interface import RequestRejected  # noqa: E402
from worker.model import sampler as sampler_module  # noqa: E402
from worker.model.sampler import Sampler, apply_logit_bias, is_greedy  # noqa: E402

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


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])  # 0 once in float32
def test_a_top_p_too_small_for_float32_still_keeps_the_top_token(top_p: float) -> None:
    logits = torch.tensor([0.15, 0.5, 0.3, 0.05]).log().tolist()
    assert sample_many(logits, 100, temperature=1.0, top_p=top_p) == {1}


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps p >= 0.125.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert sample_many(logits, 400, temperature=1.0, min_p=0.25) == {0, 1, 2}
    assert sample_many(logits, 400, temperature=1.0, min_p=0.7) == {0}
    assert sample_many(logits, 400, temperature=1.0, min_p=1.0) == {0}
    # After the temperature, as vLLM applies it: at 0.5 the ratios square.
    assert sample_many(logits, 400, temperature=0.5, min_p=0.25) == {0, 1}


def test_min_p_and_top_k_remove_the_union_of_what_each_removes() -> None:
    logits = torch.tensor([0.4, 0.35, 0.15, 0.1]).log().tolist()
    assert sample_many(logits, 400, temperature=1.0, min_p=0.3, top_k=3) == {0, 1, 2}
    assert sample_many(logits, 400, temperature=1.0, min_p=0.5, top_k=3) == {0, 1}


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


@pytest.mark.parametrize("seed", [-2, -(2**63)])
def test_a_negative_seed_draws_as_any_other(seed: int) -> None:
    """vLLM takes a signed 64-bit seed: a negative one is a seed of its own, not
    its absolute value's, and draws the same each time."""
    sampler = Sampler(CPU)
    req = request("x", [0], temperature=1.0)
    logits = torch.zeros(3, 1000)
    draws = sampler.sample(logits, [req] * 3, [seed, seed, 2], [4, 4, 4])
    assert draws[0] == draws[1] != draws[2]


def test_seed_minus_one_is_no_seed_as_vllm_reads_it() -> None:
    """llama.cpp's clients, and vLLM's, send -1 for a random draw each time."""
    sampler = Sampler(CPU)
    seeds = {sampler.seed_for(request("x", [0], temperature=1.0, seed=-1)) for _ in range(8)}
    assert len(seeds) == 8 and None not in seeds
    assert sampler.seed_for(request("x", [0], temperature=1.0, seed=-2)) == -2


def test_a_plain_sampled_row_draws_the_same_beside_a_row_that_filters() -> None:
    """top_k or top_p in one row sends the batch down the filtering path; the
    rows that filter nothing must draw there what they draw without it."""
    sampler = Sampler(CPU)
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0))
    plain = request("plain", [0], temperature=1.0)
    filters = [
        request("k", [0], top_k=5),
        request("p", [0], top_p=0.5),
        request("min_p", [0], min_p=0.2),
    ]
    for filtering in filters:
        for position in range(20):
            alone = sampler.sample(logits[:1], [plain], [7], [position])
            beside = sampler.sample(logits, [plain, filtering], [7, 3], [position, position])
            assert beside[0] == alone[0], (filtering.request_id, position)


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
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([request("bad", [1, 2], temperature=0.7, min_p=1.5)])
    assert rejected.value.message == "min_p: must be 0 (off) to 1, got 1.5"
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


def biased(
    request_id: str, prompt_ids: list[int], bias: dict[int, float], **kwargs: object
) -> GenerateRequest:
    return request(
        request_id,
        prompt_ids,
        logit_bias_token_ids=list(bias),
        logit_bias_values=list(bias.values()),
        **kwargs,
    )


def test_logit_bias_adds_to_the_rows_that_ask_and_no_others() -> None:
    logits = torch.randn(3, 50)
    requests = [
        biased("a", [0], {4: 2.5, 7: -1.0}),
        request("plain", [0]),
        biased("b", [0], {4: 100.0}),
    ]
    expected = logits.clone()
    expected[0, 4] += 2.5
    expected[0, 7] -= 1.0
    expected[2, 4] += 100.0
    apply_logit_bias(logits, requests)
    assert torch.equal(logits, expected)


def test_a_batch_without_a_logit_bias_pays_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("a batch without a bias copied something to the device")

    monkeypatch.setattr(sampler_module, "to_device", no_copy)
    logits = torch.randn(2, 50)
    before = logits.clone()
    apply_logit_bias(logits, [request("a", [0]), request("b", [0])])
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.5, "top_k": 5, "top_p": 0.5}],
    ids=["greedy", "sampled", "filtered"],
)
def test_a_bias_of_100_forces_its_token(sampling: dict[str, object]) -> None:
    sampler = Sampler(CPU)
    logits = torch.randn(8, 1000) * 3  # (N, V)
    weakest = int(logits[0].argmin())
    requests = [biased("x", [0], {weakest: 100.0}, **sampling)] * 8
    apply_logit_bias(logits, requests)
    seeds = [sampler.seed_for(r) for r in requests]
    assert sampler.sample(logits, requests, seeds, list(range(8))) == [weakest] * 8


def test_a_bias_of_minus_100_moves_greedy_off_its_token() -> None:
    sampler = Sampler(CPU)
    logits = torch.randn(1, 1000)
    first, second = logits[0].topk(2).indices.tolist()
    req = biased("x", [0], {first: -100.0})
    apply_logit_bias(logits, [req])
    assert sampler.sample(logits, [req], [None], [0]) == [second]


@pytest.mark.model
def test_logit_bias_on_the_engine_beside_plain_rows() -> None:
    """Forced (greedy and seeded sampling) and banned, while an unbiased row in
    the same batch is untouched."""
    prompt, other = prompts(seed=3, count=2)
    plain = run_schedule(tiny_engine(capacity=1), {0: [request("plain", other)]})["plain"]
    greedy = run_schedule(tiny_engine(capacity=1), {0: [request("greedy", prompt)]})["greedy"]
    banned_id = greedy.token_ids[0]
    batch = [
        biased("forced", prompt, {17: 100.0}),
        biased("sampled", prompt, {17: 100.0}, temperature=1.0, seed=5),
        biased("banned", prompt, {banned_id: -100.0}),
        request("plain", other),
    ]
    finished = run_schedule(tiny_engine(capacity=4), {0: batch})
    assert finished["forced"].token_ids == [17] * 20
    assert finished["sampled"].token_ids == [17] * 20
    assert banned_id not in finished["banned"].token_ids
    assert finished["banned"].token_ids != greedy.token_ids
    assert finished["plain"].token_ids == plain.token_ids


@pytest.mark.model
def test_a_biased_seeded_request_is_the_same_alone_and_in_a_batch() -> None:
    prompt, *others = prompts(seed=4, count=3)
    bias = {3: 40.0, 9: 40.0, 60: -5.0}  # LOGIT_SCALE makes the outputs peaked
    seeded = biased("seeded", prompt, bias, temperature=1.0, seed=77)
    alone = run_schedule(tiny_engine(capacity=3), {0: [seeded]})["seeded"]
    batchmates = [request("greedy", others[0]), biased("b", others[1], {3: -100.0})]
    crowded = run_schedule(tiny_engine(capacity=3), {0: batchmates, 2: [seeded]})
    assert crowded["seeded"].token_ids == alone.token_ids
    unbiased = biased("seeded", prompt, {}, temperature=1.0, seed=77)
    assert (
        run_schedule(tiny_engine(capacity=1), {0: [unbiased]})["seeded"].token_ids
        != alone.token_ids
    )


@pytest.mark.model
def test_min_tokens_holds_even_a_bias_of_100_on_eos() -> None:
    prompt = prompts(seed=5, count=1)[0]
    eager = GenerateRequest(
        "eager",
        "",
        20,
        prompt_token_ids=prompt,
        logit_bias_token_ids=[EOS],
        logit_bias_values=[100.0],
        min_tokens=6,
    )
    finished = run_schedule(tiny_engine(capacity=1), {0: [eager]})["eager"]
    assert finished.finish_reason == "stop"
    assert EOS not in finished.token_ids[:6]
    assert len(finished.token_ids) <= 7
