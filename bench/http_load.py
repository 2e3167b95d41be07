"""HTTP load generator: a seeded workload, closed or open loop, against our server
or any OpenAI-compatible one.

    python -m bench.http_load --mode closed --concurrency 8 --requests 64
    python -m bench.http_load --mode open --rate 6 --burstiness 0.5
    python -m bench.http_load --url http://127.0.0.1:8000 --api openai --model synthetic

Without --url it starts a local stack (synthetic model, MAX_BATCH_SIZE=--capacity)
and stops it afterwards. Reports delivered tokens/s, requests/s, end-to-end
latency, time to first token and inter-token latency (mean, p50, p95, p99) and
failures by status; writes bench/results/http_<mode>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import load
from bench.http_client import NATIVE, OPENAI, HttpTarget
from bench.report import RESULTS, RequestRecord, report_run
from bench.stack import running_stack, stack_env
from protocol import GenerateRequest


async def run_http(
    url: str,
    requests: list[GenerateRequest],
    args: argparse.Namespace,
) -> list[RequestRecord]:
    # One connection per request in flight: the pool must never be the bottleneck.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as client:
        target = HttpTarget(
            client, args.api, args.model, not args.no_stream, not args.no_ignore_eos
        )
        if args.api == OPENAI:
            await target.resolve_model()
        return await load.drive(target.send, requests, args)


@contextlib.contextmanager
def target_url(args: argparse.Namespace) -> Iterator[str]:
    """``--url``, or a local synthetic stack started for this run."""
    if args.url:
        yield args.url
        return
    env = stack_env({"MODEL_ID": args.model_id, "MAX_BATCH_SIZE": str(args.capacity)})
    with running_stack(RESULTS / "http_load_stack", env) as stack:
        stack.wait_live(timeout_s=300)
        yield stack.url


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server; default: start a local stack")
    parser.add_argument("--api", choices=(NATIVE, OPENAI), default=NATIVE)
    parser.add_argument("--model", help="the model an OpenAI request names (default: listed)")
    parser.add_argument("--model-id", default="synthetic", help="for the stack it starts")
    parser.add_argument("--capacity", type=int, default=8, help="for the stack it starts")
    parser.add_argument("--no-stream", action="store_true", help="no TTFT or ITL then")
    parser.add_argument("--no-ignore-eos", action="store_true", help="for strict servers")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--out", type=Path, help="default: bench/results/http_<mode>.json")
    load.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    requests = load.tagged_workload(args, tag=f"http-{uuid.uuid4().hex[:8]}")
    with target_url(args) as url:
        records = asyncio.run(run_http(url, requests, args))
    settings = {
        **load.describe(args),
        "url": args.url or "local stack",
        "api": args.api,
        "stream": not args.no_stream,
    }
    out = args.out or RESULTS / f"http_{args.mode}.json"
    return report_run(f"http {args.api} {args.mode}", records, settings, out)


if __name__ == "__main__":
    main()
