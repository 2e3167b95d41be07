"""A JSON Schema's patterns, which are ECMAScript's, written as llguidance reads
regexes (Rust's syntax) where the two match different characters.

ECMAScript's ``.`` leaves out U+2028 and U+2029 as well as ``\\n`` and ``\\r``;
Rust's, only ``\\n``. ECMAScript's ``\\s`` holds U+FEFF and not U+0085; Rust's
(Unicode's White_Space), the other way round. Read as Rust's, ``^.{3}$`` wrote
strings of U+2029 and ``^\\s{2}$`` of U+0085, which a JSON Schema validator in
ECMAScript (ajv) refuses. Each is rewritten as the class ECMAScript means.
(``\\d`` and ``\\w``, ASCII in both, llguidance already reads so.)
"""

from __future__ import annotations

import copy
from typing import Any

from frontend.pattern_escapes import schema_patterns
from protocol.json_schema import subschemas

# ECMAScript's WhiteSpace and LineTerminator: Unicode's White_Space with U+FEFF
# and without U+0085, in Rust's class syntax (its -- takes a set away), short, as
# a grammar's size is bounded. Each is a class of its own, nested where it stands
# in one (as one end of a range it is left as sent, for Rust to refuse as
# ECMAScript does).
_ESCAPES = {"\\s": "[\\s\\x{FEFF}--\\x{85}]", "\\S": "[^\\s\\x{FEFF}--\\x{85}]"}
_ECMA_DOT = "[^\\n\\r\\x{2028}\\x{2029}]"


def as_rust(pattern: str) -> str:
    """``pattern`` with ``.``, ``\\s`` and ``\\S`` written as the classes
    ECMAScript means; the rest as it is. Classes are read as Rust reads them
    (a ``]`` first in a class is a literal, a ``[`` in one opens a nested class),
    as llguidance reads the rest of the pattern."""
    out: list[str] = []
    depth = 0  # of classes open here
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            token = pattern[i : i + 2]
            is_kept = depth and _is_range_end(pattern, i, i + 2)
            out.append(token if is_kept else _ESCAPES.get(token, token))
            i += 2
            continue
        char = pattern[i]
        if char == "[":
            depth += 1
            out.append(char)
            i += 1
            # A ] right after [ or [^ is a literal: copied with them.
            for lead in ("^", "]"):
                if pattern.startswith(lead, i):
                    out.append(lead)
                    i += 1
            continue
        if char == "]" and depth:
            depth -= 1
        elif char == "." and not depth:
            char = _ECMA_DOT
        out.append(char)
        i += 1
    return "".join(out)


def _is_range_end(pattern: str, start: int, end: int) -> bool:
    """Whether the class item at ``pattern[start:end]`` is one end of a range: a
    ``-`` before it (not the class's first item) or after it (not its last)."""
    is_after_dash = start >= 2 and pattern[start - 1] == "-" and pattern[start - 2] not in "[^\\"
    is_before_dash = pattern.startswith("-", end) and pattern[end + 1 : end + 2] not in ("]", "")
    return is_after_dash or is_before_dash


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
            subschema["patternProperties"] = {as_rust(key): value for key, value in keys.items()}
    return rewritten


def _may_change(pattern: str) -> bool:
    return "." in pattern or "\\s" in pattern or "\\S" in pattern
