"""OpenAI-compatible endpoints: POST /v1/completions and GET /v1/models.

Shaped as OpenAI's legacy completions API, so that the `openai` package and
load tools built on it work unchanged, streaming included.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.errors import ApiError, error_body
from frontend.generation import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    accept,
    final_result,
    new_request_id,
)
from frontend.metrics import Metrics
from frontend.schemas import CompletionBody, check_max_new_tokens, parse_body, stop_strings
from frontend.streaming import sse_frame, stream_response
from frontend.worker_client import WorkerClient
from protocol import GenerateRequest, GenerateResult, TokenDelta

ENDPOINT = "/v1/completions"
OWNER = "minibatch-llm"


async def completions(request: Request) -> Response:
    """Complete one prompt (text or token ids). Body: CompletionBody. Answer:
    OpenAI's ``text_completion`` object, or with ``stream`` its chunks as
    server-sent events ending in ``data: [DONE]``. Errors in OpenAI's shape."""
    body = await parse_body(request, CompletionBody)
    client: WorkerClient = request.app.state.client
    metrics: Metrics = request.app.state.metrics
    unsupported = body.unsupported()
    if unsupported is not None:
        param, message = unsupported
        raise ApiError(400, message, "unsupported", param)
    model = _served_model(client)
    if model is not None and body.model != model:
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; this server serves {model!r}",
            "model_not_found",
            "model",
        )
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    check_max_new_tokens(max_tokens, client.config.max_new_tokens_limit, "max_tokens")
    prompt, prompt_token_ids = _one_prompt(body.prompt)
    work = GenerateRequest(
        request_id=new_request_id(),
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        max_new_tokens=max_tokens,
        stop=stop_strings(body.stop),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stream=bool(body.stream),
    )
    accepted = accept(client, work, client.config.request_timeout_s, metrics, ENDPOINT)
    completion = _Completion(f"cmpl-{work.request_id}", model or body.model)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await stream_response(
            request, client, accepted, _CompletionStream(completion, include_usage)
        )
    try:
        result = await final_result(request, client, accepted)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    usage = _usage(result)
    return JSONResponse(completion.chunk(result.text, result.finish_reason, usage))


async def models(request: Request) -> Response:
    """List the one served model, as the worker's hello names it."""
    client: WorkerClient = request.app.state.client
    model = _served_model(client)
    if model is None:
        raise ApiError(503, f"no model is loaded yet: {client.verdict().reason}", "no_worker")
    created: int = request.app.state.started_at
    card = {"id": model, "object": "model", "created": created, "owned_by": OWNER}
    return JSONResponse({"object": "list", "data": [card]})


def _served_model(client: WorkerClient) -> str | None:
    hello = client.hello
    return hello.model if hello else None


def _one_prompt(
    prompt: str | list[int] | list[str] | list[list[int]],
) -> tuple[str, list[int] | None]:
    """The prompt as text, or as token ids; a batch of prompts must hold exactly one."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(422, "prompt: must not be empty", "invalid_request", "prompt")
        return prompt, None
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(
                400,
                f"prompt: got a batch of {len(prompt)} prompts; this server takes one "
                "prompt per request: send them as separate requests",
                "unsupported",
                "prompt",
            )
        return _one_prompt(prompt[0])
    if not prompt:
        raise ApiError(422, "prompt: must not be empty", "invalid_request", "prompt")
    return "", [int(token_id) for token_id in prompt]  # type: ignore[arg-type]


def _usage(result: GenerateResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


class _Completion:
    def __init__(self, completion_id: str, model: str) -> None:
        self.id = completion_id
        self.model = model
        self.created = int(time.time())

    def chunk(
        self, text: str | None, finish_reason: str | None, usage: dict[str, int] | None
    ) -> dict[str, Any]:
        choices = (
            []
            if text is None
            else [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]
        )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


class _CompletionStream:
    def __init__(self, completion: _Completion, include_usage: bool) -> None:
        self.completion = completion
        self.include_usage = include_usage

    def delta(self, delta: TokenDelta) -> str | None:
        if not delta.text:
            return None  # tokens whose text is held back: nothing to show yet
        return sse_frame(self.completion.chunk(delta.text, None, None))

    def final(self, result: GenerateResult) -> list[str]:
        frames = [sse_frame(self.completion.chunk("", result.finish_reason, None))]
        if self.include_usage:
            usage = _usage(result)
            frames.append(sse_frame(self.completion.chunk(None, None, usage)))
        return [*frames, sse_frame("[DONE]")]

    def error(self, error: ApiError) -> list[str]:
        return [sse_frame(error_body(error)), sse_frame("[DONE]")]
