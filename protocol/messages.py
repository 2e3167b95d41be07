"""Every message that crosses the frontend/worker boundary, grouped by receiver.

A message is a frozen dataclass. Its wire form is a msgpack map holding the
protocol version, the message type (``TYPE``) and one entry per field; `codec`
encodes and strictly decodes it. Field types are limited to what `codec` can
check: int, float, str, bool, ``list[int]``, ``list[float]``, ``list[str]``, a
nested message-less dataclass (`Logprobs`) and ``X | None``. A ``list[int]``
(token ids) travels as raw little-endian uint32 bytes and a ``list[float]`` as
float32 bytes, so that decoding a long list costs no Python time per item.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from protocol.limits import MIN_MESSAGE_BYTES

PROTOCOL_VERSION = 8


class ErrorCode(StrEnum):
    """Why the worker refused or failed a request; the frontend maps each to HTTP."""

    INVALID_REQUEST = "invalid_request"  # 422: the request can never be served as sent
    CONTEXT_OVERFLOW = "context_overflow"  # 422: prompt + max_new_tokens > context window
    UNSUPPORTED = "unsupported"  # 400: a parameter value this server does not support
    QUEUE_FULL = "queue_full"  # 503: try again later
    INTERNAL = "internal"  # 500: the engine failed while serving the request
    # 500, from the frontend: workers kept dying with the request in flight, so it
    # may be what kills them: two that died before it made progress there, or
    # MAX_WORKER_DEATHS in all (frontend/replay.py); it is not replayed again.
    WORKERS_DIED = "workers_died"
    # A worker that stops hands a request back with it, and the frontend sends the
    # request on to another; a frontend that stops answers its own unfinished
    # requests with it, a 503.
    SHUTTING_DOWN = "shutting_down"


class GrammarKind(StrEnum):
    """Where a request's grammar came from: OpenAI's ``response_format`` or vLLM's
    ``structured_outputs``. The worker names that request field in its errors."""

    JSON_SCHEMA = "json_schema"  # response_format {"type": "json_schema"}
    JSON_OBJECT = "json_object"  # response_format {"type": "json_object"}
    JSON = "json"  # structured_outputs.json
    REGEX = "regex"  # structured_outputs.regex
    CHOICE = "choice"  # structured_outputs.choice
    GRAMMAR = "grammar"  # structured_outputs.grammar: Lark or GBNF

    @staticmethod
    def field(kind: str) -> str:
        """The request field a grammar of ``kind`` came from, by its whole path as
        the OpenAI endpoints name it in their own errors."""
        return _GRAMMAR_FIELDS.get(kind, "structured_outputs")


_GRAMMAR_FIELDS: dict[str, str] = {
    GrammarKind.JSON_SCHEMA: "response_format.json_schema.schema",
    GrammarKind.JSON_OBJECT: "response_format",
    GrammarKind.JSON: "structured_outputs.json",
    GrammarKind.REGEX: "structured_outputs.regex",
    GrammarKind.CHOICE: "structured_outputs.choice",
    GrammarKind.GRAMMAR: "structured_outputs.grammar",
}


# --- frontend -> worker ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Generate up to ``max_new_tokens`` tokens after a prompt.

    ``prompt`` is text; ``prompt_token_ids``, when set, replaces it (prompts given
    as ids). ``resume_token_ids`` are output tokens the client already received
    from an earlier attempt, of which ``resume_text_len`` characters of text were
    shown: generation continues after them exactly as if the attempt had not been
    interrupted (held-back text, stop strings, seeded sampling), and
    ``max_new_tokens`` counts them. ``request_id`` is unique among one frontend's
    requests in flight (the worker keys requests by sender and id): a request is
    in flight until its final answer, an abort's included, and one sent under an
    id in flight is ignored, so that a frame delivered twice runs once. Sampling is
    greedy when ``temperature`` is 0; ``top_k``, ``top_p`` and ``min_p`` (a token
    less likely than min_p times the likeliest is not drawn) filter what is drawn.
    ``stream`` asks for a `TokenDelta` after each step.

    ``chat_roles`` and ``chat_contents``, when set, are a conversation that
    replaces ``prompt``: the worker renders it through the model's chat template,
    ending with the reply's turn (``add_generation_prompt``) or, with
    ``continue_final_message``, inside the last message, which the output goes on.
    With ``fit_context``, ``max_new_tokens`` is a ceiling, lowered to what the
    context window leaves after the prompt. No stop (EOS, stop ids, stop strings)
    ends the output before ``min_tokens``. The penalties follow vLLM: repetition
    over prompt and output, presence and frequency over the output.
    ``logit_bias_token_ids`` and ``logit_bias_values`` are OpenAI's logit_bias as
    two lists: value i is added to the logit of token i before the penalties and
    sampling (vLLM's order). ``logprobs`` asks for each output token's
    log-probability and that many alternatives;
    ``prompt_logprobs`` the same for the prompt's tokens. ``echo`` asks for the
    prompt's token ids and text (a conversation as rendered) in the result.
    ``max_new_tokens`` may be 0: nothing is generated, and without
    ``prompt_logprobs`` the model does not run (tokenizing).

    ``grammar``, when set, constrains the output to the language it defines: it
    is llguidance's grammar (what ``llguidance.grammar_from`` returns: a JSON
    grammar or Lark text), and ``grammar_kind`` (a `GrammarKind`) says which
    request field it came from. The grammar's end ends the output (finish_reason
    stop), even before ``min_tokens``.

    ``cache_salt`` (vLLM's): requests reuse one another's prefix-cache rows only
    when their salts are equal, so that a tenant with a salt of its own cannot
    tell from ``cached_tokens``, or from the time to a first token, what others
    sent.
    """

    TYPE: ClassVar[str] = "generate"
    request_id: str
    prompt: str
    max_new_tokens: int
    prompt_token_ids: list[int] | None = None
    resume_token_ids: list[int] = field(default_factory=list)
    resume_text_len: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stream: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias_token_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    chat_roles: list[str] = field(default_factory=list)
    chat_contents: list[str] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    fit_context: bool = False
    echo: bool = False
    grammar_kind: str = ""
    grammar: str = ""
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request and free its slot; the worker answers with finish_reason abort
    (or with the request's own end, if that came first). Its id is in flight until
    that answer: a request sent under it before then is ignored."""

    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True, slots=True)
class Ping:
    """The frontend's keep-alive. A worker greets a sender it does not know with
    `Hello`, answers a ping with a `Heartbeat` to its sender within a round trip
    (at most one every 50 ms a sender), and drops a frontend's requests when its
    pings stop."""

    TYPE: ClassVar[str] = "ping"
    frontend_id: str


# --- worker -> frontend ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Log-probabilities of consecutive tokens under the model's own distribution
    (log-softmax of its logits, before logit_bias, penalties and temperature), as
    vLLM reports by default.

    Token i is ``token_ids[i]``, with log-probability ``logprobs[i]`` (NaN where
    there is none: a prompt's first token). Its ``num_top`` likeliest tokens, best
    first, are ``top_token_ids[i * num_top : (i + 1) * num_top]``, with
    ``top_logprobs`` alike. ``texts`` holds each token's text followed by its
    alternatives' texts, token after token, and ``text_lens`` their lengths, so
    that the frontend, which has no tokenizer, can name every token.
    ``token_bytes`` and ``byte_lens`` hold the same entries' bytes: a token's text
    is U+FFFD where it holds only part of a character, its bytes are exact. An
    output token that adds nothing to the text (the end token, a stop token) has
    none, so that the bytes of a choice's tokens decode to its text.
    """

    num_top: int
    token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]
    texts: str
    text_lens: list[int]
    token_bytes: bytes
    byte_lens: list[int]

    def __post_init__(self) -> None:
        # Checked where a frame is read, so that a worker's answer whose lists do
        # not agree fails its request there, not half way through its stream.
        num_tokens, num_top = len(self.token_ids), self.num_top
        num_entries = num_tokens * (1 + num_top)
        if not (
            num_top >= 0
            and len(self.logprobs) == num_tokens
            and len(self.top_token_ids) == len(self.top_logprobs) == num_tokens * num_top
            and len(self.text_lens) == len(self.byte_lens) == num_entries
            and sum(self.text_lens) == len(self.texts)
            and sum(self.byte_lens) == len(self.token_bytes)
        ):
            raise ValueError(f"logprobs of {num_tokens} tokens whose lists do not agree")
        # NaN marks a token with no score; a log-probability is never above 0.
        if any(logprob > 0 for logprob in (*self.logprobs, *self.top_logprobs)):
            raise ValueError("logprobs above 0: a log-probability is at most 0")


@dataclass(frozen=True, slots=True)
class Hello:
    """Sent to each frontend on first contact. A new ``instance_id`` means the
    worker process was replaced. A frontend never sends a message larger than
    ``max_message_bytes``: the worker's socket would drop the connection."""

    TYPE: ClassVar[str] = "hello"
    instance_id: str
    model: str
    is_random_weights: bool
    capacity: int
    context_window: int
    max_queue_depth: int
    max_message_bytes: int
    protocol_version: int = PROTOCOL_VERSION
    # The model's limits on a request (`protocol.request_checks`), which a frontend
    # checks before a request waits for a slot; 0: not said.
    vocab_size: int = 0
    max_token_chars: int = 0
    max_token_bytes: int = 0  # of UTF-8 a token stands for, where that bounds a prompt
    # How the engine computes (precision, decode kernels and their ISA), as /health
    # shows it; empty from a worker that does not say.
    compute: str = ""
    kv_cache_bytes: int = 0
    # Its timing, for a client to check its own against (0: not said): it sends
    # heartbeats this often, and drops a frontend's requests after this long
    # without a message from it.
    heartbeat_interval_s: float = 0.0
    frontend_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        # Limits no worker has: taken, they made each request a client's fault
        # ("more than the context window of 0 tokens holds", a 422), or, with no
        # slot or queue, left each request routed there waiting for its timeout.
        for name in ("capacity", "max_queue_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.context_window < 1:
            raise ValueError(f"context_window must be at least 1, got {self.context_window}")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be at least {MIN_MESSAGE_BYTES:,} (as a worker's "
                f"MAX_MESSAGE_BYTES), got {self.max_message_bytes:,}"
            )


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent on a timer that a long step cannot hold up, and to a peer at once in
    answer to its `Ping`. ``num_steps`` only ever
    grows while the worker makes progress; ``num_finished`` counts the requests
    it has answered since it started."""

    TYPE: ClassVar[str] = "heartbeat"
    instance_id: str
    num_steps: int
    num_queued: int
    num_active: int  # slots busy; while requests wait, those of the latest step
    num_finished: int = 0
    rss_bytes: int = 0  # the worker process's resident memory; 0 where unknown
    num_matmul_shapes: int = 0  # see the worker's InferenceEngine.num_matmul_shapes
    # Told to stop: it takes nothing new, and what it runs ends or is handed back
    # within its STOP_GRACE_S. Its connection closing then is no death.
    is_stopping: bool = False


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output of a streaming request: the tokens of one step and the text they
    completed (text is held back while a multi-byte character or a possible stop
    string is incomplete)."""

    TYPE: ClassVar[str] = "delta"
    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int = 0
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None


@dataclass(frozen=True, slots=True)
class Waiting:
    """The request waits in the worker's queue: no slot took it in the latest
    iteration. Sent once, and followed by `Admitted` when a slot takes it. Nothing
    of a request without a grammar runs while it waits, so the frontend does not
    take a worker's death in that time for one the request may have caused (see
    ``frontend/replay.py``)."""

    TYPE: ClassVar[str] = "waiting"
    request_id: str


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that was `Waiting` has a slot now: its prompt is tokenized and
    prefilled next, before its first `TokenDelta`."""

    TYPE: ClassVar[str] = "admitted"
    request_id: str


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """The one final answer to a `GenerateRequest` that ran.

    Logprobs, when asked for, are delivered once each: a streaming request's
    ride on its deltas (the prompt's on the first), and a result carries only
    those of tokens no delta carried. Those of resumed tokens came with the
    earlier attempt's deltas."""

    TYPE: ClassVar[str] = "result"
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # a FinishReason
    prompt_tokens: int
    completion_tokens: int
    queue_wait_ms: float
    generate_ms: float
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    # Prompt tokens looked up in the worker's prefix cache (0 with the cache off, or
    # for a scored prompt), and those whose keys and values it held.
    looked_up_tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        # What a result says of itself must agree, so that a worker's bug (or a
        # stranger posing as one) cannot make an answer's usage, or /metrics's
        # sums, wrong for good: a NaN in a histogram's sum stays there.
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"unknown finish_reason {self.finish_reason[:40]!r}; "
                f"they are {', '.join(FINISH_REASONS)}"
            )
        if self.completion_tokens != len(self.token_ids):
            raise ValueError(
                f"completion_tokens {self.completion_tokens} for {len(self.token_ids)} token ids"
            )
        for name in ("queue_wait_ms", "generate_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite time of at least 0, got {value}")
        if not self.cached_tokens <= self.looked_up_tokens <= self.prompt_tokens:
            raise ValueError(
                f"cached_tokens {self.cached_tokens}, looked_up_tokens "
                f"{self.looked_up_tokens} and prompt_tokens {self.prompt_tokens}: each must "
                "be at most the next"
            )
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_tokens:
            raise ValueError(
                f"prompt_token_ids of {len(self.prompt_token_ids)} tokens for prompt_tokens "
                f"{self.prompt_tokens}"
            )
        if self.logprobs is not None and len(self.logprobs.token_ids) > len(self.token_ids):
            raise ValueError(
                f"logprobs of {len(self.logprobs.token_ids)} tokens for "
                f"{len(self.token_ids)} output tokens"
            )


class FinishReason(StrEnum):
    """Why a sequence ended, in OpenAI's words."""

    STOP = "stop"  # the end token, a stop token or string, the grammar's end
    LENGTH = "length"  # its max_new_tokens, or the context window
    ABORT = "abort"  # aborted: its client went away, or its deadline passed


# Each enum's values as plain strings, for `in`: Python 3.11's enums raise a
# TypeError for a string that is no member.
FINISH_REASONS = tuple(reason.value for reason in FinishReason)
ERROR_CODES = tuple(code.value for code in ErrorCode)
GRAMMAR_KINDS = tuple(kind.value for kind in GrammarKind)


@dataclass(frozen=True, slots=True)
class ErrorResult:
    """The one final answer to a request the worker refused or failed.
    ``message`` tells the user what was wrong and what to do."""

    TYPE: ClassVar[str] = "error"
    request_id: str
    code: str  # an ErrorCode
    message: str

    def __post_init__(self) -> None:
        if self.code not in ERROR_CODES:
            raise ValueError(
                f"unknown code {self.code[:40]!r}; the codes are {', '.join(ERROR_CODES)}"
            )


ToWorker = GenerateRequest | AbortRequest | Ping
# What a worker says of one request, under that request's id.
RequestNews = Waiting | Admitted | TokenDelta | GenerateResult | ErrorResult
ToFrontend = Hello | Heartbeat | RequestNews
Message = ToWorker | ToFrontend

TO_WORKER: tuple[type[ToWorker], ...] = (GenerateRequest, AbortRequest, Ping)
TO_FRONTEND: tuple[type[ToFrontend], ...] = (
    Hello,
    Heartbeat,
    Waiting,
    Admitted,
    TokenDelta,
    GenerateResult,
    ErrorResult,
)
