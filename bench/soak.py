"""A soak: varied requests for minutes, with a backlog, watching the worker's memory
and whether every slot stays busy while requests wait.

    python -m bench.soak [--minutes 10] [--warmup-minutes 1] [--users 32]

A local stack (synthetic model, MAX_BATCH_SIZE=--capacity) gets a closed loop of
--users clients, more than its slots, so that requests always wait; each sends
prompts of 20-200 words asking for 8-64 tokens (forced), never the same prompt
twice. Every --sample-s seconds /metrics gives the worker's RSS and /health its
active slots and waiting requests. Reported: answers by status, RSS after the
warm-up and at the end, and its growth (target: under 10%); and over the
samples where requests waited, how often a slot was idle, and the least
active. Writes bench/results/soak.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.report import RESULTS, write_json
from bench.stack import running_stack, stack_env
from bench.workload import words


def _sample(client: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(client.get("/metrics").text)
    rss = next(
        (
            sample.value
            for family in families
            for sample in family.samples
            if sample.name == "minibatch_worker_rss_bytes"
        ),
        0.0,  # before the worker's first heartbeat
    )
    health = client.get("/health").json()
    return {
        "t_s": time.monotonic(),
        "rss_mb": rss / 2**20,
        "active": health["active"] or 0,
        "queued": health["queued"] or 0,
    }


async def _users(url: str, args: argparse.Namespace, stop_at: float) -> Counter[str]:
    """The closed loop; returns how many answers had each status (or failure)."""
    rng = random.Random(args.seed)
    statuses: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout_s = args.request_timeout_s + 60  # the server answers 504 first
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def user() -> None:
            while time.monotonic() < stop_at:
                body = {
                    "prompt": words(rng, rng.randint(20, 200)).capitalize(),
                    "max_new_tokens": rng.randint(8, 64),
                    "ignore_eos": True,
                }
                try:
                    response = await client.post("/generate", json=body)
                    statuses[str(response.status_code)] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1

        await asyncio.gather(*(user() for _ in range(args.users)))
    return statuses


def _sampler(url: str, args: argparse.Namespace, stop_at: float) -> list[dict[str, float]]:
    samples = []
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < stop_at:
            samples.append(_sample(client))
            time.sleep(args.sample_s)
    return samples


async def _soak(url: str, args: argparse.Namespace) -> tuple[Counter[str], list[dict[str, float]]]:
    stop_at = time.monotonic() + args.minutes * 60
    sampling = asyncio.to_thread(_sampler, url, args, stop_at)
    statuses, samples = await asyncio.gather(_users(url, args, stop_at), sampling)
    return statuses, samples


def summarize(samples: list[dict[str, float]], args: argparse.Namespace) -> dict[str, Any]:
    start = samples[0]["t_s"]
    after_warmup = [
        s for s in samples if s["t_s"] - start >= args.warmup_minutes * 60 and s["rss_mb"]
    ]
    rss_start, rss_end = after_warmup[0]["rss_mb"], samples[-1]["rss_mb"]
    backlog = [s for s in samples if s["queued"] > 0]
    idle = [s for s in backlog if s["active"] < args.capacity]
    return {
        "rss_mb_after_warmup": rss_start,
        "rss_mb_end": rss_end,
        "rss_mb_max": max(s["rss_mb"] for s in after_warmup),
        "rss_growth": rss_end / rss_start - 1,
        "samples_with_backlog": len(backlog),
        "samples_with_backlog_and_an_idle_slot": len(idle),
        "least_active_with_backlog": min((s["active"] for s in backlog), default=None),
        "median_active_with_backlog": statistics.median(s["active"] for s in backlog)
        if backlog
        else None,
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--users", type=int, default=32, help="clients, each one at a time")
    parser.add_argument("--capacity", type=int, default=8, help="slots")
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="the stack's REQUEST_TIMEOUT_S: long, so that a deep backlog waits",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    env = stack_env(
        {
            "MODEL_ID": "synthetic",
            "MAX_BATCH_SIZE": str(args.capacity),
            "REQUEST_TIMEOUT_S": str(args.request_timeout_s),
        }
    )
    with running_stack(RESULTS / "soak_stack", env) as stack:
        stack.wait_live(timeout_s=300)
        statuses, samples = asyncio.run(_soak(stack.url, args))
    summary = {"answers_by_status": dict(statuses), **summarize(samples, args)}
    for key, value in summary.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    settings = {**vars(args), "out": str(args.out)}
    report = {"settings": settings, "summary": summary, "samples": samples}
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
