"""``y = x @ W.T + b``, with the kernel that is fastest for the number of rows, and
``W`` stored as the engine's precision asks (``worker/model/precision.py``).

On CPU, decode's products are tall and skinny (a few rows against a wide weight)
and bound by reading the weights; prefill's are ordinary GEMMs, bound by compute.
Two implementations can multiply: this project's own kernel
(``worker/model/csrc/skinny_linear.cpp``), which reads the weight once in its stored
format (float32, float16, bfloat16 or int8), packed at construction into panels
of output columns for broadcast multiply-adds, and widens it in registers (int8:
multiplies in integers), any number of rows in one call, and oneDNN's inner
product on a float32 copy pre-packed for it (``torch.ops.mkldnn._reorder_linear_weight``,
as torch's own compiler packs CPU weights). Each projection takes one of them
for every row count, prefill's and decode's alike (`decode_path`), by a rule
rather than a timing, so that every worker on a machine chooses the same: a
token's keys then do not depend on whether it was prefilled or decoded, nor on
which worker computed them, and a resumed stream continues bit for bit. The
rule: stored in fewer bytes than float32, the kernel (it reads half or a quarter
of the bytes: on a 2-vCPU Intel Xeon with AVX-512 and VNNI, the LM head
(50257 x 768) at 8 rows took 3.6 ms in float16, 1.7 in int8, against oneDNN's
8.1 on the float32 copy, docs/performance.md); in float32, the kernel too where
its build has AVX-512 and a core's L2 holds 2 MiB (on that Xeon, 2 MiB, it read
the float32 LM head at 8 rows in 1.06x the time to read it, oneDNN in 1.20x,
and a 128-row prefill chunk's projections took 5.60 ms against oneDNN's 5.55;
on an AMD EPYC with AVX-512 and 1 MiB, where a group of a wide projection's
float32 panels for a prefill's rows spills out of L2, 6.26 against 4.92 ms, and
8 rows 0.97x to 1.12x oneDNN's time); and where its build is AVX2 and the L2
holds 512 KiB (a group's panels are a sixth as wide: with AVX2 code alone on
both paths, on a Zen 4 EPYC with 1 MiB, the LM head at 8 rows took 0.75x
oneDNN's time and a prefill chunk 0.98x, and `bench.engine_bench` ran 1.2x
faster); else oneDNN where torch packs for it.
Within either path a row's product does not depend on its batchmates: the
kernel sums each row in the same order whatever the rows, and oneDNN does for 2
rows or more (a lone row, which it multiplies another way, goes in as two).

Above MAX_ROWS rows oneDNN's row counts are padded to a few sizes (see
`padded_rows`).

Elsewhere than the CPU, ``F.linear`` in the model's dtype is already right.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F

from worker.model.cpu_isa import l2_cache_bytes
from worker.model.kernels import LANES, MAX_ROWS, load_kernels, unpack_weight
from worker.model.precision import has_bfloat16_products

logger = logging.getLogger(__name__)

INT8_MAX = 127
# The L2 a core needs, per build, for float32 on the kernel to keep up with oneDNN
# in prefill: the kernel runs each group of rows over a set of panels while they
# are in L2. AVX-512's group reads 3 panels of 32 columns (1.2 MB at K = 3072),
# AVX2's 2 of 8 (196 KB), which half a MiB holds twice over. A build absent
# here (the baseline) leaves float32 to oneDNN.
FLOAT32_KERNEL_MIN_L2 = {
    "avx512_vnni": 2 * 1024 * 1024,
    "avx512": 2 * 1024 * 1024,
    "avx2": 512 * 1024,
}
# The rows oneDNN's copy is packed for: a full decode batch of the kernel's.
PACKED_FOR_ROWS = MAX_ROWS

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


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per output channel (row of the
    (out, in) weight): ``weight ~= q * scale[:, None]``. A per-row scale follows
    each output's own range, which one scale for the whole matrix would not."""
    scale = weight.float().abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(weight.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8).contiguous(), scale


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
        self.compute_dtype = weight.dtype
        self.scale: torch.Tensor | None = None
        self._stored_weight: torch.Tensor | None
        if stored == "int8":
            self._stored_weight, self.scale = quantize_int8(weight)
        else:
            self._stored_weight = weight.to(getattr(torch, stored)).contiguous()
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
            assert self._stored_weight.dtype == torch.bfloat16, (
                "bfloat16 products need bfloat16 weights"
            )
        fits_kernel = is_cpu and weight.dtype == torch.float32 and self.in_features % LANES == 0
        self.kernels = load_kernels() if fits_kernel else None
        self.skinny_linear = None if self.kernels is None else self.kernels.packed_linear
        self.decode_path: DecodePath = decode_path(self)
        # The kernel's copy, packed once into its panels; it replaces the natural
        # layout (`stored_weight` unpacks it again, a copy, for the rare reader).
        self.packed_weight: torch.Tensor | None = None
        self._dense_weight: torch.Tensor | None = None
        if self.decode_path == "kernel":
            self.pack()
        else:
            self._dense_weight = self._dense_copy()

    def _dense_copy(self) -> torch.Tensor:
        """The weight as oneDNN (or F.linear) multiplies it: widened to the
        compute dtype (int8 times its scales), bfloat16 for bfloat16 products, and
        on CPU packed for oneDNN (for a decode-sized batch; it takes any)."""
        stored = self.stored_weight
        if self.bfloat16_products:
            widened = stored
        elif self.scale is not None:
            widened = (stored.float() * self.scale[:, None]).to(self.compute_dtype)
        else:
            widened = stored.to(self.compute_dtype)
        if self.is_packed:
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
                widened.contiguous(), PACKED_FOR_ROWS
            )
            return packed
        return widened

    @property
    def dense_weight(self) -> torch.Tensor:
        """oneDNN's copy: made at load where oneDNN multiplies, else on first use
        (a benchmark setting the paths side by side): a projection on the kernel
        never reads it, and keeping it would hold a float32 copy of every weight
        stored in fewer bytes."""
        if self._dense_weight is None:
            self._dense_weight = self._dense_copy()
        return self._dense_weight

    def pack(self) -> None:
        assert self.kernels is not None and self._stored_weight is not None
        self.packed_weight = self.kernels.pack_weight(self._stored_weight)
        self._stored_weight = None

    @property
    def stored_weight(self) -> torch.Tensor:
        """The weight as stored, (out, in), whichever copy is kept."""
        if self._stored_weight is not None:
            return self._stored_weight
        assert self.packed_weight is not None
        return unpack_weight(self.packed_weight, self.out_features)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """(N, in) -> (N, out) through the skinny kernel, any N."""
        assert self.skinny_linear is not None
        if self.packed_weight is None:  # a projection moved onto the kernel path
            self.pack()
        assert self.packed_weight is not None
        return self.skinny_linear(
            rows.contiguous(), self.packed_weight, self.out_features, self.scale, self.bias
        )

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
            weight = self.packed_weight if self.packed_weight is not None else self._stored_weight
            read = [weight, self.scale, self.bias]
        else:  # the packed copy's storage is opaque, but its size is its shape's
            read = [self.dense_weight, self.bias]
        return sum(t.numel() * t.element_size() for t in read if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        num_rows = rows.shape[0]
        if num_rows == 0:
            y = rows.new_empty(0, self.out_features)
        elif self.decode_path == "kernel":
            # Prefill's rows too, in one call: each row's product is decode's.
            y = self.kernel(rows)
        elif self.is_packed:
            # A lone row goes in as two, more than MAX_ROWS as a padded count.
            padded = (
                2 if num_rows == 1 else padded_rows(num_rows) if num_rows > MAX_ROWS else num_rows
            )
            _matmul_shapes.add((padded, self.out_features, self.in_features))
            if padded > num_rows:
                rows = F.pad(rows, (0, 0, 0, padded - num_rows))  # (padded, in), zeros below
            y = self.dense(rows)[:num_rows]
        else:
            y = self.dense(rows)
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)


def decode_path(projection: Projection) -> DecodePath:
    """The path ``projection`` multiplies through, for every row count: the kernel
    where it is built and the weight is stored in fewer bytes than float32, or the
    L2 holds what the build's FLOAT32_KERNEL_MIN_L2 asks, or no packed oneDNN copy
    exists; oneDNN otherwise (see the module's docstring)."""
    if projection.skinny_linear is None or projection.bfloat16_products:
        return "onednn"
    if projection.stored != "float32" or not projection.is_packed:
        return "kernel"
    assert projection.kernels is not None
    min_l2 = FLOAT32_KERNEL_MIN_L2.get(projection.kernels.isa)
    has_room = min_l2 is not None and (l2_cache_bytes() or 0) >= min_l2
    return "kernel" if has_room else "onednn"
