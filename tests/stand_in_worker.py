"""A worker's side of the protocol, played by the test: a hello, heartbeats, and
to each request what the test says, to show how the frontend (or the probe)
takes answers no real worker would send.

`tests/test_worker_client.py` has the other stand-in: one the test drives frame
by frame from its event loop, for the order of what the frontend sends."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from protocol import (
    AbortRequest,
    GenerateRequest,
    Heartbeat,
    Hello,
    Ping,
    ToFrontend,
    decode_to_worker,
    encode,
)


def stand_in_hello(**fields: Any) -> Hello:
    """A hello as a small fake worker sends it, with ``fields`` changed."""
    hello = Hello(
        instance_id="stand-in",
        model="fake",
        is_random_weights=False,
        capacity=1,
        context_window=1024,
        max_queue_depth=16,
        max_message_bytes=1 << 20,
    )
    return dataclasses.replace(hello, **fields)


# What the stand-in answers a request: messages, or frames (bytes) sent as they are.
Answer = Callable[[GenerateRequest], list[ToFrontend | bytes]]


class StandInWorker:
    """A ROUTER, on its own thread, that speaks the worker's side of the protocol:
    a hello and heartbeats, and to each request what ``answer`` says. The requests
    and aborts it gets are in ``received``, the pings in ``pings``."""

    def __init__(
        self,
        answer: Answer,
        capacity: int,
        hello: Hello | bytes | None = None,
        greeting: Sequence[ToFrontend | bytes] | None = None,
    ) -> None:
        """``hello`` may be a frame (bytes), sent as it is. ``greeting``, if given,
        answers the first ping in place of the hello (heartbeats follow either)."""
        self.answer = answer
        self.capacity = capacity
        self.hello = hello or stand_in_hello(capacity=capacity)
        self.greeting = [self.hello] if greeting is None else list(greeting)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[GenerateRequest | AbortRequest] = []
        self.pings: list[Ping] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> StandInWorker:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopping.set()
        self._thread.join()
        self.socket.close()
        self.context.term()

    def wait_for(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 5
        while not check():
            assert time.monotonic() < deadline, f"not {what}: {self.received}"
            time.sleep(0.01)

    def _serve(self) -> None:
        peer: bytes | None = None
        num_steps = 0
        next_heartbeat = time.monotonic()
        while not self._stopping.is_set():
            if self.socket.poll(20):
                sender, frame = self.socket.recv_multipart()
                message = decode_to_worker(frame)
                if isinstance(message, Ping):
                    self.pings.append(message)
                if isinstance(message, Ping) and peer is None:
                    peer = sender
                    for frame in self.greeting:
                        self._send(peer, frame)
                elif isinstance(message, (GenerateRequest, AbortRequest)):
                    self.received.append(message)
                    if isinstance(message, GenerateRequest):
                        for reply in self.answer(message):
                            self._send(sender, reply)
            if peer is not None and time.monotonic() >= next_heartbeat:
                num_steps += 1  # it keeps stepping: never judged hung
                self._send(peer, Heartbeat("stand-in", num_steps, num_queued=0, num_active=0))
                next_heartbeat += 0.1

    def _send(self, peer: bytes, message: ToFrontend | bytes) -> None:
        frame = message if isinstance(message, bytes) else encode(message)
        self.socket.send_multipart([peer, frame])
