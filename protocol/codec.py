"""msgpack encoding of `protocol.messages`, with strict decoding.

Each socket decodes into the direction it expects (`decode_to_worker`,
`decode_to_frontend`). Anything that is not a valid message of this protocol
version raises `ProtocolError`; nothing else escapes a decode.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import msgpack

from protocol.messages import (
    PROTOCOL_VERSION,
    TO_FRONTEND,
    TO_WORKER,
    Message,
    ToFrontend,
    ToWorker,
)

VERSION_KEY = "v"
TYPE_KEY = "type"


class ProtocolError(ValueError):
    """A frame that is not a valid message. ``request_id`` is set when the frame
    names one, so that the sender can still be answered."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def encode(message: Message) -> bytes:
    payload: dict[str, Any] = {VERSION_KEY: PROTOCOL_VERSION, TYPE_KEY: message.TYPE}
    for f in dataclasses.fields(message):
        payload[f.name] = getattr(message, f.name)
    return typing.cast(bytes, msgpack.packb(payload, use_bin_type=True))


def decode_to_worker(frame: bytes) -> ToWorker:
    return typing.cast(ToWorker, _decode(frame, _TO_WORKER))


def decode_to_frontend(frame: bytes) -> ToFrontend:
    return typing.cast(ToFrontend, _decode(frame, _TO_FRONTEND))


def _decode(frame: bytes, accepted: dict[str, _Schema]) -> Message:
    try:
        payload = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not valid msgpack ({len(frame)} bytes): {exc}") from exc
    if not isinstance(payload, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(payload).__name__}")
    request_id = payload.get("request_id")
    request_id = request_id if isinstance(request_id, str) else None

    version = payload.get(VERSION_KEY)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported; this side speaks "
            f"version {PROTOCOL_VERSION}: upgrade the older process",
            request_id,
        )
    kind = payload.get(TYPE_KEY)
    schema = accepted.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(
            f"message type {kind!r} is not expected here (expected one of {sorted(accepted)})",
            request_id,
        )
    return schema.build(payload, request_id)


class _Schema:
    """The fields of one message class, with the checks `_decode` applies."""

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.fields = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        self.required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }

    def build(self, payload: dict[str, Any], request_id: str | None) -> Message:
        body = {k: v for k, v in payload.items() if k not in (VERSION_KEY, TYPE_KEY)}
        name = self.cls.TYPE
        unknown = sorted(set(body) - set(self.fields))
        if unknown:
            raise ProtocolError(f"{name}: unknown fields {unknown}", request_id)
        missing = sorted(self.required - set(body))
        if missing:
            raise ProtocolError(f"{name}: missing fields {missing}", request_id)
        for key, value in body.items():
            if not _matches(value, self.fields[key]):
                raise ProtocolError(
                    f"{name}.{key} must be {_describe(self.fields[key])}, "
                    f"got {type(value).__name__} {value!r:.80}",
                    request_id,
                )
        return typing.cast(Message, self.cls(**body))


def _matches(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if annotation is type(None):
        return value is None
    if annotation is float:
        # msgpack keeps 1.0 as a float, but a hand-written client may send 1.
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(annotation))
    if origin is list:
        return f"a list of {_describe(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return str(annotation.__name__)


_TO_WORKER = {cls.TYPE: _Schema(cls) for cls in TO_WORKER}
_TO_FRONTEND = {cls.TYPE: _Schema(cls) for cls in TO_FRONTEND}
