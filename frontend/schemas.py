"""Request bodies of the HTTP API, validated with pydantic.

JSON types are checked strictly (``"16"`` is not a number), unknown fields are
refused so that a misspelt parameter is not silently ignored, and every error
names the field. Integer fields are bounded so that every accepted value fits
the wire encoding.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from frontend.body import read_json_object
from frontend.errors import ApiError

MAX_STOP_STRINGS = 4
MAX_TOKEN_ID = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_REPORTED_ERRORS = 5
MAX_NAME_CHARS = 40  # of a field name quoted back: an unknown one may be any length

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# fail_fast: one error for a long list of bad ids, not one per id.
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
StopStrings = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None

Body = TypeVar("Body", bound=BaseModel)

_STRICT = ConfigDict(extra="forbid", strict=True)


class GenerateBody(BaseModel):
    """POST /generate."""

    model_config = _STRICT

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


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class CompletionBody(BaseModel):
    """POST /v1/completions, as OpenAI defines it; n, best_of, echo, logprobs,
    suffix and the penalties are accepted only at their neutral values."""

    model_config = _STRICT

    model: str = Field(min_length=1, description="the served model, as GET /v1/models names it")
    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(fail_fast=True)]
        | Annotated[list[TokenIds], Field(fail_fast=True)]
    ) = Field(description="text, or token ids; one prompt per request")
    max_tokens: int | None = Field(16, ge=1, description="1 to MAX_NEW_TOKENS_LIMIT")
    temperature: float | None = Field(1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKEN_ID, description="-1 or 0: off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStrings = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, description="only 1")
    best_of: int | None = Field(None, description="only 1")
    echo: bool | None = Field(False, description="only false")
    logprobs: int | None = Field(None, description="not supported: only null")
    suffix: str | None = Field(None, description="not supported: only null")
    presence_penalty: float | None = Field(0.0, description="only 0")
    frequency_penalty: float | None = Field(0.0, description="only 0")
    logit_bias: dict[str, Any] | None = Field(None, description="only empty")
    user: str | None = Field(None, description="accepted and ignored")

    def unsupported(self) -> tuple[str, str] | None:
        """The first parameter set to a value this server cannot honour, with why."""
        checks = [
            ("n", self.n in (None, 1), "only n=1 is supported; send one request per completion"),
            ("best_of", self.best_of in (None, 1), "only best_of=1 is supported"),
            ("echo", not self.echo, "echo is not supported"),
            ("logprobs", self.logprobs is None, "logprobs are not supported"),
            ("suffix", self.suffix is None, "suffix is not supported"),
            ("presence_penalty", not self.presence_penalty, "only presence_penalty=0"),
            ("frequency_penalty", not self.frequency_penalty, "only frequency_penalty=0"),
            ("logit_bias", not self.logit_bias, "logit_bias is not supported"),
        ]
        for param, is_ok, message in checks:
            if not is_ok:
                return param, f"{param}: {message}"
        return None


# pydantic names the arm of a union it tried in an error's location: "list[str]".
_UNION_ARM = re.compile(r"(str|int|float|bool|(list|dict)\[.*\])$")


def describe(error: ValidationError) -> tuple[str, str | None]:
    """One readable sentence per field at fault ('max_new_tokens: Input should be
    ...'), the first MAX_REPORTED_ERRORS of them, and the first such field. For a
    union, a value of the wrong type is one sentence naming the accepted types,
    and a value of the right type is described by its own arm's complaint alone."""
    by_field: dict[str, list[tuple[str, str | None, dict[str, Any]]]] = {}
    for item in error.errors(include_url=False):
        loc = item["loc"]
        arm_at = next((i for i, part in enumerate(loc) if _is_arm(part)), len(loc))
        field = ".".join(_name(part) for part in loc[:arm_at]) or "body"
        where = ".".join(_name(part) for part in loc if not _is_arm(part)) or "body"
        arm = str(loc[arm_at]).replace("constrained-", "") if arm_at < len(loc) else None
        by_field.setdefault(field, []).append((where, arm, dict(item)))
    sentences = []
    params = []
    for field, items in by_field.items():
        specific = [(w, i) for w, arm, i in items if arm is None or not i["type"].endswith("_type")]
        if specific:
            sentences += [f"{where}: {item['msg']}" for where, item in specific]
            params.append(specific[0][0])
        else:
            arms = " or ".join(dict.fromkeys(arm or "?" for _, arm, _ in items))
            got = type(items[0][2]["input"]).__name__
            sentences.append(f"{field}: must be {arms}, got {_JSON_TYPES.get(got, got)}")
            params.append(field)
    param = params[0] if params and params[0] != "body" else None
    num_unreported = len(sentences) - MAX_REPORTED_ERRORS
    if num_unreported > 0:
        sentences = [*sentences[:MAX_REPORTED_ERRORS], f"and {num_unreported} more"]
    return "; ".join(sentences), param


_JSON_TYPES = {"dict": "object", "list": "array", "str": "string", "NoneType": "null"}


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


async def parse_body(request: Request, schema: type[Body]) -> Body:
    """The request's JSON body as ``schema``, or an error: 422 naming the bad
    fields, or what `read_json_object` refuses (408, 413, 415)."""
    value = await read_json_object(request)
    check_num_fields(value, schema)
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        message, param = describe(exc)
        raise ApiError(422, message, "invalid_request", param) from None


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
