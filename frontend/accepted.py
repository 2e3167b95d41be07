"""One accepted request as its HTTP handler waits on it: entered into the
in-flight table (503 when full), then its deltas and its result one by one, with
the latency metrics they give; 504 past its deadline, `ClientGone` when the
client hangs up. Either way the worker is told to abort, and its slot is freed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from frontend.errors import ApiError
from frontend.inflight import Event, InFlight
from frontend.inflight_table import Overloaded
from frontend.metrics import Metrics
from frontend.worker_client import WorkerClient
from protocol import ErrorResult, GenerateRequest, GenerateResult, TokenDelta

log = logging.getLogger(__name__)

# nginx's code for "client closed request": logged, never received by anyone.
CLIENT_CLOSED_REQUEST = 499


class ClientGone(Exception):
    """The HTTP client hung up; its request was aborted in the worker."""


@dataclass
class Accepted:
    entry: InFlight
    started_at: float  # time.monotonic() when the request was accepted
    endpoint: str  # the route that accepted it, for /metrics
    metrics: Metrics
    last_token_at: float | None = None
    is_answered: bool = False
    # One watcher for the client's disconnect per request, not one per token.
    disconnect: asyncio.Future[None] | None = None

    def stop_watching(self) -> None:
        if self.disconnect is not None:
            self.disconnect.cancel()

    def on_delta(self, delta: TokenDelta) -> None:
        if not delta.token_ids:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - self.started_at)
        else:
            # A delta normally holds one step's token; spread a longer one evenly.
            gap_s = (now - self.last_token_at) / len(delta.token_ids)
            for _ in delta.token_ids:
                self.metrics.inter_token_latency.observe(gap_s)
        self.last_token_at = now

    def on_result(self, result: GenerateResult) -> None:
        self.is_answered = True
        self.metrics.observe_result(self.endpoint, result, time.monotonic() - self.started_at)

    def on_client_gone(self) -> None:
        self.is_answered = True
        self.metrics.count_request(self.endpoint, CLIENT_CLOSED_REQUEST, "abort")


def accept(
    client: WorkerClient,
    request: GenerateRequest,
    timeout_s: float,
    metrics: Metrics,
    endpoint: str,
) -> Accepted:
    """Enter a request into the in-flight table, or raise 503."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    started_at = time.monotonic()  # before the send: the worker may start at once
    try:
        entry = client.submit(request, deadline)
    except Overloaded as exc:
        raise ApiError(503, str(exc), "queue_full") from None
    return Accepted(entry, started_at, endpoint, metrics)


def abandon(client: WorkerClient, accepted: Accepted) -> None:
    """The response ended before the request's answer (a stream the client closed):
    abort it in the worker so that its slot is freed."""
    accepted.stop_watching()
    if not accepted.is_answered:
        client.cancel(accepted.entry)
        accepted.on_client_gone()
        log.info("request %s: response closed early; aborted", accepted.entry.request_id)


async def next_event(
    http_request: Request, client: WorkerClient, accepted: Accepted
) -> TokenDelta | GenerateResult:
    """The request's next delta or its result. Raises ApiError for a worker error
    or a passed deadline (504), and ClientGone when the client disconnects; in
    both cases the worker is told to abort."""
    entry = accepted.entry
    if not entry.events.empty():
        return _take(accepted, entry.events.get_nowait())
    if accepted.disconnect is None:
        accepted.disconnect = asyncio.ensure_future(_disconnected(http_request))
    remaining = entry.deadline - asyncio.get_running_loop().time()
    event_task = asyncio.ensure_future(entry.events.get())
    waiting: set[asyncio.Future[Any]] = {event_task, accepted.disconnect}
    try:
        done, _ = await asyncio.wait(
            waiting,
            timeout=max(0.0, remaining),
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        # Also when this coroutine is cancelled (Starlette cancels a stream whose
        # client hung up): asyncio.wait leaves its tasks running, and a Queue.get
        # nobody awaits is destroyed pending and logged as an error.
        if not event_task.done():
            event_task.cancel()
    if event_task in done:
        return _take(accepted, event_task.result())
    with contextlib.suppress(asyncio.CancelledError):
        await event_task
    client.cancel(entry)
    accepted.is_answered = True
    if accepted.disconnect in done:
        accepted.on_client_gone()
        log.info("request %s: client disconnected; aborted", entry.request_id)
        raise ClientGone(entry.request_id)
    accepted.stop_watching()
    log.warning("request %s: deadline passed; aborted", entry.request_id)
    raise ApiError(
        504,
        f"no answer within REQUEST_TIMEOUT_S={client.config.request_timeout_s:g} s "
        f"(worker: {client.verdict().reason}); retry later, or ask for fewer tokens",
        "timeout",
    )


def _take(accepted: Accepted, event: Event) -> TokenDelta | GenerateResult:
    if isinstance(event, TokenDelta):
        accepted.on_delta(event)
        return event
    accepted.stop_watching()
    if isinstance(event, ErrorResult):
        accepted.is_answered = True
        raise ApiError.from_worker(event)
    accepted.on_result(event)
    return event


async def final_result(
    http_request: Request, client: WorkerClient, accepted: Accepted
) -> GenerateResult:
    while True:
        event = await next_event(http_request, client, accepted)
        if isinstance(event, GenerateResult):
            return event


async def _disconnected(request: Request) -> None:
    # Once the body is read, the next ASGI message is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
