"""A grammar's allowed tokens applied to the logits of the rows that have one.

Every constrained row's mask is unpacked at once and added in one op; the other
rows are not touched, and a batch without a constrained row never calls this.
A token the grammar does not allow gets a logit of -1e30 (-inf where the logits
are float16), so that greedy choice, temperature, top-k, top-p and the Gumbel
draw all pass it over, and no arithmetic on the penalty makes a NaN.
"""

from __future__ import annotations

import torch

from worker.engine.grammar import TokenMasks
from worker.model.host_copy import to_device

_BANNED = 1e30  # beyond any logit and the Gumbel noise, within float32 and bfloat16


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Ban, in place, each constrained row's disallowed tokens in ``logits`` (N, V)."""
    vocab_size = logits.shape[-1]
    allowed = torch.from_numpy(masks.allowed(vocab_size))  # (R, V) uint8, 1 where allowed
    if logits.device.type == "cuda":
        allowed = allowed.pin_memory().to(logits.device, non_blocking=True)
    # Built in float32: 0 x 1e30 in float16 would be 0 x inf, a NaN.
    penalty = allowed.float().sub_(1).mul_(_BANNED)  # (R, V): 0 or -1e30
    rows = to_device(masks.rows, logits.device, torch.long)
    logits.index_add_(0, rows, penalty.to(logits.dtype))
