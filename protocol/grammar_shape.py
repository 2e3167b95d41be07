"""What a grammar's shape costs llguidance beyond what its limits bound.

llguidance's fuel and item limits (`protocol.limits.GRAMMAR_LIMITS`) bound its
lexer and parser, but not its JSON Schema compiler's check that an object's
patternProperties regexes are pairwise disjoint, whose time grows with about the
fourth power of their number: 150 took 0.5 s and 200 took 2.2 s on a Xeon
(family 6 model 167), and 520 (19 KB) 98 s there under load, on the frontend's
check thread and again on the worker's compile thread, where its queued request
stalled the worker until it was killed as hung. Both sides refuse such a grammar first, by
reading the schemas it holds: a JSON Schema grammar's, and each `%json` block
of a Lark grammar, whether llguidance's JSON form carries it or it came alone.
What is counted is a schema's distinct patterns in all, not an object's: `allOf`
merges its objects' patternProperties into one before the check (eight objects
of 32 each, 5 KB, took 3 s; twelve took 17 s), and a merged object holds at most
the distinct patterns its schema wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from protocol.limits import MAX_PATTERN_PROPERTIES

_DECODER = json.JSONDecoder()
_INLINE_SCHEMA = re.compile(r"%json\s*")  # Lark's inline JSON Schema: %json { ... }


def grammar_shape_problem(grammar: str) -> str | None:
    """Why ``grammar`` (llguidance's JSON form, or a Lark grammar) would cost
    too much to compile, if it would; None otherwise. Cheap: one parse of at most
    MAX_GRAMMAR_CHARS characters."""
    try:
        for schema in _schemas(grammar):
            count = len(_pattern_properties(schema))
            if count > MAX_PATTERN_PROPERTIES:
                return (
                    f"its schema has {count:,} distinct patternProperties in all; at most "
                    f"{MAX_PATTERN_PROPERTIES} here (allOf merges objects' patterns, and "
                    "checking that each pair of regexes is disjoint grows much faster "
                    "than their number)"
                )
    except RecursionError:  # llguidance's JSON reader refuses past 128 levels anyway
        return "its JSON is nested too deeply"
    return None


def _schemas(grammar: str) -> Iterator[Any]:
    """Each JSON value in ``grammar`` that llguidance may read as a schema."""
    if grammar.lstrip().startswith("{"):  # llguidance's JSON form
        try:
            top = json.loads(grammar)
        except ValueError:
            return  # llguidance refuses it without compiling anything
        yield top  # json_schema entries sit in it
        for text in _strings(top):
            yield from _inline_schemas(text)
    else:
        yield from _inline_schemas(grammar)


def _inline_schemas(lark: str) -> Iterator[Any]:
    for found in _INLINE_SCHEMA.finditer(lark):
        try:
            yield _DECODER.raw_decode(lark, found.end())[0]
        except ValueError:
            continue  # not a schema llguidance would read either (or in a comment)


def _strings(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _pattern_properties(schema: Any) -> set[str]:
    """The patternProperties regexes of every object anywhere in ``schema``."""
    patterns: set[str] = set()
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found = item.get("patternProperties")
            if isinstance(found, dict):
                patterns.update(found)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return patterns
