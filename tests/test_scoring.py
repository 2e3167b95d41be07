"""Logprobs, echo, penalties and min_tokens on the torch engine, held to the
Hugging Face model on the same weights."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

pytest.importorskip("torch")

import torch
from transformers import GPT2LMHeadModel

from protocol import GenerateRequest, Logprobs
from tests.model_fixtures import (
    EOS,
    VOCAB_SIZE,
    reference_ids,
    request,
    run_schedule,
    tiny_engine,
)
from tests.resume import run
from worker.engine.interface import FinishedSequence
from worker.engine.torch_engine import TorchEngine
from worker.model.loader import synthetic_model

pytestmark = pytest.mark.model

LOGPROB_TOLERANCE = 1e-4


def hf_logprobs(model: GPT2LMHeadModel, token_ids: list[int]) -> torch.Tensor:
    """(L, V) log_softmax of the HF model's logits at every position."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def finish(engine: TorchEngine, requests: list[GenerateRequest]) -> dict[str, FinishedSequence]:
    return run_schedule(engine, {0: requests})


@pytest.fixture(scope="module")
def synthetic() -> TorchEngine:
    """distilgpt2's shape and random weights: logits as flat as a real model's."""
    return TorchEngine(synthetic_model(), capacity=3)


@pytest.mark.parametrize("prefill_chunk_tokens", [0, 16])
def test_logprobs_and_echo_match_hf_log_softmax(
    synthetic: TorchEngine, prefill_chunk_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In chunks too: the prompt scored alone arrives as the others decode, and
    goes in a chunk a step, each chunk scoring its own positions."""
    monkeypatch.setattr(synthetic, "prefill_chunk_tokens", prefill_chunk_tokens)
    rng = random.Random(1)
    prompts = [[rng.randrange(50000) for _ in range(n)] for n in (5, 23, 40)]
    requests = [
        request("a", prompts[0], 6, logprobs=5, prompt_logprobs=5, echo=True, ignore_eos=True),
        # sampled, beside greedy rows: logprobs are of the raw distribution all the same
        request("b", prompts[1], 4, logprobs=2, temperature=0.9, seed=3, ignore_eos=True),
        request("c", prompts[2], 0, prompt_logprobs=1, echo=True),  # scoring alone
    ]
    finished = run_schedule(synthetic, {0: requests[:2], 1: requests[2:]})
    worst = 0.0
    for r in requests:
        result = finished[r.request_id]
        assert r.prompt_token_ids is not None
        context = r.prompt_token_ids + result.token_ids
        reference = hf_logprobs(synthetic.model, context)
        scored: list[tuple[int, Logprobs]] = []
        if r.prompt_logprobs is not None:
            assert (
                result.prompt_logprobs is not None
                and result.prompt_token_ids == context[: len(r.prompt_token_ids)]
            )
            assert math.isnan(result.prompt_logprobs.logprobs[0])
            scored.append((0, result.prompt_logprobs))
        if r.logprobs is not None:
            assert result.logprobs is not None
            scored.append((len(r.prompt_token_ids), result.logprobs))
        for start, logprobs in scored:
            for i, token_id in enumerate(logprobs.token_ids):
                position = start + i
                if position == 0:
                    continue
                assert context[position] == token_id
                expected = reference[position - 1]
                worst = max(worst, abs(logprobs.logprobs[i] - expected[token_id].item()))
                num_top = logprobs.num_top
                top_ids = logprobs.top_token_ids[i * num_top : (i + 1) * num_top]
                top_lps = torch.tensor(logprobs.top_logprobs[i * num_top : (i + 1) * num_top])
                assert top_ids == expected.topk(num_top).indices.tolist()
                worst = max(worst, (top_lps - expected[top_ids]).abs().max().item(), 0.0)
    assert worst < LOGPROB_TOLERANCE, worst
    assert finished["c"].token_ids == [] and finished["c"].finish_reason == "length"


def test_token_texts_travel_with_their_logprobs(synthetic: TorchEngine) -> None:
    prompt = synthetic.tokenizer.encode("Hello world, again")
    result = finish(synthetic, [request("t", prompt, 2, logprobs=1, prompt_logprobs=1)])["t"]
    assert result.prompt_logprobs is not None
    lengths = result.prompt_logprobs.text_lens
    texts = result.prompt_logprobs.texts
    first_texts = [texts[sum(lengths[: 2 * i]) : sum(lengths[: 2 * i + 1])] for i in range(4)]
    assert first_texts == ["Hello", " world", ",", " again"]


def hf_greedy_with_penalties(
    model: GPT2LMHeadModel, prompt: list[int], num_tokens: int, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding with OpenAI's presence and frequency penalties, one full
    forward per token."""
    output: list[int] = []
    for _ in range(num_tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            counts = torch.bincount(
                torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]
            )
            output.append(int((logits - frequency * counts - presence * (counts > 0)).argmax()))
    return output


def test_penalised_rows_match_their_references_beside_plain_rows() -> None:
    engine = tiny_engine(capacity=4)
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE - 1) for _ in range(12)] for _ in range(4)]
    requests = [
        request("rep", prompts[0], 12, repetition_penalty=1.8, ignore_eos=True),
        request("plain", prompts[1], 12, ignore_eos=True),
        request(
            "freq", prompts[2], 12, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True
        ),
        request("plain2", prompts[3], 12, ignore_eos=True),
    ]
    finished = finish(engine, requests)
    with torch.inference_mode():
        hf_repetition = engine.model.generate(
            torch.tensor([prompts[0]]),
            attention_mask=torch.ones(1, 12, dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.8,
            pad_token_id=0,
        )[0, 12:].tolist()
    assert finished["rep"].token_ids == hf_repetition
    unpenalised = request("x", prompts[0], 12, ignore_eos=True)
    assert finished["rep"].token_ids != reference_ids(engine.model, unpenalised)
    assert finished["freq"].token_ids == hf_greedy_with_penalties(
        engine.model, prompts[2], 12, presence=0.5, frequency=1.5
    )
    for plain in (requests[1], requests[3]):
        assert finished[plain.request_id].token_ids == reference_ids(engine.model, plain)


def test_a_logit_bias_before_the_repetition_penalty_matches_hf_sequence_bias() -> None:
    """HF applies sequence_bias before the repetition penalty, as vLLM applies
    logit_bias before its penalties."""
    engine = tiny_engine(capacity=2)
    prompt = [5, 40, 7, 40, 9, 12, 3, 40]
    bias = {40: 6.0, 12: -3.0, 100: 2.0}
    fields = {"logit_bias_token_ids": list(bias), "logit_bias_values": list(bias.values())}
    biased = request("biased", prompt, 12, repetition_penalty=1.8, ignore_eos=True, **fields)
    finished = finish(engine, [biased, request("plain", prompt, 12, ignore_eos=True)])
    with torch.inference_mode():
        hf = engine.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.8,
            sequence_bias={(token_id,): value for token_id, value in bias.items()},
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert finished["biased"].token_ids == hf
    assert finished["biased"].token_ids != finished["plain"].token_ids


def test_logprobs_are_of_the_logits_before_the_bias() -> None:
    """As vLLM reports them: a banned token keeps its logprob among the alternatives."""
    engine = tiny_engine(capacity=2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = finish(engine, [request("plain", prompt, 1, logprobs=3, ignore_eos=True)])["plain"]
    assert plain.logprobs is not None
    banned = plain.token_ids[0]
    fields = {"logit_bias_token_ids": [banned], "logit_bias_values": [-100.0]}
    biased = finish(engine, [request("b", prompt, 1, logprobs=3, ignore_eos=True, **fields)])["b"]
    assert biased.logprobs is not None and biased.token_ids != plain.token_ids
    assert biased.logprobs.top_token_ids == plain.logprobs.top_token_ids
    assert biased.logprobs.top_token_ids[0] == banned
    assert biased.logprobs.top_logprobs == pytest.approx(plain.logprobs.top_logprobs, abs=1e-5)


def test_min_tokens_holds_off_eos() -> None:
    engine = tiny_engine(capacity=2, eos_scale=3.0)  # EOS comes early
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = finish(engine, [request("free", prompt, 20)])["free"]
    assert free.finish_reason == "stop" and len(free.token_ids) < 8, free.token_ids
    held = finish(engine, [request("held", prompt, 20, min_tokens=10)])["held"]
    assert EOS not in held.token_ids[:10]
    assert len(held.token_ids) > 10


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.5, "presence_penalty": 0.3, "frequency_penalty": 0.7},
        {"min_tokens": 9, "logprobs": 2},
        {
            "logit_bias_token_ids": [EOS, 7, 30],
            "logit_bias_values": [-3.0, 25.0, 25.0],
            "temperature": 1.0,
            "seed": 11,
            "logprobs": 1,
        },
    ],
    ids=["penalties", "min_tokens-logprobs", "logit_bias-seeded"],
)
def test_a_resumed_stream_rebuilds_what_depends_on_the_output(fields: dict[str, object]) -> None:
    prompt = [7, 3, 9, 12, 40, 41, 2]
    stream = request("r", prompt, 12, stream=True, **fields)
    fault_free = run(tiny_engine(capacity=1, eos_scale=3.0), stream)
    all_logprobs = [lp for lps in fault_free.delta_logprobs for lp in lps]
    assert fault_free.result.logprobs is None  # a stream's deltas carried them all
    for cut in range(1, len(fault_free.delta_token_ids)):
        streamed = [t for ids in fault_free.delta_token_ids[:cut] for t in ids]
        shown = "".join(fault_free.delta_texts[:cut])
        resumed = run(
            tiny_engine(capacity=1, eos_scale=3.0),
            dataclasses.replace(stream, resume_token_ids=streamed, resume_text_len=len(shown)),
        )
        assert resumed.result.token_ids == fault_free.result.token_ids, cut
        assert resumed.result.finish_reason == fault_free.result.finish_reason
        # Each token's logprobs once: the earlier attempt's, then the resumed run's own.
        before = [lp for lps in fault_free.delta_logprobs[:cut] for lp in lps]
        after = [lp for lps in resumed.delta_logprobs for lp in lps]
        assert len(before + after) == len(all_logprobs)
        differences = [abs(a - b) for a, b in zip(before + after, all_logprobs, strict=True)]
        assert max(differences, default=0.0) < LOGPROB_TOLERANCE
