"""POST /v1/chat/completions: a conversation in, the assistant's next message out.

The frontend has no tokenizer: the worker renders the messages through the
model's chat template (`worker/engine/chat_template.py`) and tokenizes the result.
Streaming follows OpenAI: a first chunk with the assistant's role, content
deltas, a last chunk with the finish reason, then usage and ``[DONE]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from frontend.accepted import Accepted
from frontend.choice_stream import ChoiceStream
from frontend.choices import num_to_generate
from frontend.errors import ApiError
from frontend.generation import respond
from frontend.inflight import InFlight
from frontend.logprobs import TokenScore, chat_logprobs, unpack_logprobs
from frontend.openai_common import (
    Envelope,
    UsageStream,
    check_requested_model,
    openai_request,
    read_openai_request,
    results_usage,
)
from frontend.openai_schemas import ChatBody, ChatMessage
from frontend.streaming import sse_frame
from protocol import GenerateResult, TokenDelta

ENDPOINT = "/v1/chat/completions"


async def chat_completions(request: Request) -> Response:
    """The assistant's reply to ``messages``. Body: ChatBody. Answer: OpenAI's
    ``chat.completion`` object, or with ``stream`` its ``chat.completion.chunk``
    events ending in ``data: [DONE]``. Errors in OpenAI's shape."""
    read = await read_openai_request(request, ChatBody)
    body, client = read.body, read.client
    n = num_to_generate(body.n or 1, None, bool(body.stream), client.config.max_inflight_requests)
    roles, contents = conversation(body.messages)
    asked = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    # Unasked, the budget is the server's: a min_tokens over it is told so.
    budget = param if asked else "the server's MAX_NEW_TOKENS_LIMIT"
    work = dataclasses.replace(
        openai_request(read, asked or client.config.max_new_tokens_limit, budget),
        chat_roles=roles,
        chat_contents=contents,
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message),
        # Unasked, the reply may use whatever the context window leaves, as vLLM's.
        fit_context=asked is None,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    read.log_ignored(work.request_id)
    model = await check_requested_model(request, client, body.model)
    chat = Envelope(f"chatcmpl-{work.request_id}", model)

    def choice(index: int, entry: InFlight, result: GenerateResult) -> dict[str, Any]:
        logprobs = None
        if body.logprobs:
            _, parts = entry.all_logprobs(result)
            logprobs = chat_logprobs([score for part in parts for score in unpack_logprobs(part)])
        return {
            "index": index,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
        }

    def final(accepted: Accepted, results: list[GenerateResult]) -> dict[str, Any]:
        choices = [choice(i, accepted.entries[i], result) for i, result in enumerate(results)]
        return chat.wrap("chat.completion", choices, results_usage(results))

    def stream(accepted: Accepted) -> ChoiceStream:
        usage = UsageStream(body)

        def chunks(index: int) -> _ChatStream:
            return _ChatStream(chat, body, index, usage)

        return ChoiceStream(chat, _CHUNK, usage, n, chunks)

    renamed = {"max_new_tokens": param, "logprobs": "top_logprobs"}
    return await respond(request, work, ENDPOINT, final, stream, read.headers, n, renamed)


def conversation(messages: list[ChatMessage]) -> tuple[list[str], list[str]]:
    """Each message's role and its content as text (`_content_text`)."""
    roles = [message.role for message in messages]
    return roles, [_content_text(i, message) for i, message in enumerate(messages)]


def _content_text(i: int, message: ChatMessage) -> str:
    """Message ``i``'s content as text: text parts are joined by lines, as vLLM
    joins them. 400 for a part that is not text; 422 for no content (null or no
    parts) where OpenAI requires some: all but an assistant's, whose turn may be
    a tool call."""
    param = f"messages.{i}.content"
    content = message.content
    if (content is None or content == []) and message.role != "assistant":
        raise ApiError(
            422,
            f"{param}: a {message.role} message needs content (text, or a list of "
            "text parts); only an assistant's may be left out",
            "invalid_request",
            param,
        )
    if not isinstance(content, list):
        return content or ""
    texts = []
    for k, part in enumerate(content):
        if part.type != "text":
            raise ApiError(
                400,
                f"{param}.{k}: only text parts ({{'type': 'text', 'text': ...}}) are "
                f"supported, got type {part.type[:40]!r}",
                "unsupported",
                f"{param}.{k}",
            )
        if part.text is None:
            raise ApiError(
                422, f"{param}.{k}.text: must be a string", "invalid_request", f"{param}.{k}.text"
            )
        texts.append(part.text)
    return "\n".join(texts)


class _ChatStream:
    """One choice's chunks: the assistant's role first, as OpenAI's."""

    def __init__(self, chat: Envelope, body: ChatBody, index: int, usage: UsageStream) -> None:
        self.chat = chat
        self.index = index
        self.usage = usage
        self.wants_logprobs = bool(body.logprobs)
        self.is_started = False
        self.pending: list[TokenScore] = []  # scored tokens whose text is not sent yet

    def delta(self, delta: TokenDelta) -> str | None:
        self.usage.count(delta.prompt_tokens, len(delta.token_ids))
        if self.wants_logprobs:
            self.pending += unpack_logprobs(delta.logprobs)
        if not delta.text:
            return None  # held back (half a character): its logprobs go with its text
        return self._chunk({"content": delta.text}, self._take_logprobs(), None)

    def final(self, result: GenerateResult) -> list[str]:
        if self.wants_logprobs:
            self.pending += unpack_logprobs(result.logprobs)
        return [self._chunk({}, self._take_logprobs(), result.finish_reason)]

    def _take_logprobs(self) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        scores, self.pending = self.pending, []
        return chat_logprobs(scores)

    def _chunk(
        self, delta: dict[str, str], logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> str:
        if not self.is_started:
            # The first chunk names the speaker, as OpenAI's does.
            delta = {"role": "assistant", **delta}
            self.is_started = True
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return sse_frame(self.chat.wrap(_CHUNK, [choice], self.usage.so_far()))


_CHUNK = "chat.completion.chunk"
