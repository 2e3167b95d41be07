"""A client's socket to one worker, made one way for every client: the frontend,
the supervisor, the probe and the benchmarks.

A client is a DEALER. The worker greets a peer with its `Hello` when it first
hears from it, so a client pings first; it pings on, every PING_INTERVAL_S, or
the worker forgets it (FRONTEND_TIMEOUT_S) and aborts its requests. Nothing is
capped by a high-water mark: the frontend and the worker bound what they send
themselves.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, TypeVar

import zmq

from protocol.codec import decode_to_frontend, encode
from protocol.curve import ClientKeys, secure_client
from protocol.messages import Hello, Ping

S = TypeVar("S", bound=zmq.Socket[Any])


def worker_socket(
    context: zmq.Context[S],
    endpoint: str,
    curve: ClientKeys | None = None,
    is_immediate: bool = False,
) -> S:
    """A DEALER for the worker at ``endpoint`` (a plain or an asyncio context's),
    to ``connect(endpoint)`` once whatever watches it is in place. ``is_immediate``:
    queue nothing while the worker is not connected, so that what it would miss
    goes to another worker instead of arriving late, or twice; a send then waits
    for a connection."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if is_immediate:
        socket.setsockopt(zmq.IMMEDIATE, 1)
    if endpoint.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    secure_client(socket, curve)
    return socket


def ping(client: str) -> bytes:
    """A Ping from a client named ``client``, with an id of its own."""
    return encode(Ping(f"{client}-{uuid.uuid4().hex[:12]}"))


def wait_for_hello(socket: zmq.Socket[bytes], timeout_s: float) -> Hello | None:
    """The first Hello that arrives on a blocking ``socket`` within ``timeout_s``
    (heartbeats before it are skipped), or None. Raises ProtocolError on a frame
    that is not this protocol."""
    deadline = time.monotonic() + timeout_s
    while (remaining_s := deadline - time.monotonic()) > 0:
        if not socket.poll(int(remaining_s * 1000) + 1, zmq.POLLIN):
            break
        message = decode_to_frontend(socket.recv_multipart()[-1])
        if isinstance(message, Hello):
            return message
    return None
