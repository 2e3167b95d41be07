"""The cost of the serving path: HTTP vs raw ZMQ vs the in-process engine, in one run.

    python -m bench.compare_paths --capacity 8 --requests 48 --rounds 3

It starts one stack (synthetic model, MAX_BATCH_SIZE=C) and runs one seeded
closed-loop workload four ways, in turn, --rounds times:
- http:       streamed POST /generate through the frontend to the worker, C users;
- http-queue: the same with 2C users, so that requests wait in the frontend;
- zmq:        C users straight to that worker's socket (bench/zmq_client.py);
- engine:     an engine of capacity C in this process, with C requests always
  available (the next arrives the moment one finishes, and is timed from then).
All decode the same tokens with batches of up to C, so what differs is the path:
http/zmq is the frontend's cost, zmq/engine the worker's transport and the round
trip a new request waits before it fills a freed slot, which http-queue's
waiting requests do not make. Reported: medians of the rounds, the ratios, the
CPU seconds each process used per run (on a machine with few cores the client
and frontend take theirs from the worker), and the tokens each step delivered
(from the worker's step count in /health), which no CPU noise moves: a slot left
empty for a step shows there. Writes bench/results/compare_paths.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import http_load, zmq_load
from bench.engine_bench import run_continuous
from bench.load import tagged_workload
from bench.report import RESULTS, median_summary, save_figure, summarize, table, write_json
from bench.stack import Stack, running_stack, stack_env
from worker.engine.torch_engine import TorchEngine
from worker.serve.config import WorkerConfig
from worker.serve.load import load_engine

PATHS = ("engine", "zmq", "http", "http-queue")
Summary = dict[str, Any]
# Longer than the worker's heartbeat interval (HEARTBEAT_INTERVAL_S, 0.5 s in the
# stack this starts): a heartbeat sent after this wait carries the step count of
# a worker that has gone idle.
HEARTBEAT_WAIT_S = 0.7


def _load_args(args: argparse.Namespace, requests: int, concurrency: int) -> list[str]:
    return [
        "--mode=closed",
        f"--concurrency={concurrency}",
        f"--requests={requests}",
        f"--seed={args.seed}",
        "--no-progress",
    ]


class Paths:
    """One run of each path, over a workload of ``num_requests``."""

    def __init__(self, stack: Stack, engine: TorchEngine, args: argparse.Namespace) -> None:
        self.stack = stack
        self.engine = engine
        self.args = args

    def run(self, path: str, num_requests: int) -> Summary:
        if path == "engine":
            engine_args = zmq_load.parser().parse_args(
                _load_args(self.args, num_requests, self.args.capacity)
            )
            requests = tagged_workload(engine_args, tag=f"{path}-{uuid.uuid4().hex[:8]}")
            summary = run_continuous(self.engine, requests, concurrency=self.args.capacity)
        else:
            steps_before = self._worker_steps()
            summary = self._run_served(path, num_requests)
            summary["steps"] = self._worker_steps() - steps_before
        summary["tokens_per_step"] = summary["num_tokens"] / max(1, summary["steps"])
        return summary

    def _run_served(self, path: str, num_requests: int) -> Summary:
        users = self.args.capacity * (2 if path == "http-queue" else 1)
        if path.startswith("http"):
            http_args = http_load.parser().parse_args(_load_args(self.args, num_requests, users))
            requests = tagged_workload(http_args, tag=f"http-{uuid.uuid4().hex[:8]}")
            return summarize(asyncio.run(http_load.run_http(self.stack.url, requests, http_args)))
        zmq_args = zmq_load.parser().parse_args(_load_args(self.args, num_requests, users))
        requests = tagged_workload(zmq_args, tag=f"{path}-{uuid.uuid4().hex[:8]}")
        endpoint = self.stack.worker_endpoint
        return summarize(
            asyncio.run(zmq_load.run_zmq(endpoint, requests, zmq_args, zmq_load.client_keys()))
        )

    def _worker_steps(self) -> int:
        """The worker's steps so far, once it is idle (it counts only steps that did work)."""
        time.sleep(HEARTBEAT_WAIT_S)
        health = httpx.get(f"{self.stack.url}/health", timeout=10).json()
        return int(health["workers"][0]["steps"])

    def run_with_cpu(self, path: str, num_requests: int) -> Summary:
        """The run's summary, with the CPU seconds each process spent during it."""
        processes = {
            "worker": self.stack.child("worker.serve.main"),
            "frontend": self.stack.child("frontend.main"),
            "bench (client or engine)": psutil.Process(),
        }
        before = {name: _cpu_s(p) for name, p in processes.items()}
        summary = self.run(path, num_requests)
        summary["cpu_s"] = {name: _cpu_s(p) - before[name] for name, p in processes.items()}
        return summary


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, default=8, help="MAX_BATCH_SIZE = concurrency")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="for the worker and the in-process engine alike; 0: every core. Fewer "
        "than the cores leaves the frontend and the client a core of their own",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "compare_paths.json")
    args = parser.parse_args(argv)

    engine = load_engine(
        WorkerConfig(
            model_id="synthetic", max_batch_size=args.capacity, torch_threads=args.torch_threads
        )
    )
    env = stack_env(
        {
            "MODEL_ID": "synthetic",
            "MAX_BATCH_SIZE": str(args.capacity),
            "TORCH_THREADS": str(args.torch_threads),
        }
    )
    with running_stack(RESULTS / "compare_paths_stack", env) as stack:
        stack.wait_live(timeout_s=300)
        paths = Paths(stack, engine, args)
        for path in PATHS:  # warm-up: one batch through each path
            paths.run(path, args.capacity)
        runs: dict[str, list[Summary]] = {path: [] for path in PATHS}
        for round_number in range(args.rounds):
            for path in PATHS:
                runs[path].append(paths.run_with_cpu(path, args.requests))
            print(f"round {round_number + 1}/{args.rounds} done", flush=True)
    medians = {path: _median(results) for path, results in runs.items()}
    ratios = _ratios(medians)
    print(table(medians))
    for path in PATHS:
        cpu = ", ".join(f"{name} {s:.1f}" for name, s in medians[path]["cpu_s"].items())
        print(f"CPU seconds during a {path} run: {cpu}")
    for path in PATHS:
        print(f"tokens per step, {path}: {medians[path]['tokens_per_step']:.3f}")
    for name, value in ratios.items():
        print(f"{name:<44} {value:8.3f}")
    write_json(
        args.out,
        {
            "settings": {
                "capacity": args.capacity,
                "users": {
                    path: args.capacity * (2 if path == "http-queue" else 1) for path in PATHS
                },
                "requests": args.requests,
                "rounds": args.rounds,
                "seed": args.seed,
                "torch_threads": args.torch_threads,
                "mode": "closed",
                "http": "streamed POST /generate",
            },
            "median": medians,
            "ratios": ratios,
            "runs": runs,
        },
    )
    _plot(medians, args.out.with_suffix(".png"), args.capacity)
    return {"median": medians, "ratios": ratios}


def _median(results: list[Summary]) -> Summary:
    median = median_summary(results)
    median["cpu_s"] = {
        name: statistics.median(r["cpu_s"][name] for r in results) for name in results[0]["cpu_s"]
    }
    return median


def _ratios(medians: dict[str, Summary]) -> dict[str, float]:
    def tokens(path: str) -> float:
        return float(medians[path]["tokens_per_s"])

    def p50(path: str, stat: str = "e2e_ms") -> float:
        return float(medians[path][stat]["p50"])

    def per_step(path: str) -> float:
        return float(medians[path]["tokens_per_step"]) / float(medians["engine"]["tokens_per_step"])

    return {
        "http / engine tokens/s (target >= 0.95)": tokens("http") / tokens("engine"),
        "http-queue / engine tokens/s": tokens("http-queue") / tokens("engine"),
        "zmq / engine tokens/s": tokens("zmq") / tokens("engine"),
        "http / zmq tokens/s": tokens("http") / tokens("zmq"),
        "http - engine median e2e ms (target <= 5)": p50("http") - p50("engine"),
        "zmq - engine median e2e ms": p50("zmq") - p50("engine"),
        "http - zmq median e2e ms": p50("http") - p50("zmq"),
        "http median ms outside the worker (paired)": p50("http", "path_overhead_ms"),
        "zmq median ms outside the worker (paired)": p50("zmq", "path_overhead_ms"),
        "zmq tokens per step / engine's": per_step("zmq"),
        "http tokens per step / engine's": per_step("http"),
        "http-queue tokens per step / engine's": per_step("http-queue"),
    }


def _plot(medians: dict[str, Summary], path: Path, capacity: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(medians)
    throughput.bar(names, [medians[n]["tokens_per_s"] for n in names], color="tab:blue")
    throughput.set_ylabel("delivered tokens/s")
    throughput.set_title(f"closed loop, concurrency = capacity = {capacity}")
    width = 0.4
    positions = range(len(names))
    for offset, stat in ((-width / 2, "p50"), (width / 2, "p95")):
        latency.bar(
            [p + offset for p in positions],
            [medians[n]["e2e_ms"][stat] for n in names],
            width,
            label=stat,
        )
    latency.set_xticks(list(positions), names)
    latency.set_ylabel("end-to-end latency, ms")
    latency.set_title("latency per request")
    latency.legend()
    for ax in (throughput, latency):
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
