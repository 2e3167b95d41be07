"""POST /tokenize, POST /detokenize and GET /version, shaped like vLLM's.

The tokenizer lives in the worker, so each call is a request that asks for no
tokens (``max_new_tokens`` 0). It queues like any request; once admitted, the
worker tokenizes (or decodes) it and answers at the next step, without running
the model.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, TypeVar

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from frontend.accepted import Accepted
from frontend.chat_api import conversation
from frontend.errors import ApiError
from frontend.generation import FinalAnswer, generate_request, respond
from frontend.json_response import JSONResponse
from frontend.metrics import NO_FINISH_REASON, TOKENIZER_ENDPOINTS, Metrics
from frontend.openai_common import check_requested_model, log_ignored_fields, read_lenient_body
from frontend.openai_schemas import ChatMessage
from frontend.parse import ignored_fields_headers
from frontend.schemas import STRICT, RequestBody, TokenIds
from frontend.worker_client import WorkerClient
from protocol import GenerateRequest, GenerateResult
from protocol.limits import MAX_CHAT_MESSAGES

PACKAGE = "minibatch-llm"
TOKENIZE, DETOKENIZE = TOKENIZER_ENDPOINTS


class TokenizeBody(RequestBody):
    """POST /tokenize: a prompt, or a conversation as the chat endpoint renders it."""

    # One of prompt and messages, as `tokenize` checks, said in /openapi.json too.
    model_config = ConfigDict(
        **STRICT,
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )

    model: str | None = Field(None, description="the served model, if given")
    prompt: str | None = Field(None, min_length=1, description="text to tokenize")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, max_length=MAX_CHAT_MESSAGES, description="or a conversation"
    )
    add_generation_prompt: bool = Field(
        True, description="with messages: end with the reply's turn"
    )
    continue_final_message: bool = Field(
        False, description="with messages: end inside the last one (add_generation_prompt false)"
    )
    add_special_tokens: bool = Field(
        True, description="accepted; tokens are as generation reads them (no special tokens added)"
    )


class DetokenizeBody(RequestBody):
    """POST /detokenize."""

    model_config = STRICT

    model: str | None = Field(None, description="the served model, if given")
    tokens: TokenIds = Field(description="token ids to turn into text")


async def tokenize(request: Request) -> Response:
    """``{count, max_model_len, tokens, token_strs}`` for a prompt or a conversation."""
    client: WorkerClient = request.app.state.client
    body, ignored = await _read(request, client, TokenizeBody)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(422, "body: send a prompt or messages, one of them", "invalid_request")
    # continue_final_message goes with a prompt too, for the check that refuses it.
    work = dataclasses.replace(
        _no_tokens(client),
        prompt=body.prompt or "",
        continue_final_message=body.continue_final_message,
    )
    if body.messages is not None:
        roles, contents = conversation(body.messages)
        work = dataclasses.replace(
            work,
            chat_roles=roles,
            chat_contents=contents,
            add_generation_prompt=body.add_generation_prompt,
        )

    def final(accepted: Accepted, results: list[GenerateResult]) -> dict[str, Any]:
        token_ids = results[0].prompt_token_ids or []
        hello = client.hello
        return {
            "count": len(token_ids),
            "max_model_len": hello.context_window if hello else None,
            "tokens": token_ids,
            "token_strs": None,
        }

    return await _ask(request, work, TOKENIZE, ignored, final, {})


async def detokenize(request: Request) -> Response:
    """``{prompt}``: the text of ``tokens``."""
    client: WorkerClient = request.app.state.client
    body, ignored = await _read(request, client, DetokenizeBody)
    work = dataclasses.replace(_no_tokens(client), prompt_token_ids=body.tokens)
    if not body.tokens:  # answered here, counted and logged as a worker's answer is
        log_ignored_fields(work.request_id, ignored)
        metrics: Metrics = request.app.state.metrics
        metrics.count_request(DETOKENIZE, 200, NO_FINISH_REASON)
        return JSONResponse({"prompt": ""}, headers=ignored_fields_headers(ignored))

    def final(accepted: Accepted, results: list[GenerateResult]) -> dict[str, Any]:
        return {"prompt": results[0].prompt_text or ""}

    # The worker checks ``tokens`` as a prompt's ids: only it knows the vocabulary.
    renamed = {"prompt_token_ids": "tokens", "prompt": "tokens"}
    return await _ask(request, work, DETOKENIZE, ignored, final, renamed)


async def version(request: Request) -> Response:
    """``{version}``: this server's version."""
    return JSONResponse({"version": importlib.metadata.version(PACKAGE)})


Body = TypeVar("Body", TokenizeBody, DetokenizeBody)


async def _read(
    request: Request, client: WorkerClient, schema: type[Body]
) -> tuple[Body, list[str]]:
    body, ignored = await read_lenient_body(request, client, schema)
    if body.model is not None:
        await check_requested_model(request, client, body.model)
    return body, ignored


def _no_tokens(client: WorkerClient) -> GenerateRequest:
    """A request for no tokens, whose answer echoes its prompt: tokenized, or the
    text of its ids."""
    return dataclasses.replace(generate_request(client.config, 0, "max_new_tokens"), echo=True)


async def _ask(
    request: Request,
    work: GenerateRequest,
    endpoint: str,
    ignored: list[str],
    final: FinalAnswer,
    field_names: dict[str, str],
) -> Response:
    """``final``'s answer to ``work``, a request for no tokens; ``field_names`` as
    `respond`'s."""
    log_ignored_fields(work.request_id, ignored)
    headers = ignored_fields_headers(ignored)
    return await respond(request, work, endpoint, final, headers=headers, field_names=field_names)
