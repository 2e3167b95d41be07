"""Long prompts are tokenized off the engine thread while their requests wait
(`worker/engine/prompt_tokens.py`): the batch steps on meanwhile."""

from __future__ import annotations

import os
import threading
import time

from protocol import ErrorCode, ErrorResult, GenerateRequest, GenerateResult, TokenDelta
from worker.engine.fake_engine import CharTokenizer, FakeEngine
from worker.engine.prompt_tokens import INLINE_PROMPT_CHARS, PROMPTS_NICE
from worker.model.loader import TextTokenizer, gpt2_tokenizer
from worker.serve.scheduler import Scheduler

LONG = INLINE_PROMPT_CHARS + 1


class GatedTokenizer(CharTokenizer):
    """Tokenizes a long text only once ``release`` is set, recording the threads
    that tokenized."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[str] = []
        self.nice_values: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.nice_values.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if len(text) > INLINE_PROMPT_CHARS:
            assert self.release.wait(timeout=30)
        return super().encode(text)


def _engine(context_window: int = 1024) -> tuple[FakeEngine, GatedTokenizer]:
    engine = FakeEngine(2, context_window=context_window)
    tokenizer = engine.tokenizer = GatedTokenizer()
    return engine, tokenizer


def _answers(scheduler: Scheduler, *request_ids: str) -> dict[str, ErrorResult | GenerateResult]:
    """Each request's final answer, stepping until all are in."""
    answers: dict[str, ErrorResult | GenerateResult] = {}
    deadline = time.monotonic() + 30
    while set(answers) != set(request_ids):
        assert time.monotonic() < deadline, f"answered only {sorted(answers)}"
        for output in scheduler.run_once():
            if isinstance(output, (ErrorResult, GenerateResult)):
                answers[output.request_id] = output
    return answers


def test_streams_step_on_while_a_long_prompt_is_tokenized_beside_them() -> None:
    engine, tokenizer = _engine(context_window=4096)
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(GenerateRequest("stream", "a short prompt", 40, stream=True))
    scheduler.run_once()
    scheduler.submit(GenerateRequest("long", "x" * (LONG + 500), 2))
    steps = [scheduler.run_once() for _ in range(5)]
    # Every step gave the stream its token; the long prompt waits in the queue.
    assert all(
        any(isinstance(o, TokenDelta) and o.request_id == "stream" for o in outputs)
        for outputs in steps
    )
    assert scheduler.num_queued == 1 and engine.num_active() == 1
    tokenizer.release.set()
    result = _answers(scheduler, "stream", "long")["long"]
    assert isinstance(result, GenerateResult) and result.prompt_tokens == LONG + 500
    assert tokenizer.threads[0] == "MainThread"  # the short prompt, at admission
    assert tokenizer.threads[1].startswith("prompts")
    # Beside torch's threads, at the lowest priority: a step waits for its slowest.
    assert tokenizer.nice_values == [os.getpriority(os.PRIO_PROCESS, 0), PROMPTS_NICE]
    assert len(tokenizer.threads) == 2 and len(engine.prompts) == 0


def test_a_long_prompt_refused_for_the_context_window_is_answered_and_forgotten() -> None:
    engine, tokenizer = _engine()
    tokenizer.release.set()
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(GenerateRequest("long", "x" * LONG, 2))
    result = _answers(scheduler, "long")["long"]
    assert isinstance(result, ErrorResult) and result.code == ErrorCode.CONTEXT_OVERFLOW
    assert tokenizer.threads == ["prompts_0"] and len(engine.prompts) == 0


def test_an_aborted_request_forgets_its_long_prompt() -> None:
    engine, tokenizer = _engine()
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(GenerateRequest("long", "x" * LONG, 2))
    assert len(engine.prompts) == 1 and not scheduler.can_run()
    scheduler.abort(["long"])
    tokenizer.release.set()
    assert len(engine.prompts) == 0 and not scheduler.has_work()


def test_a_short_prompt_is_ready_at_once_and_tokenized_at_admission() -> None:
    engine, tokenizer = _engine()
    request = GenerateRequest("short", "y" * INLINE_PROMPT_CHARS, 2)
    assert engine.prepare(request) and tokenizer.threads == []
    assert len(engine.prompts) == 0


def test_an_admission_tried_again_takes_the_prompt_it_tokenized() -> None:
    """A batch whose admission fails is admitted one by one: each prompt is
    tokenized once all the same."""
    engine, tokenizer = _engine(context_window=4096)
    tokenizer.release.set()
    failed_once: list[str] = []

    def fail_first_admission(request: GenerateRequest) -> bool:
        failed_once.append(request.request_id)
        return len(failed_once) == 1

    engine.fail_admit_if = fail_first_admission
    scheduler = Scheduler(engine, max_queue_depth=10)
    requests = [GenerateRequest("a", "x" * LONG, 2), GenerateRequest("b", "z" * LONG, 2)]
    for request in requests:
        scheduler.submit(request)
    while not all(engine.prepare(request) for request in requests):
        time.sleep(0.001)
    answers = _answers(scheduler, "a", "b")
    assert all(isinstance(answer, GenerateResult) for answer in answers.values())
    assert len(tokenizer.threads) == 2 and len(engine.prompts) == 0


def test_the_text_tokenizer_lets_other_threads_run_while_it_tokenizes() -> None:
    """Tokenized on a thread beside the engine's, a prompt that held the GIL
    would stop the engine thread as if it were tokenized there."""
    tokenizer = TextTokenizer(gpt2_tokenizer(), eos_token_id=50256)
    text = " ".join(f"w{i}x{i * 7919 % 10007}" for i in range(50_000))  # ~600 KB
    spans: list[float] = []

    def encode() -> None:
        started = time.perf_counter()
        tokenizer.encode(text)
        spans.append(time.perf_counter() - started)

    thread = threading.Thread(target=encode)
    last = time.perf_counter()
    longest_pause = 0.0
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
    thread.join()
    # Holding the GIL, the whole encode (hundreds of ms) would be one pause here.
    assert longest_pause < spans[0] / 3, (longest_pause, spans[0])
