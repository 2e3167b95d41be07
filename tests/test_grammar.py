"""Grammars in the worker (`worker.engine.grammar`), on the torch-free fake engine:
compiled off the engine loop and kept, refused by field name, advanced by every
token (resumed ones too), ended where the grammar ends, failed alone."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import llguidance
import pytest

from protocol import (
    ErrorCode,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    ToFrontend,
    Waiting,
)
from tests.resume import assert_every_resume_is_exact
from worker.engine import fake_engine
from worker.engine.fake_engine import FakeEngine, expected_text, fake_grammar_tokenizer
from worker.engine.grammar import MAX_COMPILED, Grammars
from worker.engine.interface import RequestRejected
from worker.serve.scheduler import Scheduler

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 5},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["word", "count", "flags"],
    "additionalProperties": False,
}


def json_grammar(schema: object) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def constrained(
    request_id: str, grammar: str, kind: str = "json_schema", **kwargs: object
) -> GenerateRequest:
    fields: dict[str, object] = {"max_new_tokens": 120, "grammar_kind": kind, "grammar": grammar}
    fields.update(kwargs)
    return GenerateRequest(request_id, f"prompt {request_id}", **fields)  # type: ignore[arg-type]


def run(scheduler: Scheduler) -> dict[str, GenerateResult | ErrorResult]:
    """Run until every request is answered; while only grammar compiles are
    pending, wait for them, as the server's loop does."""
    finals: dict[str, GenerateResult | ErrorResult] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not scheduler.has_work():
            return finals
        if not scheduler.can_run():
            time.sleep(0.001)
            continue
        for output in scheduler.run_once():
            if isinstance(output, (GenerateResult, ErrorResult)):
                finals[output.request_id] = output
    raise AssertionError("the scheduler did not drain")


def test_the_fake_follows_a_schema_and_ends_where_it_ends() -> None:
    scheduler = Scheduler(FakeEngine(2), 8)
    scheduler.submit(constrained("a", json_grammar(SCHEMA)))
    scheduler.submit(GenerateRequest("free", "unconstrained", 12))
    finals = run(scheduler)
    result = finals["a"]
    assert isinstance(result, GenerateResult) and result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.completion_tokens == len(result.text)  # one token a character
    free = finals["free"]
    assert isinstance(free, GenerateResult) and free.text == expected_text("unconstrained", 12)


def test_a_slow_compile_holds_up_neither_the_batch_nor_the_queue_behind_it() -> None:
    released = threading.Event()

    def slow_tokenizer() -> llguidance.LLTokenizer:
        assert released.wait(10)
        return fake_grammar_tokenizer()

    engine = FakeEngine(2)
    engine.grammars = Grammars(slow_tokenizer)
    scheduler = Scheduler(engine, 8)
    scheduler.submit(GenerateRequest("running", "already running", 30))
    scheduler.run_once()
    scheduler.submit(constrained("slow", json_grammar(SCHEMA)))
    scheduler.submit(GenerateRequest("behind", "queued behind it", 3))
    outputs: list[ToFrontend] = []
    for _ in range(10):
        outputs += scheduler.run_once()
    assert scheduler.num_steps == 11 and scheduler.num_queued == 1  # only the slow one waits
    assert {o.request_id for o in outputs if isinstance(o, GenerateResult)} == {"behind"}
    released.set()
    finals = run(scheduler)
    assert isinstance(finals["slow"], GenerateResult)
    assert finals["slow"].finish_reason == "stop"


def test_with_only_a_compile_pending_the_loop_may_wait_for_input() -> None:
    released = threading.Event()
    engine = FakeEngine(2)
    engine.grammars = Grammars(lambda: released.wait(10) and fake_grammar_tokenizer())
    scheduler = Scheduler(engine, 8)
    scheduler.submit(constrained("slow", json_grammar(SCHEMA)))
    assert scheduler.has_work() and not scheduler.can_run()
    assert scheduler.run_once() == [Waiting("slow")]  # no step: nothing else to report
    assert scheduler.run_once() == []
    released.set()
    assert isinstance(run(scheduler)["slow"], GenerateResult)


def _counting_compiles(engine: FakeEngine) -> list[str]:
    """The grammars ``engine`` compiles from now on, in order."""
    assert engine.grammars is not None
    compiles: list[str] = []
    compile_ = engine.grammars._compile

    def counting(grammar: str) -> llguidance.LLMatcher:
        compiles.append(grammar)
        return compile_(grammar)

    engine.grammars._compile = counting  # type: ignore[method-assign]
    return compiles


def test_a_grammar_sent_again_compiles_once_and_the_kept_ones_are_bounded() -> None:
    engine = FakeEngine(1)
    assert engine.grammars is not None
    compiles = _counting_compiles(engine)
    scheduler = Scheduler(engine, 8)
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-z]{3}")
    for i in range(3):
        scheduler.submit(constrained(f"r{i}", grammar, "regex"))
    assert all(isinstance(r, GenerateResult) for r in run(scheduler).values())
    assert compiles == [grammar]
    for i in range(MAX_COMPILED + 5):
        engine.grammars.matcher(
            constrained(f"x{i}", llguidance.LLMatcher.grammar_from_regex(f"x{i}"))
        )
    assert len(engine.grammars._compiled) == MAX_COMPILED


def test_grammars_prepared_ahead_are_kept_until_admitted_however_many_are_queued() -> None:
    """More distinct grammars queued than MAX_COMPILED, behind full slots: each
    compile for the back of the queue dropped one done for its front, which was
    compiled again, on the engine thread at its admission while the batch waited."""
    engine = FakeEngine(8)
    assert engine.grammars is not None
    compiles = _counting_compiles(engine)
    scheduler = Scheduler(engine, 1000)
    for i in range(8):
        scheduler.submit(GenerateRequest(f"busy{i}", "x", max_new_tokens=20))
    scheduler.run_once()
    num_grammars = MAX_COMPILED + 24
    grammars = [
        llguidance.LLMatcher.grammar_from_regex(f"g{i}[a-z]{{3}}") for i in range(num_grammars)
    ]
    for i, grammar in enumerate(grammars):
        scheduler.submit(constrained(f"r{i}", grammar, "regex", max_new_tokens=4))
        compiling = engine.grammars._compiled.get(grammar)
        if compiling is not None:  # prepared ahead: arrivals a while apart
            compiling.result(timeout=10)
    results = run(scheduler)
    assert all(isinstance(results[f"r{i}"], GenerateResult) for i in range(num_grammars))
    assert sorted(compiles) == sorted(grammars)  # each once
    assert len(engine.grammars._compiled) == MAX_COMPILED  # none waits now: the latest kept


def test_an_aborted_requests_compile_that_has_not_started_is_dropped() -> None:
    """Queued compiles of requests that left would otherwise all run, one after
    another, while a newcomer's grammar waited behind them."""
    released = threading.Event()
    engine = FakeEngine(1)
    engine.grammars = Grammars(lambda: released.wait(10) and fake_grammar_tokenizer())
    scheduler = Scheduler(engine, 8)
    grammars = [llguidance.LLMatcher.grammar_from_regex(f"x{i}") for i in range(3)]
    for i, grammar in enumerate(grammars):
        scheduler.submit(constrained(f"r{i}", grammar, "regex"))
    first = engine.grammars._compiled[grammars[0]]
    deadline = time.monotonic() + 10
    while not first.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.abort(["r0", "r1", "r2"])  # r0's compile has started: it waits for the tokenizer
    assert list(engine.grammars._compiled) == [grammars[0]]
    released.set()
    scheduler.submit(constrained("again", grammars[2], "regex"))  # prepared anew
    assert isinstance(run(scheduler)["again"], GenerateResult)


@pytest.mark.parametrize(
    ("kind", "grammar", "named"),
    [
        (
            "json_schema",
            '{"grammars": [{"json_schema": {"type": "strin"}}]}',
            "response_format.json_schema.schema:",
        ),
        ("regex", llguidance.LLMatcher.grammar_from_regex("a("), "structured_outputs.regex:"),
        ("grammar", "start: nowhere", "structured_outputs.grammar:"),
        ("grammar", "not a grammar at all {", "structured_outputs.grammar:"),
    ],
)
def test_a_grammar_the_worker_cannot_compile_fails_only_its_request(
    kind: str, grammar: str, named: str
) -> None:
    scheduler = Scheduler(FakeEngine(2), 8)
    scheduler.submit(constrained("bad", grammar, kind))
    scheduler.submit(GenerateRequest("good", "fine", 4))
    finals = run(scheduler)
    error = finals["bad"]
    assert isinstance(error, ErrorResult) and error.code == ErrorCode.INVALID_REQUEST
    assert error.message.startswith(f"{named} the grammar cannot be used"), error.message
    assert isinstance(finals["good"], GenerateResult)
    assert scheduler.num_failures_in_a_row == 0


NEVER_ENDS = "no output can complete it: some rule never ends"


@pytest.mark.parametrize(
    ("kind", "grammar"),
    [
        ("grammar", "start: start"),
        ("json", json_grammar({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
        # 0.3 is one, but llguidance finds none: the reason must not name a $ref only.
        (
            "json",
            json_grammar({"type": "number", "multipleOf": 0.1, "minimum": 0.25, "maximum": 0.35}),
        ),
    ],
)
def test_a_grammar_no_output_can_finish_is_refused_in_words(kind: str, grammar: str) -> None:
    scheduler = Scheduler(FakeEngine(1), 8)
    scheduler.submit(constrained("endless", grammar, kind))
    error = run(scheduler)["endless"]
    assert isinstance(error, ErrorResult) and error.code == ErrorCode.INVALID_REQUEST
    field = "structured_outputs.grammar" if kind == "grammar" else "structured_outputs.json"
    assert error.message.startswith(f"{field}: the grammar cannot be used: {NEVER_ENDS}")


def test_a_rule_that_never_ends_after_the_first_token_fails_in_words() -> None:
    scheduler = Scheduler(FakeEngine(1), 8)
    scheduler.submit(constrained("endless", 'start: "a" b\nb: b "x"', "grammar"))
    error = run(scheduler)["endless"]
    assert isinstance(error, ErrorResult) and error.code == ErrorCode.INVALID_REQUEST
    assert error.message.startswith(
        f"structured_outputs.grammar: the output could not follow the grammar: {NEVER_ENDS}"
    ), error.message


def test_an_engine_without_grammars_refuses_one_clearly() -> None:
    engine = FakeEngine(1)
    engine.grammars = None
    with pytest.raises(RequestRejected) as caught:
        engine.admit([constrained("r", json_grammar(SCHEMA))])
    assert caught.value.code == ErrorCode.UNSUPPORTED
    assert caught.value.message.startswith(
        "response_format.json_schema.schema: fake cannot constrain its output"
    )


def test_a_token_the_grammar_refuses_mid_stream_fails_that_request_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fake_engine, "fake_constrained_token", lambda token_id, allowed: ord("~"))
    scheduler = Scheduler(FakeEngine(2), 8)
    scheduler.submit(constrained("bad", json_grammar(SCHEMA)))
    scheduler.submit(GenerateRequest("good", "fine", 6))
    finals = run(scheduler)
    error = finals["bad"]
    assert isinstance(error, ErrorResult) and error.code == ErrorCode.INVALID_REQUEST
    assert error.message.startswith(
        "response_format.json_schema.schema: the output could not follow the grammar"
    )
    assert isinstance(finals["good"], GenerateResult)
    assert scheduler.num_failures_in_a_row == 0


def test_resumed_tokens_advance_the_grammar_and_the_stream_continues_exactly() -> None:
    request = constrained("r", json_grammar(SCHEMA), stream=True)
    result = assert_every_resume_is_exact(lambda: FakeEngine(1), request)
    jsonschema.validate(json.loads(result.text), SCHEMA)


def test_a_resume_the_grammar_could_not_have_streamed_is_refused() -> None:
    request = constrained("r", json_grammar(SCHEMA), resume_token_ids=[ord("[")])
    with pytest.raises(RequestRejected) as caught:
        FakeEngine(1).admit([request])
    assert caught.value.message.startswith("resume_token_ids: token 0 (91) is not one the grammar")


def test_the_grammar_ends_the_output_within_min_tokens() -> None:
    choice = llguidance.grammar_from("choice", json.dumps(["ok"]))
    scheduler = Scheduler(FakeEngine(1), 8)
    scheduler.submit(constrained("r", choice, "choice", min_tokens=10, max_new_tokens=20))
    result = run(scheduler)["r"]
    assert isinstance(result, GenerateResult)
    assert (result.text, result.finish_reason) == ("ok", "stop")


def test_where_the_grammar_may_end_its_end_token_ends_the_output_unseen() -> None:
    # "[0-9]+" may end after any digit: the fake's end-of-sequence token (0), which
    # comes first when it wraps around past the digits, ends it, and is no text.
    regex = llguidance.LLMatcher.grammar_from_regex("[0-9]+")
    request = constrained("r", regex, "regex", ignore_eos=True, stream=True)
    engine = FakeEngine(1)
    engine.admit([request])
    finished = []
    while engine.num_active():
        finished += engine.step().finished
    (result,) = finished
    assert result.finish_reason == "stop" and result.text.isdigit()
    assert result.token_ids[-1] == 0 and len(result.text) == len(result.token_ids) - 1


def test_a_copy_of_a_request_shares_the_compiled_grammar() -> None:
    engine = FakeEngine(2)
    request = constrained("a", json_grammar(SCHEMA))
    engine.admit([request, dataclasses.replace(request, request_id="b")])
    assert engine.grammars is not None and len(engine.grammars._compiled) == 1


# In a process of its own, so that memory other tests freed cannot hide the growth.
_COMPILE_A_NESTED_REPEAT = """
import psutil
from worker.engine.grammar import Grammars, hf_grammar_tokenizer
from worker.model.loader import gpt2_tokenizer
from frontend.structured import compile_grammar

grammars = Grammars(lambda: hf_grammar_tokenizer(gpt2_tokenizer(), 50256, 50257))
grammars._compiling(compile_grammar("regex", "a")[0]).result()  # the tokenizer first
grammar, problem = compile_grammar("regex", "((-{100}){100}){100}")
assert problem is None, problem
process = psutil.Process()
before = process.memory_info().rss
grammars._compiling(grammar).result()
print((process.memory_info().rss - before) // 2**20)
"""


def test_a_short_regex_of_nested_repeats_compiles_into_a_bounded_size() -> None:
    """21 characters the frontend's checks pass; the worker keeps what compiling
    them builds, and at llguidance's default lexer fuel that was 160 MB."""
    completed = subprocess.run(
        [sys.executable, "-c", _COMPILE_A_NESTED_REPEAT],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert int(completed.stdout) < 64, f"{completed.stdout.strip()} MB"
