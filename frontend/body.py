"""Reading a request body within the frontend's limits: its media type and
encoding (none: bodies come uncompressed), its size
(MAX_REQUEST_BYTES), the time it takes to arrive (BODY_TIMEOUT_S), and its JSON
shape. Everything here runs before pydantic sees the body.

A refusal here is sent with ``Connection: close``: the rest of the body is
unread, and closing is the only way not to read (or wait for) it. A body at most
`DRAIN_FACTOR` times over the limit is first read to its end and dropped, as
nginx's lingering close does: closing with unread bytes makes the kernel reset
the connection, and a client still sending would see the reset, not the 413.
A client waiting for ``100 Continue`` sends nothing, so it gets its 413 at once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pydantic_core
from starlette.requests import ClientDisconnect, Request

from frontend.accepted import CLIENT_CLOSED_REQUEST
from frontend.config import FrontendConfig
from frontend.errors import ApiError

# Where the connection refused a body as it came (too many chunks, trailers too
# large), and answered that itself (`frontend.http_protocol`), its request's scope
# holds the refusal here: the app's read of the body counts and logs it.
REFUSED_AS_IT_CAME = "minibatch.refused_as_it_came"

JSON_MEDIA_TYPE = "application/json"
SEND_JSON = f"send a JSON object with the header 'Content-Type: {JSON_MEDIA_TYPE}'"
CLOSE = {"Connection": "close"}
# A refused request's connection lingers this long, dropping up to this many times
# MAX_REQUEST_BYTES unread, for its client to read the answer (here, and in
# `frontend.http_protocol` for a request refused before its body).
DRAIN_FACTOR = 4
DRAIN_TIMEOUT_S = 1.0
UTF8_BOM = b"\xef\xbb\xbf"

# Arrays and objects in one body. Each costs a Python object to parse and, in a
# union, validations to check: a megabyte of tiny nested lists ([[1],[1],...])
# took 0.3-0.5 s of the event loop on a busy 2-core Zen 4 EPYC, 5-10 times a
# megabyte of token ids. Nothing this server takes needs more: a structured-output
# grammar is at most 32 Ki characters, a conversation 256 messages, logit_bias one
# object.
MAX_JSON_CONTAINERS = 32 * 1024
# A string from its opening quote: to its closing one, or to the end of a body
# that never closes it. It matches wherever a quote is, so the scan never starts
# again from a later quote of the same string: one pass, whatever the body (an
# unclosed string's quotes, each rescanned to the end, had made it quadratic).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)


async def read_json_body(request: Request) -> bytes:
    """The body's bytes, once its headers and size pass, or an ApiError: 415 for
    another media type, 413 beyond MAX_REQUEST_BYTES, 408 past BODY_TIMEOUT_S.
    `json_object` parses them."""
    config: FrontendConfig = request.app.state.config
    _check_media_type(request.headers.getlist("content-type"))
    _check_content_encoding(request.headers.getlist("content-encoding"))
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > config.max_request_bytes:
        refusal = _too_large(config, f"the body's Content-Length, {int(declared):,} bytes,")
        # A client that sent "Expect: 100-continue" waits for the go-ahead before
        # its body, and reading would give it one (uvicorn sends the 100 then).
        expects_go_ahead = request.headers.get("expect", "").lower() == "100-continue"
        if int(declared) <= DRAIN_FACTOR * config.max_request_bytes and not expects_go_ahead:
            await _drain(request.stream(), config)
        raise refusal
    return await _read(request, config)


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` parsed as a JSON object, or a 422 ApiError saying why it is not one."""
    num_containers = _count_containers(body)
    if num_containers > MAX_JSON_CONTAINERS:
        raise ApiError(
            422,
            f"body: {num_containers:,} JSON arrays and objects, more than this server's "
            f"{MAX_JSON_CONTAINERS:,}; no request it takes needs that many",
            "invalid_request",
        )
    try:
        # RFC 8259 lets a parser ignore a byte order mark, and some editors write one.
        value = parse_json(body.removeprefix(UTF8_BOM))
    except ValueError as exc:
        raise ApiError(422, f"body: {exc}", "invalid_request") from None
    if not isinstance(value, dict):
        raise ApiError(
            422, f"body: must be a JSON object, got {json_kind_of(value)}", "invalid_request"
        )
    return value


def parse_json(text: bytes | str) -> Any:
    """``text`` parsed, or a ValueError whose message says why in a client's words.
    The parser (jiter) bounds nesting itself, so deep nesting costs nothing;
    Python's own json module would recurse until it raised RecursionError."""
    try:
        return pydantic_core.from_json(text, allow_inf_nan=False)
    except ValueError as exc:
        if not text.strip():
            message = "empty; send a JSON object"
        elif "recursion limit" in str(exc):
            message = (
                "JSON nested too deeply (the parser stops at about 200 levels); nothing "
                "nested that deep can be sent"
            )
        elif _parses_with_inf_nan(text):
            message = "invalid JSON: NaN and Infinity are not JSON numbers; send finite numbers"
        else:
            message = f"invalid JSON ({exc})"
            if "number out of range" in str(exc):  # a float that large reads as infinity
                message += (
                    ": a number of more than 4,300 digits before any decimal point, more "
                    "than the parser reads and than any field takes"
                )
            elif "surrogate" in str(exc) or "hex escape" in str(exc):
                message += (
                    ": an escape \\ud800 to \\udfff is half of a character, sent with "
                    "its other half or not at all"
                )
        raise ValueError(message) from None


def _parses_with_inf_nan(text: bytes | str) -> bool:
    """Whether ``text`` is JSON but for NaN or Infinity (which Python's json writes)."""
    try:
        pydantic_core.from_json(text, allow_inf_nan=True)
    except ValueError:
        return False
    return True


def _count_containers(body: bytes) -> int:
    """How many arrays and objects ``body`` opens, brackets within strings aside.
    Counting every bracket costs a fraction of a millisecond a megabyte; only a
    body with more than the limit pays for finding its strings (60-85 ms a MiB of
    tiny strings, the worst found, on a busy Zen 4 EPYC)."""
    num_brackets = body.count(b"[") + body.count(b"{")
    if num_brackets <= MAX_JSON_CONTAINERS:
        return num_brackets
    outside_strings = _JSON_STRING.sub(b"", body)
    return outside_strings.count(b"[") + outside_strings.count(b"{")


def _check_media_type(content_types: list[str]) -> None:
    if len(content_types) > 1:
        # One header field, as RFC 9110 has it: a proxy in front might read the
        # other one, and then the two would not be answering the same request.
        raise ApiError(
            415,
            f"got {len(content_types)} Content-Type headers; send one: {SEND_JSON}",
            "unsupported_media_type",
            headers=CLOSE,
        )
    content_type = content_types[0] if content_types else None
    # Parameters such as "; charset=utf-8" are allowed; another charset is not,
    # since the body is read as UTF-8 (as JSON must be, RFC 8259).
    media_type, _, parameters = (content_type or "").partition(";")
    charsets = [
        value.strip().strip('"').lower()
        for name, _, value in (p.partition("=") for p in parameters.split(";"))
        if name.strip().lower() == "charset"
    ]
    if media_type.strip().lower() != JSON_MEDIA_TYPE or any(
        c not in ("utf-8", "utf8") for c in charsets
    ):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise ApiError(
            415,
            f"got {got}; {SEND_JSON} (curl: -H 'Content-Type: {JSON_MEDIA_TYPE}')",
            "unsupported_media_type",
            headers=CLOSE,
        )


def _check_content_encoding(headers: list[str]) -> None:
    # Nothing here decompresses a body (a gzip bomb is a small body that is not);
    # read as it came, a compressed one would be called invalid JSON. Several
    # fields are one list of codings (RFC 9110), every one of which must be none.
    content_encoding = ", ".join(headers)
    codings = (coding.strip().lower() for coding in content_encoding.split(","))
    if all(coding in ("", "identity") for coding in codings):
        return
    raise ApiError(
        415,
        f"got Content-Encoding {content_encoding[:64]!r}; this server reads bodies as "
        "they are sent: send it uncompressed, without a Content-Encoding",
        "unsupported_media_type",
        headers={**CLOSE, "Accept-Encoding": "identity"},  # RFC 7694's answer
    )


async def _read(request: Request, config: FrontendConfig) -> bytes:
    """The whole body, stopping as soon as it passes the limit (chunked bodies
    declare no length) or the time to send it runs out."""
    chunks: list[bytes] = []
    num_bytes = 0
    stream = request.stream()
    try:
        async with asyncio.timeout(config.body_timeout_s):
            async for chunk in stream:
                num_bytes += len(chunk)
                if num_bytes > config.max_request_bytes:
                    break
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
        _raise_if_refused_as_it_came(request)
        # Nobody reads this answer; the status is for /metrics.
        raise ApiError(
            CLIENT_CLOSED_REQUEST,
            "the client closed the connection before sending the whole body",
            "client_gone",
        ) from None
    if num_bytes > config.max_request_bytes:
        await _drain(stream, config)
        _raise_if_refused_as_it_came(request)  # as the rest was drained
        raise _too_large(config, "the body")
    return b"".join(chunks)


def _raise_if_refused_as_it_came(request: Request) -> None:
    """Raise the refusal the connection answered, if it refused this body as it
    came: that is the answer to count, not the app's, which goes nowhere."""
    refused: ApiError | None = request.scope.get(REFUSED_AS_IT_CAME)
    if refused is not None:
        raise refused


async def _drain(stream: AsyncIterator[bytes], config: FrontendConfig) -> None:
    """Read and drop the rest of a refused body, while it stays within
    `DRAIN_FACTOR` times the limit and `DRAIN_TIMEOUT_S`."""
    num_bytes = 0
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for chunk in stream:
                num_bytes += len(chunk)
                if num_bytes > DRAIN_FACTOR * config.max_request_bytes:
                    return
    except (TimeoutError, ClientDisconnect):
        return


def _too_large(config: FrontendConfig, what: str) -> ApiError:
    return ApiError(
        413,
        f"{what} is over this server's limit, MAX_REQUEST_BYTES={config.max_request_bytes:,} "
        "bytes; send a smaller request",
        "request_too_large",
        headers=CLOSE,
    )


def json_kind_of(value: object) -> str:
    """The JSON type of a parsed ``value``, as a sentence names it: "an array"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"
