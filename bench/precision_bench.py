"""Precision benchmark: float32, float16, bfloat16 and int8 weights, and bfloat16
products, in one run.

    python -m bench.precision_bench [--runs 3] [--capacity 8]

For each of worker/model/precision.py's MODES that this CPU can run, an engine on the
synthetic model at --capacity. Two measures, the modes taking turns so that a slow spell of a shared
machine hits each alike: the engine benchmark's workload (bench/engine_bench.py:
32 requests at t0, continuous batching; delivered tokens/s, median of --runs after
a warm-up), and the median decode step with every slot at 128 tokens of context
(bench/ceiling.py's method), with the bytes that step reads as each mode stores
its weights and KV cache, and the bandwidth that makes. Every ratio is against
float32 in the same run. The decode step is also taken at --wide-capacity rows
(16), for the tokens/s that twice the rows deliver against --capacity's. Writes
bench/results/precision.json.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.ceiling import decode_cost, measure_decode, read_bandwidth
from bench.engine_bench import median_of_runs, run_continuous
from bench.engines import mode_engine
from bench.report import RESULTS, write_json
from bench.workload import make_workload
from worker.model.precision import MODES, cpu_modes

CONTEXT = 128
NUM_REQUESTS = 32
DECODE_STEPS = 8


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--wide-capacity", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=cpu_modes(), choices=MODES)
    parser.add_argument("--out", type=Path, default=RESULTS / "precision.json")
    args = parser.parse_args(argv)
    cannot_run = [mode for mode in args.modes if mode not in cpu_modes()]
    if cannot_run:
        parser.error(
            f"this CPU cannot run {', '.join(cannot_run)} (it runs {', '.join(cpu_modes())})"
        )

    print(
        f"{len(args.modes)} modes, {args.runs} runs of {NUM_REQUESTS} requests each, then "
        "their decode steps: a few minutes",
        flush=True,
    )
    engines = {mode: mode_engine(mode, args.capacity) for mode in args.modes}
    wide_engines = {mode: mode_engine(mode, args.wide_capacity) for mode in args.modes}
    bandwidth = read_bandwidth(torch.device("cpu"), 2**28, repeats=5)
    requests = make_workload(NUM_REQUESTS, seed=0)
    medians, _ = median_of_runs(
        {
            mode: functools.partial(run_continuous, engine, requests)
            for mode, engine in engines.items()
        },
        args.runs,
    )
    step_s: dict[str, list[float]] = {mode: [] for mode in engines}
    wide_step_s: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(args.runs):
        for mode in engines:
            for engine, steps in ((engines[mode], step_s), (wide_engines[mode], wide_step_s)):
                tokens_per_s, _ = measure_decode(engine, CONTEXT, DECODE_STEPS, 0)
                steps[mode].append(engine.capacity / tokens_per_s)
    base = args.modes[0]
    rows = []
    for mode, engine in engines.items():
        step = statistics.median(step_s[mode])
        wide_step = statistics.median(wide_step_s[mode])
        cost = decode_cost(engine, args.capacity, CONTEXT + 2 + DECODE_STEPS // 2)
        rows.append(
            {
                "mode": mode,
                "precision": engine.precision.describe(),
                "tokens_per_s": medians[mode]["tokens_per_s"],
                "tokens_per_s_ratio": medians[mode]["tokens_per_s"] / medians[base]["tokens_per_s"],
                "decode_step_ms": step * 1000,
                "decode_step_ratio": step / statistics.median(step_s[base]),
                "bytes_per_step": cost.bytes,
                "bytes_per_s": cost.bytes / step,
                "wide_decode_step_ms": wide_step * 1000,
                "wide_tokens_per_s_ratio": (args.wide_capacity / wide_step)
                / (args.capacity / step),
            }
        )
    print(f"read bandwidth (a sum over 256 MiB): {bandwidth / 1e9:.1f} GB/s")
    print(_table(rows, base, args.capacity, args.wide_capacity))
    report = {
        "settings": {
            "capacity": args.capacity,
            "wide_capacity": args.wide_capacity,
            "runs": args.runs,
            "num_requests": NUM_REQUESTS,
            "decode_context": CONTEXT,
        },
        "read_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
        "continuous": medians,
        "decode_step_s": step_s,
        "wide_decode_step_s": wide_step_s,
    }
    write_json(args.out, report)
    return report


def _table(rows: list[dict[str, Any]], base: str, capacity: int, wide: int) -> str:
    lines = [
        f"{'mode':<17} {'tok/s':>7} {'vs ' + base:>11} {'step ms':>8} {'vs ' + base:>11} "
        f"{'MB/step':>8} {'GB/s':>6} {f'{wide}-row ms':>10} {f'{wide} vs {capacity} tok/s':>16}"
    ]
    for r in rows:
        lines.append(
            f"{r['mode']:<17} {r['tokens_per_s']:>7.1f} {r['tokens_per_s_ratio']:>10.2f}x "
            f"{r['decode_step_ms']:>8.2f} {r['decode_step_ratio']:>10.2f}x "
            f"{r['bytes_per_step'] / 1e6:>8.0f} {r['bytes_per_s'] / 1e9:>6.1f} "
            f"{r['wide_decode_step_ms']:>10.2f} {r['wide_tokens_per_s_ratio']:>15.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
