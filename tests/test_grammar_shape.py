"""Grammars whose shape llguidance's limits do not bound are refused on both
sides before anything compiles them: an object's patternProperties, whose
pairwise disjointness check grows much faster than their number, wherever a
schema sits in the grammar."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from frontend.structured import JSON_OPTIONS
from protocol import ErrorCode, GenerateRequest, GrammarKind
from protocol.grammar_shape import grammar_shape_problem
from protocol.limits import MAX_PATTERN_PROPERTIES
from protocol.request_checks import RequestLimits, request_problem

LIMITS = RequestLimits(vocab_size=1000, context_window=64, max_token_chars=4)


def _patterned(count: int, first: int = 0) -> dict[str, Any]:
    """An object with ``count`` disjoint patternProperties: the costly shape."""
    patterns = {f"^k{i}[a-z]*$": {"type": "string"} for i in range(first, first + count)}
    return {"type": "object", "patternProperties": patterns}


def _as_json_schema(schema: dict[str, Any]) -> str:
    return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), JSON_OPTIONS))


def _as_lark(schema: dict[str, Any]) -> str:
    return f"start: %json {json.dumps(schema)}"


@pytest.mark.parametrize("wrap", [_as_json_schema, _as_lark])
def test_at_most_the_limit_of_patterned_properties_passes(wrap: Any) -> None:
    assert grammar_shape_problem(wrap(_patterned(MAX_PATTERN_PROPERTIES))) is None
    # One patterned definition used from several places, as it is written.
    reused = {
        "$defs": {"map": _patterned(MAX_PATTERN_PROPERTIES)},
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/map", "description": "a map"},
            "b": {"anyOf": [{"$ref": "#/$defs/map"}, {"type": "null"}]},
        },
    }
    assert grammar_shape_problem(wrap(reused)) is None
    # A top that is an anyOf, beside the options the frontend adds to every schema.
    top_any_of = {"anyOf": [_patterned(2), {"type": "null"}]}
    assert grammar_shape_problem(wrap(top_any_of)) is None
    # Intersections without patternProperties are not this check's concern.
    assert grammar_shape_problem(wrap({"allOf": [{"type": "object"}, {"required": []}]})) is None


def _merged(num_objects: int) -> dict[str, Any]:
    """allOf over objects of the limit's patterns each, distinct: llguidance merges
    them into one object, whose check costs as one of all their patterns."""
    limit = MAX_PATTERN_PROPERTIES
    return {"allOf": [_patterned(limit, first=limit * j) for j in range(num_objects)]}


@pytest.mark.parametrize(
    "grammar",
    [
        _as_json_schema(_patterned(MAX_PATTERN_PROPERTIES + 1)),
        # nested deep in another schema, under a property named like a keyword
        _as_json_schema({"properties": {"enum": {"items": [_patterned(520)]}}}),
        _as_lark(_patterned(520)),
        # Lark inside llguidance's JSON form, as grammar_from may give it
        json.dumps({"grammars": [{"lark_grammar": "start: %json  " + json.dumps(_patterned(40))}]}),
        # the keyword spelled with a JSON escape is the same key once read
        _as_lark(_patterned(40)).replace("patternProperties", "patternPropertie\\u0073"),
        # spread over objects that allOf merges, or alternatives
        _as_json_schema(_merged(2)),
        _as_lark({"anyOf": [_patterned(MAX_PATTERN_PROPERTIES)] * 4}),
    ],
    ids=["json-schema", "nested", "lark", "lark-in-json", "escaped-key", "all-of", "any-of"],
)
def test_too_many_patterned_properties_are_refused_wherever_the_schema_sits(grammar: str) -> None:
    problem = grammar_shape_problem(grammar)
    assert problem is not None
    assert "patternProperties" in problem and f"at most {MAX_PATTERN_PROPERTIES}" in problem


@pytest.mark.parametrize(
    "schema",
    [
        # allOf distributes over anyOf: 4^4 objects of 8 regexes each (17.7 s, 8 KB)
        {"allOf": [{"anyOf": [_patterned(2, first=2 * i) for i in range(4)]}] * 4},
        {"allOf": [_patterned(4), {"required": ["k0"]}]},
        # each alternative intersected with its siblings: checked once per alternative
        {**_patterned(8), "anyOf": [{"minProperties": i} for i in range(200)]},
        {**_patterned(8), "$ref": "#/$defs/x", "$defs": {"x": {"type": "object"}}},
        {"properties": {"m": {"anyOf": [_patterned(2)], "oneOf": [{"type": "object"}]}}},
    ],
    ids=["all-of-any-of", "all-of", "any-of-beside", "ref-beside", "any-of-beside-one-of"],
)
def test_patterned_properties_under_an_intersection_are_refused(schema: dict[str, Any]) -> None:
    """llguidance checks the regexes of every combination an intersection makes,
    so one small schema could cost minutes: refused whatever their number."""
    for grammar in (_as_json_schema(schema), _as_lark(schema)):
        problem = grammar_shape_problem(grammar)
        assert problem is not None and "intersects" in problem, grammar[:80]


@pytest.mark.parametrize(
    "schema",
    [
        # a property named as the keyword, beside an intersection
        {
            "type": "object",
            "properties": {"patternProperties": {"type": "string"}},
            "allOf": [{"required": ["patternProperties"]}],
        },
        # data that looks like the keyword: llguidance follows no default or example
        {"type": "object", "default": {"patternProperties": {f"k{i}": 1 for i in range(40)}}},
        {"examples": [_patterned(40)], "anyOf": [{"type": "object"}], "type": "object"},
        {"enum": [_patterned(40)]},
    ],
    ids=["property-named-so", "default", "examples", "enum"],
)
def test_what_only_looks_like_patterned_properties_passes(schema: dict[str, Any]) -> None:
    """The shape is read where llguidance reads schemas (`protocol.json_schema`),
    as the frontend's other checks read them: a valid schema was refused."""
    for grammar in (_as_json_schema(schema), _as_lark(schema)):
        assert grammar_shape_problem(grammar) is None, grammar[:80]


def test_json_nested_past_pythons_recursion_is_refused_not_raised() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    assert grammar_shape_problem(f"start: %json {deep}") == "its JSON is nested too deeply"
    deep_object = '{"a": ' * 50_000 + "1" + "}" * 50_000  # llguidance's JSON form
    assert grammar_shape_problem(deep_object) == "its JSON is nested too deeply"


def test_the_worker_refuses_such_a_grammar_before_queueing_it() -> None:
    """What reaches the worker's socket straight, past no frontend, is checked too."""
    request = GenerateRequest(
        request_id="r",
        prompt="hi",
        max_new_tokens=4,
        grammar_kind=GrammarKind.GRAMMAR,
        grammar=_as_lark(_patterned(520)),
    )
    problem = request_problem(request, LIMITS)
    assert problem is not None
    assert problem[0] == ErrorCode.INVALID_REQUEST
    assert problem[1].startswith("structured_outputs.grammar: its schema has 520 patternProperties")
