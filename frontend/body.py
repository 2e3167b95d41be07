"""Reading a request body within the frontend's limits: its media type, its size
(MAX_REQUEST_BYTES), the time it takes to arrive (BODY_TIMEOUT_S), and its JSON
shape. Everything here is cheap and runs before pydantic sees the body.

A refusal here is sent with ``Connection: close``: the rest of the body is
unread, and closing is the only way not to read (or wait for) it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic_core
from starlette.requests import ClientDisconnect, Request

from frontend.errors import ApiError
from frontend.generation import CLIENT_CLOSED_REQUEST
from protocol.config import FrontendConfig

JSON_MEDIA_TYPE = "application/json"
SEND_JSON = f"send a JSON object with the header 'Content-Type: {JSON_MEDIA_TYPE}'"
CLOSE = {"Connection": "close"}


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or an ApiError: 415 for another media type, 413
    beyond MAX_REQUEST_BYTES, 408 past BODY_TIMEOUT_S, 422 for anything but an object."""
    config: FrontendConfig = request.app.state.config
    _check_media_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > config.max_request_bytes:
        raise _too_large(config, f"the body's Content-Length, {int(declared):,} bytes,")
    body = await _read(request, config)
    try:
        value = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        # The parser (jiter) bounds nesting itself, so deep nesting costs nothing.
        if "recursion limit" in str(exc):
            message = (
                "body: JSON nested too deeply (the parser stops at about 200 levels); "
                "a request body needs 3 at most"
            )
        else:
            message = (
                f"body: invalid JSON ({exc}); send one JSON object in UTF-8 "
                "(an escape such as \\ud800 alone is no character)"
            )
        raise ApiError(422, message, "invalid_request") from None
    if not isinstance(value, dict):
        raise ApiError(
            422, f"body: must be a JSON object, got {_json_type(value)}", "invalid_request"
        )
    return value


def _check_media_type(content_type: str | None) -> None:
    # Parameters such as "; charset=utf-8" are allowed; JSON is UTF-8 anyway.
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise ApiError(
            415,
            f"got {got}; {SEND_JSON} (curl: -H 'Content-Type: {JSON_MEDIA_TYPE}')",
            "unsupported_media_type",
            headers=CLOSE,
        )


async def _read(request: Request, config: FrontendConfig) -> bytes:
    """The whole body, stopping as soon as it passes the limit (chunked bodies
    declare no length) or the time to send it runs out."""
    chunks: list[bytes] = []
    num_bytes = 0
    try:
        async with asyncio.timeout(config.body_timeout_s):
            async for chunk in request.stream():
                num_bytes += len(chunk)
                if num_bytes > config.max_request_bytes:
                    raise _too_large(config, "the body")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body took longer than BODY_TIMEOUT_S={config.body_timeout_s:g} s "
            f"to arrive ({num_bytes:,} bytes came); send it at once",
            "request_timeout",
            headers=CLOSE,
        ) from None
    except ClientDisconnect:
        # Nobody reads this answer; the status is for /metrics.
        raise ApiError(
            CLIENT_CLOSED_REQUEST,
            "the client closed the connection before sending the whole body",
            "client_gone",
        ) from None
    return b"".join(chunks)


def _too_large(config: FrontendConfig, what: str) -> ApiError:
    return ApiError(
        413,
        f"{what} is over this server's limit, MAX_REQUEST_BYTES={config.max_request_bytes:,} "
        "bytes; send a smaller request",
        "request_too_large",
        headers=CLOSE,
    )


def _json_type(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
