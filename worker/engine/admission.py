"""Admission's checks and set-up of one request: its prompt as token ids (text
tokenized, a conversation rendered through the chat template, or ids as given),
checked against the vocabulary and the context window, and the sequence its slot
will hold, with its grammar and any output a resumed request already streamed
put back."""

from __future__ import annotations

from protocol import ErrorCode, GenerateRequest, GrammarKind
from protocol.request_checks import fit_to_context, overflow_message, overflows, prompt_field
from worker.engine.chat_template import ChatTemplate, ChatTemplateError
from worker.engine.grammar import GrammarMatcher, Grammars
from worker.engine.interface import ModelInfo, RequestRejected
from worker.engine.prompt_tokens import PromptTokens
from worker.engine.sequence import Sequence, Tokenizer


def new_sequence(
    request: GenerateRequest,
    prompt: PromptTokens,
    slot: int,
    tokenizer: Tokenizer,
    info: ModelInfo,
    grammars: Grammars | None = None,
) -> Sequence:
    """``request`` as the sequence its slot will hold: its ``prompt`` (from
    `tokenize_prompt`) checked against the context window, its grammar's matcher
    from ``grammars``, and any output a resumed request already streamed put
    back, through the grammar too. Raises RequestRejected naming what is wrong."""
    token_ids, text = prompt
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


def tokenize_prompt(
    request: GenerateRequest, tokenizer: Tokenizer, chat_template: ChatTemplate, info: ModelInfo
) -> PromptTokens:
    """The prompt's token ids (text tokenized, a conversation rendered through
    ``chat_template`` first), and its text unless it came as ids. Raises
    RequestRejected naming what is wrong."""
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
                f"prompt: tokenizes to id {max(token_ids)}, past this model's vocabulary "
                f"of {info.vocab_size} (the served tokenizer is larger than the model): "
                "leave out the text that makes it, and tell the server's operator",
            )
    if not token_ids:
        raise RequestRejected(
            request.request_id,
            ErrorCode.INVALID_REQUEST,
            f"{prompt_field(request)}: it tokenizes to no tokens; send text that "
            "makes at least one",
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
            request.chat_roles,
            request.chat_contents,
            request.add_generation_prompt,
            request.continue_final_message,
        )
    except ChatTemplateError as exc:
        raise RequestRejected(request.request_id, ErrorCode.INVALID_REQUEST, str(exc)) from None
