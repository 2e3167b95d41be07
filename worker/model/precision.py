"""What the engine stores its weights and KV cache in, and what it computes in.

On CPU a decode step is bound by reading the weights, so storing them in fewer
bytes makes it faster, while arithmetic in float32 costs nothing extra: the decode
kernels widen each loaded vector to float32 in registers. So on CPU, DTYPE chooses
storage only (weights, embeddings, KV cache) and activations, logits and every sum
stay float32; WEIGHTS=int8 stores the projections and LM head in one byte.
BFLOAT16_PRODUCTS=1 is the one exception, asked for by name: see
`Precision.bfloat16_products`. A GPU
has fast half-precision arithmetic and no such kernels: there DTYPE is the
compute type too, as in any torch model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.settings import ConfigError

# How a projection's weight can be stored (see worker/model/projection.py).
WEIGHT_FORMATS = ("float32", "float16", "bfloat16", "int8")
# The CPU modes the benchmarks and quality tests compare, by name:
# (DTYPE, WEIGHTS, BFLOAT16_PRODUCTS).
MODES = {
    "float32": ("float32", "", False),
    "float16": ("float16", "", False),
    "bfloat16": ("bfloat16", "", False),
    "int8": ("float32", "int8", False),
    "bfloat16-products": ("bfloat16", "", True),
}


def has_bfloat16_products() -> bool:
    """Whether this CPU's oneDNN has bfloat16 dot products (AVX512-BF16 or AMX)."""
    return bool(torch._C._has_mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_modes() -> list[str]:
    """The MODES this machine can run."""
    return [
        mode for mode, (_, _, products) in MODES.items() if has_bfloat16_products() or not products
    ]


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # activations and logits; the loaded model's dtype
    storage: torch.dtype  # embeddings and the KV cache
    weights: str  # the projections' and LM head's format, one of WEIGHT_FORMATS
    # The projections multiply activations rounded to bfloat16 by bfloat16 weights,
    # summing in float32 (CPU only, asked for with BFLOAT16_PRODUCTS=1). bfloat16
    # dot products do several times the multiply-adds of float32 ones, but each
    # product's sum is rounded to bfloat16, so a difference in summation order
    # (another batch size, prefill against decode) can move it by a bfloat16 step:
    # an output can then part from what it would have been at a near-tie when its
    # batchmates change or it is resumed on another worker. Every other mode keeps
    # those the same.
    bfloat16_products: bool = False

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> Precision:
        """Everything in ``dtype``: a model used as loaded."""
        return cls(dtype, dtype, str(dtype).removeprefix("torch."))

    @classmethod
    def for_device(
        cls, device: torch.device, dtype: str, weights: str, bfloat16_products: bool = False
    ) -> Precision:
        """DTYPE, WEIGHTS and BFLOAT16_PRODUCTS (as validated by WorkerConfig) on
        ``device``."""
        storage = getattr(torch, dtype)
        if device.type != "cpu":
            if weights:
                raise ConfigError(
                    f"WEIGHTS={weights} runs on CPU only (its kernel is a CPU kernel): "
                    "set DEVICE=cpu, or unset WEIGHTS and use DTYPE=float16 or bfloat16"
                )
            if bfloat16_products:
                raise ConfigError(
                    "BFLOAT16_PRODUCTS=1 is for CPUs: on a GPU, DTYPE=bfloat16 already "
                    "computes in bfloat16; unset BFLOAT16_PRODUCTS"
                )
            return cls.uniform(storage)
        if bfloat16_products and not has_bfloat16_products():
            raise ConfigError(
                "BFLOAT16_PRODUCTS=1 needs a CPU with bfloat16 dot products (AVX512-BF16 "
                "or AMX), and this one has none: unset BFLOAT16_PRODUCTS"
            )
        return cls(torch.float32, storage, weights or dtype, bfloat16_products)

    def describe(self) -> str:
        arithmetic = str(self.compute).removeprefix("torch.")
        if self.bfloat16_products:
            arithmetic += " (projections multiply in bfloat16)"
        return (
            f"weights {self.weights}, embeddings and KV cache "
            f"{str(self.storage).removeprefix('torch.')}, arithmetic {arithmetic}"
        )
