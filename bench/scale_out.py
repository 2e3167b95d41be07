"""One worker with every core, or one worker per core? Measured side by side.

    python -m bench.scale_out                      # 1 worker x 2 threads vs 2 x 1
    python -m bench.scale_out --layouts 1x2 2x1 --concurrency 16 --requests 96

Each layout (workers x torch threads each) is a local stack started by
`minibatch-serve` (NUM_WORKERS, TORCH_THREADS) with the same total number of
batch slots, driven over HTTP by the same seeded closed-loop workload; the
layouts run one after another, ``--rounds`` times alternating, in one
invocation. Prints tokens/s and latencies per layout and the ratio; writes
bench/results/scale_out.json.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from bench import load
from bench.http_client import NATIVE
from bench.http_load import run_http
from bench.report import RESULTS, machine, median_summary, summarize, table, write_json
from bench.stack import running_stack, stack_env


@dataclass(frozen=True)
class Layout:
    num_workers: int
    num_threads: int  # torch threads per worker

    @classmethod
    def parse(cls, text: str) -> Layout:
        workers, _, threads = text.partition("x")
        return cls(int(workers), int(threads))

    def __str__(self) -> str:
        return f"{self.num_workers} worker x {self.num_threads} thread"


def run_layout(layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """Start the layout's stack, warm it up, drive the workload; its summary."""
    slots = args.total_slots // layout.num_workers
    env = stack_env(
        {
            "MODEL_ID": args.model_id,
            "NUM_WORKERS": str(layout.num_workers),
            "TORCH_THREADS": str(layout.num_threads),
            "MAX_BATCH_SIZE": str(slots),
        }
    )
    logs = RESULTS / f"scale_out_{layout.num_workers}x{layout.num_threads}"
    with running_stack(logs, env) as stack:
        stack.wait_live(timeout_s=300)
        _wait_for_workers(stack.url, layout.num_workers)
        warm_up = load.tagged_workload(args, tag=f"warm-{uuid.uuid4().hex[:8]}")[: 2 * slots]
        asyncio.run(run_http(stack.url, warm_up, args))
        requests = load.tagged_workload(args, tag=f"scale-{uuid.uuid4().hex[:8]}")
        records = asyncio.run(run_http(stack.url, requests, args))
    return {"slots_per_worker": slots, **summarize(records)}


def _wait_for_workers(url: str, num_workers: int) -> None:
    for _ in range(600):
        if httpx.get(f"{url}/health", timeout=5).json()["workers_live"] == num_workers:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{num_workers} workers were not live within 300 s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x1"], help="WORKERSxTHREADS")
    parser.add_argument("--total-slots", type=int, default=16, help="batch slots in all")
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs per layout")
    parser.add_argument("--model-id", default="synthetic")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    load.add_arguments(parser)
    parser.set_defaults(requests=96, concurrency=16)
    args = parser.parse_args(argv)
    # What bench.http_load's client needs: the native endpoint, streamed, EOS ignored.
    args.api, args.model, args.no_stream, args.no_ignore_eos = NATIVE, None, False, False

    layouts = [Layout.parse(text) for text in args.layouts]
    runs: dict[str, list[dict[str, Any]]] = {str(layout): [] for layout in layouts}
    for round_ in range(args.rounds):
        for layout in layouts:
            print(f"round {round_ + 1}: {layout}", flush=True)
            runs[str(layout)].append(run_layout(layout, args))
    summaries = {name: median_summary(results) for name, results in runs.items()}
    print()
    print(table(summaries))
    rates = {name: summary["tokens_per_s"] for name, summary in summaries.items()}
    best = max(rates, key=rates.__getitem__)
    first = str(layouts[0])
    for name, rate in rates.items():
        print(f"  {name:<22} {rate:7.1f} tokens/s  {rate / rates[first]:.2f}x of {first}")
    print(f"  best: {best}")
    report = {
        "machine": machine(),
        "settings": {**load.describe(args), "total_slots": args.total_slots, "rounds": args.rounds},
        "layouts": summaries,
        "runs": runs,
        "tokens_per_s_ratio_to_first": {name: rate / rates[first] for name, rate in rates.items()},
        "best": best,
    }
    write_json(RESULTS / "scale_out.json", report)
    return report


if __name__ == "__main__":
    main()
