"""The prefix cache: which rows a slot holds and who may take them, and, on the
torch engine, that taking them changes no logit of any output."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from protocol import GenerateRequest
from worker.engine.fake_engine import FakeEngine
from worker.engine.interface import RequestRejected
from worker.engine.prefix_cache import Match, PrefixCache

BLOCK = 4


def test_only_whole_blocks_are_shared_and_the_last_token_is_always_computed() -> None:
    cache = PrefixCache(num_slots=2, block=BLOCK)
    cache.written(0, list(range(10)), 10)
    assert cache.num_reusable([*range(10), 99], 0) == 8  # 10 shared: 2 blocks
    assert cache.num_reusable([*range(7), 99, 98], 0) == 4  # 7 shared: 1 block
    assert cache.num_reusable(list(range(8)), 0) == 4  # token 7 left to compute
    assert cache.num_reusable([5, 1, 2, 3, 4], 0) == 0
    assert cache.num_reusable(list(range(10)), 1) == 0  # slot 1 holds nothing


def test_a_whole_prompt_with_its_logits_is_taken_whole() -> None:
    cache = PrefixCache(num_slots=1, block=BLOCK)
    prompt = list(range(6))
    cache.written(0, prompt, 6)
    assert cache.best_match(prompt) == Match(0, 6, is_whole=True)
    cache.written(0, prompt, 4)  # only its first block so far
    assert cache.best_match(prompt) == Match(0, 4, is_whole=False)


def test_a_free_slot_is_the_one_holding_the_prompt_else_the_least_recently_used() -> None:
    cache = PrefixCache(num_slots=3, block=BLOCK)
    for slot, first in enumerate((10, 20, 30)):
        cache.written(slot, [first] * 8, 8)
    cache.released(1)
    cache.released(0)
    cache.released(2)
    assert cache.choose_free_slot([20] * 8 + [1], [0, 1, 2]) == 1
    assert cache.choose_free_slot([7] * 9, [0, 1, 2]) == 1  # released first
    assert cache.choose_free_slot([7] * 9, [0, 2]) == 0


def test_a_newcomer_copies_rather_than_overwrite_a_longer_prompt_when_a_slot_is_empty() -> None:
    cache = PrefixCache(num_slots=2, block=BLOCK)
    cache.written(0, list(range(12)), 12)
    sharing_two_blocks = [*range(8), 99]
    assert cache.choose_free_slot(sharing_two_blocks, [0, 1]) == 1  # copies from 0
    assert cache.choose_free_slot(sharing_two_blocks, [0]) == 0
    assert cache.choose_free_slot([*range(12), 99], [0, 1]) == 0  # uses all of it
    assert cache.choose_free_slot(None, [0, 1]) == 1  # a scored prompt reuses nothing


def test_a_newcomer_copies_into_an_older_slot_rather_than_cut_a_recent_prompt() -> None:
    """A, then B sharing A's system prompt, then A again (a conversation's next
    turn): B overwrote A's own rows though older ones were free, and A found
    only the system prompt."""
    cache = PrefixCache(num_slots=3, block=BLOCK)
    cache.written(1, [50] * 12, 12)
    cache.released(1)  # the oldest
    cache.written(2, [60] * 12, 12)
    cache.released(2)
    cache.written(0, list(range(12)), 12)  # A
    cache.released(0)
    b = [*range(8), 99]
    assert cache.choose_free_slot(b, [0, 1, 2]) == 1  # copies A's first 8 rows into 1
    assert cache.choose_free_slot(b, [0]) == 0  # nowhere else to go
    cache.released(1)
    cache.released(2)  # A's rows are now the oldest: they are what gives way
    assert cache.choose_free_slot(b, [0, 1, 2]) == 0


def test_a_claimed_slot_keeps_only_the_rows_its_new_owner_reuses() -> None:
    cache = PrefixCache(num_slots=1, block=BLOCK)
    cache.written(0, list(range(12)), 12)
    cache.claim(0, [0, 1, 2, 3, 4, 5, 99])
    assert cache.num_rows_held(0) == 4
    cache.claim(0, [42])
    assert cache.num_rows_held(0) == 0


def test_copied_rows_are_held_by_the_receiving_slot() -> None:
    cache = PrefixCache(num_slots=2, block=BLOCK)
    prompt = list(range(9))
    cache.written(0, prompt, 9)
    cache.copied(Match(0, 8, is_whole=False), 1)
    assert cache.num_rows_held(1) == 8
    assert cache.best_match(prompt, [1]) == Match(1, 8, is_whole=False)


def test_rows_are_shared_only_between_prompts_of_one_salt() -> None:
    cache = PrefixCache(num_slots=2, block=BLOCK)
    prompt = list(range(9))
    cache.written(0, prompt, 9, salt="tenant a")
    assert cache.best_match(prompt, salt="tenant a") == Match(0, 9, is_whole=True)
    assert cache.best_match(prompt, salt="tenant b") is None
    assert cache.best_match(prompt) is None  # no salt is a salt of its own
    assert cache.choose_free_slot(prompt, [0, 1], salt="tenant b") == 1  # leaves a's rows
    cache.copied(Match(0, 8, is_whole=False), 1)
    assert cache.best_match(prompt, [1], salt="tenant a") == Match(1, 8, is_whole=False)
    assert cache.best_match(prompt, [1], salt="tenant b") is None
    cache.claim(0, prompt, salt="tenant b")  # b's prompt overwrites a's rows
    assert cache.num_rows_held(0) == 0


# --- on the torch engine --------------------------------------------------------------


def test_a_request_refused_at_admission_leaves_the_cached_rows_alone() -> None:
    """Admission is atomic: the sampling check ran after the newcomer had claimed
    its slot, cutting the rows cached there for a request that never ran."""
    engine = FakeEngine(1)
    engine.prefix_cache = PrefixCache(num_slots=1, block=BLOCK)
    engine.prefix_cache.written(0, [ord(c) for c in "abcdefgh"], 8)
    with pytest.raises(RequestRejected) as rejected:
        engine.admit([GenerateRequest("r", "zzzzzzzz", 4, temperature=math.nan)])
    assert rejected.value.message.startswith("temperature")
    assert engine.prefix_cache.num_rows_held(0) == 8
    assert engine.num_active() == 0


torch = pytest.importorskip("torch")

from tests.model_fixtures import (  # noqa: E402
    VOCAB_SIZE,
    disable_kernels,
    force_kernels,
    random_prompt,
    record_prefills,
    request,
    run_schedule,
    tiny_engine,
)
from worker.engine.interface import FinishedSequence  # noqa: E402
from worker.engine.sequence import Sequence  # noqa: E402
from worker.engine.torch_engine import TorchEngine  # noqa: E402
from worker.model.sampler import Sampler  # noqa: E402

CHUNK = 8
# Shared prefixes shorter than a block, ending just before, on and after block
# and chunk boundaries, and past three chunks (blocks of BLOCK, two a chunk).
SHARED_LENGTHS = [
    1,
    BLOCK - 1,
    BLOCK + 1,
    CHUNK - 1,
    CHUNK,
    CHUNK + 1,
    2 * CHUNK - 1,
    2 * CHUNK,
    2 * CHUNK + BLOCK + 1,
    3 * CHUNK + 1,
]


def _shared_prefix_schedule(
    shared: int, seed: int, is_sampled: bool
) -> dict[int, list[GenerateRequest]]:
    """Requests that begin with the same ``shared`` tokens: two arriving together,
    one while they decode, one the same prompt as the first, and one after the
    first ones are gone (its prefix in a free slot); greedy, and seeded when
    ``is_sampled``."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB_SIZE - 1) for _ in range(shared)]

    def make(name: str, **kwargs: object) -> GenerateRequest:
        suffix = random_prompt(rng, 1, 12)
        return request(name, prefix + suffix, rng.randint(3, 8), ignore_eos=True, **kwargs)

    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": seed} if is_sampled else {}
    first = make("first", logprobs=2, **sampling)
    return {
        0: [first, make("beside")],
        2: [make("later", **sampling), dataclasses.replace(first, request_id="same", seed=1)],
        20: [make("after", **sampling), dataclasses.replace(first, request_id="again")],
    }


def _run_recording(
    engine: TorchEngine,
    arrivals: dict[int, list[GenerateRequest]],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[dict[str, FinishedSequence], dict[tuple[str, int], torch.Tensor]]:
    """The results, and the logits each request drew each output token from."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    sample = Sampler.sample

    def recording(self: Sampler, logits: torch.Tensor, requests, seeds, positions):  # type: ignore[no-untyped-def]
        for row, (r, position) in enumerate(zip(requests, positions, strict=True)):
            seen[r.request_id, position] = logits[row].clone()
        return sample(self, logits, requests, seeds, positions)

    with monkeypatch.context() as patch:
        patch.setattr(Sampler, "sample", recording)
        return run_schedule(engine, arrivals), seen


@pytest.mark.model
@pytest.mark.parametrize(
    ("mode", "paths"),
    [("float32", "rule"), ("float32", "no kernels"), ("float16", "kernel"), ("int8", "kernel")],
)
def test_with_the_cache_every_logit_is_the_one_computed_without_it(
    mode: str, paths: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shared prefixes ending at every point of the blocks and chunks, taken in
    place, copied from a busy slot, waited for, and whole: each token is drawn
    from the same logits, bit for bit, as with the cache off. Without the decode kernels
    (SDPA), a row's decode logits change in their last bits with its batchmates'
    lengths, cache or not: there the greedy tokens must match."""
    if paths == "kernel":
        force_kernels(monkeypatch)
    elif paths == "no kernels":
        disable_kernels(monkeypatch)
    is_exact = paths != "no kernels"
    num_cached = 0
    for shared in SHARED_LENGTHS:
        arrivals = _shared_prefix_schedule(shared, seed=shared, is_sampled=is_exact)

        def engine(prefix_cache: bool) -> TorchEngine:
            return tiny_engine(
                4,
                mode=mode,
                prefill_chunk_tokens=CHUNK,
                prefix_cache=prefix_cache,
                block_tokens=BLOCK,
            )

        without, logits_without = _run_recording(engine(False), arrivals, monkeypatch)
        with_cache, logits_with = _run_recording(engine(True), arrivals, monkeypatch)
        assert sorted(logits_with) == sorted(logits_without)
        for key, logits in logits_without.items():
            assert not is_exact or torch.equal(logits_with[key], logits), f"shared {shared}: {key}"
        for request_id, result in without.items():
            cached = with_cache[request_id]
            assert cached.token_ids == result.token_ids, f"shared {shared}: {request_id}"
            assert not is_exact or cached.logprobs == result.logprobs
            assert result.num_cached_tokens == result.num_looked_up_tokens == 0
            assert cached.num_looked_up_tokens == cached.num_prompt_tokens
            num_cached += cached.num_cached_tokens
        assert with_cache["again"].num_cached_tokens == len(arrivals[0][0].prompt_token_ids or [])
    assert num_cached > 0


@pytest.mark.model
def test_a_shared_prefix_is_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4)
    system = random_prompt(rng, 40, 40)  # five blocks
    questions = [random_prompt(rng, 3, 3) for _ in range(4)]
    engine = tiny_engine(4, prefill_chunk_tokens=CHUNK)
    calls = record_prefills(monkeypatch)
    arrivals = {0: [request(f"q{i}", system + q, 4) for i, q in enumerate(questions)]}
    finished = run_schedule(engine, arrivals)
    # The first computes the system prompt and its question; the others wait for
    # its rows, copy them, and compute their own last block (its 3 tokens).
    assert sum(call.num_tokens for call in calls) == 43 + 3 * 3
    assert [finished[f"q{i}"].num_cached_tokens for i in range(4)] == [0, 40, 40, 40]


@pytest.mark.model
def test_a_burst_with_one_system_prompt_all_start_in_the_first_step() -> None:
    """With nothing decoding yet, those that waited for the shared rows take them
    in the same step: none waits for a later one."""
    rng = random.Random(5)
    system = random_prompt(rng, 40, 40)
    engine = tiny_engine(4, prefill_chunk_tokens=CHUNK)
    engine.admit([request(f"q{i}", system + random_prompt(rng, 3, 9), 4) for i in range(4)])
    engine.step()
    assert all(seq.output_token_ids for seq in engine.active_sequences())
    assert [seq.num_cached_tokens for seq in engine.active_sequences()] == [0, 40, 40, 40]


@pytest.mark.model
def test_the_same_prompt_again_needs_no_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """n choices of one prompt: prefilled once, each drawing from the same logits."""
    prompt = random_prompt(random.Random(6), 20, 20)
    engine = tiny_engine(4, prefill_chunk_tokens=CHUNK)
    calls = record_prefills(monkeypatch)
    choices = [
        request(f"c{i}", prompt, 6, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)
    ]
    finished = run_schedule(engine, {0: choices})
    assert sum(call.num_tokens for call in calls) == 20
    assert len({tuple(finished[f"c{i}"].token_ids) for i in range(4)}) > 1  # their own draws


@pytest.mark.model
def test_a_prompt_of_another_salt_is_computed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant with a salt of its own learns nothing of another's prompts: not
    from cached_tokens, nor from the time its prefill takes."""
    rng = random.Random(8)
    system = random_prompt(rng, 40, 40)
    engine = tiny_engine(4, prefill_chunk_tokens=CHUNK)
    calls = record_prefills(monkeypatch)
    salts = ["a", "b", "a", ""]
    prompts = [system + random_prompt(rng, 3, 3) for _ in salts]
    arrivals = {
        10 * i: [request(f"q{i}", prompt, 2, cache_salt=salt)]
        for i, (prompt, salt) in enumerate(zip(prompts, salts, strict=True))
    }
    finished = run_schedule(engine, arrivals)
    assert [finished[f"q{i}"].num_cached_tokens for i in range(4)] == [0, 0, 40, 0]
    assert sum(call.num_tokens for call in calls) == 4 * 43 - 40


@pytest.mark.model
def test_off_when_asked_and_without_chunked_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = random_prompt(random.Random(7), 30, 30)
    for engine in (
        tiny_engine(2, prefill_chunk_tokens=CHUNK, prefix_cache=False),
        tiny_engine(2, prefill_chunk_tokens=0),
    ):
        assert engine.prefix_cache is None
        finished = run_schedule(
            engine, {0: [request("a", prompt, 2)], 5: [request("b", prompt, 2)]}
        )
        assert finished["b"].num_cached_tokens == 0


@pytest.mark.model
def test_the_least_recently_used_prefix_is_the_one_replaced() -> None:
    rng = random.Random(9)
    prompts = {name: random_prompt(rng, 17, 17) for name in "abc"}
    engine = tiny_engine(2, prefill_chunk_tokens=CHUNK)
    run_schedule(engine, {0: [request("a", prompts["a"], 1)]})
    run_schedule(engine, {0: [request("b", prompts["b"], 1)]})
    run_schedule(engine, {0: [request("c", prompts["c"], 1)]})  # takes a's slot
    finished = run_schedule(
        engine, {0: [request("a2", prompts["a"], 1), request("b2", prompts["b"], 1)]}
    )
    assert finished["a2"].num_cached_tokens == 0
    assert finished["b2"].num_cached_tokens == 17


@pytest.mark.model
@pytest.mark.parametrize("num_slots", [2, 3])
def test_a_newcomer_keeps_its_shared_rows_beside_others_placed_with_it(num_slots: int) -> None:
    """Sent to another slot to copy a prefix from a free one, it lost the copy
    when a newcomer placed with it took that free slot first."""
    rng = random.Random(11)
    system = random_prompt(rng, 40, 40)  # five blocks
    engine = tiny_engine(num_slots, prefill_chunk_tokens=CHUNK)
    for i in range(num_slots):  # every slot holds rows, the system prompt's last used
        run_schedule(engine, {0: [request(f"old{i}", random_prompt(rng, 20, 20), 1)]})
    run_schedule(engine, {0: [request("a", system + random_prompt(rng, 5, 5), 1)]})
    finished = run_schedule(
        engine,
        {0: [request("x", system + random_prompt(rng, 3, 3), 1), request("y", [7] * 9, 1)]},
    )
    assert finished["x"].num_cached_tokens == 40


@pytest.mark.model
def test_a_scored_prompt_neither_takes_nor_leaves_rows() -> None:
    """Scoring computes a prompt whole, not in the aligned blocks reuse relies on."""
    prompt = random_prompt(random.Random(11), 20, 20)
    engine = tiny_engine(2, prefill_chunk_tokens=CHUNK)
    finished = run_schedule(
        engine,
        {
            0: [request("plain", prompt, 1)],
            3: [request("scored", prompt, 1, prompt_logprobs=0)],
            6: [request("after", [*prompt, 1], 1)],
        },
    )
    assert finished["scored"].num_cached_tokens == finished["scored"].num_looked_up_tokens == 0
    assert finished["after"].num_cached_tokens == 16  # from plain's slot, not scored's
    assert finished["after"].num_looked_up_tokens == len(prompt) + 1


@pytest.mark.model
def test_a_prompt_scored_first_leaves_nothing_for_the_next_ones() -> None:
    """Scoring runs the LM head over every prompt row, so the logits after the
    prompt are not bit for bit those of a plain prefill: neither they nor its rows
    may serve the same prompt again, or one that begins with it."""
    prompt = random_prompt(random.Random(12), 20, 20)
    for follower in (prompt, [*prompt, 1]):
        arrivals = {
            0: [request("scored", prompt, 1, prompt_logprobs=0)],
            3: [request("next", follower, 2, logprobs=2)],
        }
        with_cache = run_schedule(tiny_engine(2, prefill_chunk_tokens=CHUNK), arrivals)
        without = run_schedule(
            tiny_engine(2, prefill_chunk_tokens=CHUNK, prefix_cache=False), arrivals
        )
        assert with_cache["next"].num_cached_tokens == 0, len(follower)
        assert with_cache["next"].logprobs == without["next"].logprobs, len(follower)


@pytest.mark.model
def test_after_a_reset_nothing_is_reused() -> None:
    prompt = random_prompt(random.Random(13), 20, 20)
    engine = tiny_engine(2, prefill_chunk_tokens=CHUNK)
    run_schedule(engine, {0: [request("a", prompt, 1)]})
    engine.reset()
    finished = run_schedule(engine, {0: [request("b", prompt, 1)]})
    assert finished["b"].num_cached_tokens == 0


@pytest.mark.model
def test_a_failure_taking_cached_rows_falls_on_its_own_sequence_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt whose first token comes from the logits kept in the cache: if that
    fails, only its request fails; the ones decoding beside it go on. It failed
    the whole step, every active sequence with it."""
    prompt = random_prompt(random.Random(14), 20, 20)
    engine = tiny_engine(3, prefill_chunk_tokens=CHUNK)
    run_schedule(engine, {0: [request("first", prompt, 1)]})
    kept_logits = TorchEngine._first_token_from_kept_logits

    def fails_for_poison(self: TorchEngine, seq: Sequence) -> int:
        if seq.request_id == "poison":
            raise ValueError("Overflow when unpacking long long")
        return kept_logits(self, seq)

    monkeypatch.setattr(TorchEngine, "_first_token_from_kept_logits", fails_for_poison)
    other = random_prompt(random.Random(15), 10, 10)
    engine.admit([request("beside", other, 6, ignore_eos=True)])
    engine.step()
    engine.admit([request("poison", prompt, 4), request("again", prompt, 4, ignore_eos=True)])
    failed: list[str] = []
    finished: dict[str, FinishedSequence] = {}
    while engine.num_active():
        output = engine.step()
        failed += [request_id for request_id, _ in output.failed]
        finished |= {seq.request_id: seq for seq in output.finished}
    assert failed == ["poison"]
    assert sorted(finished) == ["again", "beside"]
    assert len(finished["beside"].token_ids) == 6 and len(finished["again"].token_ids) == 4
