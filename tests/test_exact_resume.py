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

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from tests.metrics_scrape import scrape, value
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
    counts the requests started so far, and which streams are mid-way."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.client = client
        self.model = model
        self.num_started = 0
        self.midway: set[int] = set()
        self.chunks_of: dict[int, int] = {}  # the streams under way: chunks so far
        self._lock = threading.Lock()

    def stream(self, index: int, body: dict[str, Any]) -> Stream:
        text, finish_reason = "", None
        logprobs: list[tuple[str, float | None]] = []
        with self._lock:
            self.num_started += 1
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
                self.chunks_of[index] += 1
                self.midway.add(index)
        with self._lock:
            self.midway.discard(index)
            del self.chunks_of[index]
        return text, finish_reason, logprobs

    def have_all_moved_since(self, chunks_then: dict[int, int]) -> bool:
        """Whether every stream under way at ``chunks_then`` (its chunks by stream)
        that is still under way has had a chunk since. Those started since need
        none: under load there is nearly always one that has had none yet."""
        with self._lock:
            return all(self.chunks_of.get(i, n + 1) > n for i, n in chunks_then.items())

    def run(
        self, bodies: list[dict[str, Any]], meanwhile: Callable[[], None] = lambda: None
    ) -> list[Stream]:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            futures = [pool.submit(self.stream, i, body) for i, body in enumerate(bodies)]
            meanwhile()
            return [future.result(timeout=120) for future in futures]


def _kill_under_load(stack: Stack, load: Load) -> list[int]:
    """SIGKILL a worker NUM_KILLS times, spread over the requests started after
    the first CONCURRENCY, each once the last victim is replaced; returns how
    many streams were mid-way at each kill. Counted in requests started, which
    only go up as earlier ones end: kills at shares of the fault-free run's
    chunks came late on a loaded machine, where the frontend sends a slow
    client's tokens in fewer chunks, and the run had ended before its last kill."""
    endpoints = sorted(stack.workers())
    midway: list[int] = []
    chunks_at_kill: dict[int, int] = {}
    for kill in range(NUM_KILLS):
        threshold = CONCURRENCY + (NUM_REQUESTS - CONCURRENCY) * (kill + 1) // (NUM_KILLS + 1)
        # Pids are looked up first: between seeing a stream mid-way and the kill,
        # a slow client (an emulated CPU, say) would let the last ones end.
        pids = {endpoint: stack.worker_pid(endpoint) for endpoint in endpoints}
        victim: dict[str, str] = {}  # its endpoint and instance, once chosen

        def reached(
            threshold: int = threshold,
            chunks_then: dict[int, int] = chunks_at_kill,
            turn: str = endpoints[kill % len(endpoints)],
            victim: dict[str, str] = victim,
        ) -> bool:
            # Some stream must be mid-way too. And every stream must have moved
            # since the last kill: one killed twice before it makes progress is
            # taken for a request that kills workers, and failed
            # (frontend.replay); these kills come from the test alone.
            with load._lock:
                if load.num_started < threshold or not load.midway:
                    return False
            if not load.have_all_moved_since(chunks_then):
                return False
            # The worker holding the most requests, taking turns between equals.
            # One holding none is not killed: a stream mid-way for its slow client
            # may be one that its worker has finished.
            workers = stack.workers()
            endpoint = max(endpoints, key=lambda e: (workers[e]["held"] or 0, e == turn))
            if not workers[endpoint]["held"]:
                return False
            victim[endpoint] = workers[endpoint]["instance_id"]
            return True

        def replaced(victim: dict[str, str] = victim) -> bool:
            workers = stack.workers()
            return all(
                workers[endpoint]["state"] == "live"
                and workers[endpoint]["instance_id"] not in (None, instance)
                for endpoint, instance in victim.items()
            )

        stack.wait_until(reached, f"{threshold} requests started, a worker holding one", 60)
        with load._lock:
            midway.append(len(load.midway))
            chunks_at_kill = dict(load.chunks_of)
        # On a machine loaded far past its cores the supervisor may have killed it
        # first, its heartbeats late (docs/operations.md): a death either way.
        with contextlib.suppress(ProcessLookupError):
            stack.kill_pid(pids[next(iter(victim))])
        time.sleep(0.2)
        stack.wait_until(replaced, "a replacement worker", 30)
    return midway


def _assert_resumes_exact(stack: Stack) -> None:
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
        load.num_started = 0
        midway: list[int] = []
        faulted = load.run(bodies, lambda: midway.extend(_kill_under_load(stack, load)))
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
    return value(scrape(stack.url), "minibatch_prefix_cache_hits_total")


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
        stack.wait_live(timeout_s=60)
        _assert_resumes_exact(stack)


def test_with_two_workers_replays_on_the_survivor_match_the_fault_free_run(
    tmp_path: Path, model_dir: Path
) -> None:
    with running_stack(tmp_path, _overrides(model_dir, 2)) as stack:
        stack.wait_for_health("both live", lambda h: h["workers_live"] == 2, 60)
        _assert_resumes_exact(stack)
