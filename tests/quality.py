"""What storing weights and the KV cache in fewer bytes costs in output, measured
against the float32 engine on the parity workload (tests/model_fixtures.py).

Each engine is fed the float32 engine's own greedy tokens (teacher forcing) through
its prefill and its decode steps, so every position is compared on the same
context: one early difference does not make every later position differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol import GenerateRequest
from worker.engine.torch_engine import TorchEngine


@torch.inference_mode()
def forced_logits(
    engine: TorchEngine, requests: list[GenerateRequest], references: dict[str, list[int]]
) -> torch.Tensor:
    """(P, V): the engine's logits before each token of each request's reference
    output, in request order, the prompt prefilled and the reference fed back one
    decode step at a time. Uses the engine's model and cache, not its slots."""
    gpt2, cache = engine.gpt2, engine.cache
    rows: list[list[torch.Tensor]] = [[] for _ in requests]
    for first in range(0, len(requests), engine.capacity):
        group = range(first, min(first + engine.capacity, len(requests)))
        prompts = [list(requests[i].prompt_token_ids or []) for i in group]
        outputs = [references[requests[i].request_id] for i in group]
        logits, _ = gpt2.prefill(
            torch.tensor([token for prompt in prompts for token in prompt]),
            [len(prompt) for prompt in prompts],
            list(range(len(group))),
            cache,
            block=engine.block_tokens,
        )  # (G, V)
        for step in range(max(len(output) for output in outputs)):
            for row, i in enumerate(group):
                if step < len(outputs[row]):
                    rows[i].append(logits[row])
            # A row whose reference is used up decodes a dummy token at position 0.
            is_live = [step < len(output) for output in outputs]
            token_ids = [
                out[step] if live else 0 for out, live in zip(outputs, is_live, strict=True)
            ]
            positions = [
                len(prompt) + step if live else 0
                for prompt, live in zip(prompts, is_live, strict=True)
            ]
            logits = gpt2.decode(
                torch.tensor(token_ids), torch.tensor(positions), max(positions) + 1, cache
            )
    return torch.stack([logit for row in rows for logit in row]).float()


@dataclass(frozen=True)
class Quality:
    agreement: float  # fraction of positions whose greedy token is float32's
    max_tied_gap: float  # the largest float32 top-2 logit gap where they differ
    relative_error: float  # max |logit - float32's| / max |float32 logit|

    @classmethod
    def of(cls, logits: torch.Tensor, reference: torch.Tensor) -> Quality:
        """``logits`` against ``reference`` (float32's), both (P, V)."""
        differs = logits.argmax(dim=-1) != reference.argmax(dim=-1)
        top2 = reference.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1])[differs]
        return cls(
            agreement=1 - float(differs.float().mean()),
            max_tied_gap=float(gaps.max()) if len(gaps) else 0.0,
            relative_error=float((logits - reference).abs().max() / reference.abs().max()),
        )
