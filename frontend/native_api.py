"""POST /generate: the native endpoint, text in and text plus metrics out."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from frontend.accepted import Accepted
from frontend.errors import ApiError, error_body
from frontend.generation import generate_request, respond
from frontend.parse import parse_body
from frontend.schemas import GenerateBody, request_seed
from frontend.streaming import sse_frame
from frontend.worker_client import WorkerClient
from protocol import GenerateResult, TokenDelta

ENDPOINT = "/generate"


async def generate(request: Request) -> Response:
    """Generate text after ``prompt``.

    Body: GenerateBody. Answer: ``{request_id, model, random_weights, text,
    finish_reason, usage{prompt_tokens, completion_tokens},
    metrics{queue_wait_ms, generate_ms, e2e_ms}}``. With ``stream``: server-sent
    events ``token`` (``{text, token_ids}``) as tokens arrive, then ``done`` (the
    answer without its text) or ``error`` (an error body). Errors: 422 invalid
    request, 400 unsupported value, 503 (Retry-After) when full, 504 past
    REQUEST_TIMEOUT_S.
    """
    body, _ = await parse_body(request, GenerateBody)
    client: WorkerClient = request.app.state.client
    work = dataclasses.replace(
        generate_request(client.config, body.max_new_tokens, "max_new_tokens", stop=body.stop),
        prompt=body.prompt,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=request_seed(body.seed),
        stream=body.stream,
        cache_salt=body.cache_salt or "",
    )
    request_id = body.request_id or work.request_id

    def final(accepted: Accepted, results: list[GenerateResult]) -> dict[str, Any]:
        (result,) = results  # /generate has one choice
        return {**_answer(client, request_id, accepted, result), "text": result.text}

    def stream(accepted: Accepted) -> _GenerateStream:
        return _GenerateStream(client, request_id, accepted)

    return await respond(request, work, ENDPOINT, final, stream)


def _answer(
    client: WorkerClient, request_id: str, accepted: Accepted, result: GenerateResult
) -> dict[str, Any]:
    hello = client.hello
    return {
        "request_id": request_id,
        "model": hello.model if hello else None,
        "random_weights": hello.is_random_weights if hello else None,
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


class _GenerateStream:
    def __init__(self, client: WorkerClient, request_id: str, accepted: Accepted) -> None:
        self.client = client
        self.request_id = request_id
        self.accepted = accepted

    def delta(self, index: int, delta: TokenDelta) -> str | None:
        return sse_frame({"text": delta.text, "token_ids": delta.token_ids}, "token")

    def final(self, index: int, result: GenerateResult) -> list[str]:
        return []  # the one choice's result is the request's: `end` sends it

    def end(self, results: list[GenerateResult]) -> list[str]:
        (result,) = results
        answer = _answer(self.client, self.request_id, self.accepted, result)
        return [sse_frame(answer, "done")]

    def error(self, error: ApiError) -> list[str]:
        return [sse_frame(error_body(error), "error")]
