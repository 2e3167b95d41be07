"""Heartbeat gaps while the worker takes the largest messages it allows in.

    python -m bench.heartbeat_gap                 # synthetic model, default limits
    python -m bench.heartbeat_gap --rounds 5

A worker that stops heartbeating for HEARTBEAT_TIMEOUT_S is declared dead and
replaced, so no message a peer may send can be allowed to hold up heartbeats.
This runs a worker in-process and sends, over its real socket, the messages that
cost it most: a text prompt as large as MAX_MESSAGE_BYTES (refused on its length),
the longest text prompt it tokenizes, an id list as large as MAX_MESSAGE_BYTES,
and frames as large that hold a list of one-character strings or a map of keys.
It reports the longest gap between heartbeats and how long each answer took.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from bench.report import RESULTS, write_json
from protocol import (
    PROTOCOL_VERSION,
    ErrorResult,
    GenerateRequest,
    GenerateResult,
    Heartbeat,
    Ping,
    decode_to_frontend,
    encode,
)
from protocol.peer import worker_socket
from protocol.request_checks import RequestLimits
from worker.engine.interface import InferenceEngine
from worker.serve.config import WorkerConfig
from worker.serve.scheduler import Scheduler
from worker.serve.server import WorkerServer

_PROSE = "The quick brown fox jumps over the lazy dog, and then it rests. "


@dataclass
class GapReport:
    interval_s: float  # HEARTBEAT_INTERVAL_S
    max_gap_s: float = 0.0
    answer_s: dict[str, list[float]] = field(default_factory=dict)


def heavy_requests(limits: RequestLimits, max_message_bytes: int) -> dict[str, GenerateRequest]:
    """The costliest messages a peer may send, each under ``max_message_bytes``."""
    room = max_message_bytes - 1024  # the rest of the message's fields
    longest_tokenized = (_PROSE * (limits.max_prompt_chars // len(_PROSE) + 1))[
        : limits.max_prompt_chars
    ]
    return {
        "largest text prompt": GenerateRequest("text", "x" * room, 16),
        "longest tokenized prompt": GenerateRequest("tokenized", longest_tokenized, 16),
        "largest id list": GenerateRequest("ids", "", 16, prompt_token_ids=[1] * (room // 4)),
    }


def costly_frames(max_message_bytes: int, suffix: str) -> list[tuple[str, str | None, bytes]]:
    """(kind, request id to be answered or None, frame): the frames that cost the
    unpacker most. Those that name a request name it first, so that their refusal
    can be answered."""
    room = max_message_bytes - 1024
    nested_id = f"nested-{suffix}"
    head = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": nested_id}
    # One byte an empty list: two million Python objects, were they unpacked.
    leaf = b"\xdc" + (256).to_bytes(2, "big") + b"\x90" * 256
    num_leaves = room // len(leaf) // 256
    nested = b"\xdc\x01\x00" + (b"\xdc" + num_leaves.to_bytes(2, "big") + leaf * num_leaves) * 256
    strings = GenerateRequest(f"strings-{suffix}", "p", 16, stop=["a"] * (room // 2))
    frames: list[tuple[str, str | None, bytes]] = [
        # Two bytes a string, and at most eight a key with its value.
        ("largest list of strings", strings.request_id, encode(strings)),
        ("nested lists", nested_id, b"\x84" + msgpack.packb(head)[1:] + b"\xa4stop" + nested),
        ("most map keys", None, msgpack.packb({f"{i:x}": 0 for i in range(room // 8)})),
    ]
    assert all(len(frame) <= max_message_bytes for _, _, frame in frames)
    return frames


def measure(
    engine: InferenceEngine, config: WorkerConfig, rounds: int, timeout_s: float = 60.0
) -> GapReport:
    """Serve ``engine`` in-process and send each heavy request ``rounds`` times."""
    server = WorkerServer(Scheduler(engine, config.max_queue_depth), config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = worker_socket(context, config.worker_endpoint)
    peer.connect(config.worker_endpoint)
    report = GapReport(config.heartbeat_interval_s)
    answered_at = time.monotonic()
    try:
        peer.send(encode(Ping("heartbeat-gap")))
        sent_at: dict[str, tuple[str, float]] = {}  # request id -> (kind, when sent)
        for round_no in range(rounds):
            for name, request_id, frame in costly_frames(config.max_message_bytes, str(round_no)):
                if request_id is not None:
                    sent_at[request_id] = (name, time.monotonic())
                peer.send(frame)
            for name, request in heavy_requests(server.limits, config.max_message_bytes).items():
                request_id = f"{request.request_id}-{round_no}"
                sent_at[request_id] = (name, time.monotonic())
                peer.send(encode(dataclasses.replace(request, request_id=request_id)))
        beats: list[float] = []
        deadline = time.monotonic() + timeout_s
        # Every answer, then two more heartbeats: the gaps around the last one count.
        while sent_at or len(beats) < 2 or beats[-1] < answered_at + 2 * report.interval_s:
            if time.monotonic() > deadline or not peer.poll(int(timeout_s * 1000)):
                raise RuntimeError(f"no answer within {timeout_s} s for {sorted(sent_at)}")
            message = decode_to_frontend(peer.recv())
            now = time.monotonic()
            if isinstance(message, Heartbeat):
                beats.append(now)
            elif isinstance(message, (GenerateResult, ErrorResult)):
                name, when = sent_at.pop(message.request_id)
                report.answer_s.setdefault(name, []).append(now - when)
                answered_at = now
        report.max_gap_s = max(later - earlier for earlier, later in itertools.pairwise(beats))
    finally:
        peer.close(linger=0)
        context.term()
        server.stop()
        thread.join(timeout=10)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default="synthetic")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8450)
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.1)
    args = parser.parse_args(argv)
    from worker.serve.main import build_engine

    config = WorkerConfig(
        model_id=args.model_id,
        worker_endpoint=f"tcp://127.0.0.1:{args.port}",
        heartbeat_interval_s=args.heartbeat_interval_s,
    )
    report = measure(build_engine(config), config, args.rounds)
    print(f"heartbeat interval {report.interval_s:g} s")
    print(f"longest gap between heartbeats: {report.max_gap_s * 1000:.0f} ms")
    for name, times in report.answer_s.items():
        print(f"  {name:<26} answered in {max(times) * 1000:7.1f} ms at most")
    summary = {
        "model": args.model_id,
        "max_message_bytes": config.max_message_bytes,
        "heartbeat_interval_s": report.interval_s,
        "rounds": args.rounds,
        "max_gap_s": report.max_gap_s,
        "answer_s": report.answer_s,
    }
    write_json(RESULTS / "heartbeat_gap.json", summary)


if __name__ == "__main__":
    main()
