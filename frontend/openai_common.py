"""What the OpenAI endpoints share: reading a body the way vLLM does (unknown
fields ignored and named), the model check, the sampling fields of a request,
and usage."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from frontend.errors import NEVER_RAN, ApiError
from frontend.field_errors import short_name
from frontend.generation import generate_request
from frontend.openai_schemas import OpenAIBody
from frontend.parse import ignored_fields_headers, ignored_note, name_fields, parse_body
from frontend.schemas import request_seed
from frontend.structured import NO_GRAMMAR, Grammar, request_grammar
from frontend.worker_client import WorkerClient
from protocol import GenerateRequest, GenerateResult
from protocol.throttled import Throttled

log = logging.getLogger(__name__)
_IGNORED_FIELDS = Throttled(log, "requests with ignored fields")

MAX_MODEL_NAME_CHARS = 200  # of a model name quoted back: a hub id may be long

Body = TypeVar("Body", bound=OpenAIBody)
Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class OpenAIRequest(Generic[Body]):
    body: Body
    client: WorkerClient
    ignored: list[str]  # unknown fields, ignored
    grammar: Grammar = NO_GRAMMAR  # structured outputs, compiled

    @property
    def headers(self) -> dict[str, str]:
        return ignored_fields_headers(self.ignored)

    def log_ignored(self, request_id: str) -> None:
        log_ignored_fields(request_id, self.ignored)


def log_ignored_fields(request_id: str, ignored: list[str]) -> None:
    """A line for unknown fields ignored (the client also gets a header naming
    them): at most one a second, as a client may send them at will."""
    if ignored:
        _IGNORED_FIELDS.warn(
            f"request {request_id}: ignored {len(ignored)} unknown fields: {name_fields(ignored)}"
        )


async def read_openai_request(request: Request, schema: type[Body]) -> OpenAIRequest[Body]:
    """The body, checked: 422 for a bad field (and, with STRICT_REQUEST_FIELDS,
    an unknown one), 400 for a value this server cannot honour; its grammar, if
    it asks for structured output, checked too. The model is the endpoint's to
    check (`check_requested_model`), once it has checked the rest: that may wait
    for a worker's hello, which nothing else the body gets wrong should."""
    client: WorkerClient = request.app.state.client
    body, ignored = await read_lenient_body(request, client, schema)
    unsupported = body.unsupported()
    if unsupported is not None:
        param, message = unsupported
        raise ApiError(400, message, "unsupported", param)
    grammar = await request_grammar(body.response_format, body.structured_outputs)
    return OpenAIRequest(body, client, ignored, grammar)


async def read_lenient_body(
    request: Request, client: WorkerClient, schema: type[Model]
) -> tuple[Model, list[str]]:
    """The body as ``schema``, and the unknown fields it ignored: vLLM's way, for
    the OpenAI endpoints and /tokenize and /detokenize; refused instead with
    STRICT_REQUEST_FIELDS."""
    strict = client.config.strict_request_fields
    try:
        body, ignored = await parse_body(request, schema, ignore_unknown=not strict)
    except ApiError as exc:
        model = served_model(client)
        if exc.param != "model" or _MODEL_MISSING not in exc.message or model is None:
            raise
        named = f"{_MODEL_MISSING} (this server serves {model!r})"
        raise ApiError(
            exc.status, exc.message.replace(_MODEL_MISSING, named), exc.code, exc.param
        ) from None
    # For `with_ignored_fields`, should a later check refuse the request.
    request.state.ignored_fields = ignored, schema
    return body, ignored


def with_ignored_fields(request: Request, error: ApiError) -> ApiError:
    """``error`` (a refusal, 4xx) of a request whose body had unknown fields
    ignored, naming them, as a typo there may be its cause: in its message, each
    with the field it likely meant, and in X-Ignored-Fields."""
    ignored_fields: tuple[list[str], type[BaseModel]] | None
    ignored_fields = getattr(request.state, "ignored_fields", None)
    if ignored_fields is None or not ignored_fields[0] or error.status >= 500:
        return error
    ignored, schema = ignored_fields
    headers = {**error.headers, **ignored_fields_headers(ignored)}
    message = error.message + ignored_note(ignored, schema)
    return ApiError(error.status, message, error.code, error.param, headers)


_MODEL_MISSING = "model: required; send it"


def served_model(client: WorkerClient) -> str | None:
    hello = client.hello
    return hello.model if hello else None


async def check_requested_model(request: Request, client: WorkerClient, name: str) -> str:
    """The served model, once a worker has named it (a request that comes before
    any worker's hello waits for one, up to REQUEST_TIMEOUT_S: 504 if none
    comes, and the wait counts toward that timeout); 404 unless ``name`` is that
    model."""
    timeout_s = client.config.request_timeout_s
    started = time.monotonic()
    hello = await client.first_hello(timeout_s)
    request.state.waited_for_hello_s = time.monotonic() - started
    if hello is None and client.is_shutting_down:
        raise ApiError(
            503,
            "this frontend is shutting down and no worker has said hello to it; retry it, "
            "on another instance or on this one once it is back",
            "shutting_down",
        )
    if hello is None:
        raise ApiError(
            504,
            f"no worker named its model within REQUEST_TIMEOUT_S={timeout_s:g} s "
            f"({client.verdict().reason}); retry once a worker is live",
            "timeout",
            headers=NEVER_RAN,
        )
    check_model(client, name)
    return hello.model


def check_model(client: WorkerClient, name: str) -> None:
    """404 unless ``name`` is the served model (any name while none is known)."""
    model = served_model(client)
    if model is not None and name != model:
        raise ApiError(
            404,
            f"model {short_name(name, MAX_MODEL_NAME_CHARS)!r} is not served here; "
            f"this server serves {model!r}",
            "model_not_found",
            "model",
        )


def openai_request(
    read: OpenAIRequest[Body], max_tokens: int, max_tokens_param: str
) -> GenerateRequest:
    """The request for the worker: the body's sampling fields, an absent one at
    its neutral value, and its grammar. The prompt fields (text, ids or a
    conversation) and what to score are the endpoint's to set
    (`dataclasses.replace`)."""
    body = read.body
    return dataclasses.replace(
        generate_request(
            read.client.config,
            max_tokens,
            max_tokens_param,
            min_tokens=body.min_tokens or 0,
            stop=body.stop,
        ),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=bool(body.ignore_eos),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        seed=request_seed(body.seed),
        stream=bool(body.stream),
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias_token_ids=[int(key) for key in body.logit_bias or {}],
        logit_bias_values=list((body.logit_bias or {}).values()),
        cache_salt=body.cache_salt or "",
        grammar_kind=read.grammar.kind,
        grammar=read.grammar.text,
    )


class Envelope:
    """What every answer and chunk of one request carries around its choices."""

    def __init__(self, answer_id: str, model: str) -> None:
        self.id = answer_id
        self.model = model
        self.created = int(time.time())

    def wrap(
        self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def results_usage(results: Sequence[GenerateResult]) -> dict[str, Any]:
    """A request's usage, as OpenAI counts it: its prompt once, and the tokens of
    every choice it generated (best_of's too); and how many of the prompt's
    tokens came from the prefix cache (where the choices differ, the one that
    computed most of the prompt)."""
    return {
        **usage(results[0].prompt_tokens, sum(result.completion_tokens for result in results)),
        "prompt_tokens_details": {"cached_tokens": min(result.cached_tokens for result in results)},
    }


class UsageStream:
    """Usage for a stream's chunks: after the stream (include_usage) and, with
    continuous_usage_stats, so far in every chunk, as vLLM sends it; one for all
    of a request's choices."""

    def __init__(self, body: OpenAIBody) -> None:
        options = body.stream_options
        self.is_final = bool(options and options.include_usage)
        self.is_continuous = self.is_final and bool(options and options.continuous_usage_stats)
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def count(self, prompt_tokens: int, num_new_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens or self.prompt_tokens
        self.completion_tokens += num_new_tokens

    def so_far(self) -> dict[str, Any] | None:
        return usage(self.prompt_tokens, self.completion_tokens) if self.is_continuous else None
