"""A grammar's allowed tokens applied to the logits of the rows that have one.

Every constrained row's mask is unpacked at once and added in one op; the other
rows are not touched, and a batch without a constrained row never calls this.
A token the grammar does not allow gets a logit of -inf, whatever it was, so
that greedy choice, temperature, top-k, top-p and the Gumbel draw all pass it
over. -1e30, added where the mask began, left a token a repetition penalty of
1e-31 had lifted past 1e30 above the allowed ones; -inf takes every finite
logit below them, and the penalties leave none infinite (inf - inf is a NaN).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from worker.model.host_copy import to_device


class AllowedTokens(Protocol):
    """A batch's constrained rows and the tokens each may take next (the engine's
    `worker.engine.grammar.TokenMasks`)."""

    @property
    def rows(self) -> list[int]: ...

    def allowed(self, vocab_size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """(R, vocab_size) 1 where row ``rows[k]`` may take a token, 0 where not."""
        ...


def apply_token_masks(logits: torch.Tensor, masks: AllowedTokens) -> None:
    """Ban, in place, each constrained row's disallowed tokens in ``logits`` (N, V)."""
    vocab_size = logits.shape[-1]
    allowed = torch.from_numpy(masks.allowed(vocab_size))  # (R, V) uint8, 1 where allowed
    if logits.device.type == "cuda":
        allowed = allowed.pin_memory().to(logits.device, non_blocking=True)
    # 0 where allowed, -inf where banned: (1 - 1) x inf would be a NaN, so -1 x 1e30 x
    # 1e30 overflows to -inf instead. (Setting the logits, by masked_fill or where,
    # took 1 to 2 ms at 8 rows of GPT-2's vocabulary on 2 cores; adding, 0.1.)
    penalty = allowed.float().sub_(1).mul_(1e30).mul_(1e30)
    rows = to_device(masks.rows, logits.device, torch.long)
    logits.index_add_(0, rows, penalty.to(logits.dtype))
