"""Server-sent events: one accepted request's deltas, then its final events.

Each endpoint supplies a `StreamFormat` that turns deltas, results and a late
error into SSE frames. A request with several choices streams them interleaved
as they arrive, each delta and result with its choice's index, and ends once
every choice has its result. The response starts only once the first event
arrives, so a request the worker refuses outright (say, a prompt beyond the
context window) still gets a plain HTTP error; an error after that goes out as
an event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from frontend.accepted import (
    CLIENT_CLOSED_REQUEST,
    Accepted,
    ChoiceEvent,
    ClientGone,
    abandon,
    next_event,
)
from frontend.errors import ApiError
from frontend.json_response import to_json
from frontend.metrics import NO_FINISH_REASON
from frontend.refusal import log_refusal
from frontend.worker_client import WorkerClient
from protocol import GenerateResult, TokenDelta

log = logging.getLogger(__name__)


class StreamFormat(Protocol):
    def delta(self, index: int, delta: TokenDelta) -> str | None:
        """The frame for one delta of choice ``index``, or None to send nothing."""

    def final(self, index: int, result: GenerateResult) -> list[str]:
        """The frames that end choice ``index``."""

    def end(self, results: list[GenerateResult]) -> list[str]:
        """The frames that end the stream, after every choice's ``final``."""

    def error(self, error: ApiError) -> list[str]:
        """The frames that end a stream with an error."""


def sse_frame(data: object, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else to_json(data).decode()
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


async def stream_response(
    http_request: Request,
    client: WorkerClient,
    accepted: Accepted,
    stream_format: StreamFormat,
    headers: dict[str, str] | None = None,
) -> Response:
    """Stream a request's events; raises ApiError if it fails before its first event."""
    try:
        first = await next_event(http_request, client, accepted)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    frames = _frames(http_request, client, accepted, stream_format, first)
    return _SseResponse(frames, client, accepted, headers or {})


async def _frames(
    http_request: Request,
    client: WorkerClient,
    accepted: Accepted,
    stream_format: StreamFormat,
    event: ChoiceEvent,
) -> AsyncGenerator[str, None]:
    while True:
        try:
            frames, is_last = _format(stream_format, accepted, event)
        except Exception:  # a bug: the stream still ends with an error event
            log.exception("request %s: formatting its stream failed", accepted.request_id)
            error = ApiError(500, "this frontend failed to send the answer (its log says why)")
            if not accepted.is_answered:  # else it was counted with its result
                accepted.cancel(client)
                accepted.metrics.count_request(accepted.endpoint, 500, NO_FINISH_REASON)
            frames, is_last = stream_format.error(error), True
        for frame in frames:
            yield frame
        if is_last:
            return
        try:
            event = await next_event(http_request, client, accepted)
        except ApiError as exc:
            accepted.metrics.count_request(accepted.endpoint, exc.status, NO_FINISH_REASON)
            log_refusal(http_request.method, http_request.url.path, exc)
            for frame in stream_format.error(exc):
                yield frame
            return
        except ClientGone:
            return


def _format(
    stream_format: StreamFormat, accepted: Accepted, event: ChoiceEvent
) -> tuple[list[str], bool]:
    """The frames for a choice's event, and whether they end the stream."""
    index, message = event
    if isinstance(message, TokenDelta):
        frame = stream_format.delta(index, message)
        return ([] if frame is None else [frame]), False
    frames = stream_format.final(index, message)
    if accepted.is_finished:
        return [*frames, *stream_format.end(accepted.finished_results())], True
    return frames, False


class _SseResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncGenerator[str, None],
        client: WorkerClient,
        accepted: Accepted,
        headers: dict[str, str],
    ) -> None:
        # X-Accel-Buffering: nginx would otherwise hold events back in its buffer.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
        super().__init__(frames, headers=headers)
        self._frames = frames
        self._client = client
        self._accepted = accepted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # When the client disconnects, Starlette cancels the stream, possibly
            # while the generator waits at a yield, or before it ever started (and
            # so before any finally in it could run). Aborting here frees the
            # worker's slot and the disconnect watcher now, whatever the stream did.
            await self._frames.aclose()
            abandon(self._client, self._accepted)
