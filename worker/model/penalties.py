"""Logits adjustments that depend on the tokens so far: penalties and min_tokens.

Both read a sequence's prompt and output ids, never state of their own, so a
sequence resumed from its prompt plus the output already streamed is adjusted
exactly as the uninterrupted run was. Each works in place on the rows that ask
for it, all such rows at once; a batch where no row asks costs one Python scan.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Sequence
from typing import Protocol

import torch

from protocol import GenerateRequest
from worker.model.host_copy import to_device


class TokenHistory(Protocol):
    """What the adjustments read of a sequence (the engine's
    `worker.engine.sequence.Sequence`): its request and its tokens so far."""

    @property
    def request(self) -> GenerateRequest: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def stop_token_ids(self) -> set[int]: ...

    @property
    def is_within_min_tokens(self) -> bool: ...


def has_penalties(request: GenerateRequest) -> bool:
    return (
        request.repetition_penalty != 1.0
        or request.presence_penalty != 0.0
        or request.frequency_penalty != 0.0
    )


def apply_penalties(logits: torch.Tensor, seqs: Sequence[TokenHistory]) -> None:
    """Penalise row i of ``logits`` (N, V) for ``seqs[i]``, as vLLM does: the
    repetition penalty divides a positive logit (multiplies a negative one) of
    every token in the prompt or output; the frequency penalty subtracts
    frequency x the token's count in the output, and the presence penalty
    subtracts presence once from every token in the output."""
    rows = [i for i, seq in enumerate(seqs) if has_penalties(seq.request)]
    if not rows:
        return
    device = logits.device
    penalised = [seqs[i] for i in rows]
    vocab_size = logits.shape[-1]
    counts = _counts([seq.output_token_ids for seq in penalised], vocab_size, device)  # (P, V)
    in_prompt = _counts([seq.prompt_token_ids for seq in penalised], vocab_size, device) > 0
    row_index = to_device(rows, device)
    scores = logits[row_index].float()  # (P, V)
    repetition = _column([seq.request.repetition_penalty for seq in penalised], device)
    seen = in_prompt | (counts > 0)
    repeated = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores = torch.where(seen, repeated, scores)
    frequency = _column([seq.request.frequency_penalty for seq in penalised], device)
    presence = _column([seq.request.presence_penalty for seq in penalised], device)
    scores -= frequency * counts + presence * (counts > 0)
    # A tiny repetition penalty (1e-300 is 0 in float32) makes a logit infinite:
    # kept finite, the largest there is, so that a grammar's -inf still bans it.
    finite = torch.finfo(logits.dtype)
    logits[row_index] = scores.clamp_(finite.min, finite.max).to(logits.dtype)


def suppress_early_stops(
    logits: torch.Tensor, seqs: Sequence[TokenHistory], exempt: Container[int] = ()
) -> None:
    """No stop token (EOS, stop_token_ids) for a row whose output is shorter than
    its min_tokens (vLLM's rule): their logits become -inf. Rows in ``exempt``
    (whose grammar allows nothing but its end) keep theirs."""
    rows: list[int] = []
    token_ids: list[int] = []
    for i, seq in enumerate(seqs):
        if seq.is_within_min_tokens and seq.stop_token_ids and i not in exempt:
            stops = sorted(seq.stop_token_ids)
            rows += [i] * len(stops)
            token_ids += stops
    if rows:
        index = (
            to_device(rows, logits.device),
            to_device(token_ids, logits.device),
        )
        logits[index] = float("-inf")


def _counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(P, V) how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    flat = list(itertools.chain.from_iterable(token_lists))
    if flat:
        lengths = to_device([len(tokens) for tokens in token_lists], device)
        # Given the output's size, repeat_interleave need not read the lengths back.
        rows = torch.repeat_interleave(
            torch.arange(len(token_lists), device=device), lengths, output_size=len(flat)
        )
        ids = to_device(flat, device)
        counts.index_put_((rows, ids), torch.ones(len(flat), device=device), accumulate=True)
    return counts


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, device)[:, None]  # (P, 1)
