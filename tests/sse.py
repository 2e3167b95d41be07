"""Server-sent events read off a streamed httpx response."""

from __future__ import annotations

from collections.abc import Iterator

import httpx


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event, data) for each server-sent event, as the SSE spec frames them."""
    event: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line.removeprefix("event:").removeprefix(" ")
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
