"""HTTP errors: one exception type, one body shape, one mapping from worker codes."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from frontend.json_response import JSONResponse
from protocol import ErrorCode, ErrorResult, GrammarKind

RETRY_AFTER_S = 1
MAX_WORKER_MESSAGE_CHARS = 1024  # of a worker's error message, passed on to the client

_STATUS_BY_CODE = {
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.CONTEXT_OVERFLOW: 422,
    ErrorCode.UNSUPPORTED: 400,
    ErrorCode.QUEUE_FULL: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.WORKERS_DIED: 500,
    ErrorCode.SHUTTING_DOWN: 503,
}
# Worker field -> /generate's field, and every endpoint's unless it names the
# field its own way; prompt ids are the request's "prompt".
_PARAM_BY_WORKER_FIELD = {
    "prompt": "prompt",
    "prompt_token_ids": "prompt",
    "max_new_tokens": "max_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "messages": "messages",
    "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "logprobs": "logprobs",
    "prompt_logprobs": "logprobs",
    **{GrammarKind.field(kind): GrammarKind.field(kind) for kind in GrammarKind.ALL},
}
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
        self.headers = headers or {}

    @classmethod
    def from_worker(cls, error: ErrorResult, field_names: Mapping[str, str]) -> ApiError:
        """The worker's refusal. Its message names the worker's field first
        ("top_k: ..."); that field, as the endpoint's body names it (``field_names``,
        else as /generate's body does), leads the message instead and is ``param``."""
        text = error.message  # a worker bounds its own; a stranger posing as one may not
        if len(text) > MAX_WORKER_MESSAGE_CHARS:
            text = text[: MAX_WORKER_MESSAGE_CHARS - 3] + "..."
        field, colon, rest = text.partition(":")
        param = (field_names.get(field) or _PARAM_BY_WORKER_FIELD.get(field)) if colon else None
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


def error_response(error: ApiError) -> Response:
    headers = dict(error.headers)
    if error.status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)
