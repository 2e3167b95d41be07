"""``y = x @ W.T + b``, with the kernel that is fastest for the number of rows, and
``W`` stored as the engine's precision asks (``worker/model/precision.py``).

On CPU, decode's products are tall and skinny (a few rows against a wide weight)
and bound by reading the weights; prefill's are ordinary GEMMs, bound by compute.
Two implementations compete for decode's rows (up to ``MAX_ROWS``): this project's
own kernel (``worker/model/csrc/skinny_linear.cpp``), which reads the weight once in its
stored format (float32, float16, bfloat16 or int8) and widens it in registers
(int8: multiplies in integers), and oneDNN's inner product on a float32 copy
pre-packed for it (``torch.ops.mkldnn._reorder_linear_weight``, as torch's own
compiler packs CPU weights). Which is faster is the machine's: on a 2-vCPU Intel
Xeon with AVX-512 and AMX, the LM head (50257 x 768) at 8 rows took 7.5 ms in
oneDNN against 10.5 ms in the kernel in float32, 5.2 ms in float16 and 1.9 ms in
int8.

So each projection times both on its own weight when it is built, once per
weight shape and format in a process (``decode_path``), and keeps the winner.
Above ``MAX_ROWS`` rows oneDNN always runs: it is ahead at prefill sizes.
Both paths multiply by the same stored weight (the oneDNN copy is it, widened),
so a token's keys do not depend on whether it was prefilled or decoded.

With BFLOAT16_PRODUCTS=1 (bfloat16 weights, on a CPU with bfloat16 dot products:
AVX512-BF16 or AMX), oneDNN's copy stays in bfloat16 and multiplies activations
rounded to bfloat16, summing in float32 (`Precision.bfloat16_products` says what
that costs). On a 2-vCPU Xeon with AMX that made a decode step at 8 rows 1.5-1.8x
faster than float32 through oneDNN, and prefill on one thread 2.4x.

Elsewhere than the CPU, ``F.linear`` in the model's dtype is already right.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from worker.model.kernels import LANES, MAX_ROWS, load_kernels
from worker.model.precision import has_bfloat16_products

logger = logging.getLogger(__name__)

INT8_MAX = 127
# The rows a decode path is timed at: a full batch of the kernel's.
TIMED_ROWS = MAX_ROWS
# Timed calls per path, taking turns; the fastest call of each counts, because a
# call can only be slowed (by a neighbour taking the core), never sped up.
TIMED_ROUNDS = 5

# oneDNN builds (and keeps) a primitive, with buffers of its own, for every row
# count it is given: prefill's packed token counts, ever new, grew a worker's RSS
# by about 2 MB a new count without levelling off. Row counts above MAX_ROWS are
# padded up to one of 4 sizes per doubling (8, 16, 24, 32, 40, 48, 56, 64, 80, ...),
# so the shapes are bounded and each product does under 25% more rows.
_matmul_shapes: set[tuple[int, int, int]] = set()  # (rows, out, in) given to oneDNN


def padded_rows(num_rows: int) -> int:
    """``num_rows`` rounded up to the sizes oneDNN is given above MAX_ROWS rows."""
    step = 8 if num_rows <= 32 else 1 << (num_rows.bit_length() - 3)
    return -(-num_rows // step) * step


def num_matmul_shapes() -> int:
    """The distinct shapes oneDNN has been given in this process."""
    return len(_matmul_shapes)


DecodePath = Literal["kernel", "onednn"]
# The winner for each (out_features, in_features, stored format, bfloat16
# products), in this process.
_decode_paths: dict[tuple[int, int, str, bool], DecodePath] = {}


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per output channel (row of the
    (out, in) weight): ``weight ~= q * scale[:, None]``. A per-row scale follows
    each output's own range, which one scale for the whole matrix would not."""
    scale = weight.float().abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(weight.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8).contiguous(), scale


def _seconds_for(multiply: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> float:
    """How long one ``multiply(rows)`` took."""
    started = time.perf_counter()
    multiply(rows)
    return time.perf_counter() - started


class Projection:
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stored: str,
        bfloat16_products: bool = False,
    ) -> None:
        """``weight`` is (out, in), as ``F.linear`` takes it, in the compute dtype;
        ``stored`` is the format the kernel reads it in (a WEIGHT_FORMATS entry);
        ``bfloat16_products``: oneDNN multiplies in bfloat16 (bfloat16 ``stored``
        on a CPU whose oneDNN has bfloat16 dot products only, as Precision checks)."""
        weight = weight.detach()
        self.stored = stored
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
        # The packing is a private op of torch's (its compiler's): a build without
        # it falls back to F.linear rather than failing to load. oneDNN packs
        # bfloat16 only for a CPU with bfloat16 dot products; elsewhere a bfloat16
        # model multiplies through F.linear.
        self.is_packed = (
            is_cpu
            and (
                weight.dtype == torch.float32
                or (weight.dtype == torch.bfloat16 and has_bfloat16_products())
            )
            and torch._C._has_mkldnn
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )
        self.bfloat16_products = bfloat16_products and self.is_packed
        if self.bfloat16_products:
            assert self.stored_weight.dtype == torch.bfloat16, (
                "bfloat16 products need bfloat16 weights"
            )
            widened = self.stored_weight
        # Packed for oneDNN on CPU (for a decode-sized batch; it takes any), else
        # as F.linear takes it; only one copy is kept.
        self.dense_weight = (
            torch.ops.mkldnn._reorder_linear_weight(widened.contiguous(), TIMED_ROWS)
            if self.is_packed
            else widened
        )
        fits_kernel = is_cpu and weight.dtype == torch.float32 and self.in_features % LANES == 0
        kernels = load_kernels() if fits_kernel else None
        self.skinny_linear = None if kernels is None else kernels.skinny_linear
        if self.skinny_linear is not None and self.is_packed:
            self.decode_path: DecodePath = decode_path(self)
        else:
            self.decode_path = "kernel" if self.skinny_linear is not None else "onednn"

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """(N, in) -> (N, out) through the skinny kernel, N <= MAX_ROWS."""
        assert self.skinny_linear is not None
        return self.skinny_linear(rows.contiguous(), self.stored_weight, self.scale, self.bias)

    def dense(self, rows: torch.Tensor) -> torch.Tensor:
        """(N, in) -> (N, out) through oneDNN (or F.linear off the CPU), any N."""
        if self.bfloat16_products:
            # The bias is added in float32, after the product is widened back.
            product: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                rows.to(torch.bfloat16), self.dense_weight, None, "none", [], ""
            )
            y = product.float()
            return y if self.bias is None else y + self.bias
        if self.is_packed:
            packed: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                rows, self.dense_weight, self.bias, "none", [], ""
            )
            return packed
        return F.linear(rows, self.dense_weight, self.bias)

    @property
    def decode_bytes(self) -> int:
        """The bytes a decode step reads of this projection's weight, scale and bias."""
        if self.decode_path == "kernel":
            read = [self.stored_weight, self.scale, self.bias]
        else:  # the packed copy's storage is opaque, but its size is its shape's
            read = [self.dense_weight, self.bias]
        return sum(t.numel() * t.element_size() for t in read if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        num_rows = rows.shape[0]
        if num_rows <= MAX_ROWS:
            y = self.kernel(rows) if self.decode_path == "kernel" else self.dense(rows)
        elif self.is_packed:
            padded = padded_rows(num_rows)
            _matmul_shapes.add((padded, self.out_features, self.in_features))
            if padded > num_rows:
                rows = F.pad(rows, (0, 0, 0, padded - num_rows))  # (padded, in), zeros below
            y = self.dense(rows)[:num_rows]
        else:
            y = self.dense(rows)
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)


def decode_path(projection: Projection) -> DecodePath:
    """Whichever of the kernel and oneDNN multiplies ``TIMED_ROWS`` rows by this
    projection's weight faster on this machine, timed once per weight shape and
    stored format in a process (a model's layers share a few shapes)."""
    key = (
        projection.out_features,
        projection.in_features,
        projection.stored,
        projection.bfloat16_products,
    )
    if key not in _decode_paths:
        rows = torch.randn(TIMED_ROWS, projection.in_features)
        paths: dict[DecodePath, Callable[[torch.Tensor], torch.Tensor]] = {
            "kernel": projection.kernel,
            "onednn": projection.dense,
        }
        fastest_s = {path: float("inf") for path in paths}
        with torch.inference_mode():
            for multiply in paths.values():
                multiply(rows)  # the first call of each pays for its set-up
            for _ in range(TIMED_ROUNDS):
                for path, multiply in paths.items():
                    fastest_s[path] = min(fastest_s[path], _seconds_for(multiply, rows))
        _decode_paths[key] = min(fastest_s, key=fastest_s.__getitem__)
        logger.debug(
            "decode matmul %s x %s (%s): kernel %.2f ms, oneDNN %.2f ms",
            key[0],
            key[1],
            key[2],
            fastest_s["kernel"] * 1e3,
            fastest_s["onednn"] * 1e3,
        )
    return _decode_paths[key]
