"""The checks a frame passes before a message is built from it: its shape, read
from msgpack's headers before anything is unpacked (`check_flat`), and each
field against its message's dataclass (`Schema`)."""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from typing import Any, Union

import msgpack

from protocol.messages import PROTOCOL_VERSION
from protocol.wire import (
    FLOAT32,
    MAX_LIST_ITEMS,
    MAX_MAP_ITEMS,
    MAX_REQUEST_ID_CHARS,
    PACKED_KINDS,
    TYPE_KEY,
    UINT32,
    VERSION_KEY,
    ProtocolError,
    VersionMismatch,
    unpack,
)


def check_flat(frame: bytes) -> None:
    """Refuse a frame whose shape no message to the worker has, before any of it
    is built.

    Every such message is one map from names to scalars, strings, bytes and lists
    of those (only a worker's answers nest: `Logprobs`). A frame of nested
    containers passes the unpacker's per-container limits, yet 2 MiB of them is
    two million Python objects: a second of the I/O thread. Walking the headers
    stops at the first nested container, so such a frame costs next to nothing.
    (A failed ``read_*_header`` consumes nothing: the next read sees the same
    item.) Another protocol version's messages may have another shape: a frame
    that gave its version before the field at fault is refused as a
    `VersionMismatch`, as every version's encoder writes the version first.
    """
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(frame), 1))
    unpacker.feed(frame)
    request_id = version = None
    try:
        try:
            num_entries = unpacker.read_map_header()
        except ValueError as exc:
            raise ProtocolError(
                f"frame must be a msgpack map ({len(frame)} bytes): {exc}"
            ) from None
        if num_entries > MAX_MAP_ITEMS:
            raise ProtocolError(
                f"frame is a map of {num_entries:,} entries; at most {MAX_MAP_ITEMS}"
            )
        for _ in range(num_entries):
            if _container_size(unpacker) is not None:
                raise ProtocolError("frame has a container for a field name")
            key = unpacker.unpack()
            num_items = _container_size(unpacker)
            if num_items is None:
                value = unpacker.unpack() if key in ("request_id", VERSION_KEY) else unpacker.skip()
                if key == VERSION_KEY:
                    version = value
                elif isinstance(value, str):
                    request_id = value
                continue
            if num_items < 0:
                raise ProtocolError(f"{preview(key)}: no field is a map")
            for _ in range(num_items):
                if _container_size(unpacker) is not None:
                    raise ProtocolError(f"{preview(key)}: no field nests lists")
                unpacker.skip()
    except ProtocolError as exc:
        # Answerable if the id came first, as it does from our frontends.
        if request_id is not None and len(request_id) <= MAX_REQUEST_ID_CHARS:
            exc.request_id = request_id
        if type(version) is int and version != PROTOCOL_VERSION:
            check_version(version, exc.request_id)  # another version's shape
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not valid msgpack ({len(frame)} bytes): {exc}") from exc


def check_version(version: Any, request_id: str | None) -> None:
    """Refuse a frame of no protocol version, or of another (`VersionMismatch`)."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError(f"no protocol version (got {preview(version)})", request_id)
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"the peer speaks protocol version {preview(version)} and this process "
            f"version {PROTOCOL_VERSION}: upgrade the older one",
            request_id,
        )


def _container_size(unpacker: msgpack.Unpacker) -> int | None:
    """The item count if a list starts here, -1 if a map does, None otherwise."""
    try:
        num_items: int = unpacker.read_array_header()
    except ValueError:
        pass
    else:
        if num_items > MAX_LIST_ITEMS:
            raise ProtocolError(f"a list of {num_items:,} items; at most {MAX_LIST_ITEMS}")
        return num_items
    try:
        unpacker.read_map_header()
    except ValueError:
        return None
    return -1


class Schema:
    """The fields of one message class (or of a dataclass nested in one), with the
    checks `_decode` applies. With ``counts_only``, every integer (alone or in a
    list) must be at least 0: in a worker's answers each one is a count, a length
    or a token id, and a negative one would fail whatever reads it."""

    def __init__(self, cls: type[Any], counts_only: bool = False) -> None:
        self.cls = cls
        self.name = getattr(cls, "TYPE", cls.__name__)
        hints = typing.get_type_hints(cls)
        self.fields = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        self.counts = {name for name, kind in self.fields.items() if counts_only and _of_ints(kind)}
        self.packed = packed_fields(cls)
        self.nested = {
            name: Schema(kind, counts_only)
            for name, annotation in self.fields.items()
            if (kind := _dataclass_in(annotation)) is not None
        }
        self.required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }

    def build(self, payload: dict[str, Any], request_id: str | None) -> Any:
        name = self.name
        # msgpack's strict_map_key lets bytes keys through beside strings.
        not_names = [key for key in payload if not isinstance(key, str)]
        if not_names:
            raise ProtocolError(
                f"{name}: field names must be strings, got {preview(not_names[0])}", request_id
            )
        body = {k: v for k, v in payload.items() if k not in (VERSION_KEY, TYPE_KEY)}
        unknown = sorted(set(body) - set(self.fields))
        if unknown:
            shown = ", ".join(preview(key) for key in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ProtocolError(f"{name}: unknown fields {shown}{more}", request_id)
        missing = sorted(self.required - set(body))
        if missing:
            raise ProtocolError(f"{name}: missing fields {missing}", request_id)
        for key, value in body.items():
            annotation = self.fields[key]
            if value is None and _matches(None, annotation):
                continue
            if key in self.packed:
                items = unpack(value, self.packed[key]) if isinstance(value, bytes) else None
                if items is None:
                    kind = PACKED_KINDS[self.packed[key]]
                    raise ProtocolError(
                        f"{name}.{key} must be {kind}, got {type(value).__name__} {preview(value)}",
                        request_id,
                    )
                body[key] = items
            elif key in self.nested:
                if not isinstance(value, dict):
                    raise ProtocolError(
                        f"{name}.{key} must be a map, got {type(value).__name__}", request_id
                    )
                body[key] = self.nested[key].build(value, request_id)
            elif not _matches(value, annotation):
                raise ProtocolError(
                    f"{name}.{key} must be {_describe(annotation)}, "
                    f"got {type(value).__name__} {preview(value)}",
                    request_id,
                )
            elif key in self.counts and (negative := _first_negative_int(value)) is not None:
                raise ProtocolError(f"{name}.{key} must be at least 0, got {negative}", request_id)
            elif isinstance(value, int) and not _matches(value, annotation, ints_as_floats=False):
                # An integer sent for a float: a float from here on. torch would
                # make an integer tensor of it, and one past 2**63 would overflow.
                body[key] = float(value)
        return self.cls(**body)


def _matches(value: Any, annotation: Any, ints_as_floats: bool = True) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        arms = typing.get_args(annotation)
        return any(_matches(value, arm, ints_as_floats) for arm in arms)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if annotation is type(None):
        return value is None
    if annotation is float:
        # msgpack keeps 1.0 as a float, but a hand-written client may send 1.
        kinds = (int, float) if ints_as_floats else float
        return isinstance(value, kinds) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _of_ints(annotation: Any) -> bool:
    """Whether a field holds integers: int, a list of them, either or None."""
    arms = typing.get_args(annotation) if typing.get_origin(annotation) is not list else ()
    kinds = [arm for arm in arms or (annotation,) if arm is not type(None)]
    return all(
        kind is int or (typing.get_origin(kind) is list and typing.get_args(kind) == (int,))
        for kind in kinds
    )


def _first_negative_int(value: Any) -> int | None:
    values = value if isinstance(value, list) else [value]
    return next((v for v in values if isinstance(v, int) and v < 0), None)


_PREVIEW = reprlib.Repr()
_PREVIEW.maxstring = _PREVIEW.maxother = 40
_PREVIEW.maxlist = 3


def preview(value: Any) -> str:
    """A short repr, in time and length: an error message must not grow with the input."""
    return _PREVIEW.repr(value)


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(annotation))
    if origin is list:
        return f"a list of {_describe(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return str(annotation.__name__)


def packed_fields(cls: type[Any]) -> dict[str, str]:
    """The fields of ``cls`` that travel packed, with their array typecode:
    ``list[int]`` (token ids) as uint32, ``list[float]`` as float32, maybe ``| None``."""
    known = _PACKED_BY_CLASS.get(cls)
    if known is not None:
        return known
    packed = {}
    for name, annotation in typing.get_type_hints(cls).items():
        arms = typing.get_args(annotation) if typing.get_origin(annotation) else ()
        for kind, typecode in ((list[int], UINT32), (list[float], FLOAT32)):
            if annotation == kind or kind in arms:
                packed[name] = typecode
    _PACKED_BY_CLASS[cls] = packed
    return packed


_PACKED_BY_CLASS: dict[type[Any], dict[str, str]] = {}


def _dataclass_in(annotation: Any) -> type[Any] | None:
    """The dataclass a field holds (``Logprobs | None``), if any."""
    for kind in (annotation, *typing.get_args(annotation)):
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            return kind
    return None
