"""A torch-free engine for tests: deterministic tokens, optional delay and failures.

Its tokenizer maps each character to its code point. Like a real greedy model,
each next token is a function of everything before it (`fake_next_token`, which
a logit_bias can move: `fake_biased_token`), so a request resumed from its
prompt plus some of its output continues exactly as it would have, and a test
can compute any answer with `expected_text`. Under a grammar it takes the first
token the grammar allows from its own choice on (`fake_constrained_token`):
structured outputs are served, deterministically, resumes included.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from protocol import GenerateRequest
from protocol.exit_codes import ExitCode
from protocol.settings import ConfigError, setting
from worker.engine.grammar import Grammars
from worker.engine.interface import ModelInfo
from worker.engine.logprobs import TokenLogprob
from worker.engine.prefill_plan import Chunk
from worker.engine.sequence import Sequence
from worker.engine.slot_engine import SlotEngine

FAKE_MODEL_NAME = "fake"
FAKE_CONTEXT_WINDOW = 1024
FAKE_VOCAB_SIZE = 0x110000  # one token per Unicode code point
FAKE_GRAMMAR_VOCAB_SIZE = 256  # the tokens a grammar may choose from

log = logging.getLogger(__name__)


class CharTokenizer:
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Seq[int]) -> str:
        # A surrogate is no character (UTF-8 cannot carry it): show it as a real
        # tokenizer shows bytes that form no character.
        return "".join("\ufffd" if 0xD800 <= t <= 0xDFFF else chr(t) for t in token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()


class _GrammarVocabulary:
    """The fake's tokens as llguidance's `TokenizerWrapper` reads them: code points
    1 to 255 (a grammar constrains the fake to those), and 0 as the end of
    sequence, which only a grammar's end emits (the fake has no EOS of its own)."""

    def __init__(self) -> None:
        self.eos_token_id = 0
        self.bos_token_id = None
        self.special_token_ids = [0]
        self.tokens = [b"\xff[EOS]", *(chr(t).encode() for t in range(1, FAKE_GRAMMAR_VOCAB_SIZE))]

    def __call__(self, text: str | bytes) -> list[int]:
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        return [ord(c) for c in text if 0 < ord(c) < FAKE_GRAMMAR_VOCAB_SIZE]


def fake_grammar_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_GrammarVocabulary()))


def fake_constrained_token(token_id: int, allowed: np.ndarray[Any, np.dtype[np.uint8]]) -> int:
    """The first token from ``token_id`` on that ``allowed`` (1 per allowed token)
    allows, wrapping around; ``token_id`` if none is allowed."""
    later = np.flatnonzero(allowed[token_id:])
    if later.size:
        return token_id + int(later[0])
    anywhere = np.flatnonzero(allowed)
    return int(anywhere[0]) if anywhere.size else token_id


def fake_next_token(context: Seq[int]) -> int:
    """The fake model's next token after ``context`` (prompt and output so far)."""
    return ord("a") + (sum(context) * 31 + len(context) * 7) % 26


FAKE_OTHER_LOGIT = -50.0


def fake_biased_token(token_id: int, request: GenerateRequest) -> int:
    """The fake model's choice under ``request``'s logit_bias, taking its logits to
    be 0 for ``token_id`` (its own choice), -1 for the code point after it and -50
    for every other token: the highest biased logit wins, the first of a tie."""
    if not request.logit_bias_token_ids:
        return token_id
    bias = dict(zip(request.logit_bias_token_ids, request.logit_bias_values, strict=True))
    runner_up = (token_id + 1) % FAKE_VOCAB_SIZE
    logits = {token_id: 0.0, runner_up: -1.0}
    candidates = [token_id, runner_up, *request.logit_bias_token_ids]
    return max(candidates, key=lambda t: logits.get(t, FAKE_OTHER_LOGIT) + bias.get(t, 0.0))


def fake_logprob(token_id: int, num_top: int) -> TokenLogprob:
    """The fake model's scores: the chosen token is the likeliest at -0.25, and
    the next code points follow, each a quarter less likely."""
    top = [token_id + rank for rank in range(num_top)]
    return TokenLogprob(-0.25, top, [-0.25 * (rank + 1) for rank in range(num_top)])


def expected_text(prompt: str, num_tokens: int) -> str:
    context = CharTokenizer().encode(prompt)
    for _ in range(num_tokens):
        context.append(fake_next_token(context))
    return "".join(chr(t) for t in context[len(context) - num_tokens :])


class InjectedFailure(RuntimeError):
    """Raised by FakeEngine where a test asked for a failure."""


@dataclass(frozen=True)
class FakeEngineConfig:
    """Test-only settings of a MODEL_ID=fake worker, read beside its WorkerConfig."""

    fake_step_delay_s: float = setting(
        "FAKE_STEP_DELAY_S", 0.0, "test only: seconds each step of the fake engine sleeps"
    )
    fake_start_delay_s: float = setting(
        "FAKE_START_DELAY_S",
        0.0,
        "test only: seconds the fake engine takes to load, to simulate a slow or stuck start",
    )
    fake_crash_prompt: str = setting(
        "FAKE_CRASH_PROMPT",
        "",
        "test only: a fake-engine worker that admits a prompt containing this text exits "
        "at once, to simulate a request that kills every worker that runs it",
    )

    def __post_init__(self) -> None:
        if self.fake_step_delay_s < 0 or self.fake_start_delay_s < 0:
            raise ConfigError("FAKE_STEP_DELAY_S and FAKE_START_DELAY_S must be >= 0")


class FakeEngine(SlotEngine):
    def __init__(
        self,
        capacity: int,
        step_delay_s: float = 0.0,
        context_window: int = FAKE_CONTEXT_WINDOW,
        fail_admit_if: Callable[[GenerateRequest], bool] | None = None,
        fail_step_if: Callable[[int], bool] | None = None,
        crash_prompt: str = "",
        prefill_chunk_tokens: int = 0,
    ) -> None:
        info = ModelInfo(
            FAKE_MODEL_NAME,
            is_random_weights=True,
            context_window=context_window,
            vocab_size=FAKE_VOCAB_SIZE,
            max_token_chars=1,
        )
        super().__init__(
            info,
            CharTokenizer(),
            capacity,
            prefill_chunk_tokens=prefill_chunk_tokens,
            grammars=Grammars(fake_grammar_tokenizer),
        )
        self.step_delay_s = step_delay_s
        self.fail_admit_if = fail_admit_if
        self.fail_step_if = fail_step_if
        # The whole process dies, as a segfault in a real engine would: no error
        # result, no sentinel, nothing the scheduler could catch.
        self.crash_prompt = crash_prompt
        self.num_decode_steps = 0
        self.num_resets = 0

    def _start_prefill(self, newcomers: list[Sequence]) -> None:
        for seq in newcomers:
            # Decoded from the ids, so that a replay sent as token ids crashes too.
            if self.crash_prompt and self.crash_prompt in self.tokenizer.decode(
                seq.prompt_token_ids
            ):
                log.critical("admitted %s, the crash prompt: exiting", seq.request_id)
                logging.shutdown()
                os._exit(ExitCode.FAKE_CRASH)
            if self.fail_admit_if is not None and self.fail_admit_if(seq.request):
                raise InjectedFailure(f"admit failure injected for {seq.request_id}")

    def _prefill_chunks(self, chunks: list[Chunk]) -> list[int]:
        for seq, start, end in chunks:
            if seq.wants_prompt_logprobs:
                self._score_chunk(seq, start, min(end, len(seq.prompt_token_ids)))
        ending = [seq for seq, _, end in chunks if end == len(seq.context_token_ids)]
        return self._next_tokens(ending)

    @staticmethod
    def _score_chunk(seq: Sequence, start: int, end: int) -> None:
        """Score the prompt tokens that positions [start, end) predict."""
        if start >= end:
            return
        num_top = seq.request.prompt_logprobs or 0
        targets = seq.prompt_targets(start, end)
        seq.score_prompt_chunk(start, end, [fake_logprob(t, num_top) for t in targets])

    def _decode(self, active: list[Sequence]) -> list[int]:
        self.num_decode_steps += 1
        if self.fail_step_if is not None and self.fail_step_if(self.num_decode_steps):
            raise InjectedFailure(f"step failure injected at step {self.num_decode_steps}")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return self._next_tokens(active)

    def _next_tokens(self, seqs: list[Sequence]) -> list[int]:
        next_ids = [
            fake_biased_token(fake_next_token(seq.context_token_ids), seq.request) for seq in seqs
        ]
        masks = self.grammars.masks(seqs) if self.grammars is not None else None
        if masks is not None:
            for i, allowed in zip(masks.rows, masks.allowed(FAKE_GRAMMAR_VOCAB_SIZE), strict=True):
                next_ids[i] = fake_constrained_token(next_ids[i], allowed)
        for seq, token_id in zip(seqs, next_ids, strict=True):
            if seq.request.logprobs is not None and seq.finish_reason is None:
                seq.record_logprob(fake_logprob(token_id, seq.request.logprobs))
        return next_ids

    def reset(self) -> list[str]:
        self.num_resets += 1
        return super().reset()
