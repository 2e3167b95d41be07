from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable, Sequence

import pytest

from protocol import (
    Admitted,
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    ToFrontend,
    TokenDelta,
    Waiting,
)
from worker.engine.fake_engine import FakeEngine, expected_text
from worker.engine.interface import RequestRejected, StepOutput
from worker.engine.sequence import Sequence as Sequence_
from worker.serve.scheduler import PREPARED_AHEAD, QueueFull, Scheduler


class RecordingEngine(FakeEngine):
    """FakeEngine that records what the scheduler asked of it."""

    def __init__(self, capacity: int, **kwargs: object) -> None:
        super().__init__(capacity, **kwargs)  # type: ignore[arg-type]
        self.admitted: list[str] = []
        self.active_at_step: list[int] = []
        self.max_active = 0
        self.num_decodes = 0

    def admit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        ids = super().admit(requests)
        self.admitted.extend(ids)
        self.max_active = max(self.max_active, self.num_active())
        return ids

    def step(self, on_prefilled: Callable[[StepOutput], None] | None = None) -> StepOutput:
        self.active_at_step.append(self.num_active())
        return super().step(on_prefilled)

    def _decode(self, active: list[Sequence_]) -> list[int]:
        self.num_decodes += 1
        return super()._decode(active)


def _request(i: int, max_new_tokens: int = 4, **kwargs: object) -> GenerateRequest:
    return GenerateRequest(f"r{i}", f"prompt {i}", max_new_tokens, **kwargs)  # type: ignore[arg-type]


def _run(scheduler: Scheduler, max_iterations: int = 10_000) -> list[ToFrontend]:
    outputs: list[ToFrontend] = []
    for _ in range(max_iterations):
        if not scheduler.has_work():
            return outputs
        outputs.extend(scheduler.run_once())
    raise AssertionError("scheduler did not drain")


def _finals(outputs: list[ToFrontend]) -> dict[str, GenerateResult | ErrorResult]:
    finals: dict[str, GenerateResult | ErrorResult] = {}
    for message in outputs:
        if isinstance(message, (GenerateResult, ErrorResult)):
            assert message.request_id not in finals, f"{message.request_id} answered twice"
            finals[message.request_id] = message
    return finals


def test_capacity_is_never_exceeded() -> None:
    engine = RecordingEngine(3)
    scheduler = Scheduler(engine, max_queue_depth=100)
    for i in range(30):
        scheduler.submit(_request(i, max_new_tokens=1 + i % 5))
    _run(scheduler)
    assert engine.max_active == 3
    assert max(engine.active_at_step) <= 3


def test_admission_is_first_come_first_served() -> None:
    engine = RecordingEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=100)
    order = [f"r{i}" for i in range(10)]
    for i in range(10):
        scheduler.submit(_request(i, max_new_tokens=random.Random(i).randint(1, 6)))
    _run(scheduler)
    assert engine.admitted == order


def test_a_finished_sequence_frees_a_slot_that_is_refilled_before_the_next_step() -> None:
    engine = RecordingEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=100)
    scheduler.submit(_request(0, max_new_tokens=2))  # finishes in the first step
    scheduler.submit(_request(1, max_new_tokens=8))
    scheduler.submit(_request(2, max_new_tokens=8))
    first = scheduler.run_once()
    assert [m.request_id for m in first if isinstance(m, GenerateResult)] == ["r0"]
    assert engine.num_active() == 1
    scheduler.run_once()
    assert engine.admitted == ["r0", "r1", "r2"]
    assert engine.active_at_step[:2] == [2, 2]


def test_ten_times_capacity_with_churn_loses_and_duplicates_nothing() -> None:
    rng = random.Random(7)
    engine = RecordingEngine(4)
    scheduler = Scheduler(engine, max_queue_depth=1000)
    requests = [_request(i, max_new_tokens=rng.randint(1, 12)) for i in range(40)]
    aborted = {"r5", "r17", "r33"}
    outputs: list[ToFrontend] = []
    pending = list(requests)
    while pending or scheduler.has_work():
        for _ in range(rng.randint(0, 3)):  # arrivals between steps
            if pending:
                scheduler.submit(pending.pop(0))
        for request_id in aborted & {r.request_id for r in requests[: 40 - len(pending)]}:
            outputs.extend(scheduler.abort([request_id]))
        outputs.extend(scheduler.run_once())
    finals = _finals(outputs)
    assert set(finals) == {r.request_id for r in requests}
    for request in requests:
        result = finals[request.request_id]
        assert isinstance(result, GenerateResult)
        if request.request_id in aborted:
            assert result.finish_reason in ("abort", "length")
            continue
        assert result.finish_reason == "length"
        assert result.text == expected_text(request.prompt, request.max_new_tokens)


def test_a_request_that_waits_is_reported_waiting_then_admitted_before_its_first_token() -> None:
    """One slot: r0 takes it at once (no notice); r1 and r2 wait, each reported
    once, and each is reported admitted before the step that prefills it, with
    ``send`` before the step runs at all."""
    engine = RecordingEngine(1)
    scheduler = Scheduler(engine, max_queue_depth=100)
    for i in range(3):
        scheduler.submit(_request(i, max_new_tokens=2, stream=True))
    messages: list[ToFrontend] = []  # in the order the worker sends them
    while scheduler.has_work():
        num_steps = len(engine.active_at_step)

        def send(sent: list[ToFrontend], num_steps: int = num_steps) -> None:
            notices = [m for m in sent if isinstance(m, (Waiting, Admitted))]
            if notices:  # alone, and before the step begins
                assert notices == sent and len(engine.active_at_step) == num_steps
            messages.extend(sent)

        messages.extend(scheduler.run_once(send))
    notices = [
        (type(m).__name__, m.request_id) for m in messages if isinstance(m, (Waiting, Admitted))
    ]
    assert notices == [
        ("Waiting", "r1"),
        ("Waiting", "r2"),
        ("Admitted", "r1"),
        ("Admitted", "r2"),
    ]
    for request_id in ("r1", "r2"):
        kinds = [type(m).__name__ for m in messages if m.request_id == request_id]  # type: ignore[union-attr]
        assert kinds[:2] == ["Waiting", "Admitted"] and "Admitted" not in kinds[2:]
        assert kinds.index("Admitted") < kinds.index("TokenDelta")


def test_a_waiting_request_that_is_aborted_is_not_reported_admitted() -> None:
    scheduler = Scheduler(FakeEngine(1), max_queue_depth=100)
    for i in range(2):
        scheduler.submit(_request(i))
    outputs = scheduler.run_once()
    assert Waiting("r1") in outputs
    outputs = scheduler.abort(["r1"]) + _run(scheduler)
    assert not any(isinstance(m, (Waiting, Admitted)) for m in outputs)
    assert _finals(outputs)["r1"].finish_reason == "abort"  # type: ignore[union-attr]


def test_an_aborted_request_sent_again_before_the_next_iteration_is_reported_waiting_once() -> None:
    scheduler = Scheduler(FakeEngine(1), max_queue_depth=100)
    scheduler.submit(_request(0))  # takes the slot
    scheduler.submit(_request(1))
    scheduler.abort(["r1"])
    scheduler.submit(_request(1))  # a client's retry, in the same inbox drain
    assert [m for m in scheduler.run_once() if isinstance(m, Waiting)] == [Waiting("r1")]


def test_requests_sent_and_aborted_on_an_idle_worker_leave_nothing_behind() -> None:
    """A peer that sends a request and its abort, again and again, between two
    iterations of an idle worker (no step runs): the worker's memory stays flat."""
    scheduler = Scheduler(FakeEngine(1), max_queue_depth=100)

    def send_and_abort(first: int, count: int) -> None:
        for i in range(first, first + count):
            scheduler.submit(_request(i))
            scheduler.abort([f"r{i}"])
            scheduler.run_once()

    send_and_abort(0, 1_000)  # warm up whatever caches the first ones fill
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        send_and_abort(1_000, 20_000)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 100_000, f"{after - before:,} bytes kept for 20,000 aborted requests"


def test_staggered_budgets_finish_in_budget_order() -> None:
    scheduler = Scheduler(FakeEngine(8), max_queue_depth=100)
    budgets = [9, 3, 7, 1, 5]
    for i, budget in enumerate(budgets):
        scheduler.submit(_request(i, max_new_tokens=budget))
    finished = [m for m in _run(scheduler) if isinstance(m, GenerateResult)]
    assert [r.completion_tokens for r in finished] == sorted(budgets)


def test_a_full_queue_pushes_back() -> None:
    scheduler = Scheduler(FakeEngine(1), max_queue_depth=3)
    for i in range(4):  # one for the free slot, three to wait
        scheduler.submit(_request(i))
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.submit(_request(4))
    scheduler.run_once()  # one request in the slot, three waiting: still full
    with pytest.raises(QueueFull):
        scheduler.submit(_request(4))
    scheduler.abort([_request(1).request_id])  # one fewer waiting
    scheduler.submit(_request(4))


def test_a_burst_that_free_slots_take_is_not_refused_as_queued() -> None:
    """Requests that the next iteration admits into free slots do not wait: 8
    slots and a queue of 4 take 12 at once (an n=8 request on an idle worker)."""
    scheduler = Scheduler(FakeEngine(8), max_queue_depth=4)
    for i in range(12):
        scheduler.submit(_request(i))
    with pytest.raises(QueueFull):
        scheduler.submit(_request(12))
    finals = _finals(_run(scheduler))
    assert sorted(finals) == sorted(_request(i).request_id for i in range(12))


def test_a_request_id_already_known_is_not_run_twice() -> None:
    scheduler = Scheduler(FakeEngine(2), max_queue_depth=10)
    scheduler.submit(_request(0))
    scheduler.submit(_request(0))
    assert len(_finals(_run(scheduler))) == 1


def test_an_admit_failure_fails_only_the_request_that_causes_it() -> None:
    engine = RecordingEngine(4, fail_admit_if=lambda r: r.prompt == "prompt 2")
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(_request(0, max_new_tokens=6))
    outputs = scheduler.run_once()  # r0 is running
    for i in (1, 2, 3):  # admitted together; r2 makes the admit fail
        scheduler.submit(_request(i, max_new_tokens=3))
    outputs += _run(scheduler)
    finals = _finals(outputs)
    assert isinstance(finals["r2"], ErrorResult)
    assert finals["r2"].code == ErrorCode.INTERNAL
    for i, budget in ((0, 6), (1, 3), (3, 3)):
        result = finals[f"r{i}"]
        assert isinstance(result, GenerateResult)
        assert result.text == expected_text(f"prompt {i}", budget)
    assert scheduler.num_failures_in_a_row == 0  # the steps after it succeeded


def test_a_refusal_that_names_no_newcomer_fails_them_and_admission_ends() -> None:
    """An engine's refusal that names a request it was not given (its bug) fails
    the newcomers as any admit failure does; nothing was dropped from them, so
    admission tried the same again forever."""

    class MisnamingEngine(FakeEngine):
        def admit(self, requests: Sequence[GenerateRequest]) -> list[str]:
            raise RequestRejected("someone-else", ErrorCode.INVALID_REQUEST, "refused")

    scheduler = Scheduler(MisnamingEngine(4), max_queue_depth=10)
    for i in (0, 1):
        scheduler.submit(_request(i))
    finals = _finals(scheduler.run_once())
    assert sorted(finals) == ["r0", "r1"]
    assert all(isinstance(f, ErrorResult) and f.code == ErrorCode.INTERNAL for f in finals.values())
    assert not scheduler.has_work()


@pytest.mark.parametrize("send", [False, True])
@pytest.mark.parametrize("every", [1, 3])
def test_failed_admissions_count_while_an_older_stream_decodes(send: bool, every: int) -> None:
    """The server's path (``send``) reports the prefill and the decode apart, and
    an iteration that only decoded counted as a success: an engine failing every
    newcomer beside one long stream was never replaced, each newcomer got a 500."""
    engine = FakeEngine(2, fail_admit_if=lambda request: request.request_id.startswith("bad"))
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(_request(0, max_new_tokens=40))
    sent: list[ToFrontend] = []
    scheduler.run_once(sent.extend if send else None)
    for i in range(3 * every):
        if i % every == 0:
            scheduler.submit(GenerateRequest(f"bad{i}", "prompt", 4))
        sent += scheduler.run_once(sent.extend if send else None)
    assert engine.num_active() == 1  # r0 decoded through every iteration
    assert [type(o) for o in sent if isinstance(o, ErrorResult)] == [ErrorResult] * 3
    assert scheduler.num_failures_in_a_row == 3
    finals = _finals(sent + _run(scheduler))  # nothing fails, and r0 finishes
    assert isinstance(finals["r0"], GenerateResult)
    assert scheduler.num_failures_in_a_row == 0


def test_failures_in_a_row_are_counted_until_a_request_finishes() -> None:
    engine = RecordingEngine(1, fail_step_if=lambda step: step <= 2)
    scheduler = Scheduler(engine, max_queue_depth=10)
    for i in range(3):
        scheduler.submit(_request(i, max_new_tokens=3))
    scheduler.run_once()
    scheduler.run_once()
    assert scheduler.num_failures_in_a_row == 2
    assert scheduler.num_steps == 0  # a failed step is no progress
    finals = _finals(_run(scheduler))
    assert isinstance(finals["r2"], GenerateResult)
    assert scheduler.num_failures_in_a_row == 0
    assert scheduler.num_finished == 3  # two errors and one result


def test_a_rejected_request_fails_alone_and_the_rest_are_admitted() -> None:
    engine = RecordingEngine(4)
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(_request(0))
    scheduler.submit(_request(1, max_new_tokens=5000))  # beyond the context window
    scheduler.submit(_request(2))
    finals = _finals(_run(scheduler))
    rejected = finals["r1"]
    assert isinstance(rejected, ErrorResult)
    assert rejected.code == ErrorCode.CONTEXT_OVERFLOW
    assert "8 tokens and 5,000 to generate, more than the context window of 1,024 " in (
        rejected.message
    )
    assert engine.admitted == ["r0", "r2"]


def test_refusing_requests_at_admission_counts_as_progress() -> None:
    """Prompts each refused once tokenized never step: a worker taking a flood of
    them in was declared hung (STEP_TIMEOUT_S) and killed."""
    engine = RecordingEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=10)
    for i in range(4):
        scheduler.submit(_request(i, max_new_tokens=5000))  # beyond the context window
    progress = [scheduler.num_steps]
    while scheduler.has_work():
        scheduler.run_once()
        progress.append(scheduler.num_steps)
    assert progress == [0, 1, 2] and engine.admitted == []


def test_a_step_failure_fails_the_active_set_resets_and_serving_goes_on() -> None:
    engine = RecordingEngine(2, fail_step_if=lambda step: step == 2)
    scheduler = Scheduler(engine, max_queue_depth=10)
    for i in range(4):
        scheduler.submit(_request(i, max_new_tokens=5))
    finals = _finals(_run(scheduler))
    assert engine.num_resets == 1
    assert all(isinstance(finals[r], ErrorResult) for r in ("r0", "r1"))
    for later in ("r2", "r3"):
        result = finals[later]
        assert isinstance(result, GenerateResult)
        assert result.text == expected_text(f"prompt {later[1]}", 5)


def test_a_slot_freed_while_requests_wait_is_reported_busy_until_refilled() -> None:
    """The next iteration refills it before it steps again: reported idle in
    between, it would look like a slot left idle under a backlog."""
    engine = RecordingEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=100)
    scheduler.submit(_request(0, max_new_tokens=2))  # finishes in the first step
    scheduler.submit(_request(1, max_new_tokens=8))
    scheduler.submit(_request(2, max_new_tokens=1))  # finishes in its first step
    scheduler.run_once()
    assert (engine.num_active(), scheduler.num_queued) == (1, 1)
    assert scheduler.num_busy == 2
    scheduler.run_once()  # r2 came and went; nothing waits for its slot
    assert engine.active_at_step == [2, 2]
    assert scheduler.num_busy == engine.num_active() == 1
    scheduler.abort(["r1"])
    assert scheduler.num_busy == 0


def test_requests_under_admission_are_reported_busy() -> None:
    """A whole prompt's prefill runs in the admission: heartbeats sent meanwhile
    said the worker had nothing to run, and a stopping one was killed as stuck."""
    busy_while_admitting: list[int] = []

    class WatchedEngine(FakeEngine):
        def admit(self, requests: Sequence[GenerateRequest]) -> list[str]:
            busy_while_admitting.append(scheduler.num_busy)
            return super().admit(requests)

    scheduler = Scheduler(WatchedEngine(4), max_queue_depth=100)
    for i in range(3):
        scheduler.submit(_request(i, max_new_tokens=4))
    scheduler.run_once()
    assert busy_while_admitting == [3]


class PreparingEngine(RecordingEngine):
    """Its request "r9" is still being prepared (its grammar compiling)."""

    def prepare(self, request: GenerateRequest) -> bool:
        return request.request_id != "r9"


def test_a_slot_freed_while_only_unprepared_requests_wait_is_reported_idle() -> None:
    engine = PreparingEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=100)
    scheduler.submit(_request(0, max_new_tokens=2))  # finishes in the first step
    scheduler.submit(_request(1, max_new_tokens=8))
    scheduler.submit(_request(9))
    scheduler.run_once()
    assert (engine.num_active(), scheduler.num_queued) == (1, 1)
    assert scheduler.num_busy == 1  # no iteration can refill it yet


class CountingEngine(RecordingEngine):
    """Prepares nothing (every grammar still compiling) and records what it was
    asked to start and to drop."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.prepared: set[str] = set()
        self.unprepared: list[str] = []

    def prepare(self, request: GenerateRequest) -> bool:
        self.prepared.add(request.request_id)
        return False

    def unprepare(self, request: GenerateRequest) -> None:
        self.unprepared.append(request.request_id)


def test_only_the_head_of_the_queue_is_prepared_and_an_aborted_request_is_dropped() -> None:
    """A peer that queued 120 distinct grammars made the worker compile and hold
    all of them (3.7 GB); only as many as the slots and PREPARED_AHEAD more go ahead."""
    engine = CountingEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=1000)
    window = 2 + PREPARED_AHEAD
    for i in range(window + 50):
        scheduler.submit(_request(i))
    scheduler.run_once()
    assert scheduler.can_run() is False
    assert engine.prepared == {f"r{i}" for i in range(window)}
    scheduler.abort(["r0", f"r{window + 1}"])
    assert engine.unprepared == ["r0", f"r{window + 1}"]
    scheduler.run_once()  # the head moved on by one
    assert engine.prepared == {f"r{i}" for i in range(window + 1)}


def test_abort_answers_queued_and_running_requests_and_frees_the_slot() -> None:
    engine = FakeEngine(1)
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(_request(0, max_new_tokens=50))
    scheduler.submit(_request(1, max_new_tokens=50))
    scheduler.run_once()
    aborted = scheduler.abort(["r0", "r1", "unknown"])
    assert {m.request_id for m in aborted} == {"r0", "r1"}
    assert all(isinstance(m, GenerateResult) and m.finish_reason == "abort" for m in aborted)
    assert engine.num_active() == 0 and not scheduler.has_work()


def test_a_stopping_worker_takes_the_queue_and_runs_what_it_admitted_to_the_end() -> None:
    engine = FakeEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=10)
    for i in range(5):
        scheduler.submit(_request(i, max_new_tokens=3))
    scheduler.run_once()
    assert scheduler.take_queued() == ["r2", "r3", "r4"]  # handed back, unanswered
    assert scheduler.num_running == 2 and scheduler.num_queued == 0
    finals = _finals(_run(scheduler))
    assert sorted(finals) == ["r0", "r1"] and scheduler.num_running == 0


def test_results_carry_timings_and_token_counts() -> None:
    ticks = iter(range(100))
    scheduler = Scheduler(FakeEngine(1), max_queue_depth=10, clock=lambda: float(next(ticks)))
    scheduler.submit(_request(0, max_new_tokens=3))
    (result,) = _finals(_run(scheduler)).values()
    assert isinstance(result, GenerateResult)
    assert (result.prompt_tokens, result.completion_tokens) == (8, 3)
    assert result.queue_wait_ms == 1000.0
    assert result.generate_ms > 0


def test_a_first_token_is_sent_before_the_decode_of_its_step() -> None:
    """Time to first token is the prefill's, not the prefill's and a decode's."""
    engine = RecordingEngine(2)
    scheduler = Scheduler(engine, max_queue_depth=10)
    scheduler.submit(_request(0, max_new_tokens=3, stream=True))
    scheduler.submit(_request(1, max_new_tokens=1, stream=True))  # its first token ends it
    sent: list[list[ToFrontend]] = []

    def send(messages: list[ToFrontend]) -> None:
        assert engine.num_decodes == 0, "sent after the decode"
        sent.append(messages)

    rest = scheduler.run_once(send)
    [early] = sent
    assert [(type(m).__name__, m.request_id) for m in early] == [
        ("TokenDelta", "r0"),
        ("TokenDelta", "r1"),
        ("GenerateResult", "r1"),
    ]
    assert engine.num_decodes == 1
    assert [(type(m).__name__, m.request_id) for m in rest] == [("TokenDelta", "r0")]
    assert all(isinstance(m, TokenDelta) and len(m.token_ids) == 1 for m in rest)
    assert scheduler.num_finished == 1
    _run(scheduler)
    assert scheduler.num_finished == 2


def test_whole_prompts_past_a_passs_budget_go_in_several_passes_each_counted_as_progress() -> None:
    """Heartbeats must see a long admission move: 48 prompts of 1,000 tokens in
    one pass took over 30 s, and the worker was replaced as hung."""
    engine = FakeEngine(4)
    scheduler = Scheduler(engine, max_queue_depth=10)
    for i in range(3):  # 1,000 + 1,000 fit a pass of PREFILL_PASS_TOKENS; the third waits
        scheduler.submit(GenerateRequest(f"r{i}", "x" * 1000, 2))
    outputs = scheduler.run_once()
    assert engine.num_extra_prefill_passes() == 1
    assert scheduler.num_steps == 2  # the first pass, then the second with the step
    while scheduler.has_work():
        outputs += scheduler.run_once()
    assert engine.num_extra_prefill_passes() == 1
    texts = [out.text for out in outputs if isinstance(out, GenerateResult)]
    assert texts == [expected_text("x" * 1000, 2)] * 3
