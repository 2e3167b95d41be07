"""One accepted request that has not been answered yet.

Each attempt to run it on a worker gets its own wire id (``<request_id>.<n>``),
so whatever an earlier attempt still sends (a worker that was replaced, a
duplicate) cannot reach the client.

A client request with n choices (OpenAI's ``n``) is n of these, one per choice,
sharing one event queue in which each event carries its choice's index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol import (
    Admitted,
    ErrorResult,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Hello,
    Logprobs,
    TokenDelta,
    Waiting,
)
from protocol.request_checks import RequestLimits, fit_to_context, request_problem

if TYPE_CHECKING:
    from frontend.worker_link import WorkerLink

Final = GenerateResult | ErrorResult
Event = TokenDelta | GenerateResult | ErrorResult
# Where a worker holds a request: in its queue, or in a slot since.
QueueNotice = Waiting | Admitted

_order = itertools.count()


@dataclass(eq=False)
class InFlight:
    request: GenerateRequest  # as accepted; replays derive from it
    deadline: float  # event-loop time after which the client gets 504
    index: int = 0  # which choice of its client request it is
    # Shared by the choices of one client request: (choice index, event).
    events: asyncio.Queue[tuple[int, Event]] = field(default_factory=asyncio.Queue)
    order: int = field(default_factory=lambda: next(_order))
    attempt: int = 0
    link: WorkerLink | None = None  # the worker holding the current attempt
    num_worker_deaths: int = 0  # workers that died while this request was in flight on them
    num_deaths_without_progress: int = 0  # of those, the ones it made no progress on
    # Of those, the ones excused (`frontend.replay`): beside a request that ran
    # there without progress, or in the same incident as another worker's death.
    num_deaths_excused: int = 0
    made_progress: bool = False  # it ran a step since it was sent, or since the last death
    # Replayed at once after a death, having made progress on the worker that died:
    # `frontend.replay` excuses a second death of the same moment.
    is_replay_after_progress: bool = False
    is_running: bool = False  # the current attempt has streamed a token: it holds a slot
    is_waiting: bool = False  # the current attempt waits in its worker's queue (`Waiting`)
    streamed_token_ids: list[int] = field(default_factory=list)
    streamed_text: str = ""
    # Logprobs ride on deltas once each; a replay never sends them again.
    streamed_logprobs: list[Logprobs] = field(default_factory=list)
    streamed_prompt_logprobs: Logprobs | None = None
    prompt_tokens: int = 0  # as its worker counted them; 0 until a delta says
    accepted_at: float = field(default_factory=time.monotonic)
    sent_at: float = 0.0  # when its current attempt was sent
    # Whether workers of each limits seen take it (`is_taken_by`), asked once each.
    _taken_by: dict[RequestLimits, bool] = field(default_factory=dict, init=False, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def wire_id(self) -> str:
        return f"{self.request_id}.{self.attempt}"

    def is_sibling(self, other: InFlight) -> bool:
        """``other`` is another choice of the same client request."""
        return other.events is self.events

    def post(self, event: Event) -> None:
        """Hand an event to the client request's handler."""
        self.events.put_nowait((self.index, event))

    def next_attempt(self) -> GenerateRequest:
        """The request to send now. An attempt that follows one which already
        streamed tokens resumes after them and the text they showed, so the client
        sees one continuous answer, the one an uninterrupted run gives; its budget
        still counts them. Every attempt streams, even if the client did not ask
        (the result still carries the whole text): the frontend sees which requests
        make progress, and where a replay must resume."""
        self.attempt += 1
        self.is_running = self.is_waiting = False
        self.sent_at = time.monotonic()
        return dataclasses.replace(
            self.request,
            request_id=self.wire_id,
            resume_token_ids=list(self.streamed_token_ids),
            resume_text_len=len(self.streamed_text),
            stream=True,
        )

    def is_taken_by(self, limits: RequestLimits | None) -> bool:
        """Whether a worker of ``limits`` (as its hello says them; None: it says
        none) takes this request. Asked once for each: the checks parse its
        grammar (20 ms for one of 30,000 characters, Zen 5 EPYC), and a request may wait
        through many dispatches."""
        if limits is None:
            return True
        if limits not in self._taken_by:
            self._taken_by[limits] = request_problem(self.request, limits) is None
        return self._taken_by[limits]

    def with_whole_wait(self, result: GenerateResult) -> GenerateResult:
        """``result`` with its queue wait counted from acceptance: the frontend
        holds a request until a worker has a slot for it, so the worker's own
        queue saw 50 ms of a 4 s wait. After a replay, it counts to the attempt
        that answered."""
        held_ms = (self.sent_at - self.accepted_at) * 1000
        return dataclasses.replace(result, queue_wait_ms=result.queue_wait_ms + held_ms)

    @property
    def has_never_run(self) -> bool:
        """No worker holds it, none died with it, and it streamed nothing: the
        client may send it again without its running twice (or killing again)."""
        return self.link is None and not self.num_worker_deaths and not self.streamed_token_ids

    @property
    def is_idle_in_queue(self) -> bool:
        """Its worker holds it in the queue, where nothing of it runs: nothing but
        a grammar, which compiles while it waits."""
        return self.is_waiting and not self.request.grammar

    @property
    def ends_this_step(self) -> bool:
        """Running, one token short of its budget: the step under way in its worker
        ends it, whatever it produces, and frees its slot."""
        return self.is_running and len(self.streamed_token_ids) + 1 >= self._budget()

    def _budget(self) -> int:
        """Its max_new_tokens; with ``fit_context`` (a chat that asked for no
        max_tokens), what its worker's context window leaves after its prompt, as
        the worker fits it (`fit_to_context`)."""
        hello = self.link.hello if self.link else None
        if not self.request.fit_context or hello is None or not self.prompt_tokens:
            return self.request.max_new_tokens
        return fit_to_context(self.request, self.prompt_tokens, hello.context_window).max_new_tokens

    def answer_problem(self, message: Event, hello: Hello | None) -> str | None:
        """What makes a worker's answer to this request one the frontend cannot
        take, if anything: more tokens than it asked for, or than its worker's
        context window holds; more text than its tokens can write; logprobs that
        are not its output tokens', each once; a result that disagrees with what
        streamed. The message checked its own fields as it was read
        (`protocol.messages`); these need the request and the worker's hello."""
        if isinstance(message, TokenDelta):
            num_tokens = len(self.streamed_token_ids) + len(message.token_ids)
            return self._growth_problem(
                num_tokens,
                len(self.streamed_text) + len(message.text),
                message.prompt_tokens,
                self._num_scored() + (len(message.logprobs.token_ids) if message.logprobs else 0),
                hello,
            )
        if not isinstance(message, GenerateResult):
            return None
        scored = [
            token_id
            for logprobs in self.all_logprobs(message)[1]
            for token_id in logprobs.token_ids
        ]
        problem = self._growth_problem(
            message.completion_tokens, len(message.text), message.prompt_tokens, len(scored), hello
        )
        if problem is not None or message.finish_reason == FinishReason.ABORT:
            return problem  # an abort's result, from its queue, carries no tokens
        if message.token_ids[: len(self.streamed_token_ids)] != self.streamed_token_ids:
            return "a result whose tokens are not the ones it streamed"
        if self.request.logprobs is not None and scored != message.token_ids:
            return "logprobs that are not one for each output token, in order"
        max_chars = hello.max_token_chars if hello else 0
        if max_chars and len(message.prompt_text or "") > message.prompt_tokens * max_chars:
            return f"a prompt text longer than {message.prompt_tokens} tokens can write"
        return None

    def _num_scored(self) -> int:
        return sum(len(logprobs.token_ids) for logprobs in self.streamed_logprobs)

    def _growth_problem(
        self,
        num_tokens: int,
        num_chars: int,
        prompt_tokens: int,
        num_scored: int,
        hello: Hello | None,
    ) -> str | None:
        """What bounds an answer as it grows, delta by delta, and its result too."""
        budget = self.request.max_new_tokens
        if num_tokens > budget:
            return f"{num_tokens} tokens for max_new_tokens {budget}"
        if num_scored > num_tokens:
            return f"logprobs of {num_scored} tokens for {num_tokens} output tokens"
        if hello is None:
            return None
        if prompt_tokens + num_tokens > hello.context_window:
            return (
                f"{prompt_tokens + num_tokens} tokens in all, past the worker's context "
                f"window {hello.context_window}"
            )
        if hello.max_token_chars and num_chars > num_tokens * hello.max_token_chars:
            return f"{num_chars} characters of text for {num_tokens} tokens"
        return None

    def record(self, delta: TokenDelta) -> None:
        self.streamed_token_ids.extend(delta.token_ids)
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        self.streamed_text += delta.text
        if delta.logprobs is not None:
            self.streamed_logprobs.append(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.streamed_prompt_logprobs = delta.prompt_logprobs

    def all_logprobs(self, result: GenerateResult) -> tuple[Logprobs | None, list[Logprobs]]:
        """The prompt's logprobs and the output's, from every attempt's deltas and
        the result: each token's arrived exactly once, in one or the other."""
        output = [*self.streamed_logprobs]
        if result.logprobs is not None:
            output.append(result.logprobs)
        return self.streamed_prompt_logprobs or result.prompt_logprobs, output
