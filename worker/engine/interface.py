"""The engine seam: the only calls the scheduler makes into a model.

The scheduler is written against `InferenceEngine` alone, so it is tested with
`FakeEngine` and runs unchanged on the torch engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protocol import GenerateRequest, Logprobs, TokenDelta


class RequestRejected(Exception):
    """``admit`` refuses one request that can never be served as sent (for example
    prompt + max_new_tokens beyond the context window). Nothing was admitted."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class FinishedSequence:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    logprobs: Logprobs | None = None  # of tokens no delta carried
    prompt_logprobs: Logprobs | None = None  # unless the first delta carried them
    prompt_token_ids: list[int] | None = None  # with echo
    prompt_text: str | None = None  # with echo: the prompt, a conversation as rendered
    num_looked_up_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens whose rows came from the prefix cache


@dataclass(slots=True)
class StepOutput:
    """What one `step` produced: new output of streaming requests, in step order,
    every sequence that finished, and any that failed (their slots are already
    free)."""

    deltas: list[TokenDelta] = field(default_factory=list)
    finished: list[FinishedSequence] = field(default_factory=list)
    # Sequences dropped because the engine failed on them alone (a chunk of
    # their prefill raised), with why; their slots are free too.
    failed: list[tuple[str, Exception]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    is_random_weights: bool
    context_window: int
    vocab_size: int  # token ids the model can embed: 0 to vocab_size - 1
    max_token_chars: int  # the longest text one token decodes to, or more
    # The most UTF-8 bytes of a prompt one token covers, where the tokenizer
    # bounds that (0: it does not say).
    max_token_bytes: int = 0
    # How it computes, for /health and logs: precision, kernels and their ISA.
    compute: str = ""
    kv_cache_bytes: int = 0  # preallocated at start, for every slot


class InferenceEngine(ABC):
    """A fixed number of slots, each holding one sequence from admit to finish."""

    info: ModelInfo

    @property
    @abstractmethod
    def capacity(self) -> int:
        """How many sequences can be active at once (MAX_BATCH_SIZE)."""

    @abstractmethod
    def num_active(self) -> int:
        """Slots in use now; never more than ``capacity``."""

    def num_extra_prefill_passes(self) -> int:
        """Passes over the model that prefills ran besides one each, counting up: a
        long prefill (many whole prompts) runs in several, and heartbeats show each
        as progress. Safe to read from any thread."""
        return 0

    def num_matmul_shapes(self) -> int:
        """Distinct matrix-product shapes the math library has built kernels for
        in this process, each holding memory of its own; bounded, so that memory
        levels off. Safe to read from any thread."""
        return 0

    def prepare(self, request: GenerateRequest) -> bool:
        """Start, off the calling thread, what admitting ``request`` needs that may
        take long (compiling its grammar, tokenizing a long prompt), and return
        whether it is done. Cheap: the scheduler calls it for each queued request
        it might admit, and admits only those it is done for, so that the running
        batch never waits on one (`admit` would do the rest on the caller's
        thread). A request whose preparation failed is done: `admit` rejects it."""
        return True

    def unprepare(self, request: GenerateRequest) -> None:
        """Drop what `prepare` started for ``request``, which left the queue without
        being admitted (aborted, refused at admission), unless it already runs: a
        peer that queues costly grammars and aborts them leaves no backlog of
        compiles."""
        return None  # nothing was started

    @abstractmethod
    def admit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Take ``requests`` into free slots and return their request ids.

        Each newcomer's prompt is prefilled, which gives its first token: here,
        with the next `step` reporting that token, or, with chunked prefill
        (PREFILL_CHUNK_TOKENS), by the next steps, a chunk at a time beside the
        streams that decode.
        A request that resumes an earlier attempt (``resume_token_ids``) continues
        from the state its replayed output gives; if that output already finished
        it, it skips the prefill and the next `step` answers it.
        Atomic: if this raises, no slot changed. `RequestRejected` names the one
        request that can never be served (the caller drops it and may retry the
        rest); any other exception is a failure of this admit. Raises ValueError
        if there are more requests than free slots.
        """

    @abstractmethod
    def step(self, on_prefilled: Callable[[StepOutput], None] | None = None) -> StepOutput:
        """Advance every active sequence by one token.

        Newcomers that their first token already finished are drained without a
        decode. Finished sequences leave their slots before this returns. If this
        raises, the state of every active sequence is undefined: call `reset`.

        ``on_prefilled``, if given, is called once between the step's prefill and
        its decode with what the prefill produced (newcomers' first tokens, the
        sequences they finished, failed chunks), so that a first token leaves
        without waiting for the decode; the returned output then holds only the
        rest. An engine that runs a step's prefill and decode in one pass over
        the model returns both at once instead.
        """

    @abstractmethod
    def abort(self, request_ids: Sequence[str]) -> list[FinishedSequence]:
        """Free the slots of these sequences (unknown ids are ignored) and return
        their output so far, with finish_reason ``abort``."""

    @abstractmethod
    def reset(self) -> list[str]:
        """Drop every sequence (after a failed step); return the dropped ids."""
