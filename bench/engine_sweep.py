"""Engine sweep: static vs continuous batching in-process, over engine capacity.

    python -m bench.engine_sweep                          # capacities 1 4 8 16 32 64
    python -m bench.engine_sweep --short                  # one run each, fewer requests

At each capacity C the engine benchmark's method (bench/engine_bench.py) runs on
the seeded workload with max(--min-requests, --requests-per-slot x C) requests,
all available at t0, so that every capacity has several waves to schedule.
Reports delivered tokens/s and end-to-end p50/p95 for both modes (median of
--runs), as a table and bench/results/engine_sweep.png; JSON beside it.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from bench.engine_bench import Summary, median_of_runs, run_continuous, run_static
from bench.engines import engines_by_capacity
from bench.report import RESULTS, save_figure, write_json
from bench.static_baseline import StaticBatchRunner
from bench.workload import make_workload
from worker.model.precision import MODES as PRECISION_MODES

MODES = ("static", "continuous")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests-per-slot", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="1 run, 2 requests per slot, min 8")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--mode", default="float32", choices=PRECISION_MODES, help="weights and KV cache"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_sweep.json")
    args = parser.parse_args(argv)
    if args.short:
        args.runs, args.requests_per_slot, args.min_requests = 1, 2, 8

    rows: list[dict[str, Any]] = []
    for capacity, engine in engines_by_capacity(args.capacities, args.device, args.mode):
        num_requests = max(args.min_requests, args.requests_per_slot * capacity)
        requests = make_workload(num_requests, seed=args.seed)
        runner = StaticBatchRunner(engine.model, engine.tokenizer, capacity)
        if not rows:  # warm the process up once, on one batch of each mode
            run_static(runner, requests[:capacity])
            run_continuous(engine, requests[:capacity])
        medians, _ = median_of_runs(
            {
                "static": functools.partial(run_static, runner, requests),
                "continuous": functools.partial(run_continuous, engine, requests),
            },
            args.runs,
            warm_up=False,
        )
        rows.append({"capacity": capacity, "num_requests": num_requests, **medians})
        print(_line(rows[-1]), flush=True)
        del engine, runner
    write_json(
        args.out,
        {
            "settings": {
                "seed": args.seed,
                "mode": args.mode,
                "runs": args.runs,
                "requests": f"max({args.min_requests}, {args.requests_per_slot} x capacity)",
                "arrival": "all at t0",
            },
            "rows": rows,
        },
    )
    _plot(rows, args.out.with_suffix(".png"))
    return {"rows": rows}


def _line(row: dict[str, Any]) -> str:
    static: Summary = row["static"]
    continuous: Summary = row["continuous"]
    ratio = continuous["tokens_per_s"] / static["tokens_per_s"]
    return (
        f"capacity {row['capacity']:>3} ({row['num_requests']:>3} requests): "
        f"tok/s static {static['tokens_per_s']:>6.1f} continuous "
        f"{continuous['tokens_per_s']:>6.1f} ({ratio:.2f}x); e2e p50/p95 ms static "
        f"{static['e2e_ms']['p50']:>6.0f}/{static['e2e_ms']['p95']:<6.0f} continuous "
        f"{continuous['e2e_ms']['p50']:>6.0f}/{continuous['e2e_ms']['p95']:.0f}"
    )


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capacities = [r["capacity"] for r in rows]
    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, color in zip(MODES, ("tab:gray", "tab:blue"), strict=True):
        throughput.plot(
            capacities, [r[mode]["tokens_per_s"] for r in rows], "o-", color=color, label=mode
        )
        for stat, style in (("p50", "o-"), ("p95", "s--")):
            latency.plot(
                capacities,
                [r[mode]["e2e_ms"][stat] / 1000 for r in rows],
                style,
                color=color,
                label=f"{mode} {stat}",
            )
    for ax in (throughput, latency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(capacities, [str(c) for c in capacities])
        ax.set_xlabel("capacity (MAX_BATCH_SIZE)")
        ax.grid(alpha=0.3)
        ax.legend()
    throughput.set_ylabel("delivered tokens/s")
    throughput.set_title("throughput")
    latency.set_ylabel("end-to-end latency, s")
    latency.set_title("latency (all requests at t0)")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
