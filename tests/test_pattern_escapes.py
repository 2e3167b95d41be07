"""A schema pattern whose character class holds every control character but
not both `"` and `\\` is refused (400 unsupported): llguidance lets any escape
through such a class, and wrote the very quote the pattern forbids."""

from __future__ import annotations

import asyncio
import json

import llguidance
import pytest

from frontend.errors import ApiError
from frontend.openai_schemas import ResponseFormat
from frontend.pattern_escapes import (
    MAX_CHARACTER_CLASSES,
    character_classes,
    escaped_pattern_problem,
)
from frontend.structured import JSON_OPTIONS, compile_grammar, request_grammar
from protocol import GrammarKind
from worker.engine.fake_engine import fake_grammar_tokenizer

# (pattern, a JSON string it forbids, whether llguidance follows it loosely)
CASES = [
    ('^[^"]$', '"\\""', True),  # the quote, written as an escape
    ("^[^\\\\]$", '"\\\\"', True),  # the backslash
    ("^[\\x00-\\x1f]$", '"\\\\"', True),
    ('^[^"\\\\]{1,3}$', '"\\""', True),
    ('^[^"\\x00-\\x1f]$', '"\\""', False),  # without the control characters
    ("^[\\x00-\\x1e]$", '"\\\\"', False),  # without one of them
    ('^[^\\n"]$', '"\\""', True),  # newline's absence aside
    ('^[^\\t"]$', '"\\""', False),  # without tab: followed exactly
    ('^[^\\d"]$', '"\\""', True),
    ("^[^a-z]$", '"a"', False),  # it holds " and \ both: no escape is wrong
    # Rust's syntax, as llguidance reads it: a ] first is a literal; nested classes;
    # set operations; POSIX and Unicode classes.
    ('^[^]"]$', '"\\""', True),
    ('^[[^"]]$', '"\\""', True),
    ('^[^"\\p{Lu}]$', '"\\""', True),
    ('^[\\W--"]$', '"\\""', True),
    ("^\\p{Cc}$", '"\\""', True),
    ("^[[:cntrl:]]$", '"\\""', True),
    ('^[^"[:cntrl:]]$', '"\\""', False),
    ("^[\\x00-\\x1f~~\\t]$", '"\\""', False),  # less tab: followed exactly
    # a [ that ends a range opens no class: the class ends at the next ]
    ('^(?:[^"\\\\!-[])$', '"\\""', True),
    # an escape is one item, whatever its length: z as \x7a ends the range A-z
    ('^[A-\\x7a-[^"]]$', '"\\""', True),
    ('^[A-\\u007a-[^"]]$', '"\\""', True),
    ('^[A-\\x{7a}-[^"]]$', '"\\""', True),
    ('^[A-\\U0000007a-[^"]]$', '"\\""', True),
    # Rust's leading dashes are literals, and so is a dash after a set operation
    ('^[--\\x00-[^"]]$', '"\\\\]"', True),  # \x00-[ holds no backslash
    ('^[--[^"]]$', '"\\""', True),
    ('^[~~-[^"]]$', '"\\""', True),
    ("^[]-[^\\\\]]$", '"\\\\"', True),  # a literal ] first starts no range
    ('^[[^"]&&-[^\\\\]]$', '"\\""', True),
]


def _accepts(pattern: str, json_text: str) -> bool:
    schema = json.dumps({"type": "string", "pattern": pattern})
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    tokenizer = fake_grammar_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    matcher.consume_tokens(tokenizer.tokenize_str(json_text))
    return matcher.is_accepting() and not matcher.is_error()


@pytest.mark.parametrize(("pattern", "forbidden", "is_loose"), CASES)
def test_llguidance_lets_any_escape_through_a_class_of_every_control_character(
    pattern: str, forbidden: str, is_loose: bool
) -> None:
    """Why such patterns are refused: should llguidance ever follow them
    exactly, this fails, and the refusal can go."""
    assert _accepts(pattern, forbidden) == is_loose


@pytest.mark.parametrize(("pattern", "forbidden", "is_loose"), CASES)
def test_a_pattern_followed_loosely_is_refused_and_any_other_compiles(
    pattern: str, forbidden: str, is_loose: bool
) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    grammar, problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)
    if not is_loose:
        assert problem is None and grammar
        return
    assert problem is not None and problem.startswith("Unimplemented: properties.s.pattern")
    assert "control characters" in problem and grammar == ""


def test_a_property_names_pattern_is_held_to_the_same_rule() -> None:
    schema = {"type": "object", "patternProperties": {'^[^"]+$': {"type": "integer"}}}
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)
    assert problem is not None and 'patternProperties has the character class [^"]' in problem


def test_the_refusal_is_a_400_that_says_what_to_write_instead() -> None:
    schema = {"type": "string", "pattern": '^[^"]{1,4}$'}
    response_format = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    with pytest.raises(ApiError) as refused:
        asyncio.run(request_grammar(response_format, None))
    assert refused.value.status == 400 and refused.value.code == "unsupported"
    assert '[^"\\x00-\\x1f]' in refused.value.message


def test_character_classes_are_read_as_llguidance_reads_them() -> None:
    assert list(character_classes(r"\[x[a\]b]c[^\\]")) == [r"[a\]b]", r"[^\\]"]
    assert list(character_classes(r"[^]a]b[[^c]d]")) == [r"[^]a]", r"[[^c]d]"]
    assert list(character_classes(r"([^!-[])x[a-z-[0-9]]")) == [r"[^!-[]", r"[a-z-[0-9]]"]
    assert list(character_classes(r"[^[:alpha:]x]\p{Lu}\pLz")) == [
        r"[^[:alpha:]x]",
        r"\p{Lu}",
        r"\pL",
    ]


def test_more_distinct_classes_than_the_limit_are_refused() -> None:
    patterns = {f"^[a-{chr(0x4E00 + i)}]$": {} for i in range(MAX_CHARACTER_CLASSES + 1)}
    schema = {"type": "object", "patternProperties": patterns}
    assert escaped_pattern_problem(schema) is not None


def test_a_lark_grammars_json_block_is_held_to_the_same_rule() -> None:
    grammar = 'start: %json {"type": "string", "pattern": "^[^\\"]{1,4}$"}'
    _, problem = compile_grammar(GrammarKind.GRAMMAR, grammar)
    assert problem is not None and 'the character class [^"]' in problem
    fine = 'start: %json {"type": "string", "pattern": "^[^\\"\\\\x00-\\\\x1f]{1,4}$"}'
    assert compile_grammar(GrammarKind.GRAMMAR, fine)[1] is None


def test_a_long_loose_class_is_quoted_cut() -> None:
    """A 30,000-character class was quoted whole, to the client and the log."""
    problem = escaped_pattern_problem({"type": "string", "pattern": '^[^"' + "a" * 30_000 + "]$"})
    assert problem is not None and 'has the character class [^"aaa' in problem
    assert len(problem) < 400, f"{len(problem):,} characters"
