"""OpenAI-compatible endpoints: POST /v1/completions and GET /v1/models.

Shaped as OpenAI's legacy completions API, with vLLM's extensions, so that the
`openai` package, load tools and evaluation harnesses built on it work
unchanged, streaming, logprobs, echo, ``n`` and ``best_of`` included.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from frontend.accepted import Accepted
from frontend.choice_stream import ChoiceStream
from frontend.choices import best_choices, num_to_generate
from frontend.errors import ApiError
from frontend.generation import respond
from frontend.inflight import InFlight
from frontend.json_response import JSONResponse
from frontend.logprobs import TextOffsets, TokenScore, completion_logprobs, unpack_logprobs
from frontend.openai_common import (
    Envelope,
    UsageStream,
    check_model,
    check_requested_model,
    openai_request,
    read_openai_request,
    results_usage,
    served_model,
)
from frontend.openai_schemas import CompletionBody
from frontend.streaming import sse_frame
from frontend.worker_client import WorkerClient
from protocol import GenerateResult, Logprobs, TokenDelta

ENDPOINT = "/v1/completions"
OWNER = "minibatch-llm"


async def completions(request: Request) -> Response:
    """Complete one prompt (text or token ids). Body: CompletionBody. Answer:
    OpenAI's ``text_completion`` object, or with ``stream`` its chunks as
    server-sent events ending in ``data: [DONE]``. Errors in OpenAI's shape."""
    read = await read_openai_request(request, CompletionBody)
    body, client = read.body, read.client
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens < (0 if body.echo else 1):
        raise ApiError(
            422,
            f"max_tokens: must be at least 1 (0 with echo, to score the prompt alone), "
            f"got {max_tokens:,}",
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
    n = body.n or 1
    num_choices = num_to_generate(
        n, body.best_of, bool(body.stream), client.config.max_inflight_requests
    )
    is_ranked = num_choices > n  # best_of: the n likeliest of num_choices
    is_asked = "max_tokens" in body.model_fields_set and body.max_tokens is not None
    budget = "max_tokens" if is_asked else "max_tokens' default"
    work = dataclasses.replace(
        openai_request(read, max_tokens, budget),
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        # best_of ranks the choices by their tokens' logprobs: ask for those at least.
        logprobs=0 if is_ranked and body.logprobs is None else body.logprobs,
        prompt_logprobs=body.logprobs if body.echo else None,
        echo=bool(body.echo),
    )
    read.log_ignored(work.request_id)
    model = await check_requested_model(request, client, body.model)
    completion = Envelope(f"cmpl-{work.request_id}", model)

    def choice(index: int, entry: InFlight, result: GenerateResult) -> dict[str, Any]:
        echoed = (result.prompt_text or "") if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            prompt_logprobs, output_logprobs = entry.all_logprobs(result)
            prompt_scores = unpack_logprobs(prompt_logprobs) if body.echo else []
            scores = [score for part in output_logprobs for score in unpack_logprobs(part)]
            offsets = TextOffsets().place(prompt_scores) + TextOffsets(len(echoed)).place(scores)
            logprobs = completion_logprobs(prompt_scores + scores, offsets)
        return _choice(index, echoed + result.text, logprobs, result.finish_reason)

    def final(accepted: Accepted, results: list[GenerateResult]) -> dict[str, Any]:
        entries = accepted.entries
        shown = best_choices(entries, results, n) if is_ranked else range(n)
        choices = [choice(index, entries[i], results[i]) for index, i in enumerate(shown)]
        return completion.wrap(_KIND, choices, results_usage(results))

    def stream(accepted: Accepted) -> ChoiceStream:
        usage = UsageStream(body)
        echo = prompt if body.echo else None

        def chunks(index: int) -> _CompletionStream:
            return _CompletionStream(completion, body, echo, index, usage)

        return ChoiceStream(completion, _KIND, usage, n, chunks)

    renamed = {"max_new_tokens": "max_tokens"}
    return await respond(request, work, ENDPOINT, final, stream, read.headers, num_choices, renamed)


async def models(request: Request) -> Response:
    """List the one served model, as the worker's hello names it."""
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def retrieve_model(request: Request) -> Response:
    """The served model's card (the `openai` client's ``models.retrieve``); 404
    for any other name."""
    card = _model_card(request)
    check_model(request.app.state.client, request.path_params["model"])
    return JSONResponse(card)


def _model_card(request: Request) -> dict[str, Any]:
    """The served model as OpenAI describes one; 503 before a worker has said hello."""
    client: WorkerClient = request.app.state.client
    name = served_model(client)
    if name is None:
        raise ApiError(
            503,
            f"no model is loaded yet: {client.verdict().reason}; retry once a worker is up "
            "(GET /ready says when)",
            "no_worker",
        )
    created: int = request.app.state.started_at
    return {"id": name, "object": "model", "created": created, "owned_by": OWNER}


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
    # Already checked to be ints; copying half a million of them costs ~30 ms.
    return "", typing.cast("list[int]", prompt)


def _choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


class _CompletionStream:
    """One choice's chunks of text; a token's logprobs go out with the chunk
    that shows its text (a token whose text is held back waits for it), at
    offsets counted across the choice's whole stream."""

    def __init__(
        self,
        completion: Envelope,
        body: CompletionBody,
        echo: str | None,
        index: int,
        usage: UsageStream,
    ) -> None:
        self.completion = completion
        self.index = index
        self.usage = usage
        self.wants_logprobs = body.logprobs is not None
        self.echo = echo  # the prompt, sent before the first output
        # Scored tokens whose text is not sent yet, each with its text_offset.
        self.pending: list[tuple[TokenScore, int]] = []
        self.prompt_offsets = TextOffsets()
        self.output_offsets = TextOffsets(len(echo or ""))

    def delta(self, delta: TokenDelta) -> str | None:
        self.usage.count(delta.prompt_tokens, len(delta.token_ids))
        self._score(delta.prompt_logprobs, delta.logprobs)
        text = self._take_echo() + delta.text
        if not text:
            return None  # tokens whose text is held back: nothing to show yet
        return self._frame(text, None)

    def final(self, result: GenerateResult) -> list[str]:
        self._score(result.prompt_logprobs, result.logprobs)
        return [self._frame(self._take_echo(), result.finish_reason)]

    def _score(self, prompt_logprobs: Logprobs | None, logprobs: Logprobs | None) -> None:
        if self.wants_logprobs:
            for part, offsets in (
                (prompt_logprobs, self.prompt_offsets),
                (logprobs, self.output_offsets),
            ):
                scores = unpack_logprobs(part)
                self.pending += zip(scores, offsets.place(scores), strict=True)

    def _take_echo(self) -> str:
        echo, self.echo = self.echo or "", None
        return echo

    def _frame(self, text: str, finish_reason: str | None) -> str:
        logprobs = None
        if self.wants_logprobs:
            scores = [score for score, _ in self.pending]
            logprobs = completion_logprobs(scores, [offset for _, offset in self.pending])
            self.pending = []
        choice = _choice(self.index, text, logprobs, finish_reason)
        return sse_frame(self.completion.wrap(_KIND, [choice], self.usage.so_far()))


_KIND = "text_completion"
