"""Admission's checks and set-up of one request: its prompt as token ids (text
tokenized, a conversation rendered through the chat template, or ids as given),
checked against the vocabulary and the context window, and the sequence its slot
will hold, with its grammar and any output a resumed request already streamed
put back."""

from __future__ import annotations

import dataclasses

from protocol import ErrorCode, GenerateRequest, GrammarKind
from worker.engine.chat_template import ChatTemplate, ChatTemplateError
from worker.engine.grammar import GrammarMatcher, Grammars
from worker.engine.interface import ModelInfo, RequestRejected
from worker.engine.sequence import Sequence, Tokenizer


def new_sequence(
    request: GenerateRequest,
    slot: int,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate,
    info: ModelInfo,
    grammars: Grammars | None = None,
) -> Sequence:
    """``request`` as the sequence its slot will hold: its prompt tokenized (or
    rendered from a conversation), checked against the context window, its
    grammar's matcher from ``grammars``, and any output a resumed request already
    streamed put back, through the grammar too. Raises RequestRejected naming
    what is wrong."""
    token_ids, text = _prompt(request, tokenizer, chat_template, info)
    request = fit_to_context(request, len(token_ids), info.context_window)
    if overflows(request, len(token_ids), info.context_window):
        raise RequestRejected(
            request.request_id,
            ErrorCode.CONTEXT_OVERFLOW,
            overflow_message(request, len(token_ids), info.context_window),
        )
    grammar = _grammar(request, grammars, info) if request.grammar else None
    seq = Sequence(request, token_ids, tokenizer, slot, grammar)
    if request.echo:
        seq.prompt_text = tokenizer.decode(token_ids) if text is None else text
    try:
        seq.resume(request.resume_token_ids, request.resume_text_len)
    except ValueError as exc:
        raise RequestRejected(request.request_id, ErrorCode.INVALID_REQUEST, str(exc)) from None
    return seq


def _prompt(
    request: GenerateRequest, tokenizer: Tokenizer, chat_template: ChatTemplate, info: ModelInfo
) -> tuple[list[int], str | None]:
    """The prompt's token ids, and its text unless it came as ids."""
    text: str | None = None
    if request.prompt_token_ids is not None:
        token_ids = list(request.prompt_token_ids)
    else:
        text = _render_chat(request, chat_template) if request.chat_roles else request.prompt
        token_ids = tokenizer.encode(text)
        if token_ids and max(token_ids) >= info.vocab_size:
            # A tokenizer larger than the model's embedding: never index past it.
            raise RequestRejected(
                request.request_id,
                ErrorCode.INVALID_REQUEST,
                f"prompt: tokenizes to id {max(token_ids)}, outside this model's "
                f"vocabulary of {info.vocab_size}",
            )
    if not token_ids:
        raise RequestRejected(
            request.request_id,
            ErrorCode.INVALID_REQUEST,
            f"{_prompt_field(request)}: it tokenizes to no tokens",
        )
    return token_ids, text


def _grammar(
    request: GenerateRequest, grammars: Grammars | None, info: ModelInfo
) -> GrammarMatcher:
    if grammars is None:
        raise RequestRejected(
            request.request_id,
            ErrorCode.UNSUPPORTED,
            f"{GrammarKind.field(request.grammar_kind)}: {info.name} cannot constrain its "
            "output; serve a model (MODEL_ID) for structured outputs",
        )
    return grammars.matcher(request)


def _render_chat(request: GenerateRequest, chat_template: ChatTemplate) -> str:
    try:
        return chat_template.render(
            request.chat_roles, request.chat_contents, request.add_generation_prompt
        )
    except ChatTemplateError as exc:
        raise RequestRejected(request.request_id, ErrorCode.INVALID_REQUEST, str(exc)) from None


def fit_to_context(
    request: GenerateRequest, num_prompt_tokens: int, window: int
) -> GenerateRequest:
    """``request``, with ``fit_context`` its max_new_tokens lowered to what ``window``
    leaves after a prompt of ``num_prompt_tokens`` (0 where it leaves nothing)."""
    if not request.fit_context:
        return request
    room = window - num_prompt_tokens
    return dataclasses.replace(request, max_new_tokens=max(0, min(request.max_new_tokens, room)))


def overflows(request: GenerateRequest, num_prompt_tokens: int, window: int) -> bool:
    """Whether ``request`` (fitted by `fit_to_context`) with a prompt of
    ``num_prompt_tokens`` is refused, in the words of `overflow_message`."""
    # The resumed output is part of max_new_tokens, so it needs no room of its own.
    return num_prompt_tokens + request.max_new_tokens > window or (
        request.fit_context and request.max_new_tokens == 0
    )


def _prompt_field(request: GenerateRequest) -> str:
    """What a refusal of the prompt names: a conversation's messages, or the prompt."""
    return "messages" if request.chat_roles else "prompt"


def overflow_message(request: GenerateRequest, num_prompt_tokens: int, window: int) -> str:
    """Why ``request``'s prompt of ``num_prompt_tokens`` does not fit ``window``, in
    words that hold for every endpoint: each names the number of tokens to
    generate its own way (max_tokens, max_completion_tokens, max_new_tokens)."""
    field = _prompt_field(request)
    if request.fit_context and request.max_new_tokens == 0:
        return (
            f"{field}: {num_prompt_tokens:,} tokens leave no room to generate in the "
            f"context window of {window:,} tokens; shorten it"
        )
    if request.max_new_tokens == 0:
        return (
            f"{field}: {num_prompt_tokens:,} tokens, more than the context window of "
            f"{window:,} tokens holds; shorten it"
        )
    return (
        f"{field}: {num_prompt_tokens:,} tokens and {request.max_new_tokens:,} to generate, "
        f"more than the context window of {window:,} tokens holds; shorten it or ask "
        "for fewer tokens"
    )
