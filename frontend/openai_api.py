"""OpenAI-compatible endpoints: POST /v1/completions and GET /v1/models.

Shaped as OpenAI's legacy completions API, with vLLM's extensions, so that the
`openai` package, load tools and evaluation harnesses built on it work
unchanged, streaming, logprobs and echo included.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.accepted import Accepted
from frontend.errors import ApiError, error_body
from frontend.generation import respond
from frontend.logprobs import TokenScore, completion_logprobs, unpack
from frontend.openai_common import (
    Envelope,
    UsageStream,
    openai_request,
    read_openai_request,
    result_usage,
    served_model,
)
from frontend.openai_schemas import CompletionBody
from frontend.streaming import sse_frame
from frontend.worker_client import WorkerClient
from protocol import GenerateResult, TokenDelta

ENDPOINT = "/v1/completions"
OWNER = "minibatch-llm"


async def completions(request: Request) -> Response:
    """Complete one prompt (text or token ids). Body: CompletionBody. Answer:
    OpenAI's ``text_completion`` object, or with ``stream`` its chunks as
    server-sent events ending in ``data: [DONE]``. Errors in OpenAI's shape."""
    read = await read_openai_request(request, CompletionBody)
    body, client = read.body, read.client
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise ApiError(
            422,
            "max_tokens: must be at least 1; 0 is for echo, to score the prompt alone",
            "invalid_request",
            "max_tokens",
        )
    prompt, prompt_token_ids = _one_prompt(body.prompt)
    if body.echo and body.stream and prompt_token_ids is not None:
        raise ApiError(
            400,
            "echo: a streamed echo needs a text prompt; send the text, or stream false",
            "unsupported",
            "echo",
        )
    work = openai_request(
        body,
        client,
        max_tokens,
        "max_tokens",
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo else None,
        echo=bool(body.echo),
        **read.grammar,
    )
    read.log_ignored(work.request_id)
    completion = _Completion(f"cmpl-{work.request_id}", read.model)

    def final(accepted: Accepted, result: GenerateResult) -> dict[str, Any]:
        text = (result.prompt_text or "") + result.text if body.echo else result.text
        logprobs = None
        if body.logprobs is not None:
            prompt_logprobs, output_logprobs = accepted.entry.all_logprobs(result)
            scores = unpack(prompt_logprobs) if body.echo else []
            for part in output_logprobs:
                scores += unpack(part)
            logprobs = completion_logprobs(scores)
        return completion.chunk(text, result.finish_reason, result_usage(result), logprobs)

    def stream(accepted: Accepted) -> _CompletionStream:
        return _CompletionStream(completion, body, prompt if body.echo else None)

    return await respond(request, work, ENDPOINT, final, stream, read.headers)


async def models(request: Request) -> Response:
    """List the one served model, as the worker's hello names it."""
    client: WorkerClient = request.app.state.client
    model = served_model(client)
    if model is None:
        raise ApiError(503, f"no model is loaded yet: {client.verdict().reason}", "no_worker")
    created: int = request.app.state.started_at
    card = {"id": model, "object": "model", "created": created, "owned_by": OWNER}
    return JSONResponse({"object": "list", "data": [card]})


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


class _Completion(Envelope):
    def chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        usage: dict[str, int] | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choices = (
            []
            if text is None
            else [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}]
        )
        return self.wrap("text_completion", choices, usage)


class _CompletionStream:
    """Chunks of text; a token's logprobs go out with the chunk that shows its
    text (a token whose text is held back waits for it), at offsets counted
    across the whole stream."""

    def __init__(self, completion: _Completion, body: CompletionBody, echo: str | None) -> None:
        self.completion = completion
        self.usage = UsageStream(body)
        self.wants_logprobs = body.logprobs is not None
        self.echo = echo  # the prompt, sent before the first output
        self.pending: list[TokenScore] = []
        self.text_offset = 0

    def delta(self, delta: TokenDelta) -> str | None:
        self.usage.count(delta.prompt_tokens, len(delta.token_ids))
        self._score(delta.prompt_logprobs, delta.logprobs)
        text = self._take_echo() + delta.text
        if not text:
            return None  # tokens whose text is held back: nothing to show yet
        return self._frame(text, None)

    def final(self, result: GenerateResult) -> list[str]:
        self._score(result.prompt_logprobs, result.logprobs)
        frames = [self._frame(self._take_echo(), result.finish_reason)]
        if self.usage.is_final:
            frames.append(sse_frame(self.completion.chunk(None, None, result_usage(result))))
        return [*frames, sse_frame("[DONE]")]

    def error(self, error: ApiError) -> list[str]:
        return [sse_frame(error_body(error)), sse_frame("[DONE]")]

    def _score(self, *parts: Any) -> None:
        if self.wants_logprobs:
            for part in parts:
                self.pending += unpack(part)

    def _take_echo(self) -> str:
        echo, self.echo = self.echo or "", None
        return echo

    def _frame(self, text: str, finish_reason: str | None) -> str:
        logprobs = None
        if self.wants_logprobs:
            logprobs = completion_logprobs(self.pending, self.text_offset)
            self.text_offset += sum(len(score.text) for score in self.pending)
            self.pending = []
        chunk = self.completion.chunk(text, finish_reason, self.usage.so_far(), logprobs)
        return sse_frame(chunk)
