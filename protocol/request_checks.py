"""The checks every request passes before a worker queues it, run by both sides.

Anything on the network can reach the worker's socket, so the worker trusts no
field because a frontend checked it. The frontend runs the same checks with the
limits a worker's hello gave it, so that a request no worker can serve is refused
at once, not after waiting for a free slot. Each check is cheap and bounded
before it touches a list: a long id list is refused on its length before its ids
are read, and a text prompt too long to fit the context window whatever it
tokenizes to is refused before it is tokenized (tokenizing holds the GIL). A
failed check names the field; nothing reaches the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.checks import preview
from protocol.grammar_shape import grammar_shape_problem
from protocol.limits import (
    CHAT_ROLES,
    MAX_CACHE_SALT_CHARS,
    MAX_CHAT_MESSAGES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_PRESENCE_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_SEED,
)
from protocol.messages import (
    GRAMMAR_KINDS,
    AbortRequest,
    ErrorCode,
    GenerateRequest,
    GrammarKind,
    Hello,
)
from protocol.wire import MAX_REQUEST_ID_CHARS


@dataclass(frozen=True)
class RequestLimits:
    """What a worker's model allows, as its hello tells it."""

    vocab_size: int  # token ids must be below this
    context_window: int  # prompt + max_new_tokens, at most
    max_token_chars: int  # no token's text is longer than this
    max_token_bytes: int = 0  # no token covers more UTF-8 of a prompt (0: not said)

    @property
    def max_prompt_chars(self) -> int:
        """A longer text prompt needs more tokens than the context window holds."""
        return self.context_window * self.max_token_chars

    def prompt_overflow(self, field: str, texts: Sequence[str]) -> tuple[str, str] | None:
        """CONTEXT_OVERFLOW for ``texts`` (a prompt, or a conversation's contents)
        that more tokens than the context window holds would spell, judged by
        their length alone: a prompt of 131,072 emoji is 131,072 characters, and
        held the worker's engine thread 0.2 s (quiet Xeon) to over a second
        (loaded) while it was tokenized, only to be refused."""
        window = self.context_window
        tokens = _counted(window, "token")
        num_chars = sum(len(text) for text in texts)
        if num_chars > self.max_prompt_chars:
            return ErrorCode.CONTEXT_OVERFLOW, (
                f"{field}: {num_chars:,} characters, more tokens than the context window "
                f"({tokens} of at most {_counted(self.max_token_chars, 'character')}) holds; "
                "shorten it"
            )
        if not self.max_token_bytes or num_chars * 4 <= window * self.max_token_bytes:
            return None  # no text of this many characters is long enough in UTF-8
        num_bytes = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        if num_bytes > window * self.max_token_bytes:
            return ErrorCode.CONTEXT_OVERFLOW, (
                f"{field}: {num_bytes:,} bytes of UTF-8, more tokens than the context "
                f"window ({tokens} of at most {_counted(self.max_token_bytes, 'byte')}) holds; "
                "shorten it"
            )
        return None


def _counted(number: int, unit: str) -> str:
    """``number`` ``unit``s, one of them in the singular: 1 character, 128 characters."""
    return f"{number:,} {unit}{'' if number == 1 else 's'}"


def limits_of(hello: Hello) -> RequestLimits | None:
    """The limits a worker's hello gives, if it gives them (0: not said)."""
    if not (hello.vocab_size and hello.max_token_chars):
        return None
    return RequestLimits(
        hello.vocab_size, hello.context_window, hello.max_token_chars, hello.max_token_bytes
    )


def is_valid_abort(request: AbortRequest) -> bool:
    return _request_id_problem(request.request_id) is None


def _request_id_problem(request_id: str) -> str | None:
    if 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        return None
    return f"request_id: must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id):,}"


def request_problem(request: GenerateRequest, limits: RequestLimits) -> tuple[str, str] | None:
    """The error code and message of the first field a worker cannot serve, if any."""
    invalid = ErrorCode.INVALID_REQUEST
    window = limits.context_window
    id_problem = _request_id_problem(request.request_id)
    if id_problem is not None:
        return invalid, id_problem
    # With fit_context, max_new_tokens is a ceiling (a chat's MAX_NEW_TOKENS_LIMIT
    # when it asked for none), lowered at admission to what the prompt leaves.
    if request.max_new_tokens < 0:
        return invalid, f"max_new_tokens: must be at least 0, got {request.max_new_tokens:,}"
    if request.max_new_tokens > window and not request.fit_context:
        return invalid, (
            f"max_new_tokens: {request.max_new_tokens:,} is more than the context window of "
            f"{_counted(window, 'token')} holds; ask for fewer"
        )
    prompt_problem = (
        _chat_problem(request, limits) if request.chat_roles else _prompt_problem(request, limits)
    )
    if prompt_problem is not None:
        return prompt_problem
    # The window too: with fit_context, max_new_tokens bounds nothing.
    if len(request.resume_token_ids) > min(request.max_new_tokens, window):
        bound = (
            f"max_new_tokens {request.max_new_tokens:,}"
            if request.max_new_tokens <= window
            else f"the context window's {window:,}"
        )
        return invalid, (
            f"resume_token_ids: {len(request.resume_token_ids):,} tokens, more than {bound}"
        )
    max_resume_chars = len(request.resume_token_ids) * limits.max_token_chars
    if not 0 <= request.resume_text_len <= max_resume_chars:
        return invalid, (
            f"resume_text_len: must be 0 to {max_resume_chars:,} for "
            f"{len(request.resume_token_ids)} resumed tokens, got {request.resume_text_len:,}"
        )
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        return invalid, f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters"
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return invalid, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids"
    if len(request.stop) > MAX_STOP_STRINGS:
        return invalid, f"stop: at most {MAX_STOP_STRINGS} strings"
    if any(not 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in request.stop):
        return invalid, f"stop: each stop string must be 1 to {MAX_STOP_STRING_CHARS} characters"
    for name in ("prompt_token_ids", "resume_token_ids", "stop_token_ids"):
        token_ids: list[int] | None = getattr(request, name)
        # The lengths are bounded above, so max() reads at most a context window.
        if token_ids and max(token_ids) >= limits.vocab_size:
            return invalid, (
                f"{name}: token id {max(token_ids)} is outside the vocabulary "
                f"(ids are 0 to {limits.vocab_size - 1})"
            )
    return (
        sampling_problem(request)
        or _logit_bias_problem(request, limits)
        or _scoring_problem(request)
        or _grammar_problem(request)
    )


# vLLM's rule: the reply goes on the last message, or starts a turn of its own.
CONTINUE_WITHOUT_GENERATION_PROMPT = (
    "the output goes on the last message, so it cannot start a new turn too; set "
    "add_generation_prompt to false"
)


def _prompt_problem(request: GenerateRequest, limits: RequestLimits) -> tuple[str, str] | None:
    invalid = ErrorCode.INVALID_REQUEST
    window = limits.context_window
    if request.chat_contents:
        return invalid, "chat_contents: sent without chat_roles; each message has one of each"
    if request.continue_final_message:
        return invalid, "continue_final_message: only for a conversation (messages)"
    if request.prompt_token_ids is not None:
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            return invalid, "prompt_token_ids: must not be empty"
        # As admission does: with fit_context, max_new_tokens is only a ceiling.
        fitted = fit_to_context(request, num_prompt, window)
        if overflows(fitted, num_prompt, window):
            return ErrorCode.CONTEXT_OVERFLOW, overflow_message(fitted, num_prompt, window)
    elif not request.prompt:
        return invalid, "prompt: must not be empty"
    else:
        return limits.prompt_overflow("prompt", [request.prompt])
    return None


def _chat_problem(request: GenerateRequest, limits: RequestLimits) -> tuple[str, str] | None:
    invalid = ErrorCode.INVALID_REQUEST
    roles, contents = request.chat_roles, request.chat_contents
    if len(roles) != len(contents):
        return invalid, (
            f"chat_contents: {len(contents)} contents for {len(roles)} chat_roles; "
            "each message has one of each"
        )
    if len(roles) > MAX_CHAT_MESSAGES:
        return invalid, f"messages: at most {MAX_CHAT_MESSAGES} messages, got {len(roles)}"
    if request.prompt or request.prompt_token_ids is not None:
        return invalid, "prompt: a chat request carries its messages, not a prompt"
    if request.continue_final_message and request.add_generation_prompt:
        return invalid, f"continue_final_message: {CONTINUE_WITHOUT_GENERATION_PROMPT}"
    for i, role in enumerate(roles):
        if role not in CHAT_ROLES:
            roles_allowed = ", ".join(CHAT_ROLES)
            return invalid, f"messages.{i}.role: {role[:64]!r} is not one of {roles_allowed}"
    return limits.prompt_overflow("messages", contents)


def min_tokens_problem(
    min_tokens: int, max_new_tokens: int, max_tokens_param: str = "max_new_tokens"
) -> str | None:
    """Why ``min_tokens`` is out of bounds, naming max_new_tokens as the body that
    set it does (``max_tokens_param``); None if it is in them."""
    if 0 <= min_tokens <= max_new_tokens:
        return None
    return f"min_tokens: must be 0 to {max_tokens_param} ({max_new_tokens:,}), got {min_tokens:,}"


def _scoring_problem(request: GenerateRequest) -> tuple[str, str] | None:
    """Penalties, min_tokens and logprobs: each bounded, so none makes work unbounded."""
    invalid = ErrorCode.INVALID_REQUEST
    min_tokens = min_tokens_problem(request.min_tokens, request.max_new_tokens)
    if min_tokens is not None:
        return invalid, min_tokens
    repetition = request.repetition_penalty
    if not (math.isfinite(repetition) and 0 < repetition <= MAX_REPETITION_PENALTY):
        return invalid, (
            f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), "
            f"got {repetition}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value: float = getattr(request, name)
        if not (math.isfinite(value) and abs(value) <= MAX_PRESENCE_PENALTY):
            return invalid, (
                f"{name}: must be in [-{MAX_PRESENCE_PENALTY:g}, {MAX_PRESENCE_PENALTY:g}] "
                f"(0 is off), got {value}"
            )
    for name in ("logprobs", "prompt_logprobs"):
        num_top: int | None = getattr(request, name)
        if num_top is not None and not 0 <= num_top <= MAX_LOGPROBS:
            return invalid, f"{name}: must be 0 to {MAX_LOGPROBS}, got {num_top}"
    return None


def _logit_bias_problem(request: GenerateRequest, limits: RequestLimits) -> tuple[str, str] | None:
    """Counted before any entry is read; an id twice would be biased twice."""
    invalid = ErrorCode.INVALID_REQUEST
    token_ids, values = request.logit_bias_token_ids, request.logit_bias_values
    if len(token_ids) > MAX_LOGIT_BIAS:
        return invalid, f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(token_ids):,}"
    if len(values) != len(token_ids):
        return invalid, (
            f"logit_bias: {len(values):,} values for {len(token_ids):,} token ids; "
            "each entry has one of each"
        )
    if token_ids and max(token_ids) >= limits.vocab_size:
        return invalid, (
            f"logit_bias: token id {max(token_ids)} is outside the vocabulary "
            f"(ids are 0 to {limits.vocab_size - 1})"
        )
    if len(set(token_ids)) != len(token_ids):
        return invalid, "logit_bias: a token id appears more than once; give each one bias"
    limit = MAX_LOGIT_BIAS_VALUE
    for token_id, value in zip(token_ids, values, strict=True):
        if not (math.isfinite(value) and abs(value) <= limit):
            return invalid, (
                f"logit_bias: the bias of token {token_id} must be in [-{limit:g}, {limit:g}], "
                f"got {value}"
            )
    return None


def _grammar_problem(request: GenerateRequest) -> tuple[str, str] | None:
    """Its kind, length and the shape that llguidance's limits do not bound:
    whether llguidance can compile it is known once it compiles, off the engine
    loop (`worker.engine.grammar`)."""
    invalid = ErrorCode.INVALID_REQUEST
    kind, grammar = request.grammar_kind, request.grammar
    if not kind and not grammar:
        return None
    if kind not in GRAMMAR_KINDS:
        return invalid, (
            f"grammar_kind: must be one of {', '.join(GRAMMAR_KINDS)}, got {preview(kind)}"
        )
    field = GrammarKind.field(kind)
    if not grammar:
        return invalid, f"{field}: the grammar is empty"
    if len(grammar) > MAX_GRAMMAR_CHARS:
        return invalid, (
            f"{field}: the grammar is {len(grammar):,} characters; at most "
            f"{MAX_GRAMMAR_CHARS:,}: send a smaller schema"
        )
    shape_problem = grammar_shape_problem(grammar)
    if shape_problem is not None:
        return invalid, f"{field}: {shape_problem}"
    return None


def sampling_problem(request: GenerateRequest) -> tuple[str, str] | None:
    """Temperature, top_p, top_k, min_p and seed: the code and message of the first that no
    distribution can be drawn with, if any (an engine checks them too, in process)."""
    invalid = ErrorCode.INVALID_REQUEST
    if not (math.isfinite(request.temperature) and 0 <= request.temperature <= MAX_TEMPERATURE):
        return invalid, f"temperature: must be 0 to {MAX_TEMPERATURE:g}, got {request.temperature}"
    if not (math.isfinite(request.top_p) and 0 < request.top_p <= 1):
        return invalid, f"top_p: must be in (0, 1], got {request.top_p}"
    if not 0 <= request.top_k <= MAX_TOP_K:
        return invalid, f"top_k: must be 0 (off) to {MAX_TOP_K}, got {request.top_k}"
    if not (math.isfinite(request.min_p) and 0 <= request.min_p <= 1):
        return invalid, f"min_p: must be 0 (off) to 1, got {request.min_p}"
    if request.seed is not None and not MIN_SEED <= request.seed <= MAX_SEED:
        return invalid, f"seed: must be {MIN_SEED} to {MAX_SEED}, got {request.seed}"
    return None


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
    # Fitting may lower max_new_tokens under min_tokens (sent past max_new_tokens,
    # min_tokens is refused on its own): the output would end before min_tokens.
    return num_prompt_tokens + request.max_new_tokens > window or (
        request.fit_context
        and (request.max_new_tokens == 0 or request.min_tokens > request.max_new_tokens)
    )


def prompt_field(request: GenerateRequest) -> str:
    """What a refusal of the prompt names: a conversation's messages, or the prompt."""
    return "messages" if request.chat_roles else "prompt"


def overflow_message(request: GenerateRequest, num_prompt_tokens: int, window: int) -> str:
    """Why ``request``'s prompt of ``num_prompt_tokens`` does not fit ``window``, in
    words that hold for every endpoint: each names the number of tokens to
    generate its own way (max_tokens, max_completion_tokens, max_new_tokens)."""
    field = prompt_field(request)
    if request.fit_context and request.max_new_tokens == 0:
        return (
            f"{field}: {num_prompt_tokens:,} tokens leave no room to generate in the "
            f"context window of {_counted(window, 'token')}; shorten it"
        )
    if request.fit_context and request.min_tokens > request.max_new_tokens:
        return (
            f"{field}: {num_prompt_tokens:,} tokens leave room for "
            f"{request.max_new_tokens:,} to generate in the context window of {window:,} "
            f"tokens, fewer than min_tokens ({request.min_tokens:,}); shorten it or lower "
            "min_tokens"
        )
    if request.max_new_tokens == 0:
        return (
            f"{field}: {num_prompt_tokens:,} tokens, more than the context window of "
            f"{_counted(window, 'token')} holds; shorten it"
        )
    return (
        f"{field}: {num_prompt_tokens:,} tokens and {request.max_new_tokens:,} to generate, "
        f"more than the context window of {_counted(window, 'token')} holds; shorten it or ask "
        "for fewer tokens"
    )
