"""HTTP errors: one exception type, one body shape, one mapping from worker codes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from frontend.json_response import JSONResponse
from protocol import ErrorCode, ErrorResult, GenerateRequest, GrammarKind
from protocol.wire import shorten

RETRY_AFTER_S = 1
# Read by the openai client (and others generated as it is) before its own
# retries: without it, a request failed as one that kills workers (500
# workers_died) was sent again twice, killing four more, and a 504 ran its whole
# REQUEST_TIMEOUT_S three times.
SHOULD_RETRY_HEADER = "x-should-retry"
MAX_WORKER_MESSAGE_CHARS = 1024  # of a worker's error message, passed on to the client

_STATUS_BY_CODE: dict[str, int] = {  # by the code as it comes off the wire
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.CONTEXT_OVERFLOW: 422,
    ErrorCode.UNSUPPORTED: 400,
    ErrorCode.QUEUE_FULL: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.WORKERS_DIED: 500,
    ErrorCode.SHUTTING_DOWN: 503,
}
# A worker's refusal starts with the field at fault, as GenerateRequest names it:
# the body's field of the same name, or, where a body names it otherwise, this
# one (every endpoint's unless it names the field its own way: ``field_names``).
_PARAM_BY_WORKER_FIELD = {
    "prompt_token_ids": "prompt",
    "prompt_logprobs": "logprobs",
    "chat_roles": "messages",
    "chat_contents": "messages",
    "logit_bias_token_ids": "logit_bias",
    "logit_bias_values": "logit_bias",
    **{GrammarKind.field(kind): GrammarKind.field(kind) for kind in GrammarKind},
}
# Fields the frontend fills in, never a client: a refusal of one names no param.
_FRONTEND_FIELDS = frozenset(
    {
        "request_id",
        "resume_token_ids",
        "resume_text_len",
        "grammar_kind",
        "grammar",
        "stream",
        "fit_context",
    }
)
_CLIENT_FIELDS = (
    frozenset(field.name for field in dataclasses.fields(GenerateRequest))
    | {"logit_bias", "messages"}  # the names of fields split in two on the wire
) - _FRONTEND_FIELDS


def _param(worker_field: str, field_names: Mapping[str, str]) -> str | None:
    """The body's name for the field a worker named, if a client sent it."""
    if worker_field in field_names:
        return field_names[worker_field]
    if worker_field in _PARAM_BY_WORKER_FIELD:
        return _PARAM_BY_WORKER_FIELD[worker_field]
    return worker_field if worker_field in _CLIENT_FIELDS else None


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI sends for a bad key
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """Ends a request with ``status`` and a message that says what to do."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param  # the request field at fault, when one is
        self.headers = dict(headers or {})

    @classmethod
    def from_worker(cls, error: ErrorResult, field_names: Mapping[str, str]) -> ApiError:
        """The worker's refusal. Its message names the worker's field first
        ("top_k: ..."); that field, as the endpoint's body names it (``field_names``,
        else as /generate's body does), leads the message instead and is ``param``."""
        # A worker bounds its own; a stranger posing as one may not.
        text = shorten(error.message, MAX_WORKER_MESSAGE_CHARS)
        field, colon, rest = text.partition(":")
        param = _param(field, field_names) if colon else None
        message = text if param is None else f"{param}:{rest}"
        return cls(_STATUS_BY_CODE[error.code], message, error.code, param)


def error_body(error: ApiError) -> dict[str, object]:
    """The OpenAI error shape, which the native endpoints share."""
    return {
        "error": {
            "message": error.message,
            "type": _TYPE_BY_STATUS.get(error.status, "server_error"),
            "code": error.code,
            "param": error.param,
        }
    }


# For an error whose request never reached a worker, whatever its status: sending
# it again runs it once, not twice.
NEVER_RAN = {SHOULD_RETRY_HEADER: "true"}


def error_response(error: ApiError) -> Response:
    """The error as a response; a 5xx says whether sending it again may help: a
    503 (full, stopping, no worker yet) after Retry-After, a 500 or a 504 not,
    unless its headers say the request never ran (`NEVER_RAN`)."""
    headers = dict(error.headers)
    if error.status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if error.status >= 500:
        headers.setdefault(SHOULD_RETRY_HEADER, "true" if error.status == 503 else "false")
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)
