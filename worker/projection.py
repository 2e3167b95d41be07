"""``y = x @ W.T + b``, with the kernel that is fastest for the number of rows, and
``W`` stored as the engine's precision asks (``worker/precision.py``).

On CPU, decode's products are tall and skinny (a few rows against a wide weight)
and bound by reading the weights; prefill's are ordinary GEMMs, bound by compute.
Profiled on a 2-core AMD EPYC at 8 rows, the LM head (50257 x 768) took 25 ms
through ``F.linear`` (MKL sgemm), 15 ms as the mathematically equal ``W @ x.T``,
9-11 ms through oneDNN's inner product with the weight pre-packed, and 7-8 ms in
this project's own kernel (``worker/csrc/skinny_linear.cpp``), which reads the weight
once at close to the machine's bandwidth, in float32, float16, bfloat16 or int8.
Above ``MAX_ROWS`` rows oneDNN wins, and it stays ahead of MKL at prefill sizes.
Which wins is the machine's: on a shared 2-vCPU Intel Xeon VM (AVX-512) oneDNN
won at 8 rows too, in every storage format (README, "Precision and 16 rows").

So on CPU a projection keeps the stored weight for the kernel (up to ``MAX_ROWS``
rows) and a oneDNN-packed float32 copy of that same stored weight, widened back,
for everything larger, so that prefill and decode multiply by the same numbers.
Elsewhere ``F.linear`` in the model's dtype is already right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.kernels import LANES, MAX_ROWS, load_kernels

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per output channel (row of the
    (out, in) weight): ``weight ~= q * scale[:, None]``. A per-row scale follows
    each output's own range, which one scale for the whole matrix would not."""
    scale = weight.float().abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(weight.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8).contiguous(), scale


class Projection:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, stored: str) -> None:
        """``weight`` is (out, in), as ``F.linear`` takes it, in the compute dtype;
        ``stored`` is the format the kernel reads it in (a WEIGHT_FORMATS entry)."""
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.scale: torch.Tensor | None = None
        if stored == "int8":
            self.stored_weight, self.scale = quantize_int8(weight)
            # The weight as the kernel sees it, for the paths that are not the kernel.
            widened = (self.stored_weight.float() * self.scale[:, None]).to(weight.dtype)
        else:
            self.stored_weight = weight.to(getattr(torch, stored)).contiguous()
            widened = self.stored_weight.to(weight.dtype)
        is_cpu = weight.device.type == "cpu"
        self.is_packed = (
            is_cpu and weight.dtype in (torch.float32, torch.bfloat16) and torch._C._has_mkldnn
        )
        # Packed for oneDNN on CPU, else as F.linear takes it; only one copy is kept.
        self.dense_weight = widened.contiguous().to_mkldnn() if self.is_packed else widened
        self.dense_bias = (
            self.bias.to_mkldnn() if self.is_packed and self.bias is not None else self.bias
        )
        fits_kernel = is_cpu and weight.dtype == torch.float32 and self.in_features % LANES == 0
        kernels = load_kernels() if fits_kernel else None
        self.skinny_linear = None if kernels is None else kernels.skinny_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if self.skinny_linear is not None and rows.shape[0] <= MAX_ROWS:
            y = self.skinny_linear(rows.contiguous(), self.stored_weight, self.scale, self.bias)
        elif self.is_packed:
            y = torch._C._nn.mkldnn_linear(
                rows.to_mkldnn(), self.dense_weight, self.dense_bias
            ).to_dense()
        else:
            y = F.linear(rows, self.dense_weight, self.dense_bias)
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)
