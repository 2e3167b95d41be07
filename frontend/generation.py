"""One request's life, the same for every endpoint: the request for the worker,
built and checked; accepted into the in-flight table (503 when it is full);
answered exactly once, as one JSON object or as server-sent events while tokens
arrive; 504 past its deadline, and 499 (logged, never received) when the client
hangs up first.

An endpoint brings only its own parts: reading its body, the fields of its
request, and the shapes of its answer (``final``) and of its stream (``stream``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from frontend.accepted import CLIENT_CLOSED_REQUEST, Accepted, ClientGone, accept, final_results
from frontend.config import FrontendConfig
from frontend.errors import ApiError
from frontend.json_response import JSONResponse
from frontend.metrics import Metrics
from frontend.streaming import StreamFormat, stream_response
from frontend.worker_client import WorkerClient
from protocol import ErrorResult, GenerateRequest, GenerateResult
from protocol.request_checks import limits_of, min_tokens_problem, request_problem

# The JSON answer of a request that does not stream, from its choices' results.
FinalAnswer = Callable[[Accepted, list[GenerateResult]], dict[str, Any]]
# The frames of a request that streams.
StreamAnswer = Callable[[Accepted], StreamFormat]

# Logprobs (each scored token and each of its top tokens) past which an answer is
# built and rendered on a thread, not on the event loop: 8 choices scoring a
# 1,020-token prompt with 20 top logprobs each took the loop about 220 ms (Xeon,
# loaded), while every other request and stream waited. On the thread the GIL
# still serializes the work, but the loop takes its turn every few milliseconds.
MAX_LOGPROBS_ON_LOOP = 10_000


def generate_request(
    config: FrontendConfig,
    max_new_tokens: int,
    max_tokens_param: str,
    min_tokens: int = 0,
    stop: str | list[str] | None = None,
) -> GenerateRequest:
    """The request for the worker, under a new request id, its budget checked:
    422 when max_new_tokens (the client's ``max_tokens_param``) is over
    MAX_NEW_TOKENS_LIMIT, or min_tokens is over it (the body's schema refused an
    empty stop string). Its other fields (the prompt, sampling, what to score)
    are the caller's to set with `dataclasses.replace`, which mypy checks field
    by field."""
    check_max_new_tokens(max_new_tokens, config.max_new_tokens_limit, max_tokens_param)
    # Here too, as the worker checks it: with no worker live, it would wait for one.
    problem = min_tokens_problem(min_tokens, max_new_tokens, max_tokens_param)
    if problem is not None:
        raise ApiError(422, problem, "invalid_request", "min_tokens")
    return GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt="",
        max_new_tokens=max_new_tokens,
        min_tokens=min_tokens,
        stop=stop_strings(stop),
    )


def _check_as_a_worker_would(
    client: WorkerClient, work: GenerateRequest, field_names: Mapping[str, str]
) -> None:
    """Refuse at once, as the workers would (the same checks, with the limits
    their hellos gave), a request that no live worker can serve: it would
    otherwise wait for a free slot first, and under load get a 504 instead. With
    no live worker, nothing is judged: the next one may serve another model."""
    problems = []  # with each worker's context window: the roomiest one's is told
    for link in client.workers():
        if link.hello is None or not link.verdict().is_live:
            continue
        limits = limits_of(link.hello)
        problem = None if limits is None else request_problem(work, limits)
        if limits is None or problem is None:
            return  # this one may serve it (one that does not say its limits, too)
        problems.append((limits.context_window, problem))
    if problems:
        _, (code, message) = max(problems)
        raise ApiError.from_worker(ErrorResult(work.request_id, code, message), field_names)


async def respond(
    http_request: Request,
    work: GenerateRequest,
    endpoint: str,
    final: FinalAnswer,
    stream: StreamAnswer | None = None,
    headers: dict[str, str] | None = None,
    num_choices: int = 1,
    field_names: Mapping[str, str] | None = None,
) -> Response:
    """Run ``work`` to its one answer: ``final``'s JSON, or, when it asked to
    stream and the endpoint streams, ``stream``'s events. ``endpoint`` names it
    in /metrics; ``headers`` go on the answer; ``num_choices`` choices are
    generated (`frontend.choices`); ``field_names`` are the body's names for the
    worker's fields where they differ (a worker error names the field). Raises
    ApiError (503 when the table has no room for them all; a worker error or 504
    before the answer started)."""
    client: WorkerClient = http_request.app.state.client
    _check_as_a_worker_would(client, work, field_names or {})
    metrics: Metrics = http_request.app.state.metrics
    # Less the time it waited for a first worker to name its model, if it did.
    waited_s = getattr(http_request.state, "waited_for_hello_s", 0.0)
    timeout_s = client.config.request_timeout_s - waited_s
    accepted = accept(client, work, num_choices, timeout_s, metrics, endpoint, field_names or {})
    if work.stream and stream is not None:
        return await stream_response(http_request, client, accepted, stream(accepted), headers)
    try:
        results = await final_results(http_request, client, accepted)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return await json_answer(work, final, accepted, results, headers)


async def json_answer(
    work: GenerateRequest,
    final: FinalAnswer,
    accepted: Accepted,
    results: list[GenerateResult],
    headers: dict[str, str] | None,
) -> Response:
    """``final``'s answer, built and rendered on a thread if it is large."""

    def build() -> Response:
        return JSONResponse(final(accepted, results), headers=headers)

    if _num_logprobs(work, results) > MAX_LOGPROBS_ON_LOOP:
        return await asyncio.to_thread(build)
    return build()


def _num_logprobs(work: GenerateRequest, results: list[GenerateResult]) -> int:
    """How many logprobs the answer to ``work`` holds, about."""
    num = 0
    if work.logprobs is not None:
        num += sum(result.completion_tokens for result in results) * (1 + work.logprobs)
    if work.prompt_logprobs is not None:
        num += sum(result.prompt_tokens for result in results) * (1 + work.prompt_logprobs)
    return num


def check_max_new_tokens(value: int, limit: int, param: str) -> None:
    if value > limit:
        raise ApiError(
            422,
            f"{param}: {value} is more than this server's limit, "
            f"MAX_NEW_TOKENS_LIMIT={limit}; ask for fewer",
            "invalid_request",
            param,
        )


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """One list of stop strings (the body's schema refused an empty one)."""
    return [stop] if isinstance(stop, str) else list(stop or [])
