"""Structured outputs on the torch engine: a small GPT-2 with random weights and
the real GPT-2 tokenizer follows every JSON schema, regex, choice and grammar,
greedy and sampled; the mask touches only the rows that ask; the raw logprobs
stay raw; and a constrained stream resumed at any point continues exactly."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from frontend.structured import compile_grammar
from protocol import GenerateRequest
from tests.model_fixtures import run_schedule
from tests.resume import assert_every_resume_is_exact
from worker.engine import torch_engine
from worker.engine.grammar import Grammars, hf_grammar_tokenizer
from worker.engine.torch_engine import TorchEngine
from worker.model.loader import LoadedModel, synthetic_config, synthetic_model

pytestmark = pytest.mark.model

PROMPT = "Here is the answer, in JSON:"
MAX_TOKENS = 200  # every schema below closes well within it (strings and numbers are bounded)

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": {"type": "string", "maxLength": 8},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "int_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 2,
        "maxItems": 5,
    },
    "enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "number": {
        "type": "object",
        # multipleOf bounds the digits: the random model would write zeros forever.
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25}},
        "required": ["x"],
        "additionalProperties": False,
    },
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "points": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "optional": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "string", "maxLength": 4},
        },
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "point"}},
        "required": ["version", "kind"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "string", "maxLength": 6},
            {"type": "integer", "minimum": 0, "maximum": 999},
        ]
    },
    "nullable": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["note"],
        "additionalProperties": False,
    },
    "refs": {
        "type": "object",
        "$defs": {"tag": {"type": "string", "enum": ["a", "b", "c"]}},
        "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "date": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "tuple": {
        "type": "array",
        "prefixItems": [
            {"type": "string", "maxLength": 5},
            {"type": "integer", "minimum": 0, "maximum": 99},
            {"type": "boolean"},
        ],
        "items": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "shipped", "done"]},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["status", "items"],
        "additionalProperties": False,
    },
    "bounds": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    "boolean": {"type": "boolean"},
    "strings": {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 4},
        "minItems": 1,
        "maxItems": 4,
    },
    "deep": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "map": {
        "type": "object",
        "patternProperties": {"^[a-z]{1,3}$": {"type": "integer", "minimum": 0, "maximum": 9}},
        "additionalProperties": False,
        "maxProperties": 3,
    },
    "email": {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email", "maxLength": 20}},
        "required": ["email"],
        "additionalProperties": False,
    },
}
SAMPLED = {"temperature": 1.0, "top_p": 0.95}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """distilgpt2's vocabulary and tokenizer on a 2-layer, 64-wide body: the
    grammars meet the real GPT-2 tokens, at a small model's cost."""
    return synthetic_model(synthetic_config(n_layer=2, n_embd=64, n_head=4, n_positions=512))


@pytest.fixture(scope="module")
def grammars(loaded: LoadedModel) -> Grammars:
    """One compiler for every engine here: llguidance reads the tokenizer once."""
    tokenizer = loaded.tokenizer
    return Grammars(lambda: hf_grammar_tokenizer(tokenizer.backend, tokenizer.eos_token_id, 50257))


@pytest.fixture
def new_engine(loaded: LoadedModel, grammars: Grammars) -> Iterator[Any]:
    def make(capacity: int = 8) -> TorchEngine:
        engine = TorchEngine(loaded, capacity)
        engine.grammars = grammars
        return engine

    yield make


def constrained(
    request_id: str, kind: str, value: Any, max_new_tokens: int = MAX_TOKENS, **kwargs: Any
) -> GenerateRequest:
    grammar, problem = compile_grammar(kind, value)
    assert problem is None, problem
    return GenerateRequest(
        request_id, PROMPT, max_new_tokens, grammar_kind=kind, grammar=grammar, **kwargs
    )


def run_to_the_end(engine: TorchEngine) -> tuple[list[Any], list[Any]]:
    """Step until no sequence is active: the requests that failed and those that
    finished."""
    failed, finished = [], []
    while engine.num_active():
        output = engine.step()
        failed += output.failed
        finished += output.finished
    return failed, finished


def test_every_output_follows_its_json_schema(new_engine: Any) -> None:
    requests = []
    for name, schema in SCHEMAS.items():
        requests.append(constrained(f"{name}/greedy", "json_schema", schema))
        requests.append(constrained(f"{name}/sampled", "json_schema", schema, seed=3, **SAMPLED))
    finished = run_schedule(new_engine(), {0: requests})
    assert len(finished) == len(requests) == 2 * len(SCHEMAS) >= 40
    for request_id, result in finished.items():
        assert result.finish_reason == "stop", (request_id, result.text)
        jsonschema.validate(json.loads(result.text), SCHEMAS[request_id.split("/")[0]])


# json_object bounds nothing, and random weights write a key or a number without
# end: '"' (1) and '}' (92) made likelier steer them to close, while the grammar
# alone decides what is allowed ('"' wins inside a string, '}' after a value).
CLOSING_BIAS = {"logit_bias_token_ids": [1, 92], "logit_bias_values": [40.0, 20.0]}


@pytest.mark.parametrize("sampling", [{}, {"seed": 4, **SAMPLED}], ids=["greedy", "sampled"])
def test_json_object_outputs_are_objects(
    new_engine: Any, grammars: Grammars, sampling: dict[str, Any]
) -> None:
    steered = constrained("steered", "json_object", {"type": "object"}, **CLOSING_BIAS, **sampling)
    free = constrained("free", "json_object", {"type": "object"}, 60, **sampling)
    finished = run_schedule(new_engine(), {0: [steered, free]})
    assert finished["steered"].finish_reason == "stop"
    assert isinstance(json.loads(finished["steered"].text), dict)
    # Cut by its length, the free one is still where a JSON object may go on.
    result = finished["free"]
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
    else:
        matcher = grammars.matcher(free)
        assert all(matcher.accept(token_id) for token_id in result.token_ids)


def test_the_end_token_is_allowed_only_where_the_grammar_may_end(new_engine: Any) -> None:
    """<|endoftext|> is the model's stop token, not seven characters of text that
    a JSON string or a regex's dot would take: made the likeliest token, it must
    still wait for a complete output."""
    eos = {"logit_bias_token_ids": [50256], "logit_bias_values": [100.0]}
    requests = [
        constrained("object", "json_object", {"type": "object"}, 40, **eos),
        constrained("string", "json_schema", {"type": "string", "minLength": 3}, 40, **eos),
        constrained("dots", "regex", r".{5,9}", 40, **eos),
    ]
    finished = run_schedule(new_engine(), {0: requests})
    for name, result in finished.items():
        assert "<|endoftext|>" not in result.text, (name, result.text)
        if result.finish_reason == "stop" and name != "dots":
            json.loads(result.text)
    assert re.fullmatch(r".{5,9}", finished["dots"].text, re.DOTALL), finished["dots"].text


@pytest.mark.parametrize("sampling", [{}, {"seed": 11, **SAMPLED}], ids=["greedy", "sampled"])
def test_regex_choice_and_grammar_outputs_match(new_engine: Any, sampling: dict[str, Any]) -> None:
    checks = {
        "regex": ("regex", r"[A-Z][a-z]{2,6} [0-9]{1,3}", None),
        "choice": ("choice", json.dumps(["yes", "no", "maybe not"]), None),
        "lark": ("grammar", 'start: "(" item ("," item){0,3} ")"\nitem: /[a-z]{1,4}/', None),
        "gbnf": ("grammar", 'root ::= "x=" [0-9] [0-9]? ";"', None),
    }
    patterns = {
        "regex": r"[A-Z][a-z]{2,6} [0-9]{1,3}",
        "lark": r"\([a-z]{1,4}(,[a-z]{1,4}){0,3}\)",
        "gbnf": r"x=[0-9][0-9]?;",
    }
    requests = [
        constrained(name, kind, value, **sampling) for name, (kind, value, _) in checks.items()
    ]
    finished = run_schedule(new_engine(), {0: requests})
    for name, result in finished.items():
        assert result.finish_reason == "stop", (name, result.text)
        if name == "choice":
            assert result.text in ("yes", "no", "maybe not")
        else:
            assert re.fullmatch(patterns[name], result.text), (name, result.text)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(new_engine: Any) -> None:
    free = [
        GenerateRequest("free0", "The river ran", 24, ignore_eos=True),
        GenerateRequest("free1", "Stone and light", 24, ignore_eos=True, seed=5, **SAMPLED),
        GenerateRequest("free2", "Quiet morning", 24, ignore_eos=True, presence_penalty=0.5),
        GenerateRequest("free3", "Paper", 24, ignore_eos=True, seed=9, **SAMPLED),
    ]
    alone = run_schedule(new_engine(), {0: free})
    neighbours = [
        constrained(f"c{i}", "json_schema", schema, seed=i, **SAMPLED)
        for i, schema in enumerate([SCHEMAS["order"], SCHEMAS["nested"], SCHEMAS["flat"]])
    ]
    mixed = [free[0], neighbours[0], free[1], neighbours[1], free[2], neighbours[2], free[3]]
    beside = run_schedule(new_engine(), {0: mixed})
    for request in free:
        assert beside[request.request_id].token_ids == alone[request.request_id].token_ids
    for request in neighbours:
        assert beside[request.request_id].finish_reason == "stop"


def test_a_batch_without_a_constrained_row_computes_no_mask(
    new_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("a mask was applied to a batch without a grammar")

    monkeypatch.setattr(torch_engine, "apply_token_masks", refuse)
    finished = run_schedule(new_engine(), {0: [GenerateRequest("free", "hi", 8)]})
    assert len(finished["free"].token_ids) == 8


def test_logprobs_stay_those_of_the_raw_logits(new_engine: Any) -> None:
    prompt = GenerateRequest("free", PROMPT, 1, logprobs=3)
    (free,) = run_schedule(new_engine(), {0: [prompt]}).values()
    json_request = constrained("json", "json_schema", SCHEMAS["flat"], 2, logprobs=3)
    (result,) = run_schedule(new_engine(), {0: [json_request]}).values()
    assert free.logprobs is not None and result.logprobs is not None
    # The model's own likeliest first tokens, though the grammar forced '{"'.
    assert result.logprobs.top_token_ids[:3] == free.logprobs.top_token_ids[:3]
    assert result.text.startswith("{")


def test_penalties_logit_bias_and_min_tokens_compose_with_the_grammar(new_engine: Any) -> None:
    brace = 90  # '{': banned as hard as logit_bias bans, still the only way to start
    schema = SCHEMAS["nested"]
    shaped = [
        constrained(
            "biased",
            "json_schema",
            schema,
            logit_bias_token_ids=[brace],
            logit_bias_values=[-100.0],
        ),
        constrained(
            "penalised",
            "json_schema",
            schema,
            repetition_penalty=1.5,
            presence_penalty=1.0,
            frequency_penalty=1.0,
            seed=2,
            **SAMPLED,
        ),
        constrained("early", "choice", json.dumps(["done"]), min_tokens=10),
    ]
    finished = run_schedule(new_engine(), {0: shaped})
    for name in ("biased", "penalised"):
        assert finished[name].finish_reason == "stop"
        jsonschema.validate(json.loads(finished[name].text), schema)
    # The grammar's end ends the output before min_tokens: nothing else may follow.
    assert (finished["early"].text, finished["early"].finish_reason) == ("done", "stop")


@pytest.mark.parametrize("penalty", [1e-31, 1e-300])
def test_a_tiny_repetition_penalty_cannot_lift_a_banned_token_over_the_grammar(
    new_engine: Any, penalty: float
) -> None:
    """Dividing by 1e-31 lifts a repeated token past the mask's 1e30 (1e-300 is 0
    in float32: to infinity): the output left the grammar, a 422 that blamed the
    schema."""
    schema = SCHEMAS["flat"]
    shaped = [
        constrained(f"{name}", "json_schema", schema, repetition_penalty=penalty, **sampling)
        for name, sampling in (("greedy", {}), ("sampled", {"seed": 5, **SAMPLED}))
    ]
    finished = run_schedule(new_engine(), {0: shaped})
    for name in ("greedy", "sampled"):
        assert finished[name].finish_reason == "stop", finished[name]
        jsonschema.validate(json.loads(finished[name].text), schema)


def test_a_stop_within_min_tokens_stays_text_where_the_grammar_ends(new_engine: Any) -> None:
    """The grammar's last token is a stop token, or ends a stop string, within
    min_tokens: it stays in the text, as it does without a grammar; only the
    grammar's end token is never text."""
    ab = 397  # "ab", one token of GPT-2's
    choice = json.dumps(["ab"])
    shaped = [
        constrained("stop id", "choice", choice, min_tokens=1, stop_token_ids=[ab]),
        constrained("stop string", "choice", choice, min_tokens=1, stop=["ab"]),
        constrained("past min_tokens", "choice", choice, stop=["ab"]),
    ]
    finished = run_schedule(new_engine(), {0: shaped})
    answers = {name: (result.text, result.finish_reason) for name, result in finished.items()}
    assert answers == {
        "stop id": ("ab", "stop"),
        "stop string": ("ab", "stop"),
        "past min_tokens": ("", "stop"),
    }


@pytest.mark.parametrize("sampling", [{}, {"seed": 21, **SAMPLED}], ids=["greedy", "sampled"])
def test_a_resumed_constrained_stream_continues_as_the_uninterrupted_run(
    new_engine: Any, sampling: dict[str, Any]
) -> None:
    stream = constrained("r", "json_schema", SCHEMAS["flat"], stream=True, **sampling)
    result = assert_every_resume_is_exact(lambda: new_engine(1), stream)
    jsonschema.validate(json.loads(result.text), SCHEMAS["flat"])
    assert result.finish_reason == "stop"


def test_a_grammar_too_costly_for_a_step_fails_its_request_alone(new_engine: Any) -> None:
    """Valid without a tokenizer; once its keys meet the vocabulary, one step
    needs more than llguidance's row limit: the request ends with an error that
    names its field, and its neighbour goes on."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    engine = new_engine()
    engine.admit([constrained("costly", "json_schema", schema), GenerateRequest("n", "hi", 6)])
    failed, finished = run_to_the_end(engine)
    ((request_id, error),) = failed
    assert request_id == "costly"
    assert str(error).startswith(
        "response_format.json_schema.schema: the output could not follow the grammar"
    )
    assert "max is 2000" in str(error)
    assert [(seq.request_id, len(seq.token_ids)) for seq in finished] == [("n", 6)]


def test_a_regex_too_large_to_build_fails_saying_what_to_change(new_engine: Any) -> None:
    engine = new_engine()
    engine.admit([constrained("large", "regex", "a{1000000}")])
    failed, _ = run_to_the_end(engine)
    ((_, error),) = failed
    assert "too large to build" in str(error) and "smaller repeats" in str(error)


@pytest.mark.parametrize(
    "kind, value",
    [
        ("choice", json.dumps(["x<|endoftext|>"])),
        ("regex", r"ab<\|endoftext\|>c"),
        # The token itself, named, where the grammar cannot end: it was taken, and
        # the output ended at it as "stop", not a sentence of the grammar.
        ("grammar", 'start: "b" <|endoftext|> "a"'),
        ("grammar", 'start: <|endoftext|> "a"'),
    ],
)
def test_a_grammar_that_asks_for_the_end_tokens_text_fails_saying_so(
    new_engine: Any, kind: str, value: str
) -> None:
    """llguidance offers the end token where the grammar's text spells it, then
    refuses it: the request fails with a reason that says what to change."""
    engine = new_engine()
    engine.admit([constrained("spelled", kind, value), GenerateRequest("n", "hi", 6)])
    failed, finished = run_to_the_end(engine)
    ((request_id, error),) = failed
    assert request_id == "spelled"
    field = f"structured_outputs.{kind}"
    assert str(error) == (
        f"{field}: the grammar asks for '<|endoftext|>' where it cannot end, and this "
        "model's tokenizer keeps that for its end token, after which nothing follows; "
        "leave it out of the grammar"
    )
    assert [seq.request_id for seq in finished] == ["n"]


@pytest.mark.parametrize(
    ("grammar", "text"),
    [('start: "a" <|endoftext|>', "a"), ('start: "a" <[50256]>', "a"), ("start: <[50256]>", "")],
)
def test_a_grammar_that_ends_with_the_end_token_ends_the_output_there(
    new_engine: Any, grammar: str, text: str
) -> None:
    """The end token named as the grammar's last symbol was judged from before it
    was taken, where the grammar could not yet end: the request failed, saying
    that the grammar asked for it where it cannot end."""
    engine = new_engine()
    engine.admit([constrained("ends", "grammar", grammar)])
    failed, (finished,) = run_to_the_end(engine)
    assert failed == []
    assert (finished.text, finished.finish_reason) == (text, "stop")


@pytest.mark.parametrize(
    "grammar", ["start: x+\nx: x x | /[a-z]/", "start: start start | start start start | /[a-z]/"]
)
def test_an_ambiguous_grammar_fails_before_its_steps_grow_costly(
    new_engine: Any, grammar: str
) -> None:
    """Each token of an ambiguous rule adds parser items, whose cost grows faster
    than their number: with llguidance's default limit such a row ran ~150 tokens
    and took 2 s a step before it failed, every other row waiting on it. It now
    fails within a few tokens, and its neighbour goes on."""
    engine = new_engine()
    engine.admit([constrained("ambiguous", "grammar", grammar), GenerateRequest("n", "hi", 60)])
    failed, num_steps = [], 0
    while engine.num_active() and not failed:  # a grammar that ended would end the loop too
        failed += engine.step().failed
        num_steps += 1
    ((request_id, error),) = failed
    assert request_id == "ambiguous"
    assert "it is too costly to follow within this server's limits" in str(error), error
    assert "<non-verbose/>" not in str(error)
    assert num_steps <= 30
    assert [seq.request_id for seq in engine.active_sequences()] == ["n"]
