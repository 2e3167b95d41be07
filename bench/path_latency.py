"""The latency the serving path adds to one request, with nothing else running.

    python -m bench.path_latency --requests 30

It starts one stack (synthetic model) and sends the same streamed request over
HTTP (POST /generate) and straight to the worker over ZMQ, one at a time and
taking turns, each from the simplest blocking client (httpx.Client, a zmq DEALER).
For each it takes the client's end-to-end time less the server's queue wait (in
the frontend's line and the worker's queue: none here, one request at a time)
and generate time, which every answer reports: what the path and the client add.
HTTP's median less ZMQ's is the frontend's own share, free of the queueing and
CPU contention that a loaded run (bench.compare_paths) mixes in.
Writes bench/results/path_latency.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import zmq
from httpx_sse import EventSource

from bench.report import RESULTS, latency_stats, write_json
from bench.stack import running_stack, stack_env
from bench.zmq_load import client_keys
from protocol import ErrorResult, GenerateRequest, GenerateResult, decode_to_frontend, encode
from protocol.curve import ClientKeys
from protocol.peer import ping, wait_for_hello, worker_socket

PROMPT = "The path from a client to the worker and back " * 4
# How long a request over ZMQ may go without a word from the worker, and how
# often it pings meanwhile (the worker drops a silent peer's requests after its
# FRONTEND_TIMEOUT_S).
ZMQ_SILENCE_S = 30.0
ZMQ_PING_INTERVAL_MS = 1000


def http_overhead_ms(client: httpx.Client, url: str, max_new_tokens: int) -> float:
    body = {"prompt": PROMPT, "max_new_tokens": max_new_tokens, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    with client.stream("POST", f"{url}/generate", json=body) as response:
        response.raise_for_status()
        events = [sse.data for sse in EventSource(response).iter_sse()]
    ended = time.perf_counter()
    metrics = json.loads(events[-1])["metrics"]
    return (ended - started) * 1e3 - float(metrics["queue_wait_ms"]) - float(metrics["generate_ms"])


def zmq_overhead_ms(socket: zmq.Socket[bytes], max_new_tokens: int) -> float:
    request_id = f"latency-{uuid.uuid4().hex[:12]}"
    request = GenerateRequest(request_id, PROMPT, max_new_tokens, ignore_eos=True, stream=True)
    started = time.perf_counter()
    socket.send(encode(request))
    heard_at = time.monotonic()
    while True:
        if not socket.poll(ZMQ_PING_INTERVAL_MS):
            if time.monotonic() - heard_at > ZMQ_SILENCE_S:
                raise RuntimeError(f"the worker said nothing for {ZMQ_SILENCE_S:g} s")
            socket.send(ping("bench"))
            continue
        heard_at = time.monotonic()
        message = decode_to_frontend(socket.recv())
        if isinstance(message, ErrorResult) and message.request_id == request_id:
            raise RuntimeError(f"the worker refused a request: {message.message}")
        if isinstance(message, GenerateResult) and message.request_id == request_id:
            break
    ended = time.perf_counter()
    return (ended - started) * 1e3 - message.queue_wait_ms - message.generate_ms


def connect_worker(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, curve: ClientKeys | None
) -> zmq.Socket[bytes]:
    """A DEALER to the worker at ``endpoint``, greeted: the worker answers a new
    peer's first ping with its hello. ``curve``: the client's keys, for a worker
    that the environment's CURVE settings secure."""
    socket = worker_socket(context, endpoint, curve)
    socket.connect(endpoint)
    socket.send(ping("bench"))
    if wait_for_hello(socket, timeout_s=10) is None:
        raise RuntimeError(f"the worker at {endpoint} did not answer a ping with its hello")
    return socket


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30, help="per path")
    parser.add_argument("--max-new-tokens", type=int, default=28)
    parser.add_argument("--out", type=Path, default=RESULTS / "path_latency.json")
    args = parser.parse_args(argv)

    env = stack_env({"MODEL_ID": "synthetic"})
    samples: dict[str, list[float]] = {"http": [], "zmq": []}
    with running_stack(RESULTS / "path_latency_stack", env) as stack:
        stack.wait_live(timeout_s=300)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        socket = connect_worker(context, stack.worker_endpoint, client_keys())
        with httpx.Client(timeout=120) as client:
            # Warm-up: the first request of each path pays for connections and caches.
            http_overhead_ms(client, stack.url, args.max_new_tokens)
            zmq_overhead_ms(socket, args.max_new_tokens)
            for _ in range(args.requests):
                samples["http"].append(http_overhead_ms(client, stack.url, args.max_new_tokens))
                samples["zmq"].append(zmq_overhead_ms(socket, args.max_new_tokens))
        socket.close()
        context.term()
    medians = {path: statistics.median(values) for path, values in samples.items()}
    added = medians["http"] - medians["zmq"]
    for path, values in samples.items():
        p95 = latency_stats([value / 1e3 for value in values])["p95"]
        print(f"{path:<5} outside the worker: median {medians[path]:6.2f} ms, p95 {p95:6.2f} ms")
    print(f"HTTP adds {added:.2f} ms to a request over ZMQ (median; target <= 5)")
    report = {
        "settings": {"requests": args.requests, "max_new_tokens": args.max_new_tokens},
        "median_ms": medians,
        "http_added_ms": added,
        "samples_ms": samples,
    }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
