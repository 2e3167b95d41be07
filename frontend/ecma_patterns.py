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

# ECMAScript's WhiteSpace and LineTerminator, in a class's Rust syntax.
_ECMA_SPACE = (
    "\\t\\n\\x0B\\x0C\\r \\xA0\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}\\x{FEFF}"
)
_ECMA_DOT = "[^\\n\\r\\x{2028}\\x{2029}]"
_OUTSIDE = {".": _ECMA_DOT, "\\s": f"[{_ECMA_SPACE}]", "\\S": f"[^{_ECMA_SPACE}]"}
# In a class: \S as a class nested in it, which Rust's syntax allows.
_INSIDE = {"\\s": _ECMA_SPACE, "\\S": f"[^{_ECMA_SPACE}]"}


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
            out.append((_INSIDE if depth else _OUTSIDE).get(token, token))
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
