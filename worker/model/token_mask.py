"""A grammar's allowed tokens applied to the logits of the rows that have one.

Every constrained row's mask is unpacked at once and applied to all of them
together (taken out, filled, put back); the other rows are not touched, and a
batch without a constrained row never calls this.
A token the grammar does not allow gets a logit of -1e30 (-inf where the logits
are float16), so that greedy choice, temperature, top-k, top-p and the Gumbel
draw all pass it over. The logit is set, not lowered: a penalised logit may lie
past 1e30 (a repetition penalty of 1e-31 divides by it), and lowered by 1e30 it
still won the draw.
"""

from __future__ import annotations

import torch

from worker.engine.grammar import TokenMasks
from worker.model.host_copy import to_device

_BANNED = -1e30  # below any logit and the Gumbel noise, within float32 and bfloat16


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Ban, in place, each constrained row's disallowed tokens in ``logits`` (N, V)."""
    vocab_size = logits.shape[-1]
    allowed = torch.from_numpy(masks.allowed(vocab_size))  # (R, V) uint8, 1 where allowed
    if logits.device.type == "cuda":
        allowed = allowed.pin_memory().to(logits.device, non_blocking=True)
    rows = to_device(masks.rows, logits.device, torch.long)
    banned = _BANNED if torch.finfo(logits.dtype).max > -_BANNED else float("-inf")
    constrained = logits.index_select(0, rows).masked_fill_(allowed == 0, banned)
    logits.index_copy_(0, rows, constrained)
