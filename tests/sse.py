"""Server-sent events read off a streamed httpx response, framed by httpx-sse."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
from httpx_sse import EventSource


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event, data) for each server-sent event; None names an unnamed event."""
    for sse in EventSource(response).iter_sse():
        yield (None if sse.event == "message" else sse.event), sse.data
