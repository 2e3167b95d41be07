"""A torch-free engine for tests: deterministic tokens, optional delay and failures.

Its tokenizer maps each character to its code point. The token at output
position ``i`` is a lowercase letter chosen by `fake_token` from the prompt and
``i``, so a test can compute any request's exact answer with `expected_text`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from protocol import GenerateRequest
from worker.engine import ModelInfo
from worker.sequence import Sequence
from worker.slot_engine import SlotEngine

FAKE_MODEL_NAME = "fake"
FAKE_CONTEXT_WINDOW = 1024


class CharTokenizer:
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Seq[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def fake_token(prompt_token_ids: Seq[int], position: int) -> int:
    """The fake model's output token at ``position`` (0-based) after a prompt."""
    return ord("a") + (sum(prompt_token_ids) * 31 + position * 7) % 26


def expected_text(prompt: str, num_tokens: int) -> str:
    prompt_ids = CharTokenizer().encode(prompt)
    return "".join(chr(fake_token(prompt_ids, i)) for i in range(num_tokens))


class InjectedFailure(RuntimeError):
    """Raised by FakeEngine where a test asked for a failure."""


class FakeEngine(SlotEngine):
    def __init__(
        self,
        capacity: int,
        step_delay_s: float = 0.0,
        context_window: int = FAKE_CONTEXT_WINDOW,
        fail_admit_if: Callable[[GenerateRequest], bool] | None = None,
        fail_step_if: Callable[[int], bool] | None = None,
    ) -> None:
        info = ModelInfo(FAKE_MODEL_NAME, is_random_weights=True, context_window=context_window)
        super().__init__(info, CharTokenizer(), capacity)
        self.step_delay_s = step_delay_s
        self.fail_admit_if = fail_admit_if
        self.fail_step_if = fail_step_if
        self.num_decode_steps = 0
        self.num_resets = 0

    def _prefill(self, newcomers: list[Sequence]) -> list[int]:
        for seq in newcomers:
            if self.fail_admit_if is not None and self.fail_admit_if(seq.request):
                raise InjectedFailure(f"admit failure injected for {seq.request_id}")
        return [fake_token(seq.prompt_token_ids, 0) for seq in newcomers]

    def _decode(self, active: list[Sequence]) -> list[int]:
        self.num_decode_steps += 1
        if self.fail_step_if is not None and self.fail_step_if(self.num_decode_steps):
            raise InjectedFailure(f"step failure injected at step {self.num_decode_steps}")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return [fake_token(seq.prompt_token_ids, len(seq.output_token_ids)) for seq in active]

    def reset(self) -> list[str]:
        self.num_resets += 1
        return super().reset()
