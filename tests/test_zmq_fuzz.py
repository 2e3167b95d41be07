"""Anything on the network can reach the worker's socket: random frames from a
peer that keeps reconnecting must not take the worker down or hurt anyone else."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import psutil
import zmq

from protocol import PROTOCOL_VERSION, GenerateRequest, Ping, encode
from tests.stack import Stack, running_stack
from worker.engine.fake_engine import expected_text

MAX_MESSAGE_BYTES = 256 * 1024
NUM_CONNECTIONS = 30
MESSAGES_PER_CONNECTION = 40


def _random_message(rng: random.Random) -> list[bytes]:
    """One multipart message: garbage, near-protocol maps, or valid requests with
    hostile values, in any number of frames."""
    kind = rng.randrange(7)
    if kind == 0:
        return [rng.randbytes(rng.choice([0, 1, 7, 100, 5000]))]
    if kind == 1:
        return [rng.randbytes(rng.randrange(50)) for _ in range(rng.randrange(2, 6))]
    if kind == 2:
        return [rng.randbytes(MAX_MESSAGE_BYTES + rng.randrange(1, 1000))]  # ZMQ drops the peer
    if kind == 3:
        fields = {"v": PROTOCOL_VERSION, "type": rng.choice(["generate", "abort", "ping", "x"])}
        fields.update({"request_id": "r", "prompt": rng.choice([3, None, "p", []])})
        fields["max_new_tokens"] = rng.choice([-1, 0, 2**64 - 1, "4", 1.5])
        return [msgpack.packb(fields)]
    request = GenerateRequest(
        request_id=rng.choice(["r", "x" * 300, "", "dup"]),
        prompt=rng.choice(["", "p", "y" * 5000]),
        max_new_tokens=rng.choice([0, 1, 5, 10**6]),
        prompt_token_ids=rng.choice([None, [], [0x110000], [1, 2, 3]]),
        resume_token_ids=rng.choice([[], [5] * 10]),
        temperature=rng.choice([0.0, 1e-45, -1.0, math.nan, math.inf, 1.0]),
        top_p=rng.choice([1.0, 0.0, math.nan, 1e-300]),
        top_k=rng.choice([0, -5, 2**62]),
        seed=rng.choice([None, -1, 2**64 - 1, 7]),
        stop=rng.choice([[], [""], ["z" * 1000], ["a"] * 20]),
        **rng.choice(
            [
                {},
                {"logit_bias_token_ids": [0x110000], "logit_bias_values": [1.0]},
                {"logit_bias_token_ids": [1, 2], "logit_bias_values": [math.nan]},
                {"logit_bias_token_ids": [3, 3], "logit_bias_values": [-math.inf, 1e30]},
                {"logit_bias_token_ids": [4] * 50_000, "logit_bias_values": [100.0] * 50_000},
                {"grammar_kind": "x" * 1000, "grammar": "start: /a/"},
                {"grammar_kind": "regex", "grammar": "start: /(/"},
                {"grammar_kind": "grammar", "grammar": "{" * 100_000},
                {"grammar_kind": "json", "grammar": '{"grammars": [{"json_schema": 7}]}'},
                {"grammar_kind": "choice", "grammar": 'start: "a" | "b"', "min_tokens": 5},
            ]
        ),
    )
    frame = encode(request)
    if kind == 4:
        return [frame, frame]
    if kind == 5:
        return [frame[: rng.randrange(len(frame))]]
    return [frame]


def _fuzz(endpoint: str, seed: int) -> None:
    rng = random.Random(seed)
    context = zmq.Context()
    try:
        for _ in range(NUM_CONNECTIONS):
            peer = context.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(endpoint)
            for _ in range(MESSAGES_PER_CONNECTION):
                peer.send_multipart(_random_message(rng))
            time.sleep(0.01)
            peer.close(linger=0)
    finally:
        context.destroy(linger=0)


def _generate(stack: Stack, prompt: str, max_new_tokens: int) -> str:
    body = {"prompt": prompt, "max_new_tokens": max_new_tokens}
    response = httpx.post(f"{stack.url}/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["text"])


def test_random_frames_from_a_reconnecting_peer_leave_the_worker_serving(
    tmp_path: Path,
) -> None:
    overrides = {"MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES), "FAKE_STEP_DELAY_S": "0.01"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        first = stack.wait_live()
        (pid,) = stack.worker_pids()
        for seed in range(3):
            _fuzz(stack.env["WORKER_ENDPOINT"], seed)
            assert _generate(stack, f"after round {seed}", 12) == expected_text(
                f"after round {seed}", 12
            )
        assert stack.worker_pids() == [pid]
        health = stack.wait_live()
        assert (health["instance_id"], health["worker_restarts"]) == (first["instance_id"], 0)
        assert "Traceback" not in stack.log("worker")


@contextlib.contextmanager
def _peer(stack: Stack, **options: int) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER connected to the worker's socket, with these socket options."""
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        peer.setsockopt(getattr(zmq, name), value)
    peer.connect(stack.env["WORKER_ENDPOINT"])
    try:
        yield peer
    finally:
        peer.close(linger=0)
        context.term()


def _worker_rss_mb(stack: Stack) -> float:
    (pid,) = stack.worker_pids()
    return float(psutil.Process(pid).memory_info().rss) / 1e6


def test_a_peer_that_never_reads_cannot_stall_the_worker(tmp_path: Path) -> None:
    with running_stack(tmp_path, {"FAKE_STEP_DELAY_S": "0.005"}, supervised=False) as stack:
        stack.wait_live()
        with _peer(stack, RCVHWM=1) as silent:
            silent.send(encode(Ping("silent")))
            for i in range(200):  # streams whose outputs nobody reads
                silent.send(encode(GenerateRequest(f"s{i}", "z", 50, stream=True)))
            assert _generate(stack, "still here", 8) == expected_text("still here", 8)


def test_a_flooding_peer_is_pushed_back_and_the_worker_stays_small(tmp_path: Path) -> None:
    with running_stack(tmp_path, supervised=False) as stack:
        first = stack.wait_live()
        rss_before = _worker_rss_mb(stack)
        garbage = b"\xc1" * 200
        num_sent = 0
        with _peer(stack) as flood:
            ends_at = time.monotonic() + 3
            while time.monotonic() < ends_at:
                try:
                    flood.send(garbage, zmq.NOBLOCK)
                    num_sent += 1
                except zmq.Again:
                    time.sleep(0.001)  # pushed back: the worker reads no faster than it decodes
            assert _generate(stack, "during a flood", 6) == expected_text("during a flood", 6)
            growth_mb = _worker_rss_mb(stack) - rss_before
        assert num_sent > 10_000  # a real flood
        assert growth_mb < 100, f"worker grew {growth_mb:.0f} MB under {num_sent} frames"
        assert stack.wait_live()["instance_id"] == first["instance_id"]


def test_refusals_that_are_never_read_cost_the_worker_little(tmp_path: Path) -> None:
    # Before ids were bounded, each refusal echoed the peer's id back at it: 300
    # one-megabyte ids left 300 MB queued in the worker for a peer that never reads.
    with running_stack(tmp_path, supervised=False) as stack:
        first = stack.wait_live()
        rss_before = _worker_rss_mb(stack)
        with _peer(stack, RCVHWM=1, RCVBUF=4096) as silent:
            silent.send(encode(Ping("silent")))
            for i in range(300):
                silent.send(encode(GenerateRequest(f"{i}-" + "x" * 1_000_000, "p", 0)))
            for i in range(40_000):  # answerable: the longest id allowed, and a bad field
                silent.send(encode(GenerateRequest(f"{i:<256}", "p", 0)))
            deadline = time.monotonic() + 30
            while "stopped reading" not in stack.log("worker") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "stopped reading" in stack.log("worker")  # forgotten, its queue dropped
            assert _generate(stack, "after", 6) == expected_text("after", 6)
            growth_mb = _worker_rss_mb(stack) - rss_before
        assert growth_mb < 50, f"worker grew {growth_mb:.0f} MB"
        # Greeted in vain at each message after that, it is logged at most once a second.
        assert stack.log("worker").count("stopped reading") < 30
        assert stack.wait_live()["instance_id"] == first["instance_id"]


def test_a_peer_that_takes_the_next_routing_ids_cannot_crash_the_worker(tmp_path: Path) -> None:
    """libzmq aborts when the id it makes up for a new peer is taken. Unseeded, its
    counter starts at libc's first rand(), 0x6b8b4567, in every process: a peer
    that claimed the next ids took the worker down with the next connection."""
    first_unseeded_id = 0x6B8B4567
    with running_stack(tmp_path, supervised=False) as stack:
        first = stack.wait_live()
        (pid,) = stack.worker_pids()
        context = zmq.Context()
        claims = [context.socket(zmq.DEALER) for _ in range(64)]
        try:
            for k, claim in enumerate(claims):
                claim.setsockopt(zmq.LINGER, 0)
                claim.setsockopt(zmq.ROUTING_ID, b"\x00" + (first_unseeded_id + k).to_bytes(4))
                claim.connect(stack.env["WORKER_ENDPOINT"])
                claim.send(encode(Ping("claim")))
                # Greeted once the worker has its id (unless that id was taken, as
                # by the frontend when unseeded: then the worker ignores it).
                claim.poll(1000)
            with _peer(stack) as newcomer:  # no id of its own: libzmq makes one up
                newcomer.send(encode(Ping("newcomer")))
                assert newcomer.poll(5000), "the worker did not greet the newcomer"
        finally:
            for claim in claims:
                claim.close(linger=0)
            context.term()
        assert _generate(stack, "after", 6) == expected_text("after", 6)
        assert stack.worker_pids() == [pid]
        assert stack.wait_live()["instance_id"] == first["instance_id"]
