"""Ceiling report: how close decode gets to what this machine can do.

    python -m bench.ceiling                        # CPU, batches 1 4 8 16 32 64
    python -m bench.ceiling --device cuda          # the same on a GPU
    python -m bench.ceiling --mode int8            # weights stored as int8

It measures the machine's fp32 matrix-multiply rate (a large square ``torch.mm``)
and its memory read bandwidth (``sum`` over a tensor far larger than any cache);
computes the model's FLOPs and bytes per decode step at each batch size B (every
weight read once as --mode stores it, each row's KV cache read once; 2 FLOPs per
weight per row plus attention); and prints the roofline ceiling, B / max(FLOPs / rate, bytes /
bandwidth) tokens/s, beside the engine's measured decode tokens/s (decode steps
only, every row at the same context length), the bandwidth that reaches and the
fraction of the ceiling. At the
largest batch it profiles a step (bench/step_profile.py). Writes
bench/results/ceiling.json and ceiling.png.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engines import engines_by_capacity, sync
from bench.report import RESULTS, save_figure, write_json
from bench.step_profile import median_step_s, profile_steps
from protocol import GenerateRequest
from worker.engine.torch_engine import TorchEngine
from worker.model.precision import MODES

WARMUP_STEPS = 2


def _best_time(run: Any, device: torch.device, repeats: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        run()
        sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def matmul_flops(device: torch.device, size: int, repeats: int) -> float:
    """Peak fp32 FLOP/s of a square ``size`` x ``size`` matrix product."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    out = torch.empty(size, size, device=device)
    return 2 * size**3 / _best_time(lambda: torch.mm(a, b, out=out), device, repeats)


def read_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes/s of reading a ``num_bytes`` fp32 tensor once (a sum)."""
    x = torch.ones(num_bytes // 4, device=device)
    return num_bytes / _best_time(x.sum, device, repeats)


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def decode_cost(engine: TorchEngine, batch: int, context: int) -> StepCost:
    """One decode step of ``batch`` rows, each attending to ``context`` positions,
    with the weights and KV cache as the engine's precision stores them."""
    gpt2 = engine.gpt2
    config = engine.model.config
    # Every projection weight and the LM head is read once per step, in the copy its
    # decode path reads (worker/model/projection.py), and used in one multiply-add per row;
    # biases, norms and int8 scales are read once too; the embeddings are gathered
    # a row at a time.
    projections = [gpt2.lm_head]
    norms = [*gpt2.ln_f]
    for layer in gpt2.layers:
        projections += [layer.attn, layer.proj, layer.fc, layer.out]
        norms += [*layer.ln_1, *layer.ln_2]
    weights = sum(p.out_features * p.in_features for p in projections)
    weight_bytes = sum(p.decode_bytes for p in projections) + sum(_nbytes(norm) for norm in norms)
    kv_per_row = 2 * config.n_layer * context * config.n_embd  # keys and values read
    attention_flops = 2 * kv_per_row  # q.k and p.v: one multiply-add per element
    return StepCost(
        flops=batch * (2 * weights + attention_flops),
        bytes=weight_bytes + batch * kv_per_row * engine.cache.kv.element_size(),
    )


def measure_decode(
    engine: TorchEngine, context: int, num_steps: int, num_profile_steps: int
) -> tuple[float, dict[str, float]]:
    """Decode tokens/s with every slot at ``context`` tokens, from the median step
    time (a step the OS preempted for a neighbour does not count), and (when
    asked) the step profile right after."""
    rng = random.Random(0)
    budget = WARMUP_STEPS + num_steps + 2 * num_profile_steps + 1
    engine.admit(
        [
            GenerateRequest(
                f"ceiling-{row}",
                "",
                budget,
                prompt_token_ids=[rng.randrange(engine.gpt2.vocab_size) for _ in range(context)],
                ignore_eos=True,
            )
            for row in range(engine.capacity)
        ]
    )
    for _ in range(WARMUP_STEPS):
        engine.step()
    step_s = median_step_s(engine, num_steps)
    tokens_per_s = engine.capacity / step_s
    profile = profile_steps(engine, num_profile_steps) if num_profile_steps else {}
    engine.reset()
    return tokens_per_s, profile


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=128, help="tokens each row attends to")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    parser.add_argument("--profile-steps", type=int, default=4, help="0: no profile")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default="float32", choices=MODES, help="weights and KV cache")
    parser.add_argument("--out", type=Path, default=RESULTS / "ceiling.json")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    is_gpu = device.type == "cuda"
    rows: list[dict[str, Any]] = []
    profile: dict[str, float] = {}
    for batch, engine in engines_by_capacity(args.batches, args.device, args.mode):
        if not rows:  # the engine set the thread count; measure the machine with it
            peak_flops = matmul_flops(device, 8192 if is_gpu else 2048, repeats=5)
            bandwidth = read_bandwidth(device, (2**30 if is_gpu else 2**28), repeats=5)
            print(
                f"{device}: fp32 matmul {peak_flops / 1e9:,.1f} GFLOP/s, "
                f"read bandwidth {bandwidth / 1e9:,.1f} GB/s "
                f"({torch.get_num_threads()} torch threads)"
            )
        is_last = batch == args.batches[-1]
        measured, step_profile = measure_decode(
            engine, args.context, args.steps, args.profile_steps if is_last else 0
        )
        profile = step_profile or profile
        # The context each timed step attends to, on average.
        cost = decode_cost(engine, batch, args.context + WARMUP_STEPS + args.steps // 2)
        compute_s, memory_s = cost.flops / peak_flops, cost.bytes / bandwidth
        ceiling = batch / max(compute_s, memory_s)
        rows.append(
            {
                "batch": batch,
                **asdict(cost),
                "bound": "compute" if compute_s >= memory_s else "memory",
                "ceiling_tokens_per_s": ceiling,
                "measured_bytes_per_s": cost.bytes * measured / batch,
                "compute_ceiling_tokens_per_s": batch / compute_s,
                "measured_tokens_per_s": measured,
                "fraction_of_ceiling": measured / ceiling,
                "fraction_of_compute_ceiling": measured * compute_s / batch,
            }
        )
        del engine
    print(_table(rows))
    if profile:
        print(f"\nwhere a decode step's time goes at batch {args.batches[-1]} (ms per step):")
        for section, ms in profile.items():
            print(f"  {section:<30} {ms:8.2f}")
    report = {
        "settings": {
            "device": str(device),
            "mode": args.mode,
            "context": args.context,
            "steps": args.steps,
        },
        "peak_fp32_flops": peak_flops,
        "read_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
        "profile_ms_per_step": {"batch": args.batches[-1], **profile},
    }
    write_json(args.out, report)
    _plot(rows, args.out.with_suffix(".png"), f"{device}, {args.mode}")
    return report


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'batch':>5} {'GFLOP':>7} {'MB':>7} {'bound':>8} {'ceiling tok/s':>14} "
        f"{'measured tok/s':>15} {'GB/s':>6} {'of ceiling':>11} {'of compute':>11}"
    ]
    for r in rows:
        lines.append(
            f"{r['batch']:>5} {r['flops'] / 1e9:>7.2f} {r['bytes'] / 1e6:>7.0f} {r['bound']:>8} "
            f"{r['ceiling_tokens_per_s']:>14,.0f} {r['measured_tokens_per_s']:>15,.0f} "
            f"{r['measured_bytes_per_s'] / 1e9:>6.1f} "
            f"{r['fraction_of_ceiling']:>11.0%} {r['fraction_of_compute_ceiling']:>11.0%}"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["ceiling_tokens_per_s"] for r in rows], "k--", label="roofline ceiling")
    ax.plot(batches, [r["measured_tokens_per_s"] for r in rows], "o-", label="engine decode")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (sequences per step)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"decode vs the roofline ceiling ({device})")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
