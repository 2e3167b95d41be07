"""The decode kernel against the machine's bandwidth and against oneDNN, per ISA.

    python -m bench.kernel_bench [--rows 1 8] [--repeats 7]

The LM head (50257 x 768, the largest product of a decode step) at each of
--rows, in every stored format, for every kernel build this CPU runs
(`worker.model.cpu_isa.runnable_isas`), and through oneDNN on the float32 copy the
engine packs for it. Each time is the fastest of --repeats calls, taking turns,
and is set against the time to read that format's weight once at this machine's
read bandwidth, measured in the same run (``bench.ceiling.read_bandwidth``): a
ratio of 1.0 is a kernel bound by memory alone.

Then a prefill's products: one layer's four projections (distilgpt2's shapes) at
--prefill-rows rows, for each build and stored format, in one call (as the
engine runs them) and in calls of 8 rows (as it did before the kernel took more),
against oneDNN on float32 copies. Writes bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.ceiling import read_bandwidth
from bench.report import RESULTS, write_json
from worker.model.cpu_isa import runnable_isas
from worker.model.kernels import Kernels, load_kernels
from worker.model.precision import WEIGHT_FORMATS
from worker.model.projection import PACKED_FOR_ROWS, quantize_int8

VOCAB, WIDTH = 50257, 768
# (in, out) of one layer's projections: attention in and out, the MLP's two.
LAYER_SHAPES = [(WIDTH, 3 * WIDTH), (WIDTH, WIDTH), (WIDTH, 4 * WIDTH), (4 * WIDTH, WIDTH)]


def fastest_s(multiply: Callable[[], object], repeats: int) -> float:
    multiply()  # its set-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        multiply()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill-rows", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = parser.parse_args(argv)

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, WIDTH, generator=generator)
    stored: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        "int8": quantize_int8(weight),
        **{f: (weight.to(getattr(torch, f)), None) for f in WEIGHT_FORMATS if f != "int8"},
    }
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
    bandwidth = read_bandwidth(torch.device("cpu"), 2**28, repeats=5)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; LM head {VOCAB} x {WIDTH}")
    rows_out: list[dict[str, Any]] = []
    with torch.inference_mode():
        for num_rows in args.rows:
            x = torch.randn(num_rows, WIDTH, generator=generator)
            onednn = functools.partial(
                torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""
            )
            onednn_s = fastest_s(onednn, args.repeats)
            read_s = weight.numel() * 4 / bandwidth
            rows_out.append(_row("onednn", "float32", num_rows, onednn_s, read_s, onednn_s))
            for isa in runnable_isas():
                kernels = load_kernels(isa)
                if kernels is None:
                    continue
                for format, (w, scale) in stored.items():
                    packed_w = kernels.pack_weight(w)  # as a Projection packs it, once
                    kernel = functools.partial(
                        kernels.packed_linear, x, packed_w, VOCAB, scale, None
                    )
                    seconds = fastest_s(kernel, args.repeats)
                    read_s = w.numel() * w.element_size() / bandwidth
                    rows_out.append(_row(isa, format, num_rows, seconds, read_s, onednn_s))
    print(f"{'path':<12} {'format':<9} {'rows':>4} {'ms':>7} {'x read time':>12} {'x oneDNN':>9}")
    for row in rows_out:
        print(
            f"{row['path']:<12} {row['format']:<9} {row['rows']:>4} {row['ms']:>7.2f} "
            f"{row['vs_read_time']:>12.2f} {row['vs_onednn_float32']:>9.2f}"
        )
    prefill = prefill_rows(args.prefill_rows, args.repeats, generator)
    report = {"read_bandwidth_bytes_per_s": bandwidth, "rows": rows_out, "prefill": prefill}
    write_json(args.out, report)
    return report


def prefill_rows(num_rows: int, repeats: int, generator: torch.Generator) -> list[dict[str, Any]]:
    """One layer's projections at ``num_rows`` rows: each build and format in one
    call and in 8-row calls, against oneDNN on float32 copies packed for them."""
    layer = [
        (
            torch.randn(out, inp, generator=generator),
            torch.randn(num_rows, inp, generator=generator),
        )
        for inp, out in LAYER_SHAPES
    ]
    dense = [(torch.ops.mkldnn._reorder_linear_weight(w, num_rows), x) for w, x in layer]

    def onednn() -> None:
        for packed, x in dense:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    out: list[dict[str, Any]] = []
    with torch.inference_mode():
        onednn_s = fastest_s(onednn, repeats)
        out.append({"path": "onednn", "format": "float32", "one_call_ms": onednn_s * 1e3})
        for isa in runnable_isas():
            kernels = load_kernels(isa)
            if kernels is None:
                continue
            for format in WEIGHT_FORMATS:
                products = []
                for w, x in layer:
                    stored_w, scale = (
                        quantize_int8(w)
                        if format == "int8"
                        else (w.to(getattr(torch, format)), None)
                    )
                    products.append((x, kernels.pack_weight(stored_w), w.shape[0], scale))
                one_call = functools.partial(_layer, kernels, products, num_rows)
                in_eights = functools.partial(_layer, kernels, products, PACKED_FOR_ROWS)
                one_s = fastest_s(one_call, repeats)
                eights_s = fastest_s(in_eights, repeats)
                out.append(
                    {
                        "path": isa,
                        "format": format,
                        "one_call_ms": one_s * 1e3,
                        "eight_row_calls_ms": eights_s * 1e3,
                    }
                )
    print(f"one layer's projections at {num_rows} rows (a prefill chunk)")
    print(f"{'path':<12} {'format':<9} {'one call ms':>11} {'x oneDNN':>9} {'8-row calls':>12}")
    for row in out:
        eights = row.get("eight_row_calls_ms")
        print(
            f"{row['path']:<12} {row['format']:<9} {row['one_call_ms']:>11.2f} "
            f"{row['one_call_ms'] / (onednn_s * 1e3):>9.2f} "
            + (f"{eights / row['one_call_ms']:>11.2f}x" if eights else f"{'':>12}")
        )
    return out


def _layer(
    kernels: Kernels,
    products: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]],
    rows_a_call: int,
) -> None:
    for x, packed, out_features, scale in products:
        for start in range(0, x.shape[0], rows_a_call):
            kernels.packed_linear(x[start : start + rows_a_call], packed, out_features, scale, None)


def _row(
    path: str, format: str, num_rows: int, seconds: float, read_s: float, onednn_s: float
) -> dict[str, Any]:
    return {
        "path": path,
        "format": format,
        "rows": num_rows,
        "ms": seconds * 1e3,
        "vs_read_time": seconds / read_s,
        "vs_onednn_float32": seconds / onednn_s,
    }


if __name__ == "__main__":
    main()
