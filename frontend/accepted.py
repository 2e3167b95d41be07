"""One accepted request as its HTTP handler waits on it: entered into the
in-flight table (503 when full), then its deltas and its results one by one,
with the latency metrics they give; 504 past its deadline, `ClientGone` when the
client hangs up. Either way the worker is told to abort, and its slots are freed.

A request with n choices (`frontend.choices`) is n entries in the table with one
event queue, one deadline and one disconnect: it is answered once every choice
has its result, and it ends, every choice aborted, at the first error, the
deadline or the client's hang-up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from frontend.choices import choice_requests
from frontend.errors import NEVER_RAN, ApiError
from frontend.inflight import Event, InFlight
from frontend.inflight_table import Overloaded
from frontend.metrics import Metrics
from frontend.worker_client import WorkerClient
from protocol import ErrorResult, FinishReason, GenerateRequest, GenerateResult, TokenDelta
from protocol.liveness import Verdict
from protocol.throttled import Throttled

log = logging.getLogger(__name__)
# A client can hang up, or let requests time out, as fast as it likes: their
# lines are held to one a second each (`/metrics` counts every one).
_CLOSED_EARLY = Throttled(log, "responses closed early", logging.INFO)
_CLIENT_GONE = Throttled(log, "client disconnects", logging.INFO)
_DEADLINE_PASSED = Throttled(log, "requests past their deadline")

# nginx's code for "client closed request": logged, never received by anyone.
CLIENT_CLOSED_REQUEST = 499

# One choice's delta or result, with the choice's index.
ChoiceEvent = tuple[int, TokenDelta | GenerateResult]


class ClientGone(Exception):
    """The HTTP client hung up; its request was aborted in the worker."""


@dataclass
class Accepted:
    request_id: str  # the client request's; its choices' ids derive from it
    entries: list[InFlight]  # one per choice, in order
    started_at: float  # time.monotonic() when the request was accepted
    endpoint: str  # the route that accepted it, for /metrics
    metrics: Metrics
    # The worker's field -> the endpoint's body's, where it names one its own way:
    # the worker's errors name the field as the client sent it.
    field_names: Mapping[str, str]
    results: list[GenerateResult | None] = field(init=False)
    last_token_at: list[float | None] = field(init=False)  # per choice
    is_answered: bool = False
    # One watcher for the client's disconnect per request, not one per token.
    disconnect: asyncio.Future[None] | None = None

    def __post_init__(self) -> None:
        self.results = [None] * len(self.entries)
        self.last_token_at = [None] * len(self.entries)

    @property
    def is_finished(self) -> bool:
        """Every choice has its result."""
        return all(result is not None for result in self.results)

    def finished_results(self) -> list[GenerateResult]:
        """Every choice's result, in order; only once it `is_finished`."""
        return [result for result in self.results if result is not None]

    def stop_watching(self) -> None:
        if self.disconnect is not None:
            self.disconnect.cancel()

    def cancel(self, client: WorkerClient) -> None:
        """Abort every choice not yet answered: the request has its one answer."""
        self.is_answered = True
        self.stop_watching()
        client.cancel(self.entries)

    def on_delta(self, index: int, delta: TokenDelta) -> None:
        if not delta.token_ids:
            return
        now = time.monotonic()
        last_token_at = self.last_token_at[index]
        if last_token_at is None:
            if all(at is None for at in self.last_token_at):
                self.metrics.time_to_first_token.observe(now - self.started_at)
        else:
            # A delta normally holds one step's token; spread a longer one evenly.
            gap_s = (now - last_token_at) / len(delta.token_ids)
            for _ in delta.token_ids:
                self.metrics.inter_token_latency.observe(gap_s)
        self.last_token_at[index] = now

    def on_result(self, index: int, result: GenerateResult) -> None:
        self.results[index] = result
        if self.is_finished:
            self.is_answered = True
            self.stop_watching()
            e2e_s = time.monotonic() - self.started_at
            self.metrics.observe_results(self.endpoint, self.finished_results(), e2e_s)

    def on_client_gone(self) -> None:
        self.metrics.count_request(self.endpoint, CLIENT_CLOSED_REQUEST, FinishReason.ABORT)


def accept(
    client: WorkerClient,
    request: GenerateRequest,
    num_choices: int,
    timeout_s: float,
    metrics: Metrics,
    endpoint: str,
    field_names: Mapping[str, str],
) -> Accepted:
    """Enter a request's ``num_choices`` choices into the in-flight table, or
    raise 503 when they do not all fit."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    started_at = time.monotonic()  # before the send: the worker may start at once
    try:
        entries = client.submit(choice_requests(request, num_choices), deadline)
    except Overloaded as exc:
        raise ApiError(503, str(exc), "queue_full") from None
    return Accepted(request.request_id, entries, started_at, endpoint, metrics, field_names)


def abandon(client: WorkerClient, accepted: Accepted) -> None:
    """The response ended before the request's answer (a stream the client closed):
    abort it in the worker so that its slots are freed."""
    accepted.stop_watching()
    if not accepted.is_answered:
        accepted.cancel(client)
        accepted.on_client_gone()
        _CLOSED_EARLY.warn(f"request {accepted.request_id}: response closed early; aborted")


async def next_event(
    http_request: Request, client: WorkerClient, accepted: Accepted
) -> ChoiceEvent:
    """A choice's next delta or its result. Raises ApiError for a worker error
    (every other choice is aborted) or a passed deadline (504), and ClientGone
    when the client disconnects; in both cases the worker is told to abort."""
    events = accepted.entries[0].events
    if not events.empty():
        return _take(client, accepted, events.get_nowait())
    if accepted.disconnect is None:
        accepted.disconnect = asyncio.ensure_future(_disconnected(http_request))
    remaining = accepted.entries[0].deadline - asyncio.get_running_loop().time()
    event_task = asyncio.ensure_future(events.get())
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
        return _take(client, accepted, event_task.result())
    # Let the cancelled get finish; asyncio.wait does not raise its CancelledError,
    # while this coroutine's own cancellation still propagates.
    await asyncio.wait({event_task})
    # Before the cancel, which lets go of where each choice was.
    never_ran = all(entry.has_never_run for entry in accepted.entries)
    accepted.cancel(client)
    if accepted.disconnect in done:
        accepted.on_client_gone()
        _CLIENT_GONE.warn(f"request {accepted.request_id}: client disconnected; aborted")
        raise ClientGone(accepted.request_id)
    _DEADLINE_PASSED.warn(f"request {accepted.request_id}: deadline passed; aborted")
    verdict = client.verdict()
    raise ApiError(
        504,
        f"no answer within REQUEST_TIMEOUT_S={client.config.request_timeout_s:g} s "
        f"(worker: {verdict.reason}){_timeout_advice(client, accepted, never_ran, verdict)}",
        "timeout",
        headers=NEVER_RAN if never_ran else None,
    )


def _timeout_advice(
    client: WorkerClient, accepted: Accepted, never_ran: bool, verdict: Verdict
) -> str:
    """What to do about a 504, as its x-should-retry says: retry one that never
    ran; for one that ran, fewer tokens, where a worker is there to make them."""
    if never_ran:
        return "; retry later"
    if not verdict.is_live:
        return ""
    if any(entry.request.fit_context for entry in accepted.entries):
        limit = client.config.max_new_tokens_limit
        return (
            "; set max_tokens: none was set, so it may write up to "
            f"MAX_NEW_TOKENS_LIMIT={limit} tokens, as the context window allows"
        )
    return "; ask for fewer tokens"


def _take(client: WorkerClient, accepted: Accepted, event: tuple[int, Event]) -> ChoiceEvent:
    index, message = event
    if isinstance(message, TokenDelta):
        accepted.on_delta(index, message)
        return index, message
    if isinstance(message, ErrorResult):
        # One answer per request: a choice's error is the request's, as OpenAI's.
        accepted.cancel(client)
        raise ApiError.from_worker(message, accepted.field_names)
    accepted.on_result(index, message)
    return index, message


async def final_results(
    http_request: Request, client: WorkerClient, accepted: Accepted
) -> list[GenerateResult]:
    """Every choice's result, in order."""
    while not accepted.is_finished:
        await next_event(http_request, client, accepted)
    return accepted.finished_results()


async def _disconnected(request: Request) -> None:
    # Once the body is read, the next ASGI message is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
