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
from zmq.utils.monitor import parse_monitor_message

from protocol.codec import decode_to_frontend, encode
from protocol.curve import ClientKeys, secure_client
from protocol.endpoints import TcpEndpoint
from protocol.messages import Hello, Ping
from protocol.wire import MAX_WORKER_MESSAGE_BYTES

S = TypeVar("S", bound=zmq.Socket[Any])

# A worker's refusals of a client's handshake, as a socket monitor reports them.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def handshake_advice(event: int) -> str:
    """Why a handshake failed with ``event``, and what to set."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            "the worker does not allow this client's CURVE key: add the public key of "
            "CURVE_CLIENT_SECRET_KEY to the worker's CURVE_CLIENT_KEYS, or check "
            "CURVE_SERVER_PUBLIC_KEY"
        )
    # Also what anything that is no worker makes of a handshake, once it hangs up
    # (an HTTP server, after its header timeout), what a worker does with a CURVE
    # hello sealed for another key (it cannot open it, and says nothing), and what
    # a worker killed half way through one leaves.
    return (
        "either nothing at that address is a worker (check WORKER_ENDPOINT), or CURVE "
        "is on at one end only (set CURVE keys on both the worker and this client, or "
        "on neither), or CURVE_SERVER_PUBLIC_KEY is not that worker's public key (the "
        "pair of its CURVE_SERVER_SECRET_KEY); seen once, it may only be a worker that "
        "died during the handshake (tried again as it restarts)"
    )


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
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_WORKER_MESSAGE_BYTES)
    if is_immediate:
        socket.setsockopt(zmq.IMMEDIATE, 1)
    if (tcp := TcpEndpoint.parse(endpoint)) is not None and tcp.is_ipv6:
        socket.setsockopt(zmq.IPV6, 1)
    secure_client(socket, curve)
    return socket


def ping(client: str) -> bytes:
    """A Ping from a client named ``client``, with an id of its own."""
    return encode(Ping(f"{client}-{uuid.uuid4().hex[:12]}"))


class HandshakeRefused(ConnectionError):
    """The worker refused the client's handshake; the message says what to set."""


def wait_for_hello(
    socket: zmq.Socket[bytes], timeout_s: float, monitor: zmq.Socket[bytes] | None = None
) -> Hello | None:
    """The first Hello that arrives on a blocking ``socket`` within ``timeout_s``
    (heartbeats before it are skipped), or None. Raises ProtocolError on a frame
    that is not this protocol, and HandshakeRefused as soon as ``monitor`` (the
    socket's, watching `HANDSHAKE_FAILED`) reports a refusal: no Hello follows one."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    if monitor is not None:
        poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (remaining_s := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(remaining_s * 1000) + 1))
        if monitor is not None and monitor in ready:
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event & HANDSHAKE_FAILED:
                name = zmq.Event(event).name
                raise HandshakeRefused(
                    f"it refused the handshake ({name}): {handshake_advice(event)}"
                )
        if socket in ready:
            message = decode_to_frontend(socket.recv_multipart()[-1])
            if isinstance(message, Hello):
                return message
    return None
