"""Request bodies of the HTTP API, validated with pydantic.

JSON types are checked strictly (``"16"`` is not a number) and every error
names the field (`frontend.field_errors` words them). Unknown fields are
refused on the native endpoint, so that a misspelt parameter is not silently
ignored; the OpenAI endpoints ignore them (`parse_body`'s ``ignore_unknown``),
as vLLM does. Integer fields are bounded so that every accepted value fits the
wire encoding. The OpenAI bodies are in `frontend.openai_schemas`.
"""

from __future__ import annotations

import asyncio
import functools
import typing
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request

from frontend.body import json_object, read_json_body
from frontend.errors import ApiError
from frontend.field_errors import MAX_REPORTED_ERRORS, describe, short_name
from protocol.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOP_K,
)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# fail_fast: one error for a long list of bad ids, not one per id.
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
# The worker's limits, checked here too: a request past them is refused at once,
# not after waiting in this frontend for a free slot.
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
StopStrings = (
    StopString
    | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)]
    | None
)

CacheSalt = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="requests share prefix-cache rows only with those of the same salt",
    ),
]

Body = TypeVar("Body", bound=BaseModel)

STRICT = ConfigDict(extra="forbid", strict=True)


def _holds_integers(annotation: Any) -> bool:
    """Whether a field's type is, or holds in a list, an integer: int, a token id,
    a list of them, or a union with one of these."""
    if annotation is int:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        return _holds_integers(args[0])
    return any(_holds_integers(arg) for arg in args)


@functools.cache
def _integer_fields(body: type[BaseModel]) -> frozenset[str]:
    return frozenset(
        name for name, field in body.model_fields.items() if _holds_integers(field.annotation)
    )


def _as_integers(value: Any) -> Any:
    """``value`` with each integral number in it (in lists too) an int, up to 2**64."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**64:
        return int(value)
    if isinstance(value, list):
        if set(map(type, value)) <= {int}:
            return value  # ids as sent, the usual case: no copy (a 1 MB prompt's ids)
        return [_as_integers(item) for item in value]
    return value


class RequestBody(BaseModel):
    """A request body. JSON has one number type: in an integer field, or a list of
    token ids, 16.0 is 16, as JSON Schema (and so /openapi.json) reads it, and as
    pydantic's lax mode and vLLM take it; 16.5, "16" and true are refused as
    ever. Past every integer field's bound (1e300) a number stays one, refused as
    out of bounds, not quoted back as 301 digits. (Converted here, not by a validator on
    the type: one wrapped around int loses its bounds in the schema and names
    union arms in pydantic's words.)"""

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers_as_integers(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        integers = _integer_fields(cls)
        return {
            name: _as_integers(item) if name in integers else item for name, item in value.items()
        }


class GenerateBody(RequestBody):
    """POST /generate."""

    model_config = STRICT

    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="echoed back; made up if absent"
    )
    prompt: str = Field(min_length=1, description="the text to continue")
    max_new_tokens: int = Field(16, ge=1, description="1 to MAX_NEW_TOKENS_LIMIT (512 unless set)")
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 keeps all")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0 keeps the whole vocabulary")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p times the likeliest"
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="reproducible sampling")
    stop: StopStrings = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; output is cut before them"
    )
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks)")
    stream: bool = Field(False, description="send server-sent events as tokens arrive")
    cache_salt: CacheSalt | None = None


def check_num_fields(value: dict[str, Any], schema: type[BaseModel], where: str = "body") -> None:
    """Refuse an object with more fields than ``schema`` has, naming a few unknown
    ones. pydantic would write one error per unknown field, and a megabyte of
    them is a million errors; counting them here costs almost nothing."""
    fields = wire_fields(schema)
    if len(value) > len(fields):
        unknown = [key for key in value if key not in fields]
        named = ", ".join(repr(short_name(key)) for key in unknown[:MAX_REPORTED_ERRORS])
        more = len(unknown) - MAX_REPORTED_ERRORS
        named += f" and {more:,} more" if more > 0 else ""
        raise ApiError(
            422,
            f"{where}: {len(unknown):,} unknown fields ({named}); "
            f"the fields are {', '.join(fields)}",
            "invalid_request",
            where if where != "body" else None,
        )
    for name, nested in wire_fields(schema).items():
        if nested is not None and name in value:
            path = name if where == "body" else f"{where}.{name}"
            for item_path, item in _objects_in(path, value[name]):
                check_num_fields(item, nested, item_path)


@functools.cache
def wire_fields(schema: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """``schema``'s fields by the names a body gives them (a field's alias: the
    JSON Schema "schema" is ``schema_``, away from pydantic's own attribute), each
    with the model it holds, alone or in a list, if any (``StreamOptions | None``,
    ``list[ChatMessage]``). Cached: a body is walked by these for every object in it."""
    return {
        field.alias or name: _model_in(field.annotation)
        for name, field in schema.model_fields.items()
    }


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for kind in typing.get_args(annotation):
        model = _model_in(kind)
        if model is not None:
            return model
    return None


def _objects_in(path: str, item: Any) -> list[tuple[str, dict[str, Any]]]:
    """The objects a field holds, each with its dotted path: the field's value
    if it is one, or those in the list it is (``messages.3``). Anything else is
    left to pydantic to refuse."""
    if isinstance(item, dict):
        return [(path, item)]
    if isinstance(item, list):
        return [(f"{path}.{i}", each) for i, each in enumerate(item) if isinstance(each, dict)]
    return []


# Bodies this large are parsed and validated one per turn of the event loop: a
# megabyte of token ids takes ~40 ms, and a burst of them woken in the same turn
# would hold up /health, every other request and the workers' heartbeats for
# seconds. A thread would not help: pydantic keeps the GIL, and the loop would
# then wait for it after every system call.
LARGE_BODY_BYTES = 64 * 1024


async def parse_body(
    request: Request, schema: type[Body], ignore_unknown: bool = False
) -> tuple[Body, list[str]]:
    """The request's JSON body as ``schema``, and the unknown fields ignored (with
    ``ignore_unknown``; else they are refused), or an error: 422 naming the bad
    fields, or what `read_json_body` refuses (408, 413, 415)."""
    body = await read_json_body(request)
    if len(body) < LARGE_BODY_BYTES:
        return decode_body(body, schema, ignore_unknown)
    turn: asyncio.Lock = request.app.state.large_body_turn
    async with turn:
        try:
            return decode_body(body, schema, ignore_unknown)
        finally:
            await asyncio.sleep(0)  # the next large body waits for the loop's next turn


def decode_body(
    body: bytes, schema: type[Body], ignore_unknown: bool = False
) -> tuple[Body, list[str]]:
    """`parse_body` once the bytes are in."""
    value = json_object(body)
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
    """``value`` without the fields ``schema`` does not know (in nested objects,
    alone or in lists, too), whose dotted names are added to ``dropped``. One pass
    over the keys, so a body of a million unknown fields costs a million cheap
    lookups."""
    fields = wire_fields(schema)
    known: dict[str, Any] = {}
    for key, item in value.items():
        if key not in fields:
            dropped.append(where + key)
            continue
        nested = fields[key]
        if nested is not None and isinstance(item, dict):
            item = drop_unknown(item, nested, dropped, f"{where}{key}.")
        elif nested is not None and isinstance(item, list):
            item = [
                drop_unknown(each, nested, dropped, f"{where}{key}.{i}.")
                if isinstance(each, dict)
                else each
                for i, each in enumerate(item)
            ]
        known[key] = item
    return known


def name_fields(names: list[str]) -> str:
    """A few field names, shortened, and how many more: for messages and headers."""
    named = ", ".join(short_name(name) for name in names[:MAX_REPORTED_ERRORS])
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
