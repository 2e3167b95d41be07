"""Where a JSON Schema holds schemas, read as llguidance reads it: the walk that
the frontend's checks of a schema and both sides' checks of a grammar's shape
share, so that they never disagree on what is a keyword."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords that ask for a number, or a value, exactly: data, not schemas.
EXACT_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum", "const"}
)
# Keywords whose value is data, which llguidance does not follow.
DATA_KEYWORDS = frozenset({"default", "examples"})
# Keywords whose value maps names to subschemas: a property may be named "enum".
SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def subschemas(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Each object in ``schema`` that may be a schema, with where it is: not the
    values of enum, const, default and examples (data, not schemas), nor the maps
    of names to subschemas themselves (a property may be named
    "patternProperties"), but the subschemas they hold. Anything else is walked
    into, as a keyword llguidance may read. Raises RecursionError for a value
    nested past Python's recursion limit."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from subschemas(item, f"{path}[{i}]")
    elif isinstance(schema, dict):
        yield path, schema
        for key, item in schema.items():
            where = f"{path}.{key}"
            if key in EXACT_KEYWORDS or key in DATA_KEYWORDS:
                continue
            if key in SCHEMA_MAPS and isinstance(item, dict):
                for name, subschema in item.items():
                    yield from subschemas(subschema, f"{where}.{name}")
            else:
                yield from subschemas(item, where)
