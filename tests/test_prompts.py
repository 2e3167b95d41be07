"""Long text prompts are read (tokenized, checked) on a thread of their own, so
that the running streams step on while a request's 131,072 characters are."""

from __future__ import annotations

import threading
import time

from protocol import ErrorCode, ErrorResult, GenerateRequest, GenerateResult, ToFrontend
from worker.engine.fake_engine import CharTokenizer, FakeEngine, expected_text
from worker.engine.prompts import INLINE_PROMPT_CHARS
from worker.serve.scheduler import Scheduler

LONG = "x" * INLINE_PROMPT_CHARS


class GatedTokenizer(CharTokenizer):
    """Records which thread read each text; a long text waits for ``gate``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.read_on: dict[str, str] = {}  # text -> thread name

    def encode(self, text: str) -> list[int]:
        self.read_on[text] = threading.current_thread().name
        if len(text) >= INLINE_PROMPT_CHARS:
            assert self.gate.wait(timeout=30)
        return super().encode(text)


def _engine(capacity: int, context_window: int = 1024) -> tuple[FakeEngine, GatedTokenizer]:
    engine = FakeEngine(capacity, context_window=context_window)
    tokenizer = GatedTokenizer()
    engine.tokenizer = tokenizer
    return engine, tokenizer


def _drain(scheduler: Scheduler, timeout_s: float = 30.0) -> dict[str, ToFrontend]:
    finals: dict[str, ToFrontend] = {}
    deadline = time.monotonic() + timeout_s
    while scheduler.has_work():
        assert time.monotonic() < deadline, "the scheduler did not drain"
        if not scheduler.can_run():
            time.sleep(0.001)  # as the server's loop does while a prompt is read
        for output in scheduler.run_once():
            if isinstance(output, (GenerateResult, ErrorResult)):
                finals[output.request_id] = output
    return finals


def test_streams_step_on_while_a_long_prompt_is_read_and_then_it_runs() -> None:
    engine, tokenizer = _engine(capacity=2, context_window=2 * INLINE_PROMPT_CHARS)
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(GenerateRequest("short", "hello", 8))
    long_prompt = LONG + "y"
    scheduler.submit(GenerateRequest("long", long_prompt, 4))
    for _ in range(5):
        scheduler.run_once()  # the long one is still being read: the short one steps
    assert engine.num_active() == 1 and scheduler.num_queued == 1
    tokenizer.gate.set()
    finals = _drain(scheduler)
    long_result = finals["long"]
    assert isinstance(long_result, GenerateResult)
    assert long_result.text == expected_text(long_prompt, 4)
    assert tokenizer.read_on[long_prompt].startswith("prompt")
    assert tokenizer.read_on["hello"] == threading.current_thread().name  # at admission


def test_a_long_prompt_past_the_context_window_is_refused_from_its_thread() -> None:
    engine, tokenizer = _engine(capacity=1)
    tokenizer.gate.set()
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(GenerateRequest("long", LONG, 4))
    refused = _drain(scheduler)["long"]
    assert isinstance(refused, ErrorResult)
    assert refused.code == ErrorCode.CONTEXT_OVERFLOW
    assert refused.message.startswith(f"prompt: {len(LONG):,} tokens and 4 to generate")
    assert tokenizer.read_on[LONG].startswith("prompt")


def test_an_aborted_long_prompt_is_never_read() -> None:
    engine, tokenizer = _engine(capacity=1, context_window=2 * INLINE_PROMPT_CHARS)
    scheduler = Scheduler(engine, max_queue_depth=10)
    first, second = LONG + "1", LONG + "2"
    scheduler.submit(GenerateRequest("first", first, 2))
    scheduler.submit(GenerateRequest("second", second, 2))  # waits behind the first's read
    scheduler.abort(["second"])
    tokenizer.gate.set()
    finals = _drain(scheduler)
    assert set(finals) == {"first"}
    assert second not in tokenizer.read_on
