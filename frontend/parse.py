"""A request's JSON body as its pydantic model, the same way for every endpoint:
unknown fields dropped and named (``ignore_unknown``, the OpenAI endpoints' way)
or refused, objects with more fields than their model counted before pydantic
writes an error per field, and large bodies validated one per turn of the event
loop. The bodies themselves are in `frontend.schemas` and
`frontend.openai_schemas`; reading the bytes is `frontend.body`'s."""

from __future__ import annotations

import asyncio
import functools
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from starlette.requests import Request

from frontend.body import json_object, read_json_body
from frontend.errors import ApiError
from frontend.field_errors import (
    MAX_REPORTED_ERRORS,
    describe,
    nearest_name,
    printable,
    short_name,
)

Body = TypeVar("Body", bound=BaseModel)

# Names the request fields that were ignored, so that a client can see a typo.
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"

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
        message, param = describe(exc, functools.partial(fields_in, schema))
        message += ignored_note(ignored, schema)
        headers = ignored_fields_headers(ignored)
        raise ApiError(422, message, "invalid_request", param, headers) from None


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
        if nested is not None and not nested.is_list and isinstance(item, dict):
            item = drop_unknown(item, nested.model, dropped, f"{where}{key}.")
        elif nested is not None and (listed := nested.listed(item)):
            item = list(item)
            for i, each in listed:
                item[i] = drop_unknown(each, nested.model, dropped, f"{where}{key}.{i}.")
        known[key] = item
    return known


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
    for name, nested in fields.items():
        if nested is None or name not in value:
            continue
        path = name if where == "body" else f"{where}.{name}"
        if not nested.is_list and isinstance(value[name], dict):
            check_num_fields(value[name], nested.model, path)
        for i, item in nested.listed(value[name]):
            check_num_fields(item, nested.model, f"{path}.{i}")


def fields_in(schema: type[BaseModel], path: Sequence[str]) -> list[str]:
    """The fields of the object at ``path`` (its fields' names, list indexes left
    out) in a body of ``schema``; none where no model holds that object."""
    model = schema
    for name in path:
        nested = wire_fields(model).get(name)
        if nested is None:
            return []
        model = nested.model
    return list(wire_fields(model))


@dataclass(frozen=True)
class Nested:
    """A field that holds a model: one object, or a list of them (of at most
    ``max_items``, if bounded)."""

    model: type[BaseModel]
    is_list: bool
    max_items: int | None

    def listed(self, item: Any) -> list[tuple[int, dict[str, Any]]]:
        """The objects in the field's value, with their indexes, where the field is
        a list of them and the value one within its bound. Anything else (an
        object for a list, a list past its bound) is left for pydantic to refuse
        as it is, unwalked: 32,000 messages, refused for their number, are not
        walked first."""
        if not (self.is_list and isinstance(item, list)):
            return []
        if self.max_items is not None and len(item) > self.max_items:
            return []
        return [(i, each) for i, each in enumerate(item) if isinstance(each, dict)]


@functools.cache
def wire_fields(schema: type[BaseModel]) -> dict[str, Nested | None]:
    """``schema``'s fields by the names a body gives them (a field's alias: the
    JSON Schema "schema" is ``schema_``, away from pydantic's own attribute), each
    with the model it holds, if any (``StreamOptions | None``,
    ``list[ChatMessage]``). Cached: a body is walked by these for every object in it."""
    return {field.alias or name: _nested(field) for name, field in schema.model_fields.items()}


def _nested(field: FieldInfo) -> Nested | None:
    found = _model_in(field.annotation)
    if found is None:
        return None
    model, is_list = found
    max_items = next((m.max_length for m in field.metadata if hasattr(m, "max_length")), None)
    return Nested(model, is_list, max_items)


def _model_in(annotation: Any, in_list: bool = False) -> tuple[type[BaseModel], bool] | None:
    """The model a field's type holds, and whether in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, in_list
    is_list = typing.get_origin(annotation) is list
    for kind in typing.get_args(annotation):
        found = _model_in(kind, in_list or is_list)
        if found is not None:
            return found
    return None


def name_fields(names: list[str], meant: Callable[[str], str | None] | None = None) -> str:
    """A few field names, shortened and printable, and how many more: for a log
    line, a header or a message, which gives each the field ``meant`` says it
    likely meant, if any. A name that holds a comma or a double quote is quoted,
    as in a CSV line, so that the list reads one way (`"a,b", c` is two names)."""
    named = []
    for name in names[:MAX_REPORTED_ERRORS]:
        shown = _listed(printable(short_name(name)))
        likely = meant(name) if meant else None
        named.append(f"{shown} (did you mean {likely}?)" if likely else shown)
    more = len(names) - MAX_REPORTED_ERRORS
    return ", ".join(named) + (f" and {more:,} more" if more > 0 else "")


def ignored_fields_headers(ignored: list[str]) -> dict[str, str]:
    """The response header that names the ignored fields, if any."""
    if not ignored:
        return {}
    return {IGNORED_FIELDS_HEADER: name_fields(ignored)}


def ignored_note(ignored: list[str], schema: type[BaseModel]) -> str:
    """For an error answered to a body whose unknown fields were ignored: those
    fields (a few), each with the field it likely meant, as a typo there may be
    the cause ('messages.0.contnet', and then no content); "" for none."""

    def meant(name: str) -> str | None:
        *parent, last = name.split(".")
        fields = fields_in(schema, [part for part in parent if not part.isdigit()])
        return nearest_name(last, fields)

    return f"; unknown fields ignored: {name_fields(ignored, meant)}" if ignored else ""


def _listed(name: str) -> str:
    # An empty name is "" too: bare, a list ending in it ends in a space, which
    # no header value may (h11 dropped the connection instead of answering).
    is_quoted = "," in name or '"' in name or not name
    return '"' + name.replace('"', '""') + '"' if is_quoted else name
