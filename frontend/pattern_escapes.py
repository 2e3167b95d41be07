"""JSON Schema patterns that llguidance follows loosely, refused rather than
followed wrongly.

A schema's `pattern` (and a `patternProperties` key) is a regex over a string's
characters, which llguidance turns into one over the string as JSON writes it,
escapes included. Where a character class holds every control character
(U+0000 to U+001F, which JSON must escape), newline aside, it lets any escape
through, `\\"` and `\\\\` too, even where the class leaves out `"` or `\\`: with
llguidance 1.9.1, `^[^"]{1,4}$` wrote `"<\\"al"`, a string holding the quote it
forbids (`[^\\n"]` too). Classes without another control character
(`[^"\\x00-\\x1f]`, `[^\\t"]`) are followed exactly, as are classes that hold
`"` and `\\` both (`[^a-z]`): `tests/test_pattern_escapes.py` asks llguidance.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from protocol.json_schema import subschemas

# The control characters whose presence in a class makes it loose (newline's
# does not count: `[^\\n"]` is as loose as `[^"]`).
_CONTROLS = [chr(code) for code in range(0x20) if chr(code) != "\n"]


def escaped_pattern_problem(schema: Any) -> str | None:
    """Why a pattern in ``schema`` would be followed loosely, if one would."""
    for where, subschema in subschemas(schema):
        patterns = [("pattern", subschema.get("pattern"))]
        keys = subschema.get("patternProperties")
        if isinstance(keys, dict):
            patterns += [("patternProperties", key) for key in keys]
        for keyword, pattern in patterns:
            if not isinstance(pattern, str):
                continue
            loose = next((c for c in character_classes(pattern) if _is_loose(c)), None)
            if loose is not None:
                at = f"{where}.{keyword}".lstrip(".")
                return (
                    f"Unimplemented: {at} has the character class {loose}, which holds the "
                    'control characters but not both " and \\, and which the grammar engine '
                    "follows loosely (it lets any escape through); leave the control "
                    f"characters out of it{_as_without_controls(loose)}, or let it hold "
                    '" and \\ too'
                )
    return None


def character_classes(pattern: str) -> Iterator[str]:
    """Each bracket expression in ``pattern`` (``[^"]``), as written."""
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
        elif pattern[i] == "[":
            j = i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            yield pattern[i : j + 1]
            i = j + 1
        else:
            i += 1


def _is_loose(character_class: str) -> bool:
    try:
        compiled = re.compile(character_class)
    except re.error:
        return False  # not Python's syntax: left to the grammar engine
    if not all(compiled.fullmatch(c) for c in _CONTROLS):
        return False
    return not (compiled.fullmatch('"') and compiled.fullmatch("\\"))


def _as_without_controls(character_class: str) -> str:
    """A negated class as it would be followed exactly, less the control
    characters, to show in parentheses; nothing for another class."""
    if character_class.startswith("[^"):
        return f" ({character_class[:-1]}\\x00-\\x1f])"
    return ""
