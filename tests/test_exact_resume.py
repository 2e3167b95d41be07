"""Seeded, sampled streams that outlive their worker continue bit for bit as the
run without faults (constrained ones too): real processes, a small GPT-2, the
worker SIGKILLed several times under load, and each stream (its text, finish
reason and logprobs) held to its own fault-free run on the same stack.

Prompts of every length go in chunks of PREFILL_CHUNK_TOKENS beside the streams
that decode (docs/engine.md, "Exact resumes")."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedTokenizerFast

from tests.stack import Stack, openai_client, running_stack
from worker.model.loader import gpt2_tokenizer, synthetic_config, synthetic_model

pytestmark = pytest.mark.model

CONCURRENCY = 8  # the streams in flight at once: one worker's slots
NUM_REQUESTS = 32
NUM_KILLS = 3
WORDS = [
    *("the", "river", "stone", "light", "over", "under", "quiet", "morning", "garden"),
    *("window", "silver", "paper", "north", "sudden", "bright", "engine", "letter"),
]


RECORDS_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "records",
        "schema": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "word": {"type": "string", "maxLength": 8},
                    "n": {"type": "integer"},
                },
                "required": ["word", "n"],
            },
            "maxItems": 4,
        },
    },
}

# A stream as its client saw it: text, finish reason, and (token, logprob) pairs.
Stream = tuple[str, str | None, list[tuple[str, float | None]]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GPT-2 with random weights and the real tokenizer: its logits are
    nearly flat, so any difference in a bit of them soon turns up in a sample."""
    directory = tmp_path_factory.mktemp("exact-resume-gpt2")
    config = synthetic_config(n_layer=2, n_embd=64, n_head=4, n_positions=128)
    synthetic_model(config).model.save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()).save_pretrained(directory)
    return directory


def _bodies() -> list[dict[str, Any]]:
    """Seeded, sampled requests: a third with stop strings, some penalised, some
    with min_tokens, a logit_bias or a JSON schema to follow, some asking for
    logprobs, which are compared too; a third begin with one shared prefix,
    which the prefix cache serves."""
    rng = random.Random(23)
    shared = " ".join(rng.choice(WORDS) for _ in range(20))
    bodies = []
    for i in range(NUM_REQUESTS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24)))
        body: dict[str, Any] = {
            "prompt": f"{shared} {prompt}" if i % 3 == 1 else prompt,
            "max_tokens": rng.randint(24, 48),
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 1000 + i,
            "extra_body": {"ignore_eos": True},
        }
        if i % 2:
            body["logprobs"] = 1
        if i % 3 == 0:
            body["stop"] = [" the", "er"]
        if i % 4 == 1:
            body["presence_penalty"] = 0.5
            body["frequency_penalty"] = 0.3
        if i % 5 == 2:
            body["extra_body"] = {"min_tokens": 12}
        if i % 6 == 3:  # " the" likelier, " and" banned, "." a little likelier
            body["logit_bias"] = {"262": 5, "290": -100, "13": 2.5}
        if i % 7 == 5:  # a resumed worker replays the streamed tokens through the grammar
            body["extra_body"] = {**body["extra_body"], "response_format": RECORDS_FORMAT}
        bodies.append(body)
    return bodies


class Load:
    """Every request streamed through the official client, CONCURRENCY at a time;
    counts the chunks delivered so far, and which streams are mid-way."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.client = client
        self.model = model
        self.num_chunks = 0
        self.midway: set[int] = set()
        self.chunks_of: dict[int, int] = {}  # the streams under way: chunks so far
        self._lock = threading.Lock()

    def stream(self, index: int, body: dict[str, Any]) -> Stream:
        text, finish_reason = "", None
        logprobs: list[tuple[str, float | None]] = []
        with self._lock:
            self.chunks_of[index] = 0
        chunks = self.client.completions.create(model=self.model, stream=True, timeout=60, **body)
        for chunk in chunks:
            choice = chunk.choices[0]
            text += choice.text
            finish_reason = choice.finish_reason or finish_reason
            if choice.logprobs is not None:
                scores = choice.logprobs
                logprobs += zip(scores.tokens or [], scores.token_logprobs or [], strict=True)
            with self._lock:
                self.num_chunks += 1
                self.chunks_of[index] += 1
                self.midway.add(index)
        with self._lock:
            self.midway.discard(index)
            del self.chunks_of[index]
        return text, finish_reason, logprobs

    def have_all_moved_since(self, chunks_then: dict[int, int]) -> bool:
        """Whether every stream under way has had a chunk since ``chunks_then``."""
        with self._lock:
            return all(n > chunks_then.get(i, 0) for i, n in self.chunks_of.items())

    def run(
        self, bodies: list[dict[str, Any]], meanwhile: Callable[[], None] = lambda: None
    ) -> list[Stream]:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            futures = [pool.submit(self.stream, i, body) for i, body in enumerate(bodies)]
            meanwhile()
            return [future.result(timeout=120) for future in futures]


def _kill_under_load(
    stack: Stack,
    load: Load,
    num_chunks: int,
    pick_victim: Callable[[int], int],
    replaced: Callable[[], bool],
) -> list[int]:
    """SIGKILL a worker (``pick_victim(kill)``'s pid) NUM_KILLS times, when a
    quarter, a half and three quarters of the run's ``num_chunks`` have arrived,
    each time once the last victim is ``replaced``; returns how many streams
    were mid-way at each kill."""
    midway = []
    chunks_at_kill: dict[int, int] = {}
    for kill in range(NUM_KILLS):
        threshold = num_chunks * (kill + 1) // (NUM_KILLS + 1)

        def reached(
            threshold: int = threshold, chunks_then: dict[int, int] = chunks_at_kill
        ) -> bool:
            # Some stream must be mid-way too: on a slow machine the last chunks
            # can arrive when every stream left has already finished. And every
            # stream must have moved since the last kill: one killed twice before
            # it makes progress is taken for a request that kills workers, and
            # failed (frontend.replay); these kills come from the test alone.
            with load._lock:
                if load.num_chunks < threshold or not load.midway:
                    return False
            return load.have_all_moved_since(chunks_then)

        # The victim is looked up first: between seeing a stream mid-way and the
        # kill, a slow client (an emulated CPU, say) would let the last ones end.
        victim = pick_victim(kill)
        stack.wait_until(reached, f"{threshold} chunks with a stream mid-way", 60)
        with load._lock:
            midway.append(len(load.midway))
            chunks_at_kill = dict(load.chunks_of)
        # On a machine loaded far past its cores the supervisor may have killed it
        # first, its heartbeats late (docs/operations.md): a death either way.
        with contextlib.suppress(ProcessLookupError):
            stack.kill_pid(victim)
        time.sleep(0.2)
        stack.wait_until(replaced, "a replacement worker", 30)
    return midway


def _assert_resumes_exact(
    stack: Stack, pick_victim: Callable[[int], int], replaced: Callable[[], bool]
) -> None:
    bodies = _bodies()
    with openai_client(stack) as client:
        load = Load(client, client.models.list().data[0].id)
        fault_free = load.run(bodies)
        assert any(finish == "stop" for _, finish, _ in fault_free)  # the stop strings bite
        constrained = [
            text
            for (text, _, _), b in zip(fault_free, bodies, strict=True)
            if "response_format" in b["extra_body"]
        ]
        assert constrained and all(text.startswith("[") for text in constrained)
        num_chunks, load.num_chunks = load.num_chunks, 0
        midway: list[int] = []
        faulted = load.run(
            bodies,
            lambda: midway.extend(_kill_under_load(stack, load, num_chunks, pick_victim, replaced)),
        )
    assert min(midway) > 0, f"streams mid-way at each kill: {midway}"
    assert _prefix_cache_hits(stack) > 0  # some prompts (and resumes) took cached rows
    assert stack.log("supervisor").count("replaying") >= NUM_KILLS
    differing = [i for i, (a, b) in enumerate(zip(fault_free, faulted, strict=True)) if a != b]
    in_text = [i for i in differing if fault_free[i][:2] != faulted[i][:2]]
    assert not differing, (
        f"{len(differing)} of {len(bodies)} streams differ from their fault-free run, "
        f"{len(in_text)} in their text (the rest in logprobs; streams mid-way at each "
        f"kill: {midway}); first: {differing[0]}\n"
        f"fault-free: {fault_free[differing[0]]}\nfaulted:    {faulted[differing[0]]}"
    )


def _prefix_cache_hits(stack: Stack) -> float:
    metrics = text_string_to_metric_families(httpx.get(f"{stack.url}/metrics").text)
    return next(
        sample.value
        for family in metrics
        for sample in family.samples
        if sample.name == "minibatch_prefix_cache_hits_total"
    )


def _overrides(model_dir: Path, num_workers: int) -> dict[str, str]:
    return {
        "MODEL_ID": str(model_dir),
        "DEVICE": "cpu",
        "NUM_WORKERS": str(num_workers),
        "MAX_BATCH_SIZE": str(CONCURRENCY),
        # Small, so that prompts are split beside the streams that decode.
        "PREFILL_CHUNK_TOKENS": "8",
        # Kills come from the test alone, not from a busy machine's slow step.
        "STEP_TIMEOUT_S": "30",
        # Nor from a request: a long stream may be in flight at every kill.
        "MAX_WORKER_DEATHS": str(NUM_KILLS + 1),
    }


def test_seeded_streams_resumed_after_kill_9_match_the_fault_free_run(
    tmp_path: Path, model_dir: Path
) -> None:
    with running_stack(tmp_path, _overrides(model_dir, 1)) as stack:
        instance = stack.wait_live(timeout_s=60)["instance_id"]

        def pick_victim(kill: int) -> int:
            nonlocal instance
            instance = stack.health().json()["instance_id"]
            (pid,) = stack.worker_pids()
            return pid

        def replaced() -> bool:
            health = stack.health().json()
            return health["status"] == "ok" and health["instance_id"] not in (None, instance)

        _assert_resumes_exact(stack, pick_victim, replaced)


def test_with_two_workers_replays_on_the_survivor_match_the_fault_free_run(
    tmp_path: Path, model_dir: Path
) -> None:
    with running_stack(tmp_path, _overrides(model_dir, 2)) as stack:
        stack.wait_for_health("both live", lambda h: h["workers_live"] == 2, 60)
        endpoints = sorted(stack.workers())
        killed: dict[str, str] = {}

        def pick_victim(kill: int) -> int:
            # The one holding the most streams: taking turns, a replacement that
            # had been given nothing yet was killed holding nothing, and no
            # request was replayed for that kill.
            workers = stack.workers()
            endpoint = max(
                endpoints, key=lambda e: (workers[e]["held"] or 0, e == endpoints[kill % 2])
            )
            killed.clear()
            killed[endpoint] = stack.workers()[endpoint]["instance_id"]
            return stack.worker_pid(endpoint)

        def replaced() -> bool:
            workers = stack.workers()
            return all(
                workers[endpoint]["state"] == "live"
                and workers[endpoint]["instance_id"] not in (None, instance)
                for endpoint, instance in killed.items()
            )

        _assert_resumes_exact(stack, pick_victim, replaced)
