"""Structured outputs over HTTP: response_format and structured_outputs checked
by the frontend (each error names its field), and served by the fake engine,
which follows a grammar deterministically, through a worker's death too."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import llguidance
import openai
import pytest

from frontend.errors import ApiError
from frontend.openai_schemas import ResponseFormat
from frontend.parse import IGNORED_FIELDS_HEADER
from frontend.structured import NO_GRAMMAR, Grammar, compile_grammar, request_grammar
from protocol import GrammarKind
from protocol.limits import MAX_GRAMMAR_CHARS
from tests.sse import sse_events
from tests.stack import Stack, live_stack, openai_client, running_stack
from worker.engine.fake_engine import fake_grammar_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
MANY_PATTERNS = {
    "type": "object",
    "patternProperties": {f"^k{i}[a-z]*$": {"type": "string"} for i in range(520)},
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with live_stack(tmp_path_factory.mktemp("stack")) as stack:
        yield stack


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai_client(stack) as client:
        yield client


def _grammar(response_format: Any = None, structured_outputs: Any = None) -> Grammar:
    """What the frontend makes of the two fields, once the body's schema took them."""
    if response_format is not None:
        response_format = ResponseFormat.model_validate(response_format)
    return asyncio.run(request_grammar(response_format, structured_outputs))


def test_text_asks_for_no_grammar_and_each_kind_names_its_source() -> None:
    assert _grammar({"type": "text"}) == NO_GRAMMAR
    assert _grammar() == NO_GRAMMAR
    kinds = {
        "json_object": _grammar({"type": "json_object"}),
        "json_schema": _grammar(PERSON_FORMAT),
        "json": _grammar(structured_outputs={"json": json.dumps(PERSON)}),
        "regex": _grammar(structured_outputs={"regex": "[0-9]+"}),
        "choice": _grammar(structured_outputs={"choice": ["yes", "no"]}),
        "grammar": _grammar(structured_outputs={"grammar": 'root ::= "a" | "b"'}),  # GBNF
    }
    for kind, grammar in kinds.items():
        assert grammar.kind == kind
        assert 0 < len(grammar.text) <= MAX_GRAMMAR_CHARS


def test_vllm_options_at_the_values_honoured_here_are_accepted() -> None:
    """As a client that sends all of vLLM's defaults sends them."""
    defaults = {
        "json_object": None,
        "disable_fallback": False,
        "disable_any_whitespace": False,
        "disable_additional_properties": False,
        "whitespace_pattern": None,
        "structural_tag": None,
    }
    assert _grammar(structured_outputs={"choice": ["a"], **defaults}).kind == "choice"
    as_vllm = {**defaults, "json_object": True}  # vLLM's spelling of any JSON object
    assert _grammar(structured_outputs=as_vllm) == _grammar({"type": "json_object"})


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "minProperties": 1},  # one key written is one parsed
        # "a" once, and another at least once: two distinct keys however it repeats
        {"properties": {"a": {}}, "required": ["a"], "minProperties": 2},
        {"properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
        # a required key need not be listed to be written once
        {"properties": {"a": {}}, "required": ["a", "b"], "minProperties": 2},
        # what closes the object, or requires its keys, is in another schema
        {
            "allOf": [
                {"minProperties": 2},
                {"properties": {"a": {}, "b": {}}, "required": ["a", "b"]},
            ]
        },
        {"type": "object", "minProperties": 2, "anyOf": [{"required": ["a", "b"]}]},
        # anyOf requires a and b whatever oneOf adds
        {"minProperties": 3, "anyOf": [{"required": ["a", "b"]}], "oneOf": [{"required": ["c"]}]},
        {"type": "string", "minProperties": 2},  # no object to count
        {"minProperties": 2, "const": {"a": 1, "b": 2}},  # one value, written whole
    ],
)
def test_a_count_no_repeat_can_meet_falsely_is_followed(schema: dict[str, Any]) -> None:
    assert compile_grammar(GrammarKind.JSON_SCHEMA, schema)[1] is None


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        (
            {"allOf": [{"properties": {"x": {"type": "object", "minProperties": 3}}}]},
            "allOf[0].properties.x",
        ),
        ({"allOf": [{"minProperties": 3}, {"type": "object"}]}, "the schema"),
        ({"type": "object", "minProperties": 3, "anyOf": [{"type": "object"}]}, "the schema"),
    ],
)
def test_a_count_a_repeat_can_meet_is_refused_through_allof_and_anyof(
    schema: dict[str, Any], where: str
) -> None:
    """Nothing in these closes the object or requires its keys: llguidance takes
    {"k": 1, "k": 2, "k": 3} for each."""
    problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)[1]
    assert problem is not None and problem.startswith(f"Unimplemented: {where} asks for")


def test_default_and_examples_are_data_not_schemas() -> None:
    """llguidance follows neither: a number past 2^53 or an object shaped like a
    schema there asks nothing of the output."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "default": 10**30}},
        "examples": [{"minProperties": 5}],
    }
    assert compile_grammar(GrammarKind.JSON_SCHEMA, schema)[1] is None


@pytest.mark.parametrize(
    ("schema", "repeats"),
    [
        ({"type": "object", "additionalProperties": {"type": "integer"}}, True),
        ({"type": "object", "patternProperties": {"^k$": {"type": "integer"}}}, True),
        ({"type": "object", "properties": {"k": {"type": "integer"}}}, False),
    ],
)
def test_llguidance_lets_only_a_key_not_listed_in_properties_repeat(
    schema: dict[str, Any], repeats: bool
) -> None:
    """Why a minProperties beside keys not listed is refused: should llguidance
    ever keep those apart too, this fails, and the refusal can go."""
    grammar, problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)
    assert problem is None
    tokenizer = fake_grammar_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    matcher.consume_tokens(tokenizer.tokenize_str('{"k": 1, "k": 2}'))
    assert (matcher.is_accepting() and not matcher.is_error()) == repeats, matcher.get_error()


@pytest.mark.parametrize(
    ("response_format", "structured_outputs", "status", "param", "message"),
    [
        ({"type": "json"}, None, 422, "response_format.type", "must be one of"),
        ({"type": "structural_tag"}, None, 400, "response_format.type", "is not supported"),
        (
            {"type": "text", "json_schema": {"schema": PERSON}},
            None,
            422,
            "response_format.json_schema",
            "is for type json_schema, not text",
        ),
        ({"type": "json_schema"}, None, 422, "response_format.json_schema", "with a schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            None,
            422,
            "response_format.json_schema.schema",
            "response_format.json_schema.schema: Invalid type: strin; a type is one of string, "
            "number, integer, boolean, object, array, null",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "null"}}}},
            None,
            400,
            "response_format.json_schema.schema",
            'Unimplemented keys: ["not"]; this server cannot follow these keywords: leave them',
        ),
        (
            None,
            {"regex": "ab[z-a]"},
            422,
            "structured_outputs.regex",
            "structured_outputs.regex: invalid regex at offset 3: invalid character class range",
        ),
        # llguidance drops a lone backslash at its end, and followed /a/ for this one
        (
            None,
            {"regex": "a\\"},
            422,
            "structured_outputs.regex",
            "structured_outputs.regex: invalid regex at offset 1: incomplete escape sequence",
        ),
        (None, {"regex": "\\"}, 422, "structured_outputs.regex", "incomplete escape sequence"),
        # a key misspelt is named with the one it likely meant
        (None, {"regexp": "a"}, 400, "structured_outputs", "not supported; did you mean regex?"),
        (None, {"lark": "a"}, 400, "structured_outputs", "send one of json, regex, choice"),
        # llguidance followed -3 as 3; JSON Schema requires more than 0
        (
            None,
            {"json": {"type": "number", "multipleOf": -3}},
            422,
            "structured_outputs.json",
            "structured_outputs.json: multipleOf: must be greater than 0, got -3",
        ),
        # draft 4's boolean bound, which llguidance ignored
        (
            None,
            {"json": {"type": "number", "minimum": 0, "exclusiveMinimum": True}},
            400,
            "structured_outputs.json",
            "exclusiveMinimum is true, draft 4's form, which is not followed here",
        ),
        # llguidance wrote {"k": 6, "k": 1}: parsed, one property
        (
            None,
            {
                "json": {
                    "type": "object",
                    "patternProperties": {"^k$": {"type": "integer"}},
                    "additionalProperties": False,
                    "minProperties": 2,
                }
            },
            400,
            "structured_outputs.json",
            "the schema asks for at least 2 properties, with keys not listed in properties",
        ),
        (
            None,
            {"json": {"properties": {"a": {"type": "object", "minProperties": 3}}}},
            400,
            "structured_outputs.json",
            "properties.a asks for at least 3 properties",
        ),
        (
            None,
            {"json": {"properties": {"a": {}}, "required": ["a"], "minProperties": 3}},
            400,
            "structured_outputs.json",
            "the schema asks for at least 3 properties",
        ),
        # valid JSON Schema that llguidance cannot follow: unsupported, not invalid
        (
            None,
            {"json": {"type": "string", "format": "idn-email"}},
            400,
            "structured_outputs.json",
            "Unknown format: idn-email",
        ),
        (
            None,
            {"json": {"type": "object", "properties": {"a": {}}, "maxProperties": 1}},
            400,
            "structured_outputs.json",
            "min/maxProperties only supported when",
        ),
        (  # branches llguidance cannot tell apart: not its advice of an option refused here
            None,
            {"json": {"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer"}]}},
            400,
            "structured_outputs.json",
            "structured_outputs.json: a oneOf is followed only where no value can match two "
            "of its branches, as llguidance tells: branches of different types, string "
            "consts or enums, or objects told apart by a property's string const (a tag); "
            "make them so, or use anyOf",
        ),
        (  # where it is, where llguidance says
            None,
            {
                "json": {
                    "$defs": {"n": {"oneOf": [{"type": "integer", "maximum": 5}, {"const": 9}]}},
                    "properties": {"a": {"$ref": "#/$defs/n"}},
                }
            },
            400,
            "structured_outputs.json",
            "or use anyOf (at json-schema:///#/$defs/n)",
        ),
        # a valid construct llguidance does not follow: unsupported, said without
        # the rule it wraps a regex in; in a schema's pattern, naming the pattern
        (
            None,
            {"regex": r"\bfoo\b"},
            400,
            "structured_outputs.regex",
            "structured_outputs.regex: valid, but this server cannot follow it: \\b, a word "
            "boundary: no look-around or anchor inside it is followed",
        ),
        (  # ECMAScript's named backreference, which regex-syntax takes for a bad escape
            None,
            {"json": {"type": "string", "pattern": "(?<n>a)\\k<n>"}},
            400,
            "structured_outputs.json",
            "pattern (?<n>a)\\k<n>: valid, but this server cannot follow it: backreferences "
            "are not supported (at offset 7)",
        ),
        (  # not one unclosed: an invalid regex
            None,
            {"json": {"type": "string", "pattern": "(?<n>a)\\k<n"}},
            422,
            "structured_outputs.json",
            "pattern (?<n>a)\\k<n: invalid regex at offset 7: unrecognized escape sequence",
        ),
        (  # ECMAScript's backspace, [\b], which regex-syntax takes for a bad escape
            None,
            {"json": {"type": "string", "pattern": "^[\\b]$"}},
            400,
            "structured_outputs.json",
            "pattern ^[\\b]$: valid, but this server cannot follow it: \\b in a character "
            "class, ECMAScript's backspace (at offset 2): write \\x08",
        ),
        (  # and as a range's boundary
            None,
            {"json": {"type": "string", "pattern": "^[\\b-\\x10]$"}},
            400,
            "structured_outputs.json",
            "ECMAScript's backspace (at offset 2): write \\x08",
        ),
        (  # an anchor, named as written
            None,
            {"regex": "a^b"},
            400,
            "structured_outputs.regex",
            "cannot follow it: ^ where it does not begin the regex",
        ),
        (
            None,
            {"regex": "a(?m)$"},
            400,
            "structured_outputs.regex",
            "cannot follow it: $ in multi-line mode, (?m)",
        ),
        (
            None,
            {"regex": r"(a)\1"},
            400,
            "structured_outputs.regex",
            "cannot follow it: backreferences are not supported (at offset 3)",
        ),
        (
            None,
            {"json": {"type": "string", "pattern": "^(?!x)a$"}},
            400,
            "structured_outputs.json",
            "structured_outputs.json: pattern ^(?!x)a$: valid, but this server cannot follow "
            "it: look-around, including look-ahead and look-behind, is not supported",
        ),
        (  # offsets and the pattern as written, though llguidance quotes a / as \/
            None,
            {"json": {"type": "string", "pattern": "a/b/c(?!x)"}},
            400,
            "structured_outputs.json",
            "structured_outputs.json: pattern a/b/c(?!x): valid, but this server cannot "
            "follow it: look-around, including look-ahead and look-behind, is not supported "
            "(at offset 5)",
        ),
        (
            None,
            {"regex": "a/b/c["},
            422,
            "structured_outputs.regex",
            "structured_outputs.regex: invalid regex at offset 5: unclosed character class",
        ),
        (  # a newline or tab llguidance quotes as two characters: one here
            None,
            {"regex": "\n\n\n("},
            422,
            "structured_outputs.regex",
            "structured_outputs.regex: invalid regex at offset 3: unclosed group",
        ),
        (
            None,
            {"json": {"type": "string", "pattern": "\t(?=a)"}},
            400,
            "structured_outputs.json",
            "pattern \\t(?=a): valid, but this server cannot follow it: look-around, "
            "including look-ahead and look-behind, is not supported (at offset 1)",
        ),
        (  # a Lark grammar's %json block, too
            None,
            {"grammar": 'start: %json {"type": "string", "pattern": "\\t(?=a)"}'},
            400,
            "structured_outputs.grammar",
            "pattern \\t(?=a): valid, but this server cannot follow it: look-around, "
            "including look-ahead and look-behind, is not supported (at offset 1)",
        ),
        (
            None,
            {"json": {"type": "object", "patternProperties": {"(": {}}}},
            422,
            "structured_outputs.json",
            "structured_outputs.json: pattern (: invalid regex at offset 0: unclosed group",
        ),
        (
            None,
            {"choice": ["a", ""]},
            422,
            "structured_outputs.choice",
            "structured_outputs.choice",
        ),
        (
            None,
            {"json": "{"},
            422,
            "structured_outputs.json",
            "structured_outputs.json: is not JSON",
        ),
        (None, {"json": "[]"}, 422, "structured_outputs.json", "must be a JSON Schema object"),
        (
            None,
            {"json": '{"items":' * 1000 + "{}" + "}" * 1000},
            422,
            "structured_outputs.json",
            "is not JSON: JSON nested too deeply",
        ),
        (None, {"grammar": "start: nowhere"}, 422, "structured_outputs.grammar", "unknown name"),
        (None, {"regex": "a", "choice": ["a"]}, 422, "structured_outputs", "exactly one"),
        (None, {}, 422, "structured_outputs", "exactly one of json, regex, choice, grammar"),
        (
            None,
            {"structural_tag": "x"},
            400,
            "structured_outputs.structural_tag",
            "only null is supported here",
        ),
        (None, {"guided_json": {}}, 400, "structured_outputs", '"guided_json" not supp'),
        ({"type": "json_object"}, {"regex": "a"}, 422, "structured_outputs", "not both"),
        (
            None,
            {"choice": ["a"], "whitespace_pattern": " *"},
            400,
            "structured_outputs.whitespace_pattern",
            "only null is supported here",
        ),
        (
            None,
            {"regex": "a", "disable_additional_properties": True},
            400,
            "structured_outputs.disable_additional_properties",
            "only false is supported here, got true",
        ),
        (
            None,
            {"regex": "a", "disable_fallback": 1},
            400,
            "structured_outputs.disable_fallback",
            "only false or true is supported here, got 1",
        ),
        (
            None,
            {"json": {"type": "number", "multipleOf": 1e-11}},
            422,
            "structured_outputs.json",
            "multipleOf: llguidance follows a multipleOf as an integer of at most 10 digits "
            "times a power of ten, and read one here as 9999999999999998",
        ),
        (
            None,
            {"json": {"type": "string", "maxLength": float("inf")}},  # 1e400, as JSON reads it
            422,
            "structured_outputs.json",
            "past a float's range",
        ),
        (None, {"json_object": True, "regex": "a"}, 422, "structured_outputs", "exactly one"),
        (None, {"json_object": True, "json": {}}, 422, "structured_outputs", "got 2"),
        (
            None,
            {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)},
            422,
            "structured_outputs.regex",
            f"at most {MAX_GRAMMAR_CHARS:,}",
        ),
    ],
)
def test_each_bad_grammar_is_refused_naming_its_field(
    response_format: Any, structured_outputs: Any, status: int, param: str, message: str
) -> None:
    with pytest.raises(ApiError) as caught:
        _grammar(response_format, structured_outputs)
    assert (caught.value.status, caught.value.param) == (status, param)
    assert caught.value.message.startswith(f"{param}: ") and message in caught.value.message


def test_a_choice_list_matches_exactly_its_strings_however_long_and_whatever_they_hold() -> None:
    """Past llguidance's 2,000 alternatives in a row, and every character that
    means something in a regex or a grammar taken for itself."""
    tricky = [chr(c) for c in range(1, 256)] + ["a b", "x|y", ".*", "\\d+", '"quoted"', "(ab)?"]
    choices = tricky + [f"o{i}" for i in range(2500)]
    grammar = _grammar(structured_outputs={"choice": choices}).text
    tokenizer = fake_grammar_tokenizer()  # one token per code point below 256

    def is_matched(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return matcher.consume_tokens([ord(c) for c in text]) and matcher.is_accepting()

    assert all(is_matched(choice) for choice in tricky + choices[-3:])
    assert not any(is_matched(text) for text in ["o2500", "o25000", "ab", "xy", "a  b", ""])


PAST_DOUBLES = 2**53 + 1  # the first integer a double cannot hold


def test_a_regex_fault_is_told_in_the_regex_terms_not_the_rule_it_was_wrapped_in() -> None:
    """llguidance wraps a regex in a Lark rule (`start: /.../`) and quotes that
    rule, with a caret line, which the client never wrote."""
    for regex, expected in [
        (
            r"\bfoo\b",
            "valid, but this server cannot follow it: \\b, a word boundary: no look-around "
            "or anchor inside it is followed",
        ),
        (
            "ab[z-a]",
            "invalid regex at offset 3: invalid character class range, "
            "the start must be <= the end",
        ),
    ]:
        _, problem = compile_grammar(GrammarKind.REGEX, regex)
        assert problem == expected


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        # Each wrote text that is no JSON, or JSON that the schema refuses, and said "stop".
        ({"key_separator": " = "}, 'x-guidance.key_separator must be a ":" with JSON whitespace'),
        ({"item_separator": "; "}, "x-guidance.item_separator must be a"),
        ({"whitespace_pattern": "[a-z]{0,3}"}, "x-guidance.whitespace_pattern is not followed"),
        ({"lenient": True}, "x-guidance.lenient is not followed here"),
        ({"coerce_one_of": True}, "x-guidance.coerce_one_of is not followed here"),
        ({"json_allowed_escapes": ""}, "x-guidance.json_allowed_escapes is not followed"),
    ],
)
def test_guidance_options_that_give_up_json_or_the_schema_are_refused(
    options: dict[str, Any], problem: str
) -> None:
    schema = {"type": "array", "uniqueItems": True, "x-guidance": options}
    for fields in (
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, None),
        (None, {"json": json.dumps(schema)}),
    ):
        with pytest.raises(ApiError) as caught:
            _grammar(*fields)
        assert (caught.value.status, caught.value.code) == (400, "unsupported")
        assert problem in caught.value.message, caught.value.message


def test_guidance_options_that_keep_json_are_followed() -> None:
    options = {"whitespace_flexible": True, "key_separator": " : ", "item_separator": ",\n"}
    defaults = {"lenient": False, "coerce_one_of": False, "whitespace_pattern": None}
    for given in (options, defaults):
        schema = {"type": "object", "x-guidance": given}
        assert _grammar(structured_outputs={"json": json.dumps(schema)}).kind == "json"


@pytest.mark.parametrize(
    ("option", "problem"),
    [
        ({"whitespace_flexible": "yes"}, 'whitespace_flexible: must be true or false, got "yes"'),
        ({"lenient": 0}, "lenient: must be true or false, got 0"),
        ({"whitespace_pattern": 5}, "whitespace_pattern: must be a string or null, got 5"),
    ],
)
def test_a_guidance_option_of_the_wrong_type_is_an_invalid_request(
    option: dict[str, object], problem: str
) -> None:
    schema = {"type": "object", "x-guidance": option}
    with pytest.raises(ApiError) as caught:
        _grammar(structured_outputs={"json": json.dumps(schema)})
    assert (caught.value.status, caught.value.code) == (422, "invalid_request")
    assert caught.value.message == f"structured_outputs.json: x-guidance.{problem}"


def test_a_lark_grammars_json_block_takes_the_same_guidance_options() -> None:
    """lenient let a %json block's uniqueItems through, ignored: [1, 1] was written."""
    block = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    with pytest.raises(ApiError) as caught:
        _grammar(structured_outputs={"grammar": f"start: %json {json.dumps(block)}"})
    assert caught.value.status == 400
    assert "x-guidance.lenient is not followed here" in caught.value.message


@pytest.mark.parametrize(
    ("pattern", "shown"),
    [
        ("^" + "a" * 30_000 + "[z-a]", "pattern ...aaa[z-a]: invalid regex at offset 30002"),
        ("^" + "a" * 30_000 + "\\", "pattern ...aaa\\: invalid regex at offset 30001"),
        ("^[z-a]" + "a" * 30_000, "pattern ^[z-a]aaa"),
        ("(?=a)" + "a" * 30_000, "pattern (?=a)aaa"),
    ],
)
def test_a_long_patterns_fault_is_quoted_around_the_fault_not_whole(
    pattern: str, shown: str
) -> None:
    """A 30,000-character pattern was quoted whole, to the client and to the log."""
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, {"type": "string", "pattern": pattern})
    assert problem is not None
    assert len(problem) < 300, f"{len(problem):,} characters"
    start, end = shown.split("aaa")
    assert problem.startswith(start) and end in problem, problem


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"enum": ["a", PAST_DOUBLES]}, "enum[1]"),
        ({"const": {"ids": [1, -PAST_DOUBLES]}}, "const.ids[1]"),
        ({"properties": {"n": {"type": "integer", "maximum": 10**19}}}, "properties.n.maximum"),
        ({"anyOf": [{"type": "integer", "exclusiveMinimum": PAST_DOUBLES}]}, "anyOf[0]."),
        ({"$defs": {"enum": {"multipleOf": PAST_DOUBLES}}}, "$defs.enum.multipleOf"),
        # 9007199254740993.0 is ...992.0 once parsed: a float that large is refused.
        ({"const": float(2**53)}, "const"),
        ({"maximum": 1e17}, "maximum"),
        # quoted short: a 400-digit bound is not echoed back whole
        ({"maximum": 10**400}, "maximum holds 1000000000000000000000000000000000000..."),
    ],
)
def test_an_integer_past_two_to_the_53_is_refused_not_followed_as_its_neighbour(
    schema: dict[str, Any], where: str
) -> None:
    """llguidance holds schema numbers as doubles: enum [2^53 + 1] allowed 2^53."""
    response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    # the schema as its JSON text too
    for fields in ((response_format, None), (None, {"json": json.dumps(schema)})):
        with pytest.raises(ApiError) as caught:
            _grammar(*fields)
        assert (caught.value.status, caught.value.code) == (400, "unsupported")
        assert where in caught.value.message and "2^53" in caught.value.message


def test_integers_up_to_two_to_the_53_and_large_defaults_are_followed_exactly() -> None:
    limit = 2**53
    schema = {
        "type": "integer",
        "minimum": -limit,
        "maximum": limit,
        "default": PAST_DOUBLES,  # not asked for: an annotation
        "examples": [PAST_DOUBLES],
    }
    grammar = _grammar({"type": "json_schema", "json_schema": {"schema": schema}}).text
    tokenizer = fake_grammar_tokenizer()  # one token per code point below 256

    def is_matched(number: int) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return matcher.consume_tokens([ord(c) for c in str(number)]) and matcher.is_accepting()

    assert is_matched(limit) and is_matched(-limit) and is_matched(0)
    assert not is_matched(limit + 1) and not is_matched(-limit - 1)


def test_the_frontend_checks_grammars_without_torch_or_llguidance_torch() -> None:
    code = (
        "import asyncio, sys; from frontend.structured import request_grammar; "
        "from frontend.openai_schemas import ResponseFormat; "
        "asyncio.run(request_grammar(ResponseFormat(type='json_object'), None)); "
        "assert 'torch' not in sys.modules and 'llguidance.torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        (
            "response_format",
            {"type": "json_schema", "json_schema": {}},
            "response_format.json_schema.schema",
        ),
        ("response_format", {"type": "json_schema"}, "response_format.json_schema"),
        ("response_format", {"type": 1}, "response_format.type"),
        ("response_format", {}, "response_format.type"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"schema": PERSON, "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"schema": PERSON, "name": 5}},
            "response_format.json_schema.name",
        ),
        ("structured_outputs", {"regex": "("}, "structured_outputs.regex"),
        ("structured_outputs", {"json": "{"}, "structured_outputs.json"),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}, "structured_outputs"),
        # Checking 520 patternProperties took the frontend 98 s, then killed workers.
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"schema": MANY_PATTERNS}},
            "response_format.json_schema.schema",
        ),
        (
            "structured_outputs",
            {"grammar": f"start: %json {json.dumps(MANY_PATTERNS)}"},
            "structured_outputs.grammar",
        ),
    ],
)
def test_over_http_a_bad_grammar_names_its_field(
    stack: Stack, endpoint: str, field: str, value: Any, param: str
) -> None:
    body: dict[str, Any] = {"model": "fake", field: value, "max_tokens": 4}
    if endpoint == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = httpx.post(f"{stack.url}{endpoint}", json=body, timeout=10)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_a_misplaced_schema_is_named_as_ignored(stack: Stack) -> None:
    """json_object with a "schema" beside it: the schema is not followed, and the
    client is told so rather than left to find out from the output."""
    body = {
        "model": "fake",
        "prompt": "hi",
        "max_tokens": 4,
        "response_format": {"type": "json_object", "schema": PERSON},
    }
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == "response_format.schema"


def test_completions_follow_a_json_schema(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model="fake",
        prompt="a person:",
        max_tokens=100,
        extra_body={"response_format": PERSON_FORMAT},
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), PERSON)


def test_chat_follows_json_object_and_a_stream_is_the_same_answer(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "answer in JSON"}]
    reply = client.chat.completions.create(
        model="fake", messages=messages, response_format={"type": "json_object"}, max_tokens=50
    )
    content = reply.choices[0].message.content
    assert content is not None and isinstance(json.loads(content), dict)
    assert reply.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model="fake",
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=50,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == content


@pytest.mark.parametrize(
    ("structured_outputs", "check"),
    [
        ({"regex": "[0-9]{3}-[a-z]{2,4}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2,4}", text)),
        ({"choice": ["tea", "café", "milk"]}, lambda text: text in ("tea", "café", "milk")),
        ({"grammar": 'start: "(" /[xy]{1,3}/ ")"'}, lambda text: re.fullmatch(r"\([xy]+\)", text)),
        ({"json": {"type": "integer"}}, lambda text: isinstance(json.loads(text), int)),
    ],
)
def test_structured_outputs_are_followed(
    client: openai.OpenAI, structured_outputs: dict[str, Any], check: Any
) -> None:
    completion = client.completions.create(
        model="fake",
        prompt="go",
        max_tokens=40,
        extra_body={"structured_outputs": structured_outputs},
    )
    (choice,) = completion.choices
    assert check(choice.text), choice.text
    assert choice.finish_reason == "stop"


def test_a_constrained_stream_cut_by_a_worker_kill_continues_exactly(tmp_path: Path) -> None:
    schema = {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 6}
    body = {
        "model": "fake",
        "prompt": "a constrained stream that outlives its worker",
        "max_tokens": 200,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }

    def stream(stack: Stack, kill_after: int | None) -> str:
        texts = []
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as reply:
            for _, data in sse_events(reply):
                if data == "[DONE]":
                    continue
                texts.append(json.loads(data)["choices"][0]["text"])
                if len(texts) == kill_after:
                    stack.signal_worker(signal.SIGKILL)
        return "".join(texts)

    with running_stack(tmp_path, {"FAKE_STEP_DELAY_S": "0.03"}) as stack:
        stack.wait_live()
        uninterrupted = stream(stack, None)
        resumed = stream(stack, kill_after=12)
        assert "replaying 1 request(s)" in stack.log("supervisor")
    jsonschema.validate(json.loads(uninterrupted), schema)
    assert resumed == uninterrupted
