"""What a grammar's shape costs llguidance beyond what its limits bound.

llguidance's fuel and item limits (`protocol.limits.GRAMMAR_LIMITS`) bound its
lexer and parser, but not its JSON Schema compiler's check that an object's
patternProperties regexes are pairwise disjoint, whose time grows much faster
than their number, and with each regex's own: 150 took 0.5 s and 200 took
2.2 s on a Xeon (family 6 model 167), and 520 (19 KB) 98 s there under load, on
the frontend's check thread and again on the worker's compile thread, where its
queued request stalled the worker until it was killed as hung. And where a
schema intersects objects (`allOf`; `anyOf`, `oneOf` or `$ref` beside other
keywords), llguidance distributes the intersection and checks every
combination's patterns again: allOf over four anyOf of four objects of eight
hard regexes each (8 KB) took 17.7 s on a Zen 4, and patternProperties beside
an anyOf of eight empty schemas eight times one object's 0.11 s.

So both sides refuse, by reading the schemas a grammar holds (a JSON Schema
grammar's, and each `%json` block of a Lark grammar, whether llguidance's JSON
form carries it or it came alone), a schema with patternProperties that has
more than MAX_PATTERN_PROPERTIES regexes in all, or any such intersection:
then no object is checked but as written, and the pairs checked are at most
MAX_PATTERN_PROPERTIES squared (1,024 hard ones: 0.11 s on that Zen 4).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from protocol.json_schema import subschemas
from protocol.limits import MAX_PATTERN_PROPERTIES

_DECODER = json.JSONDecoder()
_INLINE_SCHEMA = re.compile(r"%json\s*")  # Lark's inline JSON Schema: %json { ... }


def grammar_shape_problem(grammar: str) -> str | None:
    """Why ``grammar`` (llguidance's JSON form, or a Lark grammar) would cost
    too much to compile, if it would; None otherwise. Cheap: one parse of at most
    MAX_GRAMMAR_CHARS characters."""
    try:
        for schema in grammar_schemas(grammar):
            problem = _pattern_properties_problem(schema)
            if problem is not None:
                return problem
    except RecursionError:  # llguidance's JSON reader refuses past 128 levels anyway
        return "its JSON is nested too deeply"
    return None


def grammar_schemas(grammar: str) -> Iterator[Any]:
    """Each JSON value in ``grammar`` (llguidance's JSON form, or a Lark grammar
    with `%json` blocks) that llguidance may read as a schema."""
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


# Keywords beside `anyOf`, `oneOf` or `$ref` that intersect nothing (x-guidance:
# llguidance's options, which the frontend adds to every schema's top).
_ANNOTATIONS = frozenset(
    {"title", "description", "$comment", "default", "examples", "$id", "$schema", "$defs"}
    | {"definitions", "deprecated", "readOnly", "writeOnly", "x-guidance"}
)
_BRANCHES = {"anyOf": list, "oneOf": list, "$ref": str}


def _pattern_properties_problem(schema: Any) -> str | None:
    num_patterns = 0
    intersection: str | None = None
    # The top of llguidance's JSON form is no schema, but walked as one it holds
    # its grammars' json_schema entries, which are.
    for _, subschema in subschemas(schema):
        patterns = subschema.get("patternProperties")
        if isinstance(patterns, dict):
            num_patterns += len(patterns)
        if intersection is None:
            intersection = _intersection(subschema)
    if num_patterns > MAX_PATTERN_PROPERTIES:
        return (
            f"its schema has {num_patterns:,} patternProperties regexes in all; at most "
            f"{MAX_PATTERN_PROPERTIES} here (checking that each pair of an object's "
            "regexes is disjoint grows much faster than their number)"
        )
    if num_patterns and intersection is not None:
        return (
            f"its schema has patternProperties and {intersection}, which llguidance "
            "intersects, checking the regexes of every combination again; write the "
            "patterned object on its own, outside allOf, and without anyOf, oneOf or $ref "
            "beside other keywords"
        )
    return None


def _intersection(item: dict[str, Any]) -> str | None:
    """The keyword that makes ``item`` an intersection of schemas, if one does."""
    if isinstance(item.get("allOf"), list):
        return "allOf"
    branches = [key for key, kind in _BRANCHES.items() if isinstance(item.get(key), kind)]
    if len(branches) > 1:
        return f"{branches[0]} beside {branches[1]}"
    if branches and any(key not in _ANNOTATIONS and key != branches[0] for key in item):
        return f"{branches[0]} beside other keywords"
    return None
