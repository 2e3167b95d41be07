"""The Starlette application: routes, and the worker link's lifetime."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend.errors import ApiError, handle_api_error
from frontend.generation import Accepted, ClientGone, accept, final_result, new_request_id
from frontend.schemas import GenerateBody, describe
from frontend.worker_client import WorkerClient
from protocol import GenerateRequest, GenerateResult
from protocol.config import FrontendConfig

log = logging.getLogger(__name__)

# nginx's code for "client closed request": logged, never received by anyone.
CLIENT_CLOSED_REQUEST = 499


def create_app(config: FrontendConfig) -> Starlette:
    client = WorkerClient(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.close()

    app = Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
        ],
        exception_handlers={ApiError: handle_api_error},
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.client = client
    return app


def _client(request: Request) -> WorkerClient:
    client: WorkerClient = request.app.state.client
    return client


async def parse_body(request: Request, schema: type[GenerateBody]) -> GenerateBody:
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as exc:
        raise ApiError(422, describe(exc), "invalid_request") from None


async def generate(request: Request) -> Response:
    """Generate text after ``prompt``.

    Body: GenerateBody. Answer: ``{request_id, model, random_weights, text,
    finish_reason, usage{prompt_tokens, completion_tokens},
    metrics{queue_wait_ms, generate_ms, e2e_ms}}``. Errors: 422 invalid request,
    400 unsupported value, 503 (Retry-After) when full, 504 past REQUEST_TIMEOUT_S.
    """
    body = await parse_body(request, GenerateBody)
    client = _client(request)
    config = client.config
    if body.max_new_tokens > config.max_new_tokens_limit:
        raise ApiError(
            422,
            f"max_new_tokens: {body.max_new_tokens} is more than "
            f"MAX_NEW_TOKENS_LIMIT={config.max_new_tokens_limit}",
            "invalid_request",
        )
    try:
        stop = body.stop_strings()
    except ValueError as exc:
        raise ApiError(422, str(exc), "invalid_request") from None
    work = GenerateRequest(
        request_id=new_request_id(),
        prompt=body.prompt,
        max_new_tokens=body.max_new_tokens,
        stop_token_ids=body.stop_token_ids,
        stop=stop,
        ignore_eos=body.ignore_eos,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stream=body.stream,
    )
    accepted = accept(client, work, config.request_timeout_s)
    client_request_id = body.request_id or work.request_id
    try:
        result = await final_result(request, client, accepted)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(_generate_answer(client, client_request_id, accepted, result))


def _generate_answer(
    client: WorkerClient, request_id: str, accepted: Accepted, result: GenerateResult
) -> dict[str, Any]:
    hello = client.liveness.hello
    return {
        "request_id": request_id,
        "model": hello.model if hello else None,
        "random_weights": hello.is_random_weights if hello else None,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
        },
        "metrics": {
            "queue_wait_ms": round(result.queue_wait_ms, 3),
            "generate_ms": round(result.generate_ms, 3),
            "e2e_ms": round((time.monotonic() - accepted.started_at) * 1000, 3),
        },
    }


def _status(client: WorkerClient) -> dict[str, Any]:
    verdict = client.verdict()
    hello = client.liveness.hello
    heartbeat = client.liveness.last_heartbeat
    return {
        "status": "ok" if verdict.is_live else "unavailable",
        "worker": verdict.state.value,
        "reason": verdict.reason,
        "model": hello.model if hello else None,
        "random_weights": hello.is_random_weights if hello else None,
        "instance_id": hello.instance_id if hello else None,
        "capacity": hello.capacity if hello else None,
        "context_window": hello.context_window if hello else None,
        "queued": heartbeat.num_queued if heartbeat else None,
        "active": heartbeat.num_active if heartbeat else None,
        "inflight": client.num_inflight,
        "worker_restarts": client.num_worker_restarts,
    }


async def health(request: Request) -> Response:
    """200 while a worker is live (judged from its heartbeats), else 503 and why."""
    status = _status(_client(request))
    return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503)


async def ready(request: Request) -> Response:
    """For load balancers: 200 only when a worker is live and there is room for
    more requests; 503 (hold off) otherwise."""
    client = _client(request)
    status = _status(client)
    has_room = client.num_inflight < client.config.max_queue_depth
    is_ready = status["status"] == "ok" and has_room
    if status["status"] == "ok" and not has_room:
        status["reason"] = f"MAX_QUEUE_DEPTH={client.config.max_queue_depth} requests in flight"
    status["ready"] = is_ready
    return JSONResponse(status, status_code=200 if is_ready else 503)
