"""In-process engine benchmark: continuous batching vs static batching, side by side.

Methodology: 32 requests are all available at t0, with varied prompt lengths and
max_new_tokens drawn from (8, 16, 32, 48) under a fixed seed; capacity 8; the
synthetic model (distilgpt2's shape and compute). Static batching runs HF
``generate(do_sample=False)`` over first-come chunks of 8, each to its largest
max_new_tokens; continuous batching refills a slot as soon as a sequence leaves.
Reported: delivered tokens/s and latency from t0 to each request's last token,
p50/p95/p99, the median of 3 runs after a warm-up, alternating the two modes.

    python -m bench.engine_bench [--runs 3] [--out bench/results/engine.json]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import (
    OK,
    RESULTS,
    RequestRecord,
    median_summary,
    summarize,
    table,
    write_json,
)
from bench.static_baseline import StaticBatchRunner
from bench.workload import make_workload
from protocol import GenerateRequest
from worker.engine.torch_engine import TorchEngine
from worker.serve.config import WorkerConfig
from worker.serve.load import load_engine

CAPACITY = 8
NUM_REQUESTS = 32
SEED = 0

Summary = dict[str, Any]


def run_continuous(
    engine: TorchEngine, requests: list[GenerateRequest], concurrency: int | None = None
) -> Summary:
    """Continuous batching over ``requests``. With ``concurrency`` C, a closed loop:
    C requests are available at any time and the next one arrives when one
    finishes, timed from then; without it, every request is available at t0."""
    t0 = time.perf_counter()
    records = {
        r.request_id: RequestRecord(r.request_id, t0) for r in requests[: concurrency or None]
    }
    num_admitted = num_steps = 0
    while num_admitted < len(requests) or engine.num_active():
        num_free = engine.capacity - engine.num_active()
        # Only requests that have arrived (have a record) may be admitted.
        newcomers = requests[num_admitted : min(len(records), num_admitted + num_free)]
        if newcomers:
            engine.admit(newcomers)
            num_admitted += len(newcomers)
        num_steps += 1
        for seq in engine.step().finished:
            now = time.perf_counter()
            record = records[seq.request_id]
            record.ended_at = now
            record.num_tokens = len(seq.token_ids)
            if len(records) < len(requests):
                arrival = requests[len(records)]
                records[arrival.request_id] = RequestRecord(arrival.request_id, now)
    return {**summarize(list(records.values())), "steps": num_steps}


def run_static(runner: StaticBatchRunner, requests: list[GenerateRequest]) -> Summary:
    t0 = time.perf_counter()
    records = []
    for chunk in runner.run(requests):
        done = time.perf_counter()
        records += [RequestRecord(s.request_id, t0, OK, done, len(s.token_ids)) for s in chunk]
    return summarize(records)


def median_of_runs(
    modes: dict[str, Callable[[], Summary]], num_runs: int, warm_up: bool = True
) -> tuple[dict[str, Summary], dict[str, list[Summary]]]:
    """Warm each mode up once (unless the caller did), then run them in turn
    ``num_runs`` times, so that a slow spell of a shared machine hits every mode
    alike; return the medians and every run."""
    for mode in modes.values() if warm_up else ():
        mode()
    runs: dict[str, list[Summary]] = {name: [] for name in modes}
    for _ in range(num_runs):
        for name, mode in modes.items():
            runs[name].append(mode())
    return {name: median_summary(results) for name, results in runs.items()}, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "engine.json")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    config = WorkerConfig(model_id="synthetic", max_batch_size=CAPACITY, device=args.device)
    engine = load_engine(config)
    runner = StaticBatchRunner(engine.model, engine.tokenizer, CAPACITY)
    requests = make_workload(NUM_REQUESTS, seed=SEED)
    medians, runs = median_of_runs(
        {
            "static": lambda: run_static(runner, requests),
            "continuous": lambda: run_continuous(engine, requests),
        },
        args.runs,
    )
    ratios = {
        "tokens_per_s": medians["continuous"]["tokens_per_s"] / medians["static"]["tokens_per_s"],
        "p95": medians["continuous"]["e2e_ms"]["p95"] / medians["static"]["e2e_ms"]["p95"],
    }
    print(table(medians))
    print(f"continuous / static: {ratios['tokens_per_s']:.2f}x tokens/s, p95 {ratios['p95']:.2f}x")
    write_json(
        args.out,
        {
            "workload": {
                "num_requests": NUM_REQUESTS,
                "seed": SEED,
                "capacity": CAPACITY,
                "model": engine.info.name,
                "prompt_tokens": [len(engine.tokenizer.encode(r.prompt)) for r in requests],
                "max_new_tokens": [r.max_new_tokens for r in requests],
            },
            "median_of_runs": args.runs,
            "median": medians,
            "runs": runs,
            "ratios_continuous_over_static": ratios,
        },
    )


if __name__ == "__main__":
    main()
