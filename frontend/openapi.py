"""GET /openapi.json: the HTTP API described from the same pydantic models that
validate request bodies, so the description cannot drift from the checks."""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

from pydantic.json_schema import models_json_schema

from frontend import __doc__ as frontend_doc
from frontend.openai_schemas import ChatBody, CompletionBody
from frontend.schemas import GenerateBody
from frontend.tokenize_api import PACKAGE, DetokenizeBody, TokenizeBody

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string", "description": "what was wrong and what to do"},
                "type": {"type": "string"},
                "code": {"type": ["string", "null"]},
                "param": {"type": ["string", "null"], "description": "the field at fault"},
            },
        }
    },
}
_ANSWER = {"type": "object"}
# One server-sent event, as OpenAPI 3.2's itemSchema reads a stream and tools
# read a 3.1 stream's schema: /generate names each event (token, done, error);
# the OpenAI endpoints send unnamed events of JSON, then the data [DONE].
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"enum": ["token", "done", "error"]},
        "data": {"type": "string", "description": "JSON, or [DONE] at the end of an OpenAI stream"},
    },
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "a parameter value this server does not support",
        401: "no valid 'Authorization: Bearer <key>' header, when the server has an API_KEY",
        404: "unknown model",
        408: "the body did not arrive within BODY_TIMEOUT_S",
        413: "the body is over MAX_REQUEST_BYTES",
        415: "the body is not Content-Type: application/json, or is compressed",
        422: "an invalid request; the message names the field",
        503: "no live worker, or the queue is full: retry after Retry-After seconds",
        504: "no answer within REQUEST_TIMEOUT_S",
    }
    return {
        str(status): {
            "description": reasons[status],
            "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}},
        }
        for status in statuses
    }


# The key is needed only when the server has one: {} is "no credentials".
_KEY_IF_SET: list[dict[str, list[str]]] = [{"bearer": []}, {}]
# Every body is read within the same limits.
_BODY_ERRORS = (401, 408, 413, 415, 422)


def _post(summary: str, body: str, *errors: int) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _KEY_IF_SET,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF.format(model=body)}}},
            },
            "responses": {
                "200": {
                    "description": "the answer, or server-sent events when stream is true",
                    "content": {"application/json": {"schema": _ANSWER}, **_SSE},
                },
                **_errors(*errors),
            },
        }
    }


def _get(
    summary: str,
    media_type: str = "application/json",
    *errors: int,
    is_open: bool = False,
    parameters: tuple[dict[str, Any], ...] = (),
) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "security": [{}] if is_open else _KEY_IF_SET,
            **({"parameters": list(parameters)} if parameters else {}),
            "responses": {
                "200": {"description": summary, "content": {media_type: {"schema": _ANSWER}}},
                **_errors(*errors),
            },
        }
    }


_MODEL_IN_PATH = {
    "name": "model",
    "in": "path",
    "required": True,
    "description": "the served model, as GET /v1/models names it",
    "schema": {"type": "string"},
}

# Bodies that ignore a field they do not define (and name it in a header) unless
# STRICT_REQUEST_FIELDS is set, in nested objects too; /generate refuses one always.
_LENIENT_BODIES = (CompletionBody, ChatBody, TokenizeBody, DetokenizeBody)


def _reached(names: list[str], schemas: dict[str, Any]) -> set[str]:
    """The schemas named, and every schema they refer to, however deep."""
    reached: set[str] = set()
    while names:
        name = names.pop()
        if name not in reached:
            reached.add(name)
            names.extend(re.findall(r"#/components/schemas/(\w+)", str(schemas[name])))
    return reached


# The fields that ask for a number of tokens, bounded by MAX_NEW_TOKENS_LIMIT:
# a setting, so the models cannot say it, and the document is written for it.
_TOKEN_BUDGETS = (
    ("GenerateBody", "max_new_tokens"),
    ("CompletionBody", "max_tokens"),
    ("ChatBody", "max_completion_tokens"),
    ("ChatBody", "max_tokens"),
)


@functools.cache
def openapi_schema(
    strict_request_fields: bool = False, max_new_tokens_limit: int | None = None
) -> dict[str, Any]:
    """The description of this server's API, as configured: whether the OpenAI
    bodies refuse an unknown field (STRICT_REQUEST_FIELDS) or ignore it, and how
    many tokens a request may ask for (MAX_NEW_TOKENS_LIMIT; None: not said)."""
    _, definitions = models_json_schema(
        [
            (body, "validation")
            for body in (GenerateBody, CompletionBody, ChatBody, TokenizeBody, DetokenizeBody)
        ],
        ref_template=_REF,
    )
    schemas = {**definitions["$defs"], "Error": _ERROR}
    if not strict_request_fields:
        for name in _reached([body.__name__ for body in _LENIENT_BODIES], schemas):
            schemas[name].pop("additionalProperties", None)
    if max_new_tokens_limit is not None:
        for body, name in _TOKEN_BUDGETS:
            field = schemas[body]["properties"][name]
            for arm in field.get("anyOf", [field]):
                if arm.get("type") == "integer":
                    arm["maximum"] = max_new_tokens_limit
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "MiniBatch-LLM",
            "version": importlib.metadata.version(PACKAGE),  # as /version says
            "description": (frontend_doc or "").strip(),
        },
        "paths": {
            "/generate": _post(
                "Generate text after a prompt", "GenerateBody", 400, *_BODY_ERRORS, 503, 504
            ),
            "/v1/completions": _post(
                "OpenAI-compatible completion", "CompletionBody", 400, 404, *_BODY_ERRORS, 503, 504
            ),
            "/v1/chat/completions": _post(
                "OpenAI-compatible chat completion", "ChatBody", 400, 404, *_BODY_ERRORS, 503, 504
            ),
            "/v1/models": _get("The served model", "application/json", 401, 503),
            "/v1/models/{model}": _get(
                "The served model's card",
                "application/json",
                401,
                404,
                503,
                parameters=(_MODEL_IN_PATH,),
            ),
            "/tokenize": _post(
                "A prompt's or a conversation's token ids",
                "TokenizeBody",
                400,
                404,
                *_BODY_ERRORS,
                503,
            ),
            "/detokenize": _post(
                "The text of token ids", "DetokenizeBody", 404, *_BODY_ERRORS, 503
            ),
            "/version": _get("This server's version", "application/json", 401),
            "/health": _get("Worker liveness; 503 when no worker is live", is_open=True),
            "/ready": _get(
                "200 when a worker is live and there is room for requests", is_open=True
            ),
            "/metrics": _get("Prometheus metrics", "text/plain", is_open=True),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the server's API_KEY; needed only when it is set",
                }
            },
        },
    }
