"""What the engine stores its weights and KV cache in, and what it computes in.

On CPU a decode step is bound by reading the weights, so storing them in fewer
bytes makes it faster, while arithmetic in float32 costs nothing extra: the decode
kernels widen each loaded vector to float32 in registers. So on CPU, DTYPE chooses
storage only (weights, embeddings, KV cache) and activations, logits and every sum
stay float32; WEIGHTS=int8 stores the projections and LM head in one byte. A GPU
has fast half-precision arithmetic and no such kernels: there DTYPE is the
compute type too, as in any torch model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.config import ConfigError

# How a projection's weight can be stored (see worker/projection.py).
WEIGHT_FORMATS = ("float32", "float16", "bfloat16", "int8")
# The CPU modes the benchmarks and quality tests compare, by name: (DTYPE, WEIGHTS).
MODES = {
    "float32": ("float32", ""),
    "float16": ("float16", ""),
    "bfloat16": ("bfloat16", ""),
    "int8": ("float32", "int8"),
}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # activations and logits; the loaded model's dtype
    storage: torch.dtype  # embeddings and the KV cache
    weights: str  # the projections' and LM head's format, one of WEIGHT_FORMATS

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> Precision:
        """Everything in ``dtype``: a model used as loaded."""
        return cls(dtype, dtype, str(dtype).removeprefix("torch."))

    @classmethod
    def for_device(cls, device: torch.device, dtype: str, weights: str) -> Precision:
        """DTYPE and WEIGHTS (as validated by WorkerConfig) on ``device``."""
        storage = getattr(torch, dtype)
        if device.type != "cpu":
            if weights:
                raise ConfigError(
                    f"WEIGHTS={weights} runs on CPU only (its kernel is a CPU kernel): "
                    "set DEVICE=cpu, or unset WEIGHTS and use DTYPE=float16 or bfloat16"
                )
            return cls.uniform(storage)
        return cls(torch.float32, storage, weights or dtype)

    @property
    def bfloat16_products(self) -> bool:
        """Whether projections multiply in bfloat16, summing in float32: bfloat16
        weights on a CPU whose oneDNN has bfloat16 dot products (AVX512-BF16 or
        AMX), which do several times the multiply-adds of float32 ones. Activations
        are rounded to bfloat16 for the product only; everything else stays float32."""
        return (
            self.weights == "bfloat16"
            and self.compute == torch.float32
            and torch._C._has_mkldnn
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )

    def describe(self) -> str:
        arithmetic = str(self.compute).removeprefix("torch.")
        if self.bfloat16_products:
            arithmetic += " (projections multiply in bfloat16)"
        return (
            f"weights {self.weights}, embeddings and KV cache "
            f"{str(self.storage).removeprefix('torch.')}, arithmetic {arithmetic}"
        )
