"""The native request body, and the field types and base every body shares,
validated with pydantic.

JSON types are checked strictly (``"16"`` is not a number) and every error
names the field (`frontend.field_errors` words them). Unknown fields are
refused on the native endpoint, so that a misspelt parameter is not silently
ignored; the OpenAI endpoints ignore them (`frontend.parse`), as vLLM does.
Integer fields are bounded so that every accepted value fits the wire
encoding. The OpenAI bodies are in `frontend.openai_schemas`.
"""

from __future__ import annotations

import functools
import secrets
import typing
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MIN_SEED,
    UNSEEDED,
)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# fail_fast: one error for a long list of bad ids, not one per id.
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
# The worker's limits, checked here too: a request past them is refused at once,
# not after waiting in this frontend for a free slot.
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = (
    StopString
    | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)]
    | None
)

# The sampling fields' bounds, for every body (each gives its own default).
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]


def request_seed(seed: int | None) -> int:
    """The seed a request samples with: the body's, or for none (absent, or
    UNSEEDED as vLLM reads -1) one drawn at random here, once. A stream resumed
    on another worker after a kill then draws what it would have drawn, as a
    seeded one does; a seed drawn by the worker changed with every attempt."""
    return secrets.randbits(63) if seed is None or seed == UNSEEDED else seed


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
    temperature: Temperature = Field(0.0, description="0 is greedy")
    top_p: TopP = Field(1.0, description="nucleus sampling; 1 keeps all")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0 keeps the whole vocabulary")
    min_p: MinP = Field(0.0, description="drop tokens less likely than min_p times the likeliest")
    seed: Seed | None = Field(None, description="reproducible sampling")
    stop: StopStrings = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; output is cut before them"
    )
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks)")
    stream: bool = Field(False, description="send server-sent events as tokens arrive")
    cache_salt: CacheSalt | None = None
