"""The load shapes every client drives: a closed loop and an open loop.

A client is one coroutine, ``send(request) -> RequestRecord``; this module decides
when it is called. Closed loop: ``concurrency`` users, each sending its next
request as soon as the last one is answered, so the load adapts to the server.
Open loop: requests arrive on a seeded schedule whatever the server does, so a
slow server builds a queue, as it would in production.

Arrival gaps are gamma-distributed with mean ``1 / rate`` and shape
``burstiness``: 1 is a Poisson process; below 1 the arrivals come in bursts,
above 1 they are more evenly spaced than Poisson.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from tqdm import tqdm

from bench.report import RequestRecord
from bench.workload import MAX_NEW_TOKENS_CHOICES, make_workload
from protocol import GenerateRequest

Send = Callable[[GenerateRequest], Awaitable[RequestRecord]]


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``num`` requests arrives."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num):
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(now)
    return offsets


async def closed_loop(
    send: Send, requests: Sequence[GenerateRequest], concurrency: int, show_progress: bool = True
) -> list[RequestRecord]:
    pending = list(reversed(requests))
    records: list[RequestRecord] = []
    with tqdm(total=len(requests), disable=not show_progress, unit="req") as bar:

        async def user() -> None:
            while pending:
                records.append(await send(pending.pop()))
                bar.update()

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return records


async def open_loop(
    send: Send,
    requests: Sequence[GenerateRequest],
    offsets: Sequence[float],
    show_progress: bool = True,
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    start = time.perf_counter()
    with tqdm(total=len(requests), disable=not show_progress, unit="req") as bar:

        async def arrive(request: GenerateRequest, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            records.append(await send(request))
            bar.update()

        await asyncio.gather(*map(arrive, requests, offsets))
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload and load-shape flags both load clients share."""
    parser.add_argument("--requests", type=int, default=64, help="how many requests")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrivals seed")
    parser.add_argument(
        "--prompt-words", type=int, nargs=2, default=(16, 160), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        nargs="+",
        default=list(MAX_NEW_TOKENS_CHOICES),
        help="each request draws its budget from these",
    )
    parser.add_argument("--mode", choices=("closed", "open"), default="closed")
    parser.add_argument("--concurrency", type=int, default=8, help="closed loop: users")
    parser.add_argument("--rate", type=float, default=4.0, help="open loop: requests/s")
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="open loop: 1 Poisson, <1 bursty"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def tagged_workload(args: argparse.Namespace, tag: str) -> list[GenerateRequest]:
    """The seeded workload, with request ids unique to this run (``tag``), so that
    two runs against one worker never collide."""
    requests = make_workload(
        args.requests, args.seed, tuple(args.prompt_words), args.max_new_tokens
    )
    return [dataclasses.replace(r, request_id=f"{tag}-{r.request_id}") for r in requests]


async def drive(
    send: Send, requests: Sequence[GenerateRequest], args: argparse.Namespace
) -> list[RequestRecord]:
    show = not args.no_progress
    if args.mode == "closed":
        return await closed_loop(send, requests, args.concurrency, show)
    offsets = arrival_offsets(len(requests), args.rate, args.burstiness, args.seed)
    return await open_loop(send, requests, offsets, show)


def describe(args: argparse.Namespace) -> dict[str, object]:
    """The load settings, saved beside the results."""
    shape: dict[str, object] = {"mode": args.mode}
    if args.mode == "closed":
        shape["concurrency"] = args.concurrency
    else:
        shape.update(rate=args.rate, burstiness=args.burstiness)
    return {
        **shape,
        "requests": args.requests,
        "seed": args.seed,
        "prompt_words": list(args.prompt_words),
        "max_new_tokens": list(args.max_new_tokens),
    }
