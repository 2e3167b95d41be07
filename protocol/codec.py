"""msgpack encoding of `protocol.messages`, with strict decoding.

Each socket decodes into the direction it expects (`decode_to_worker`,
`decode_to_frontend`). Anything that is not a valid message of this protocol
version raises `ProtocolError`; nothing else escapes a decode.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgpack

from protocol.checks import Schema, check_flat, check_version, packed_fields, preview
from protocol.messages import (
    PROTOCOL_VERSION,
    TO_FRONTEND,
    TO_WORKER,
    Message,
    ToFrontend,
    ToWorker,
)
from protocol.wire import (
    MAX_LIST_ITEMS,
    MAX_MAP_ITEMS,
    MAX_REQUEST_ID_CHARS,
    TYPE_KEY,
    VERSION_KEY,
    ProtocolError,
    pack,
)


def encode(message: Message) -> bytes:
    payload: dict[str, Any] = {VERSION_KEY: PROTOCOL_VERSION, TYPE_KEY: message.TYPE}
    payload.update(_fields(message))
    return typing.cast(bytes, msgpack.packb(payload, use_bin_type=True))


def _fields(value: Any) -> dict[str, Any]:
    """A dataclass's fields as msgpack values: packed lists as bytes, nested
    dataclasses as maps."""
    packed = packed_fields(type(value))
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if f.name in packed:
            item = pack(item, packed[f.name])
        elif dataclasses.is_dataclass(item):
            item = _fields(item)
        fields[f.name] = item
    return fields


def decode_to_worker(frame: bytes) -> ToWorker:
    check_flat(frame)  # anyone can reach the worker's socket
    return typing.cast(ToWorker, _decode(frame, _TO_WORKER))


def decode_to_frontend(frame: bytes) -> ToFrontend:
    return typing.cast(ToFrontend, _decode(frame, _TO_FRONTEND))


def _decode(frame: bytes, accepted: dict[str, Schema]) -> Message:
    try:
        payload = _unpack(frame, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(
            f"frame is not valid msgpack ({len(frame)} bytes): {exc}", _request_id_of(frame)
        ) from exc
    if not isinstance(payload, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(payload).__name__}")
    request_id = payload.get("request_id")
    request_id = request_id if isinstance(request_id, str) else None
    if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ProtocolError(
            f"request_id is {len(request_id):,} characters; at most {MAX_REQUEST_ID_CHARS}"
        )

    check_version(payload.get(VERSION_KEY), request_id)
    kind = payload.get(TYPE_KEY)
    schema = accepted.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(
            f"message type {preview(kind)} is not expected here (expected one of "
            f"{sorted(accepted)})",
            request_id,
        )
    try:
        return typing.cast(Message, schema.build(payload, request_id))
    except ProtocolError:
        raise
    except Exception as exc:  # a frame these checks missed is still only a bad frame
        # A message's own check (ErrorResult's code) says why in its words.
        why = f"{type(exc).__name__}: {str(exc)[:_MAX_WHY_CHARS]}"
        raise ProtocolError(f"{kind}: cannot be built from this frame: {why}", request_id) from exc


def _unpack(frame: bytes, raw: bool) -> Any:
    # Bounded before anything is built: a frame of a million small strings or
    # keys costs the unpacker, and the thread running it, no more than this.
    return msgpack.unpackb(
        frame,
        raw=raw,
        strict_map_key=not raw,  # raw keys are bytes
        max_array_len=MAX_LIST_ITEMS,
        max_map_len=MAX_MAP_ITEMS,
    )


def _request_id_of(frame: bytes) -> str | None:
    """The request id of a frame that does not decode as text throughout (a
    string that is not UTF-8 elsewhere in it), so that its request fails at
    once rather than waiting for an answer that never comes; None if it has
    no readable one."""
    try:
        payload = _unpack(frame, raw=True)
        request_id = payload[b"request_id"].decode()
    except Exception:  # not msgpack at all, no map, no such key, not UTF-8 either
        return None
    return request_id if len(request_id) <= MAX_REQUEST_ID_CHARS else None


_MAX_WHY_CHARS = 200
_TO_WORKER = {cls.TYPE: Schema(cls) for cls in TO_WORKER}
_TO_FRONTEND = {cls.TYPE: Schema(cls, counts_only=True) for cls in TO_FRONTEND}
