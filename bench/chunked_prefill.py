"""Chunked prefill: what long prompts arriving do to the streams already running.

    python -m bench.chunked_prefill [--chunk-tokens 256] [--runs 3]

One in-process engine on the synthetic model, capacity 12. Eight streams of
--stream-tokens tokens each run from the start; every --every steps a prompt of
--prompt-tokens tokens arrives (4 tokens asked of it) and is admitted at once.
Each stream's inter-token latency (ITL) is the time between its consecutive
tokens, including any prefill that ran between them. Three configurations take
turns, --runs times: the streams alone; with the long prompts, each prefilled
whole when it arrives (PREFILL_CHUNK_TOKENS=0); and with the long prompts
prefilled --chunk-tokens at a time between decode steps. Reported: the streams'
ITL p50/p99/max and the long prompts' time to first token, pooled over runs.
Then the engine benchmark's workload (bench/engine_bench.py: 32 requests at t0)
with and without chunks, for the tokens/s chunking costs. Targets: ITL p99 with
chunked long prompts <= 2x the streams' alone, and tokens/s >= 0.95x. Writes
bench/results/chunked_prefill.json.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from pathlib import Path
from typing import Any

from bench.engine_bench import median_of_runs, run_continuous
from bench.report import RESULTS, latency_stats, write_json
from bench.workload import make_workload
from protocol import GenerateRequest
from worker.engine.torch_engine import TorchEngine
from worker.serve.config import WorkerConfig
from worker.serve.load import load_engine

CAPACITY = 12
NUM_STREAMS = 8
STREAM_PROMPT_TOKENS = 32
LONG_PROMPT_NEW_TOKENS = 4


def _request(
    request_id: str, num_prompt_tokens: int, max_new_tokens: int, seed: int
) -> GenerateRequest:
    rng = random.Random(seed)
    return GenerateRequest(
        request_id,
        "",
        max_new_tokens,
        prompt_token_ids=[rng.randrange(50000) for _ in range(num_prompt_tokens)],
        ignore_eos=True,
        stream=True,
    )


def run_streams(
    engine: TorchEngine, args: argparse.Namespace, chunk_tokens: int, long_prompts: bool
) -> dict[str, list[float]]:
    """The streams' inter-token latencies, and each long prompt's time to first token."""
    engine.prefill_chunk_tokens = chunk_tokens
    streams = [
        _request(f"stream-{i}", STREAM_PROMPT_TOKENS, args.stream_tokens, seed=i)
        for i in range(NUM_STREAMS)
    ]
    engine.admit(streams)
    last_token_at = dict.fromkeys((r.request_id for r in streams), time.perf_counter())
    arrived_at: dict[str, float] = {}
    itl: list[float] = []
    ttft: list[float] = []
    step = 0
    while engine.num_active():
        room = engine.capacity - engine.num_active()
        if long_prompts and step % args.every == 0 and room:
            request_id = f"long-{step}"
            arrived_at[request_id] = time.perf_counter()
            engine.admit(
                [_request(request_id, args.prompt_tokens, LONG_PROMPT_NEW_TOKENS, seed=step)]
            )
        output = engine.step()
        now = time.perf_counter()
        for delta in output.deltas:
            if delta.request_id in last_token_at:
                itl.append(now - last_token_at[delta.request_id])
                last_token_at[delta.request_id] = now
            elif delta.request_id in arrived_at:
                ttft.append(now - arrived_at.pop(delta.request_id))
        for finished in output.finished:
            last_token_at.pop(finished.request_id, None)
        if not last_token_at:  # the streams are done: so is the measurement
            engine.reset()
        step += 1
    return {"itl_s": itl, "ttft_s": ttft}


def _latency(values: list[float]) -> dict[str, float]:
    stats = latency_stats(values)
    return {
        "p50_ms": stats["p50"],
        "p99_ms": stats["p99"],
        "max_ms": max(values) * 1000,
        "count": len(values),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-tokens", type=int, default=WorkerConfig().prefill_chunk_tokens)
    parser.add_argument("--prompt-tokens", type=int, default=900)
    parser.add_argument("--stream-tokens", type=int, default=120)
    parser.add_argument("--every", type=int, default=10, help="steps between long prompts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "chunked_prefill.json")
    args = parser.parse_args(argv)

    engine = load_engine(WorkerConfig(model_id="synthetic", max_batch_size=CAPACITY))
    if args.chunk_tokens < engine.block_tokens:
        parser.error(f"--chunk-tokens must hold a whole block of {engine.block_tokens} tokens")
    configurations = {
        "streams alone": (args.chunk_tokens, False),
        "long prompts, whole": (0, True),
        f"long prompts, {args.chunk_tokens}-token chunks": (args.chunk_tokens, True),
    }
    run_streams(engine, args, args.chunk_tokens, True)  # warm-up
    pooled: dict[str, dict[str, list[float]]] = {
        name: {"itl_s": [], "ttft_s": []} for name in configurations
    }
    for _ in range(args.runs):
        for name, (chunk_tokens, long_prompts) in configurations.items():
            for key, values in run_streams(engine, args, chunk_tokens, long_prompts).items():
                pooled[name][key] += values
    rows: dict[str, dict[str, Any]] = {
        name: {
            "itl": _latency(samples["itl_s"]),
            "long_prompt_ttft": _latency(samples["ttft_s"]) if samples["ttft_s"] else None,
        }
        for name, samples in pooled.items()
    }
    alone, whole, chunked = (rows[name]["itl"]["p99_ms"] for name in configurations)

    engine.prefill_chunk_tokens = 0
    requests = make_workload(32, seed=0)

    def with_chunks(chunk_tokens: int) -> dict[str, Any]:
        engine.prefill_chunk_tokens = chunk_tokens
        return run_continuous(engine, requests)

    throughput, _ = median_of_runs(
        {
            "whole": functools.partial(with_chunks, 0),
            "chunked": functools.partial(with_chunks, args.chunk_tokens),
        },
        args.runs,
    )
    tokens_ratio = throughput["chunked"]["tokens_per_s"] / throughput["whole"]["tokens_per_s"]

    print(
        f"{'configuration':<34} {'ITL p50 ms':>10} {'p99 ms':>8} {'max ms':>8} "
        f"{'long TTFT p50 ms':>17}"
    )
    for name, row in rows.items():
        itl, ttft = row["itl"], row["long_prompt_ttft"]
        ttft_text = f"{ttft['p50_ms']:>17.0f}" if ttft else f"{'':>17}"
        print(
            f"{name:<34} {itl['p50_ms']:>10.1f} {itl['p99_ms']:>8.1f} {itl['max_ms']:>8.1f} "
            f"{ttft_text}"
        )
    print(
        f"ITL p99 against the streams alone: whole prompts {whole / alone:.2f}x, "
        f"chunked {chunked / alone:.2f}x (target <= 2x)"
    )
    print(
        f"engine benchmark tokens/s: whole {throughput['whole']['tokens_per_s']:.1f}, "
        f"chunked {throughput['chunked']['tokens_per_s']:.1f} "
        f"({tokens_ratio:.2f}x, target >= 0.95x)"
    )
    report = {
        "settings": {
            "capacity": CAPACITY,
            "streams": NUM_STREAMS,
            "stream_tokens": args.stream_tokens,
            "prompt_tokens": args.prompt_tokens,
            "every_steps": args.every,
            "chunk_tokens": args.chunk_tokens,
            "runs": args.runs,
        },
        "configurations": rows,
        "itl_p99_ratio_whole": whole / alone,
        "itl_p99_ratio_chunked": chunked / alone,
        "throughput": throughput,
        "tokens_per_s_ratio": tokens_ratio,
    }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
