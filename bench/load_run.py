"""One run of the drills' workload: streamed requests at a steady concurrency
against one or more frontends, each request's answer, text and token times
recorded, so that a run with faults can be held to one without."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from httpx_sse import EventSource


@dataclass
class Outcome:
    sent: int = 0
    succeeded: int = 0
    failed_by_status: Counter[int] = field(default_factory=Counter)
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    texts: dict[str, str] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)  # of each success
    # When each success was sent, then when each of its tokens arrived.
    token_times: dict[str, list[float]] = field(default_factory=dict)
    completed_at: list[float] = field(default_factory=list)


class LoadRun:
    """A workload sent at steady concurrency. Faults and poison run alongside it and
    pace themselves on its progress."""

    def __init__(
        self, urls: list[str], bodies: list[dict[str, object]], concurrency: int, timeout_s: float
    ) -> None:
        self.urls = urls
        self.url = urls[0]
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.outcome = Outcome()
        self.in_flight: set[str] = set()  # request ids sent and not yet answered
        self._waiting = deque(bodies)
        self._progress = asyncio.Event()  # set whenever a request ends

    async def run(self, *alongside: Callable[[LoadRun], Awaitable[object]]) -> Outcome:
        async with contextlib.AsyncExitStack() as clients:
            # Each user talks to one frontend, the frontends in turn.
            tasks = []
            for i in range(self.concurrency):
                url = self.urls[i % len(self.urls)]
                client = await clients.enter_async_context(httpx.AsyncClient(base_url=url))
                tasks.append(asyncio.create_task(self._client_loop(client)))
            await asyncio.gather(*tasks, *(side(self) for side in alongside))
        return self.outcome

    async def wait_for_num_completed(self, num_completed: int) -> bool:
        """Until ``num_completed`` requests have been answered: True, or False if the
        workload ended first."""
        return await self._wait_until(lambda: len(self.outcome.completed_at) >= num_completed)

    async def wait_for_answers(self, request_ids: set[str]) -> bool:
        """Until none of ``request_ids`` is still in flight."""
        return await self._wait_until(lambda: request_ids.isdisjoint(self.in_flight))

    async def _wait_until(self, condition: Callable[[], bool]) -> bool:
        while not condition():
            if not self._waiting and not self.in_flight:
                return False
            self._progress.clear()
            await self._progress.wait()
        return True

    async def _client_loop(self, client: httpx.AsyncClient) -> None:
        outcome = self.outcome
        while self._waiting:
            body = self._waiting.popleft()
            request_id = str(body["request_id"])
            outcome.sent += 1
            self.in_flight.add(request_id)
            sent_at = time.monotonic()
            try:
                status, answer, text, token_times = await _post_streamed(
                    client, body, self.timeout_s
                )
            except httpx.TimeoutException:
                outcome.lost += 1
                continue
            except httpx.TransportError:
                outcome.failed_by_status[0] += 1  # connection refused/reset: no status
                continue
            finally:
                self.in_flight.discard(request_id)
                self._progress.set()
            outcome.completed_at.append(time.monotonic())
            if answer is None:
                outcome.failed_by_status[status] += 1
                continue
            if answer["request_id"] != request_id or request_id in outcome.texts:
                outcome.duplicated += 1
                continue
            outcome.succeeded += 1
            outcome.texts[request_id] = text
            outcome.token_times[request_id] = [sent_at, *token_times]
            outcome.latency_s[request_id] = time.monotonic() - sent_at


async def _post_streamed(
    client: httpx.AsyncClient, body: dict[str, object], timeout_s: float
) -> tuple[int, dict[str, object] | None, str, list[float]]:
    """POST ``body`` as a stream: the HTTP status, the final answer (None if the
    request failed: the status, or 500 for an error event), the text, and when
    each token arrived."""
    text, token_times = "", list[float]()
    streamed = {**body, "stream": True}
    async with client.stream("POST", "/generate", json=streamed, timeout=timeout_s) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None, text, token_times
        async for sse in EventSource(response).aiter_sse():
            payload = json.loads(sse.data)
            if sse.event == "token":
                text += payload["text"]
                if payload["token_ids"]:
                    token_times.append(time.monotonic())
            elif sse.event == "done":
                return 200, payload, text, token_times
            else:
                break
    return 500, None, text, token_times


def stall_across(times: list[float], at: float) -> float | None:
    """How long the token stream ``times`` (its send time first) paused across
    ``at``: from the last token before it (or the send) to the first after."""
    before = [t for t in times if t <= at]
    after = [t for t in times if t > at]
    if not before or not after:
        return None
    return after[0] - before[-1]


async def health(url: str) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        return dict((await client.get("/health")).json())


def check_answers(reference: Outcome, drill: Outcome) -> tuple[dict[str, object], int]:
    """Print how the drill's requests fared against the reference; return that
    summary and the number of requests that went wrong in any way."""
    drill.wrong = sum(
        1 for rid, text in drill.texts.items() if reference.texts.get(rid) not in (None, text)
    )
    failed = sum(drill.failed_by_status.values())
    rows = [
        ("requests sent", drill.sent),
        ("succeeded", drill.succeeded),
        ("failed", failed),
        *(
            (f"  failed with HTTP {code or 'none'}", n)
            for code, n in drill.failed_by_status.items()
        ),
        ("lost (no answer by the deadline)", drill.lost),
        ("duplicated", drill.duplicated),
        ("wrong text", drill.wrong),
    ]
    for name, value in rows:
        print(f"  {name:<34} {value:>6}")
    summary = {
        "sent": drill.sent,
        "succeeded": drill.succeeded,
        "failed_by_status": {str(k): v for k, v in drill.failed_by_status.items()},
        "lost": drill.lost,
        "duplicated": drill.duplicated,
        "wrong": drill.wrong,
    }
    return summary, failed + drill.lost + drill.duplicated + drill.wrong
