"""``y = x @ W.T + b``, with the kernel that is fastest for the number of rows.

On CPU, decode's products are tall and skinny (a few rows against a wide weight)
and bound by reading the weights; prefill's are ordinary GEMMs, bound by compute.
Profiled on a 2-core AMD EPYC at 8 rows, the LM head (50257 x 768) took 25 ms
through ``F.linear`` (MKL sgemm), 15 ms as the mathematically equal ``W @ x.T``,
9-11 ms through oneDNN's inner product with the weight pre-packed, and 7-8 ms in
this project's own kernel (``worker/csrc/skinny_linear.cpp``), which reads the weight
once at close to the machine's bandwidth. From 16 rows up, oneDNN wins (at 16
rows 12.5 ms against the kernel's 17), and it stays ahead of MKL at prefill sizes.

So on CPU in float32 a projection keeps the plain weight for the kernel (up to
``MAX_ROWS`` rows) and a oneDNN-packed copy for everything larger; in bfloat16,
oneDNN alone; elsewhere ``F.linear`` is already right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.kernels import LANES, MAX_ROWS, load_kernels


class Projection:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """``weight`` is (out, in), as ``F.linear`` takes it."""
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.weight, self.bias = weight, bias
        is_cpu = weight.device.type == "cpu"
        self.is_packed = (
            is_cpu and weight.dtype in (torch.float32, torch.bfloat16) and torch._C._has_mkldnn
        )
        if self.is_packed:
            self.packed_weight = weight.contiguous().to_mkldnn()
            self.packed_bias = None if bias is None else bias.contiguous().to_mkldnn()
        fits_kernel = is_cpu and weight.dtype == torch.float32 and self.in_features % LANES == 0
        kernels = load_kernels() if fits_kernel else None
        self.skinny_linear = None if kernels is None else kernels.skinny_linear
        if self.skinny_linear is not None:
            self.weight = weight.contiguous()
            self.bias = None if bias is None else bias.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if self.skinny_linear is not None and rows.shape[0] <= MAX_ROWS:
            y = self.skinny_linear(rows.contiguous(), self.weight, self.bias)
        elif self.is_packed:
            y = torch._C._nn.mkldnn_linear(
                rows.to_mkldnn(), self.packed_weight, self.packed_bias
            ).to_dense()
        else:
            y = F.linear(rows, self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)
