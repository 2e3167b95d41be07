"""`minibatch-probe`: is a worker up and speaking this protocol?

A health check for containers and scripts. It connects a DEALER to the worker,
sends a `Ping` as a new frontend would, and waits for the worker's `Hello`.
Exit status 0 means a worker answered; 1 means none did in time, or the one
that answered speaks another protocol version; 2, as for any argparse program,
arguments it cannot use. Torch-free: it imports `protocol`, pyzmq and the
worker's settings (to find its endpoint), so it runs in a second or less.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import zmq

from protocol import Hello, ProtocolError
from protocol.client_config import WorkerClientConfig
from protocol.curve import ClientKeys
from protocol.endpoints import TcpEndpoint, check_connect_endpoint
from protocol.peer import HANDSHAKE_FAILED, HandshakeRefused, ping, wait_for_hello, worker_socket
from protocol.settings import ConfigError, load
from worker.serve.config import WorkerConfig

DEFAULT_TIMEOUT_S = 5.0


class ProbeFailed(RuntimeError):
    """No usable Hello; the message says what was tried and what to check."""


def local_endpoint(config: WorkerConfig) -> str:
    """Where a probe beside the worker connects: its bind address, on loopback."""
    endpoint = config.listen_endpoint
    tcp = TcpEndpoint.parse(endpoint)
    # Bound to every address, from inside its own container (or host) the
    # worker is reached on loopback.
    return tcp.at(host="127.0.0.1") if tcp is not None and tcp.is_every_address else endpoint


def probe(
    endpoint: str,
    timeout_s: float,
    context: zmq.Context[zmq.Socket[bytes]],
    curve: ClientKeys | None = None,
) -> Hello:
    """Ping the worker at ``endpoint`` and return its Hello, or raise `ProbeFailed`."""
    socket = worker_socket(context, endpoint, curve)
    monitor = socket.get_monitor_socket(HANDSHAKE_FAILED)
    try:
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ProbeFailed(f"cannot connect to {endpoint!r}: {exc}") from exc
        try:
            socket.send(ping("probe"), zmq.NOBLOCK)
        except zmq.Again:
            # libzmq drops a connection whose handshake failed and does not try
            # again; a DEALER left with none would wait in a blocking send forever.
            raise ProbeFailed(
                f"no Hello from a worker at {endpoint}: it refused the connection's "
                "handshake; check that this client's CURVE settings match the worker's"
            ) from None
        hello = wait_for_hello(socket, timeout_s, monitor)
    except HandshakeRefused as exc:
        raise ProbeFailed(f"no Hello from a worker at {endpoint}: {exc}") from None
    except ProtocolError as exc:
        raise ProbeFailed(f"the process at {endpoint} answered, but: {exc}") from exc
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close()
    if hello is not None:
        return hello
    raise ProbeFailed(
        f"no Hello from a worker at {endpoint} within {timeout_s:g}s: "
        "check that the worker is running and bound there (WORKER_BIND / WORKER_ENDPOINT)"
        + (
            ", and that it allows this client's key"
            if curve
            # A worker that requires CURVE drops a plain handshake without a word.
            else "; a worker that requires CURVE answers only a client with its keys "
            "(CURVE_SERVER_PUBLIC_KEY, CURVE_CLIENT_SECRET_KEY)"
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="minibatch-probe",
        description="Exit 0 if a MiniBatch-LLM worker answers a Ping with Hello, else 1 "
        "(2 for arguments it cannot use).",
    )
    parser.add_argument(
        # --worker-endpoint as every other process spells it; --endpoint, as
        # healthchecks written for it do.
        "--worker-endpoint",
        "--endpoint",
        dest="endpoint",
        help="the worker's ZMQ endpoint (default: the worker's own WORKER_BIND or "
        "WORKER_ENDPOINT from the environment, with a wildcard host read as 127.0.0.1)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for the Hello (default {DEFAULT_TIMEOUT_S:g})",
    )
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s:g}")
    if args.endpoint is not None:
        try:
            check_connect_endpoint(args.endpoint, "--worker-endpoint")
        except ConfigError as exc:
            parser.error(str(exc))
    try:
        # A healthcheck runs every few seconds: the worker itself warns of
        # misspelt variables, once.
        endpoint = args.endpoint or local_endpoint(load(WorkerConfig, argv=[], warn_misspelt=False))
        # It pings as a frontend would, so with a client's CURVE settings.
        curve = load(WorkerClientConfig, argv=[], warn_misspelt=False).curve
    except ConfigError as exc:
        print(f"minibatch-probe: {exc}", file=sys.stderr)
        return 1

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        hello = probe(endpoint, args.timeout_s, context, curve)
    except ProbeFailed as exc:
        print(f"minibatch-probe: {exc}", file=sys.stderr)
        return 1
    finally:
        context.term()
    print(
        f"worker ok at {endpoint}: model {hello.model}, instance {hello.instance_id}, "
        f"capacity {hello.capacity}, protocol {hello.protocol_version}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
