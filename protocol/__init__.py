"""The frontend/worker wire protocol: messages, their msgpack codec, shared config.

Pure Python + msgpack: importing this package never imports torch or Starlette.
"""

from protocol.codec import decode_to_frontend, decode_to_worker, encode
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    Admitted,
    ErrorCode,
    ErrorResult,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GrammarKind,
    Heartbeat,
    Hello,
    Logprobs,
    Ping,
    RequestNews,
    ToFrontend,
    TokenDelta,
    ToWorker,
    Waiting,
)
from protocol.wire import ProtocolError, VersionMismatch

__all__ = [
    "PROTOCOL_VERSION",
    "AbortRequest",
    "Admitted",
    "ErrorCode",
    "ErrorResult",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "GrammarKind",
    "Heartbeat",
    "Hello",
    "Logprobs",
    "Ping",
    "ProtocolError",
    "RequestNews",
    "ToFrontend",
    "ToWorker",
    "TokenDelta",
    "VersionMismatch",
    "Waiting",
    "decode_to_frontend",
    "decode_to_worker",
    "encode",
]
