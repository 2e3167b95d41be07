"""A loaded GPT-2's weights as the engine multiplies them: each HF block's
layer norms and its four projections, stored as `Precision` says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.model.precision import Precision
from worker.model.projection import Projection


@dataclass(frozen=True)
class Layer:
    ln_1: tuple[torch.Tensor, torch.Tensor]
    attn: Projection  # C -> 3C
    proj: Projection  # C -> C
    ln_2: tuple[torch.Tensor, torch.Tensor]
    fc: Projection  # C -> 4C
    out: Projection  # 4C -> C


def projection(weight: torch.Tensor, bias: Any, precision: Precision) -> Projection:
    return Projection(weight, bias, precision.weights, precision.bfloat16_products)


def _conv1d(conv: Any, precision: Precision) -> Projection:
    # HF's Conv1D stores its weight (in, out); a projection takes (out, in).
    return projection(conv.weight.detach().t(), conv.bias, precision)


def layer_of(block: Any, precision: Precision) -> Layer:
    """The weights of one HF ``GPT2Block``, its projections as ``precision`` says."""
    return Layer(
        ln_1=(block.ln_1.weight.detach(), block.ln_1.bias.detach()),
        attn=_conv1d(block.attn.c_attn, precision),
        proj=_conv1d(block.attn.c_proj, precision),
        ln_2=(block.ln_2.weight.detach(), block.ln_2.bias.detach()),
        fc=_conv1d(block.mlp.c_fc, precision),
        out=_conv1d(block.mlp.c_proj, precision),
    )
