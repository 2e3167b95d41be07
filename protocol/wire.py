"""What every frame is made of: the error a bad frame raises, the limits no
message exceeds, and lists packed as bytes."""

from __future__ import annotations

import array
import sys
from typing import Any

VERSION_KEY = "v"
TYPE_KEY = "type"
# array's typecode for 4-byte unsigned ints ("I" is 4 bytes on every platform
# CPython supports; checked at import below).
UINT32 = "I"
FLOAT32 = "f"
PACKED_KINDS = {
    UINT32: "token ids packed as little-endian uint32",
    FLOAT32: "numbers packed as little-endian float32",
}
# No message has a list longer than this (token ids travel as bytes, not lists),
# nor a map with more entries: a frame beyond either is refused while unpacking.
MAX_LIST_ITEMS = 256
MAX_MAP_ITEMS = 64
# A longer request id is refused unanswered: no reply echoes a peer's megabytes
# back at it. (A frontend's ids are its own uuid, a choice's index and an attempt
# number, under 50 characters; a client's own request_id is only echoed back.)
MAX_REQUEST_ID_CHARS = 256
# The largest frame a client takes from a worker: a result with 20 alternatives'
# logprobs for every one of 200,000 tokens (about 320 bytes a token, packed)
# fits. A peer posing as a worker that sent one of 200 MB made a frontend hold
# 670 MB; past this, the connection is dropped, as a dead worker's.
MAX_WORKER_MESSAGE_BYTES = 64 * 1024 * 1024
assert array.array(UINT32).itemsize == array.array(FLOAT32).itemsize == 4


class ProtocolError(ValueError):
    """A frame that is not a valid message. ``request_id`` is set when the frame
    names one, so that the sender can still be answered."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class VersionMismatch(ProtocolError):
    """A frame of another protocol version. Nothing in it can be read, but what
    to do is known: upgrade the older process."""


def shorten(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars``, ending "..." where it was cut: a peer's or a
    client's text, quoted in a message or a log line."""
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def pack(values: list[int] | list[float] | None, typecode: str) -> bytes | None:
    if values is None:
        return None
    try:
        packed = array.array(typecode, values)
    except (OverflowError, TypeError) as exc:
        kind = "integers in [0, 2**32)" if typecode == UINT32 else "numbers"
        raise ValueError(f"a packed list must hold {kind}: {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack(raw: bytes, typecode: str) -> list[Any] | None:
    """The inverse of `pack`; None if ``raw`` is not a whole number of items."""
    if len(raw) % 4:
        return None
    values = array.array(typecode)
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
