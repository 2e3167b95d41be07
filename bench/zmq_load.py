"""ZMQ load client: the HTTP load generator's workload and report, sent straight to
the worker's socket with `protocol`, bypassing the frontend.

    python -m bench.zmq_load --mode closed --concurrency 8 --requests 64
    python -m bench.zmq_load --endpoint tcp://127.0.0.1:5555 --mode open --rate 6

Without --endpoint it starts a local stack (synthetic model, MAX_BATCH_SIZE=
--capacity) and talks to its worker. Writes bench/results/zmq_<mode>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from bench import load
from bench.report import RESULTS, RequestRecord, report_run
from bench.stack import running_stack, stack_env
from bench.zmq_client import ZmqTarget
from protocol import GenerateRequest
from protocol.client_config import WorkerClientConfig
from protocol.curve import ClientKeys
from protocol.settings import load as load_config
from worker.launch.probe import ProbeFailed, probe

_HELLO_TIMEOUT_S = 60.0  # a worker on a cold machine may still be loading its model


async def run_zmq(
    endpoint: str,
    requests: list[GenerateRequest],
    args: argparse.Namespace,
    curve: ClientKeys | None,
) -> list[RequestRecord]:
    async with ZmqTarget(endpoint, stream=not args.no_stream, curve=curve) as target:
        return await load.drive(target.send, requests, args)


def client_keys() -> ClientKeys | None:
    """A client's CURVE settings, from the environment, for a worker with CURVE on."""
    return load_config(WorkerClientConfig, []).curve


def check_worker(endpoint: str, curve: ClientKeys | None) -> None:
    """Say what it waits for, and end the run at once, saying why (as
    minibatch-probe does), if no worker greets it: it waited 60 s in silence,
    then raised."""
    print(f"waiting up to {_HELLO_TIMEOUT_S:g} s for a worker's hello at {endpoint}", flush=True)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        probe(endpoint, _HELLO_TIMEOUT_S, context, curve)
    except ProbeFailed as exc:
        sys.exit(f"zmq_load: {exc}")
    finally:
        context.term()


@contextlib.contextmanager
def target_endpoint(args: argparse.Namespace) -> Iterator[str]:
    """``--endpoint``, or the worker of a local synthetic stack started for this run."""
    if args.endpoint:
        yield args.endpoint
        return
    env = stack_env({"MODEL_ID": args.model_id, "MAX_BATCH_SIZE": str(args.capacity)})
    with running_stack(RESULTS / "zmq_load_stack", env) as stack:
        stack.wait_live(timeout_s=300)
        yield stack.worker_endpoint


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", help="a worker's ZMQ endpoint; default: a local stack")
    parser.add_argument("--model-id", default="synthetic", help="for the stack it starts")
    parser.add_argument("--capacity", type=int, default=8, help="for the stack it starts")
    parser.add_argument("--no-stream", action="store_true", help="no TTFT or ITL then")
    parser.add_argument("--out", type=Path, help="default: bench/results/zmq_<mode>.json")
    load.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    requests = load.tagged_workload(args, tag=f"zmq-{uuid.uuid4().hex[:8]}")
    curve = client_keys()
    with target_endpoint(args) as endpoint:
        check_worker(endpoint, curve)
        records = asyncio.run(run_zmq(endpoint, requests, args, curve))
    settings = {**load.describe(args), "endpoint": args.endpoint or "local stack"}
    out = args.out or RESULTS / f"zmq_{args.mode}.json"
    return report_run(f"zmq {args.mode}", records, settings, out)


if __name__ == "__main__":
    main()
