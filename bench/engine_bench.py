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
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.workload import make_workload
from protocol import GenerateRequest
from protocol.config import WorkerConfig
from worker.static_baseline import StaticBatchRunner
from worker.torch_engine import TorchEngine, load_engine

CAPACITY = 8
NUM_REQUESTS = 32
SEED = 0

Run = dict[str, float]


def run_continuous(engine: TorchEngine, requests: list[GenerateRequest]) -> Run:
    queue = list(requests)
    finished_at: dict[str, float] = {}
    num_tokens = 0
    t0 = time.perf_counter()
    while queue or engine.num_active():
        num_free = engine.capacity - engine.num_active()
        if queue and num_free:
            engine.admit(queue[:num_free])
            del queue[:num_free]
        for seq in engine.step().finished:
            finished_at[seq.request_id] = time.perf_counter() - t0
            num_tokens += len(seq.token_ids)
    return _summary(t0, finished_at, num_tokens)


def run_static(runner: StaticBatchRunner, requests: list[GenerateRequest]) -> Run:
    finished_at: dict[str, float] = {}
    num_tokens = 0
    t0 = time.perf_counter()
    for chunk in runner.run(requests):
        done = time.perf_counter() - t0
        for seq in chunk:
            finished_at[seq.request_id] = done
            num_tokens += len(seq.token_ids)
    return _summary(t0, finished_at, num_tokens)


def _summary(t0: float, finished_at: dict[str, float], num_tokens: int) -> Run:
    wall_s = time.perf_counter() - t0
    latencies = sorted(finished_at.values())
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "tokens": num_tokens,
        "wall_s": wall_s,
        "tokens_per_s": num_tokens / wall_s,
        "p50_s": cuts[49],
        "p95_s": cuts[94],
        "p99_s": cuts[98],
    }


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/results/engine.json")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    config = WorkerConfig(model_id="synthetic", max_batch_size=CAPACITY, device=args.device)
    engine = load_engine(config)
    runner = StaticBatchRunner(engine.model, engine.tokenizer, CAPACITY)
    requests = make_workload(NUM_REQUESTS, seed=SEED)
    modes: dict[str, Callable[[], Run]] = {
        "static": lambda: run_static(runner, requests),
        "continuous": lambda: run_continuous(engine, requests),
    }
    for mode in modes.values():
        mode()  # warm-up
    runs: dict[str, list[Run]] = {name: [] for name in modes}
    for _ in range(args.runs):
        for name, mode in modes.items():
            runs[name].append(mode())
    medians = {
        name: {key: statistics.median(run[key] for run in results) for key in results[0]}
        for name, results in runs.items()
    }
    ratios = {
        "tokens_per_s": medians["continuous"]["tokens_per_s"] / medians["static"]["tokens_per_s"],
        "p95": medians["continuous"]["p95_s"] / medians["static"]["p95_s"],
    }
    report = {
        "machine": machine(),
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
    }
    print(_table(medians, ratios, report["machine"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {out}")


def _table(medians: dict[str, Run], ratios: dict[str, float], machine: object) -> str:
    lines = [
        f"machine: {machine}",
        f"{'mode':<11} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'p50 s':>6} "
        f"{'p95 s':>6} {'p99 s':>6}",
    ]
    for name, m in medians.items():
        lines.append(
            f"{name:<11} {m['tokens']:>6.0f} {m['wall_s']:>7.2f} {m['tokens_per_s']:>7.1f} "
            f"{m['p50_s']:>6.2f} {m['p95_s']:>6.2f} {m['p99_s']:>6.2f}"
        )
    lines.append(
        f"continuous / static: {ratios['tokens_per_s']:.2f}x tokens/s, p95 {ratios['p95']:.2f}x"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
