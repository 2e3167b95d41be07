"""A JSON Schema's patterns, which are ECMAScript's, written as llguidance reads
regexes (Rust's syntax) where the two match different characters.

ECMAScript's ``.`` leaves out U+2028 and U+2029 as well as ``\\n`` and ``\\r``;
Rust's, only ``\\n``. ECMAScript's ``\\s`` holds U+FEFF and not U+0085; Rust's
(Unicode's White_Space), the other way round. Read as Rust's, ``^.{3}$`` wrote
strings of U+2029 and ``^\\s{2}$`` of U+0085, which a JSON Schema validator in
ECMAScript (ajv) refuses. Each is rewritten as the class ECMAScript means, and
ECMAScript's ``\\0`` and ``\\cJ``, which Rust's syntax lacks, as the character they
mean. (``\\d`` and ``\\w``, ASCII in both, llguidance already reads so.)
"""

from __future__ import annotations

import copy
from typing import Any

from frontend.pattern_escapes import ESCAPE, is_set_escape, past_opening, schema_patterns
from protocol.json_schema import subschemas

# ECMAScript's WhiteSpace and LineTerminator: Unicode's White_Space with U+FEFF
# and without U+0085, in Rust's class syntax (its -- takes a set away), short, as
# a grammar's size is bounded.
_ESCAPES = {"\\s": "[\\s\\x{FEFF}--\\x{85}]", "\\S": "[^\\s\\x{FEFF}--\\x{85}]"}
_ECMA_DOT = "[^\\n\\r\\u2028\\u2029]"


def as_rust(pattern: str) -> str:
    """``pattern`` with each ``.``, ``\\s`` and ``\\S`` written as the class
    ECMAScript means (in a class, as a class nested in it), the rest as it is.
    Classes are read as Rust reads them (`past_opening`: dashes, or a ``]``,
    first in one are literals; a ``[`` in one opens a nested class unless it
    ends a range). A ``\\s`` or ``\\S`` at either end of a range is left as
    sent, for Rust to refuse, as ECMAScript does (``[\\x00-\\s]``); spliced in,
    it would lend the range an end."""
    out: list[str] = []
    depth = 0  # of classes open here
    may_start_range = False  # in a class: its last item is one character
    ends_range = False  # in a class: a range's dash came last
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if (escape := ESCAPE.match(pattern, i)) is not None:
            token = _character_escape(escape.group(), pattern[escape.end() : escape.end() + 1])
            i = escape.end()
            if not depth:
                out.append(_ESCAPES.get(token, token))
                continue
            starts_range = pattern.startswith("-", i) and pattern[i + 1 : i + 2] not in ("]", "")
            is_kept = ends_range or starts_range
            out.append(token if is_kept else _ESCAPES.get(token, token))
            is_set = is_set_escape(token)
            may_start_range = not is_set and not ends_range
            ends_range = False
            continue
        i += 1
        if char == "[" and not ends_range:
            depth += 1
            # [, a ^, and the literals first in it (dashes, or a ]), copied as they are.
            opening = past_opening(pattern, i - 1)
            out.append(pattern[i - 1 : opening])
            i, may_start_range = opening, False  # those literals start no range
            continue
        if not depth:
            out.append(_ECMA_DOT if char == "." else char)
            continue
        out.append(char)
        if char == "]":
            depth -= 1
            may_start_range = ends_range = False
        elif char == "-" and may_start_range and pattern[i : i + 1] not in ("]", ""):
            may_start_range, ends_range = False, True
        else:
            may_start_range, ends_range = not ends_range, False
    return "".join(out)


def _character_escape(token: str, after: str) -> str:
    """ECMAScript's escapes for one character that Rust's syntax lacks, in Rust's:
    ``\\0`` (NUL, where no digit follows) and ``\\cJ`` (a control character);
    any other escape as it is."""
    if token == "\\0" and not after.isdigit():
        return "\\x00"
    if token.startswith("\\c") and len(token) == 3:
        return f"\\x{ord(token[2]) % 32:02X}"
    return token


def with_rust_patterns(schema: Any) -> Any:
    """``schema`` (unchanged) with each ``pattern`` and ``patternProperties`` key
    rewritten by `as_rust`; the schema itself where none changes."""
    if not any(_may_change(pattern) for *_, pattern in schema_patterns(schema)):
        return schema
    rewritten = copy.deepcopy(schema)
    for _, subschema in subschemas(rewritten):
        pattern = subschema.get("pattern")
        if isinstance(pattern, str):
            subschema["pattern"] = as_rust(pattern)
        keys = subschema.get("patternProperties")
        if isinstance(keys, dict):
            rewritten_keys = {as_rust(key): value for key, value in keys.items()}
            # Two keys written alike once rewritten (^a. and ^a[^\n\r\u2028\u2029])
            # would be one: the object's keys are left as sent.
            if len(rewritten_keys) == len(keys):
                subschema["patternProperties"] = rewritten_keys
    return rewritten


def _may_change(pattern: str) -> bool:
    return any(part in pattern for part in (".", "\\s", "\\S", "\\0", "\\c"))
