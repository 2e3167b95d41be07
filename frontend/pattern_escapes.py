"""JSON Schema patterns that llguidance follows loosely, refused rather than
followed wrongly.

A schema's `pattern` (and a `patternProperties` key) is a regex over a string's
characters, which llguidance turns into one over the string as JSON writes it,
escapes included. Where a character class holds the control characters (which
JSON must escape; newline aside) it lets any escape through, `\\"` and `\\\\`
too, even where the class leaves out `"` or `\\`: with llguidance 1.9.1,
`^[^"]{1,4}$` wrote `"<\\"al"`, a string holding the quote it forbids; so did
`[^]"]`, `[[^"]]` and `\\p{Cc}`. Each class of a pattern is put to llguidance
itself, in its own syntax: loose when, as a JSON string's pattern, it takes the
escaped `"` or `\\` that, as a regex, it does not take.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import llguidance

from protocol.json_schema import subschemas
from protocol.wire import shorten

# Distinct classes asked about a schema: each costs llguidance a few
# milliseconds, and a schema may hold thousands.
MAX_CHARACTER_CLASSES = 64
# Of a class quoted in a refusal: a 30,000-character one was quoted whole.
_SHOWN_CLASS_CHARS = 120
_QUOTE_AND_BACKSLASH = ('"', "\\")

# One escape, whole: a character written in hex (\x41, \u0041, \U00000041,
# \u{41}) or as a control (\cJ), a property's class (\p{L}), or a backslash and
# the one character after it (\pL, a one-letter property, is \p and L).
ESCAPE = re.compile(
    r"\\(?:[xuU]\{[^}]*\}|x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|c[A-Za-z]"
    r"|[pP]\{[^}]*\}|.)",
    re.S,
)
# Rust's set operations in a class: difference, intersection, symmetric difference.
_SET_OPERATORS = ("--", "&&", "~~")
_CLASS_ESCAPES = frozenset({"\\d", "\\D", "\\w", "\\W", "\\s", "\\S"})


def is_set_escape(escape: str) -> bool:
    """Whether ``escape`` (one `ESCAPE` matched, or the escape it was written as)
    stands for a set of characters, which no range may end in: ``\\d``, ``\\s``,
    ``\\p{L}``, and ``\\p`` of ``\\pL``."""
    return escape in _CLASS_ESCAPES or escape[1] in "pP"


def escaped_pattern_problem(schema: Any) -> str | None:
    """Why a pattern in ``schema`` would be followed loosely, if one would."""
    asked: set[str] = set()
    for where, keyword, pattern in schema_patterns(schema):
        for character_class in character_classes(pattern):
            asked.add(character_class)
            if len(asked) > MAX_CHARACTER_CLASSES:
                return (
                    f"Unimplemented: its patterns hold more than {MAX_CHARACTER_CLASSES} "
                    "distinct character classes, which this server checks one by one; "
                    "write fewer"
                )
            if _is_loose(character_class):
                at = f"{where}.{keyword}".lstrip(".")
                shown = shorten(character_class, _SHOWN_CLASS_CHARS)
                return (
                    f"Unimplemented: {at} has the character class {shown}, which "
                    'leaves out " or \\ but holds the control characters, and which the '
                    "grammar engine follows loosely (it lets any escape through); leave "
                    'the control characters out of it (as [^"\\x00-\\x1f] does), or let '
                    'it hold " and \\ too'
                )
    return None


def schema_patterns(schema: Any) -> Iterator[tuple[str, str, str]]:
    """Each regex in ``schema``: where, under which keyword, and the regex."""
    for where, subschema in subschemas(schema):
        pattern = subschema.get("pattern")
        if isinstance(pattern, str):
            yield where, "pattern", pattern
        keys = subschema.get("patternProperties")
        if isinstance(keys, dict):
            yield from ((where, "patternProperties", key) for key in keys)


def character_classes(pattern: str) -> Iterator[str]:
    """Each character class in ``pattern``, as written: a bracket expression,
    nested classes and all (Rust's syntax, which llguidance reads: a `]` first
    in it is one of its characters), and a Unicode class (`\\p{Cc}`, `\\PL`)."""
    i = 0
    while i < len(pattern):
        if pattern.startswith(("\\p", "\\P"), i):
            end = pattern.find("}", i) + 1 if pattern.startswith("{", i + 2) else i + 3
            end = end or len(pattern)
            yield pattern[i:end]
            i = end
        elif pattern[i] == "\\":
            i += 2
        elif pattern[i] == "[":
            end = _class_end(pattern, i)
            yield pattern[i:end]
            i = end
        else:
            i += 1


def _class_end(pattern: str, start: int) -> int:
    """Where the bracket expression that opens at ``start`` ends (past its `]`).
    A ``[`` in it opens a nested class, unless it ends a range (``[!-[]``, as Rust
    reads it: taken for a nested class, the class ran on past its end, and a
    loose one in it went unseen). An escape is one item: read as ``\\x`` and two
    characters, ``[A-\\x7a-[^"]]`` had its nested class taken for a range's end."""
    i, depth = past_opening(pattern, start), 1
    may_start_range = False  # a literal ] or - first in a class starts no range
    ends_range = False  # a range's dash came last
    while i < len(pattern) and depth:
        char = pattern[i]
        if char == "[" and pattern.startswith("[:", i) and ":]" in pattern[i + 2 :]:
            i = pattern.index(":]", i + 2) + 2  # [:cntrl:], a POSIX class
            may_start_range = ends_range = False
        elif char == "[" and not ends_range:
            i, depth = past_opening(pattern, i), depth + 1
            may_start_range = ends_range = False
        elif char == "]":
            i, depth = i + 1, depth - 1
            may_start_range = ends_range = False
        elif pattern.startswith(_SET_OPERATORS, i):
            # Rust's set operations: the next item starts an operand, a - there
            # is a literal (in [~~-[^"]], the nested class is an operand's).
            i, may_start_range, ends_range = i + 2, False, False
        elif char == "-" and may_start_range and pattern[i + 1 : i + 2] not in ("]", ""):
            i, may_start_range, ends_range = i + 1, False, True
        else:  # a character, or an escape read whole (\x7a, not \x then 7a)
            escape = ESCAPE.match(pattern, i) if char == "\\" else None
            i = escape.end() if escape else i + 1
            is_set = escape is not None and is_set_escape(escape.group())
            may_start_range, ends_range = not ends_range and not is_set, False
    return min(i, len(pattern))


def past_opening(pattern: str, start: int) -> int:
    """Past ``[``, a ``^`` after it, and the literals Rust reads first in a class,
    which start no range: any number of ``-`` (``[--\\x00-[^"]]`` holds the
    range ``\\x00-[``), else a ``]`` (``[]-[^\\\\]]`` holds ], - and a nested class)."""
    i = start + 1
    i += pattern.startswith("^", i)
    dashes = len(pattern) - i - len(pattern[i:].lstrip("-"))
    return i + dashes if dashes else i + pattern.startswith("]", i)


@functools.lru_cache(maxsize=4096)
def _is_loose(character_class: str) -> bool:
    """Whether, as a JSON string's pattern, ``character_class`` takes the escaped
    quote or backslash that it does not take as a regex."""
    string = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps({"type": "string", "pattern": f"^{character_class}$"})
    )
    regex = llguidance.LLMatcher.grammar_from_regex(character_class)
    return any(
        _accepts(string, json.dumps(char)) and not _accepts(regex, char)
        for char in _QUOTE_AND_BACKSLASH
    )


def _accepts(grammar: str, text: str) -> bool:
    tokenizer = _ascii_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    matcher.consume_tokens(tokenizer.tokenize_str(text))
    return matcher.is_accepting() and not matcher.is_error()


class _AsciiVocabulary:
    """A token per ASCII character (1 to 127), and 0 for the end, as llguidance's
    `TokenizerWrapper` reads a vocabulary: enough to spell the texts asked about."""

    def __init__(self) -> None:
        self.eos_token_id = 0
        self.bos_token_id = None
        self.special_token_ids = [0]
        self.tokens = [b"\xff[EOS]", *(bytes([code]) for code in range(1, 128))]

    def __call__(self, text: str | bytes) -> list[int]:
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        return [ord(c) for c in text if 0 < ord(c) < 128]


@functools.cache
def _ascii_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_AsciiVocabulary()))
