"""Body errors told in JSON's words: pydantic's validation errors as one sentence
per field at fault ("max_new_tokens: must be an integer, got a string"), and
the names a client sent quoted back cut short, since they may be any length."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from frontend.body import json_kind_of
from protocol.wire import shorten

MAX_REPORTED_ERRORS = 5
MAX_NAME_CHARS = 40  # of a field name quoted back: an unknown one may be any length

# pydantic names the arm of a union it tried in an error's location: "list[str]",
# or "constrained-str" for a string with a bound on its length.
_UNION_ARM = re.compile(r"(constrained-)?(str|int|float|bool|(list|dict)\[.*\])$")


# The field names of the object at a path of a body (its field names, list
# indexes and union arms left out; () for the body itself), to suggest from.
FieldsAt = Callable[[Sequence[str]], Sequence[str]]


@dataclass(frozen=True)
class _Fault:
    """One of pydantic's errors, placed."""

    where: str  # the dotted path, union arms left out
    arm: str | None  # the union arm ("list[int]") the value was tried as, if any
    refuses_type: bool  # that arm refused the value's type, not a part of the value
    past_arm: tuple[tuple[int, int | str], ...]  # the path inside the arm, comparable
    item: dict[str, Any]


def describe(error: ValidationError, fields_at: FieldsAt | None = None) -> tuple[str, str | None]:
    """One readable sentence per field at fault, in JSON's words
    ('max_new_tokens: must be an integer, got a string'), the first
    MAX_REPORTED_ERRORS of them, and the first such field. For a union, a value
    of no arm's type is one sentence naming the accepted types, and one of an
    arm's type is told that arm's complaint alone (an array's bad item, say). An
    unknown field is told the nearest of the fields ``fields_at`` gives for its
    object, or all of them."""
    fields_at = fields_at or (lambda path: ())
    by_field: dict[str, list[_Fault]] = {}
    for item in error.errors(include_url=False):
        loc = item["loc"]
        arm_at = next((i for i, part in enumerate(loc) if _is_arm(part)), len(loc))
        field = ".".join(short_name(part) for part in loc[:arm_at]) or "body"
        where = ".".join(short_name(part) for part in loc if not _is_arm(part)) or "body"
        arm = str(loc[arm_at]).replace("constrained-", "") if arm_at < len(loc) else None
        refuses_type = arm_at == len(loc) - 1 and item["type"].endswith("_type")
        past_arm = tuple((0, p) if isinstance(p, int) else (1, str(p)) for p in loc[arm_at + 1 :])
        by_field.setdefault(field, []).append(
            _Fault(where, arm, refuses_type, past_arm, dict(item))
        )
    sentences = []
    params = []
    for field, faults in by_field.items():
        specific = [fault for fault in faults if not fault.refuses_type]
        if specific:
            specific = _furthest_arm(specific)
            sentences += [f"{f.where}: {_complaint(f.item, fields_at)}" for f in specific]
            params.append(specific[0].where)
        else:
            kinds = [_json_kind(arm or "?") for arm in dict.fromkeys(f.arm for f in faults)]
            either = " or ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
            got = json_kind_of(faults[0].item["input"])
            sentences.append(f"{field}: must be {either}, got {got}")
            params.append(field)
    param = params[0] if params and params[0] != "body" else None
    num_unreported = len(sentences) - MAX_REPORTED_ERRORS
    if num_unreported > 0:
        sentences = [*sentences[:MAX_REPORTED_ERRORS], f"and {num_unreported} more"]
    if any(sentence.endswith(_NOT_A_FIELD) for sentence in sentences):
        # Once, however many unknown fields there are.
        sentences.append(f"this body's fields are {', '.join(fields_at(()))}")
    return "; ".join(sentences), param


def _furthest_arm(faults: list[_Fault]) -> list[_Fault]:
    """The faults of the one union arm the value got furthest through: for a
    prompt [1, 2.0], list[int]'s complaint about item 1, not list[str]'s about
    item 0. On a tie, the arm the union names first."""
    arms = list(dict.fromkeys(fault.arm for fault in faults))
    if len(arms) == 1:
        return faults
    furthest = max(arms, key=lambda arm: min(f.past_arm for f in faults if f.arm == arm))
    return [fault for fault in faults if fault.arm == furthest]


# What each of pydantic's type errors asks for, in JSON's words: "Input should be
# a valid dictionary or instance of ChatMessage" says nothing to a client.
_KIND_BY_ERROR_TYPE = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
# A union's arm as pydantic names it ("list[int]"), singular and plural.
_KIND_BY_ARM = {
    "str": ("a string", "strings"),
    "int": ("an integer", "integers"),
    "float": ("a number", "numbers"),
    "bool": ("true or false", "booleans"),
}


# Each of pydantic's range errors as a bound the client can aim at: its words
# ("List should have at most 4 items after validation, not 5") are its own.
_BOUND_BY_ERROR_TYPE = {
    "greater_than_equal": ("ge", "at least {}"),
    "greater_than": ("gt", "more than {}"),
    "less_than_equal": ("le", "at most {}"),
    "less_than": ("lt", "less than {}"),
    "too_long": ("max_length", "at most {} items"),
    "too_short": ("min_length", "at least {} items"),
    "string_too_long": ("max_length", "at most {} characters"),
    "string_too_short": ("min_length", "at least {} characters"),
}


_NOT_A_FIELD = "not a field of this body"


def _complaint(item: Any, fields_at: FieldsAt) -> str:
    if item["type"] == "extra_forbidden":
        return _not_a_field(item["loc"], fields_at)
    if item["type"] in _BOUND_BY_ERROR_TYPE:
        return _out_of_bounds(item)
    if item["type"] == "missing":
        return "required; send it"
    kind = _KIND_BY_ERROR_TYPE.get(item["type"])
    if kind is None:
        return str(item["msg"])
    value = item["input"]
    if item["type"] == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        # An integer is a number to JSON: this one is past what a float holds.
        return "must be a number, got an integer past a float's range (about 1.8e308)"
    if item["type"] == "int_type" and _is_huge_integral(value):
        # An integral number past 2**64 stays a float (`frontend.schemas._as_integers`):
        # it is an integer to JSON, past this field's bounds, whatever they are.
        shown = "a number past a float's range" if math.isinf(value) else f"{value:g}"
        return f"must be an integer within this field's bounds, got {shown}"
    return f"must be {kind}, got {json_kind_of(value)}"


def _not_a_field(loc: Sequence[int | str], fields_at: FieldsAt) -> str:
    """An unknown field, told the nearest field of its object, or, inside the
    body, all of them (the body's are named once, by `describe`)."""
    parent = [part for part in loc[:-1] if not _is_arm(part)]
    fields = fields_at([part for part in parent if isinstance(part, str)])
    where = ".".join(short_name(part) for part in parent)
    if nearest := nearest_name(str(loc[-1]), fields):
        return f"not a field of {where or 'this body'}; did you mean {nearest}?"
    if not parent and fields:
        return _NOT_A_FIELD
    if fields:
        return f"not a field of {where}, whose fields are {', '.join(fields)}"
    return f"not a field of {where or 'this body'}; leave it out"


def nearest_name(name: str, names: Sequence[str]) -> str | None:
    """The one of ``names`` that ``name`` likely meant, if one is close: closer
    than difflib's default, which offered presence_penalty for vLLM's
    length_penalty, another field, not a typo."""
    nearest = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    return nearest[0] if nearest else None


def _is_huge_integral(value: Any) -> bool:
    return isinstance(value, float) and (math.isinf(value) or value.is_integer())


def _out_of_bounds(item: Any) -> str:
    """'must be at most 2, got 2.5'; 'must have at most 4 items, got 5'."""
    key, bound = _BOUND_BY_ERROR_TYPE[item["type"]]
    limit = item["ctx"][key]
    value = item["input"]
    if limit == 1 and item["type"] in ("too_short", "string_too_short"):
        return "must not be empty"
    if item["type"] in ("too_long", "too_short"):
        bound = bound.replace("items", "item") if limit == 1 else bound
        return f"must have {bound.format(limit)}, got {item['ctx']['actual_length']}"
    if item["type"].startswith("string_"):
        return f"must be {bound.format(f'{limit:,}')}, got {len(value):,}"
    shown = f"{limit:g}" if isinstance(limit, float) else str(limit)
    if isinstance(value, float) and math.isinf(value):  # 1e400 as JSON parses it
        return f"must be {bound.format(shown)}, got a number past a float's range"
    return f"must be {bound.format(shown)}, got {short_name(value)}"


def _json_kind(arm: str, is_plural: bool = False) -> str:
    """ "list[list[int]]" as "an array of arrays of integers"."""
    if arm.startswith("list[") and arm.endswith("]"):
        items = _json_kind(arm[len("list[") : -1], is_plural=True)
        return f"arrays of {items}" if is_plural else f"an array of {items}"
    if arm.startswith("dict["):
        return "objects" if is_plural else "an object"
    singular, plural = _KIND_BY_ARM.get(arm, (arm, arm))
    return plural if is_plural else singular


def _is_arm(part: str | int) -> bool:
    return isinstance(part, str) and _UNION_ARM.fullmatch(part) is not None


def short_name(part: str | int, max_chars: int = MAX_NAME_CHARS) -> str:
    """A name the client sent (a field, a path part, a model), cut to ``max_chars``."""
    return shorten(str(part), max_chars)


def printable(text: str) -> str:
    """``text`` as printable ASCII, for a header or a log line: a client's newline
    would otherwise start a forged log line, and a NUL make the log binary. Spaces
    at either end are escaped too: a header value cannot begin or end with one (h11
    would refuse to send the response)."""
    escaped = text.encode("unicode_escape").decode("ascii")
    unled = escaped.lstrip(" ")
    body = unled.rstrip(" ")
    return "\\x20" * (len(escaped) - len(unled)) + body + "\\x20" * (len(unled) - len(body))
