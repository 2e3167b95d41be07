"""Static batching, the baseline continuous batching is measured and checked against.

Requests are taken first come, first served, in chunks of ``capacity``; each chunk
is one Hugging Face ``generate(do_sample=False)`` call that runs until its largest
max_new_tokens, and no request leaves or joins a chunk while it runs. Each row's
tokens then go through the same `Sequence` finishing rules as the engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch
from transformers import GPT2LMHeadModel

from protocol import FinishReason, GenerateRequest
from worker.engine.interface import FinishedSequence
from worker.engine.sequence import Sequence, Tokenizer

# Left padding is masked out, so its id never matters; it is deliberately not EOS.
PAD_TOKEN_ID = 0


class StaticBatchRunner:
    def __init__(self, model: GPT2LMHeadModel, tokenizer: Tokenizer, capacity: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.capacity = capacity

    def run(self, requests: Seq[GenerateRequest]) -> Iterator[list[FinishedSequence]]:
        """Yield each chunk's results as soon as its generate call returns."""
        for start in range(0, len(requests), self.capacity):
            yield self.run_chunk(requests[start : start + self.capacity])

    @torch.inference_mode()
    def run_chunk(self, requests: Seq[GenerateRequest]) -> list[FinishedSequence]:
        prompts = [
            r.prompt_token_ids
            if r.prompt_token_ids is not None
            else self.tokenizer.encode(r.prompt)
            for r in requests
        ]
        longest = max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.tensor(
            [[PAD_TOKEN_ID] * (longest - len(p)) + p for p in prompts], device=device
        )  # (B, T), left padded
        attention_mask = torch.tensor(
            [[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device
        )
        eos = self.tokenizer.eos_token_id
        stops_at_eos = eos is not None and not any(r.ignore_eos for r in requests)
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max(r.max_new_tokens for r in requests),
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos if stops_at_eos else None,
            pad_token_id=PAD_TOKEN_ID,
        )  # (B, T + new)
        return [
            self._finish(request, prompt, row.tolist())
            for request, prompt, row in zip(requests, prompts, output[:, longest:], strict=True)
        ]

    def _finish(
        self, request: GenerateRequest, prompt: list[int], new_ids: list[int]
    ) -> FinishedSequence:
        seq = Sequence(request, prompt, self.tokenizer, slot=0)
        for token_id in new_ids:
            if seq.append(token_id) is not None:
                break
        return FinishedSequence(
            request_id=request.request_id,
            token_ids=seq.output_token_ids,
            text=seq.final_text(),
            finish_reason=seq.finish_reason or FinishReason.LENGTH,
            num_prompt_tokens=len(prompt),
        )
