"""A JSON Schema's patterns are followed as ECMAScript reads them: its ``.``,
``\\s`` and ``\\S`` match other characters than Rust's, which llguidance reads."""

from __future__ import annotations

import json

import llguidance
import pytest

from frontend.ecma_patterns import as_rust, with_rust_patterns
from frontend.structured import compile_grammar
from protocol import GrammarKind


class _ByteVocabulary:
    """A token per byte (1 to 255), and 0 for the end: any text, in UTF-8, as
    llguidance's `TokenizerWrapper` reads a vocabulary."""

    def __init__(self) -> None:
        self.eos_token_id = 0
        self.bos_token_id = None
        self.special_token_ids = [0]
        self.tokens = [b"\xff[EOS]", *(bytes([code]) for code in range(1, 256))]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def _accepts(schema: dict[str, object], text: str) -> bool:
    """Whether the grammar made from ``schema`` takes ``text``, JSON."""
    grammar, problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)
    assert problem is None, problem
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    matcher.consume_tokens(tokenizer.tokenize_str(text))
    return matcher.is_accepting() and not matcher.is_error()


@pytest.mark.parametrize(
    ("pattern", "value", "is_match"),
    [
        ("^.{3}$", "abc", True),
        ("^.{3}$", "a\u2028c", False),  # a line terminator to ECMAScript, not to Rust
        ("^.{3}$", "a\u2029c", False),
        ("^.{3}$", "a\rc", False),
        ("^\\s{2}$", " \ufeff", True),  # whitespace to ECMAScript alone
        ("^\\s{2}$", " \u0085", False),  # whitespace to Rust alone
        ("^\\S{2}$", "a\ufeff", False),
        ("^\\S{2}$", "a\u0085", True),
        ("^[\\s\\S]{2}$", "\u2028\u0085", True),  # ECMAScript's any character
        ("^[.]$", ".", True),  # a dot in a class is itself
        ("^[.]$", "a", False),
        ("^\\.$", "a", False),
        ("^[!-[].$", "!\u2028", False),  # a [ that ends a range opens no class
        ("^[!-[].$", "[a", True),
        ("^[a-z-\\s]$", "\ufeff", True),  # the dash after a range is itself
        ("^[a-z-\\s]$", "\u0085", False),
        ("^[a-z-\\s]$", "-", True),
        ("^[\\u0041-\\u005A-\\s]$", "\u0085", False),  # an escape read whole
        ("^[^a-z\\s]$", "\u0085", True),
        ("^a\\0$", "a\u0000", True),  # ECMAScript's NUL, not a backreference
        ("^\\cJ$", "\n", True),  # a control character
        ("^[\\cA-\\cZ]$", "\u0005", True),
    ],
)
def test_a_pattern_matches_what_ecmascript_matches(
    pattern: str, value: str, is_match: bool
) -> None:
    schema = {"type": "string", "pattern": pattern}
    assert _accepts(schema, json.dumps(value, ensure_ascii=False)) == is_match


def test_pattern_properties_keys_are_read_as_ecmascript_reads_them() -> None:
    schema = {
        "type": "object",
        "patternProperties": {"^k.$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 1,
    }
    for key, is_taken in (("ka", True), ("k\u2028", False)):
        text = json.dumps({key: 1}, ensure_ascii=False, separators=(", ", ": "))
        assert _accepts(schema, text) == is_taken, key


def test_escapes_classes_and_unchanged_schemas_are_left_as_they_are() -> None:
    assert (
        as_rust("\\\\s\\.[.]") == "\\\\s\\.[.]"
    )  # an escaped backslash, a dot escaped, in a class
    assert as_rust("[].]") == "[].]"  # ] first in a class is a literal, as Rust reads it
    schema = {"type": "string", "pattern": "^[a-z]+$"}
    assert with_rust_patterns(schema) is schema


def test_a_fault_is_placed_in_the_clients_own_pattern() -> None:
    """The pattern compiled is rewritten; the error names the one sent."""
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, {"type": "string", "pattern": ".\\s(a"})
    assert problem is not None
    assert problem.startswith("pattern .\\s(a: invalid regex at offset 3"), problem


@pytest.mark.parametrize("pattern", ["^[\\x00-\\s]$", "^[\\s-\\uFFFF]$"])
def test_a_range_with_a_class_escape_for_an_end_is_refused_as_sent(pattern: str) -> None:
    """Spliced into the class, the escape's first or last character became the
    range's end, and the pattern was followed with a meaning ECMAScript refuses."""
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, {"type": "string", "pattern": pattern})
    assert problem is not None and "invalid range boundary" in problem, problem


def test_a_pattern_whose_rewrite_would_be_too_long_is_followed_as_sent() -> None:
    """Each dot written out made a 1.5 KB schema's grammar 40 KB, refused for a
    size its client never sent: it is followed as Rust reads it, as before."""
    schema = {"type": "string", "pattern": "^" + "." * 1500 + "$"}
    grammar, problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)
    assert problem is None, problem
    assert "\\u2028" not in grammar


def test_a_schema_of_many_patterns_that_fit_before_the_rewrite_still_fits() -> None:
    """Each \\s written out in full made a 7 KB schema's grammar 45 KB, over the
    bound on grammars: refused for a size its client never sent."""
    pattern = "^\\S+(\\s\\S+)*$"
    properties = {f"p{i}": {"type": "string", "pattern": pattern} for i in range(120)}
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, {"properties": properties})
    assert problem is None, problem


def test_pattern_properties_keys_written_alike_once_rewritten_are_left_as_sent() -> None:
    """^a. and ^a[^\\n\\r\\u2028\\u2029] became one key, and one key's subschema was
    dropped: a schema refused before (its keys overlap) was followed."""
    keys = {"^a.$": {"type": "integer"}, "^a[^\\n\\r\\u2028\\u2029]$": {"type": "string"}}
    schema = {"type": "object", "patternProperties": keys, "additionalProperties": False}
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)
    assert problem is not None and "disjoint" in problem, problem


def test_a_schema_refused_as_rewritten_for_anything_but_its_size_is_refused() -> None:
    """Followed as sent whatever the fault, every pattern in it lost ECMAScript's
    meaning: keys of U+2028 were written where no key pattern takes them."""
    keys = {"^\\s*(..){1,4}$": {}, "^\\S{2,7}\\d.{3}.{3}": {}}
    schema = {"type": "object", "patternProperties": keys, "additionalProperties": False}
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, schema)
    assert problem is not None, "followed, with Rust's meaning"


def test_a_pattern_ending_in_a_lone_backslash_is_refused() -> None:
    """llguidance dropped the backslash: ^a\\ was followed as ^a."""
    _, problem = compile_grammar(GrammarKind.JSON_SCHEMA, {"pattern": "^a\\"})
    assert problem == "pattern ^a\\: invalid regex at offset 2: incomplete escape sequence"
