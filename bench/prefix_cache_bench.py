"""The prefix cache over HTTP: chat-like requests that share a system prompt, with
the cache on and off, and the plain seeded workload (no shared prefixes) both ways.

    python -m bench.prefix_cache_bench [--runs 2] [--requests 64] [--concurrency 8]

Each request is a transcript sent to /v1/completions, streamed: a system prompt
of --system-words words (about one GPT-2 token each, the same for every request),
then a question of --question-words words of its own, then "Assistant:"; every
request is forced to --max-new-tokens tokens. A local stack (synthetic model)
is started per configuration, PREFIX_CACHE=0 and 1 taking turns --runs times;
reported are the medians, the cache's hits from /metrics, and the ratios.
Targets: time to first token p50 >= 3x lower and tokens/s >= 1.5x higher with
the cache; on the plain workload, tokens/s within 2% of off. Writes
bench/results/prefix_cache.json.

    python -m bench.prefix_cache_bench --engine-only [--runs 3]

The plain workload's cost alone, without HTTP's noise: one in-process engine,
the cache off and on taking turns. Writes bench/results/prefix_cache_engine.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import http_load
from bench.report import RESULTS, RequestRecord, median_summary, summarize, table, write_json
from bench.stack import running_stack, stack_env
from bench.workload import make_workload, words
from protocol import GenerateRequest

CAPACITY = 8


def shared_prefix_workload(args: argparse.Namespace, tag: str) -> list[GenerateRequest]:
    rng = random.Random(args.seed)
    system = words(rng, args.system_words).capitalize()
    requests = []
    for i in range(args.requests):
        question = words(rng, rng.randint(*args.question_words)).capitalize()
        requests.append(
            GenerateRequest(
                request_id=f"{tag}-{i}",
                prompt=f"System: {system}.\nUser: {question}?\nAssistant:",
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
            )
        )
    return requests


def plain_workload(args: argparse.Namespace, tag: str) -> list[GenerateRequest]:
    requests = make_workload(args.requests, args.seed)
    return [
        GenerateRequest(f"{tag}-{i}", r.prompt, r.max_new_tokens, ignore_eos=True)
        for i, r in enumerate(requests)
    ]


def _hits(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    samples = {sample.name: sample.value for family in families for sample in family.samples}
    return {
        "queries": samples["minibatch_prefix_cache_queries_total"],
        "hits": samples["minibatch_prefix_cache_hits_total"],
    }


def run_configuration(
    prefix_cache: bool, run: int, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """One stack with the cache on or off: the shared-prefix workload, then the plain."""
    env = stack_env(
        {
            "MODEL_ID": "synthetic",
            "MAX_BATCH_SIZE": str(CAPACITY),
            "PREFIX_CACHE": str(int(prefix_cache)),
        }
    )
    http_args = http_load.parser().parse_args(
        ["--api", "openai", "--concurrency", str(args.concurrency), "--no-progress"]
    )
    results: dict[str, dict[str, Any]] = {}
    with running_stack(RESULTS / "prefix_cache_stack", env) as stack:
        stack.wait_live(timeout_s=300)
        for name, make in (("shared", shared_prefix_workload), ("plain", plain_workload)):
            before = _hits(stack.url)
            records: list[RequestRecord] = asyncio.run(
                http_load.run_http(stack.url, make(args, f"{name}-{run}"), http_args)
            )
            after = _hits(stack.url)
            summary = summarize(records)
            summary["cached_fraction"] = (after["hits"] - before["hits"]) / max(
                1.0, after["queries"] - before["queries"]
            )
            results[name] = summary
    return results


def engine_only(args: argparse.Namespace) -> dict[str, Any]:
    """The plain workload, 8 at a time, through one in-process engine with the
    prefix cache off and on in turns: what the cache costs when nothing is shared."""
    from bench.engine_bench import median_of_runs, run_continuous
    from worker.engine.prefix_cache import PrefixCache
    from worker.serve.config import WorkerConfig
    from worker.serve.load import load_engine

    engine = load_engine(WorkerConfig(model_id="synthetic", max_batch_size=CAPACITY))
    num_runs = 0

    def run(is_on: bool) -> Callable[[], dict[str, Any]]:
        def once() -> dict[str, Any]:
            nonlocal num_runs
            num_runs += 1
            engine.prefix_cache = PrefixCache(CAPACITY, engine.block_tokens) if is_on else None
            return run_continuous(engine, plain_workload(args, f"run{num_runs}"), CAPACITY)

        return once

    medians, runs = median_of_runs({"off": run(False), "on": run(True)}, args.runs)
    ratio = medians["on"]["tokens_per_s"] / medians["off"]["tokens_per_s"]
    for name, summary in medians.items():
        each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs[name])
        print(f"plain, cache {name}: {summary['tokens_per_s']:.1f} tokens/s (runs: {each})")
    print(f"plain_tokens_per_s_on_over_off: {ratio:.3f}")
    report = {"settings": vars(args), "medians": medians, "ratio_on_over_off": ratio}
    write_json(RESULTS / "prefix_cache_engine.json", report)
    return report


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="turns of each configuration")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=400)
    parser.add_argument("--question-words", type=int, nargs=2, default=(20, 60))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-only", action="store_true", help="the plain workload in one engine, no HTTP"
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.engine_only:
        return engine_only(args)
    runs: dict[str, list[dict[str, Any]]] = {}
    for run in range(args.runs):
        for prefix_cache in (False, True):
            label = "cache on" if prefix_cache else "cache off"
            for name, summary in run_configuration(prefix_cache, run, args).items():
                runs.setdefault(f"{name}, {label}", []).append(summary)
    medians = {name: median_summary(summaries) for name, summaries in runs.items()}
    print(table(medians))
    on, off = medians["shared, cache on"], medians["shared, cache off"]
    ratios = {
        "shared_ttft_p50_off_over_on": off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"],
        "shared_tokens_per_s_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
        "plain_tokens_per_s_on_over_off": medians["plain, cache on"]["tokens_per_s"]
        / medians["plain, cache off"]["tokens_per_s"],
        "shared_cached_fraction": on["cached_fraction"],
    }
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")
    report = {"settings": vars(args), "medians": medians, "ratios": ratios}
    write_json(RESULTS / "prefix_cache.json", report)
    return report


if __name__ == "__main__":
    main()
