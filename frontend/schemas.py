"""Request bodies of the HTTP API, validated with pydantic.

JSON types are checked strictly (``"16"`` is not a number) and every error
names the field. Unknown fields are refused on the native endpoint, so that a
misspelt parameter is not silently ignored; the OpenAI endpoints ignore them
(`parse_body`'s ``ignore_unknown``), as vLLM does. Integer fields are bounded so
that every accepted value fits the wire encoding. The OpenAI bodies are in
`frontend.openai_schemas`.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from frontend.body import json_kind_of, read_json_object
from frontend.errors import ApiError
from protocol.limits import MAX_SEED, MAX_STOP_STRINGS, MAX_TOKEN_ID

MAX_REPORTED_ERRORS = 5
MAX_NAME_CHARS = 40  # of a field name quoted back: an unknown one may be any length

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# fail_fast: one error for a long list of bad ids, not one per id.
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
StopStrings = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None

Body = TypeVar("Body", bound=BaseModel)

STRICT = ConfigDict(extra="forbid", strict=True)


class GenerateBody(BaseModel):
    """POST /generate."""

    model_config = STRICT

    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="echoed back; made up if absent"
    )
    prompt: str = Field(min_length=1, description="the text to continue")
    max_new_tokens: int = Field(16, ge=1, description="1 to MAX_NEW_TOKENS_LIMIT (default 512)")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 keeps all")
    top_k: int = Field(0, ge=0, le=MAX_TOKEN_ID, description="0 keeps the whole vocabulary")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="reproducible sampling")
    stop: StopStrings = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; output is cut before them"
    )
    stop_token_ids: TokenIds = Field(default_factory=list)
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks)")
    stream: bool = Field(False, description="send server-sent events as tokens arrive")


# pydantic names the arm of a union it tried in an error's location: "list[str]".
_UNION_ARM = re.compile(r"(str|int|float|bool|(list|dict)\[.*\])$")


@dataclass(frozen=True)
class _Fault:
    """One of pydantic's errors, placed."""

    where: str  # the dotted path, union arms left out
    arm: str | None  # the union arm ("list[int]") the value was tried as, if any
    refuses_type: bool  # that arm refused the value's type, not a part of the value
    past_arm: tuple[tuple[int, int | str], ...]  # the path inside the arm, comparable
    item: dict[str, Any]


def describe(error: ValidationError, fields: Sequence[str] = ()) -> tuple[str, str | None]:
    """One readable sentence per field at fault, in JSON's words
    ('max_new_tokens: must be an integer, got a string'), the first
    MAX_REPORTED_ERRORS of them, and the first such field. For a union, a value
    of no arm's type is one sentence naming the accepted types, and one of an
    arm's type is told that arm's complaint alone (an array's bad item, say). An
    unknown top-level field is told the nearest of ``fields`` (the body's), or
    all of them."""
    by_field: dict[str, list[_Fault]] = {}
    for item in error.errors(include_url=False):
        loc = item["loc"]
        arm_at = next((i for i, part in enumerate(loc) if _is_arm(part)), len(loc))
        field = ".".join(_name(part) for part in loc[:arm_at]) or "body"
        where = ".".join(_name(part) for part in loc if not _is_arm(part)) or "body"
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
            sentences += [f"{f.where}: {_complaint(f.item, fields)}" for f in specific]
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


def _complaint(item: Any, fields: Sequence[str]) -> str:
    if item["type"] == "extra_forbidden" and len(item["loc"]) == 1 and fields:
        nearest = difflib.get_close_matches(str(item["loc"][0]), fields, n=1)
        if nearest:
            return f"not a field of this body; did you mean {nearest[0]}?"
        return f"not a field of this body, whose fields are {', '.join(fields)}"
    kind = _KIND_BY_ERROR_TYPE.get(item["type"])
    if kind is None:
        return str(item["msg"])
    return f"must be {kind}, got {json_kind_of(item['input'])}"


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


def _name(part: str | int) -> str:
    name = str(part)
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 3] + "..."


def check_num_fields(value: dict[str, Any], schema: type[BaseModel], where: str = "body") -> None:
    """Refuse an object with more fields than ``schema`` has, naming a few unknown
    ones. pydantic would write one error per unknown field, and a megabyte of
    them is a million errors; counting them here costs almost nothing."""
    fields = schema.model_fields
    if len(value) > len(fields):
        unknown = [key for key in value if key not in fields]
        named = ", ".join(repr(_name(key)) for key in unknown[:MAX_REPORTED_ERRORS])
        more = len(unknown) - MAX_REPORTED_ERRORS
        named += f" and {more:,} more" if more > 0 else ""
        raise ApiError(
            422,
            f"{where}: {len(unknown):,} unknown fields ({named}); "
            f"the fields are {', '.join(fields)}",
            "invalid_request",
            where if where != "body" else None,
        )
    for name, field in fields.items():
        nested = _model_in(field.annotation)
        if nested is not None and isinstance(value.get(name), dict):
            check_num_fields(value[name], nested, name)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (``StreamOptions | None``), if any."""
    for kind in (annotation, *typing.get_args(annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


async def parse_body(
    request: Request, schema: type[Body], ignore_unknown: bool = False
) -> tuple[Body, list[str]]:
    """The request's JSON body as ``schema``, and the unknown fields ignored (with
    ``ignore_unknown``; else they are refused), or an error: 422 naming the bad
    fields, or what `read_json_object` refuses (408, 413, 415)."""
    value = await read_json_object(request)
    ignored: list[str] = []
    if ignore_unknown:
        value = drop_unknown(value, schema, ignored)
    check_num_fields(value, schema)
    try:
        return schema.model_validate(value), ignored
    except ValidationError as exc:
        message, param = describe(exc, list(schema.model_fields))
        raise ApiError(422, message, "invalid_request", param) from None


def drop_unknown(
    value: dict[str, Any], schema: type[BaseModel], dropped: list[str], where: str = ""
) -> dict[str, Any]:
    """``value`` without the fields ``schema`` does not know (in nested objects
    too), whose dotted names are added to ``dropped``. One pass over the keys, so
    a body of a million unknown fields costs a million cheap lookups."""
    fields = schema.model_fields
    known: dict[str, Any] = {}
    for key, item in value.items():
        if key not in fields:
            dropped.append(where + key)
            continue
        nested = _model_in(fields[key].annotation)
        if nested is not None and isinstance(item, dict):
            item = drop_unknown(item, nested, dropped, f"{where}{key}.")
        known[key] = item
    return known


def name_fields(names: list[str]) -> str:
    """A few field names, shortened, and how many more: for messages and headers."""
    named = ", ".join(_name(name) for name in names[:MAX_REPORTED_ERRORS])
    more = len(names) - MAX_REPORTED_ERRORS
    return named + (f" and {more:,} more" if more > 0 else "")


def check_max_new_tokens(value: int, limit: int, param: str) -> None:
    if value > limit:
        raise ApiError(
            422,
            f"{param}: {value} is more than this server's limit, "
            f"MAX_NEW_TOKENS_LIMIT={limit}; ask for fewer",
            "invalid_request",
            param,
        )


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """One list of stop strings, or a 422 when one is empty."""
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in strings):
        raise ApiError(422, "stop: stop strings must not be empty", "invalid_request", "stop")
    return strings
