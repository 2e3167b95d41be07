"""What a ZMQ endpoint setting must look like: the checks every process makes of
the worker endpoints it is given, before it binds or connects; the one reading
of a tcp:// endpoint's host and port; and whether an address can be listened
on, which the worker and the frontend probe before they bind."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from protocol.settings import ConfigError, env_name

# A Unix socket's path, less its terminating NUL (sockaddr_un.sun_path on Linux).
MAX_IPC_PATH_BYTES = 107
MAX_PORT = 65535
# Where the worker listens, and its clients connect, unless WORKER_ENDPOINT says.
DEFAULT_WORKER_ENDPOINT = "tcp://127.0.0.1:5555"
# Where a frontend listens unless HOST and PORT say: the supervisor checks them too.
DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class TcpEndpoint:
    """A tcp:// endpoint's host and port, read one way by every process."""

    # As written, less an IPv6 address's brackets: a name, an address, or ZMQ's
    # "*" for every address of this machine.
    host: str
    port: int

    @classmethod
    def parse(cls, endpoint: str) -> TcpEndpoint | None:
        """``endpoint``'s host and port; None unless it is a tcp:// endpoint that
        ends in a port from 1 to MAX_PORT."""
        if not endpoint.startswith("tcp://"):
            return None
        # libzmq takes a port past 65535 modulo 65536 (99999 listens on 34463), and
        # 0 or * for a port the system picks: either way, not where clients look.
        host, colon, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not (colon and port.isascii() and port.isdigit() and 1 <= int(port) <= MAX_PORT):
            return None
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return cls(host, int(port))

    @property
    def is_ipv6(self) -> bool:
        """Whether it names an IPv6 address, which a ZMQ socket binds or reaches
        only with its IPV6 option set."""
        return ":" in self.host

    @property
    def is_every_address(self) -> bool:
        """Whether it binds every IPv4 address: ZMQ's ``*``, or 0.0.0.0."""
        return self.host in ("*", "0.0.0.0")

    def at(self, host: str | None = None, port: int | None = None) -> str:
        """The endpoint string, with ``host`` or ``port`` in place of its own."""
        host = self.host if host is None else host
        written = f"[{host}]" if ":" in host else host
        return f"tcp://{written}:{self.port if port is None else port}"


def check_endpoint(config: object, name: str, endpoint: str | None = None) -> None:
    """Raises ConfigError naming the setting ``name`` unless ``endpoint`` (by
    default the setting's value; one of its items for a list) is a ZMQ endpoint,
    a tcp:// one with a port from 1 to MAX_PORT."""
    endpoint = getattr(config, name) if endpoint is None else endpoint
    check_endpoint_value(endpoint, env_name(type(config), name))


def check_endpoint_value(endpoint: str, env: str) -> None:
    """`check_endpoint` for a value that ``env`` (a setting, or a flag) gave."""
    if endpoint.startswith("inproc://"):
        # A worker's clients are other processes, which never reach it there.
        raise ConfigError(
            f"{env}={endpoint}: inproc:// reaches only threads of one process; use "
            f"tcp:// (such as {DEFAULT_WORKER_ENDPOINT}) or ipc://"
        )
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ConfigError(
            f"{env} must be a ZMQ endpoint such as {DEFAULT_WORKER_ENDPOINT}, got {endpoint!r}"
        )
    path = endpoint.removeprefix("ipc://")
    if endpoint.startswith("ipc://") and not path:
        raise ConfigError(f"{env} names no socket path: ipc:///run/minibatch.sock is one")
    if endpoint.startswith("ipc://") and len(path.encode()) > MAX_IPC_PATH_BYTES:
        raise ConfigError(
            f"{env} names a socket path of {len(path.encode())} bytes; the system allows "
            f"{MAX_IPC_PATH_BYTES}: choose a shorter path, got {endpoint!r}"
        )
    if endpoint.startswith("tcp://") and TcpEndpoint.parse(endpoint) is None:
        raise ConfigError(
            f"{env} must end in a port from 1 to {MAX_PORT}, as tcp://127.0.0.1:5555 does, "
            f"got {endpoint!r}"
        )
    if endpoint.startswith("tcp://") and (problem := _host_problem(endpoint)):
        raise ConfigError(f"{env}={endpoint} {problem}")


def _host_problem(endpoint: str) -> str | None:
    """What is wrong with a tcp:// endpoint's host as written, if anything: none,
    a source address (which no process here takes), or an IPv6 address that the
    port cannot be told from."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if not host:
        return "names no host: tcp://127.0.0.1:5555 is one (tcp://*:5555 binds every address)"
    if ";" in host:
        return "names a source address (SOURCE;HOST:PORT), not taken here: name the host alone"
    is_bracketed = host.startswith("[") and host.endswith("]")
    if ("[" in host or "]" in host) and not (
        is_bracketed and host.count("[") == host.count("]") == 1
    ):
        return "has unmatched brackets: write an IPv6 address as tcp://[::1]:5555 does"
    if ":" in host and not is_bracketed:
        return (
            "has a colon in its host: write an IPv6 address in brackets, as tcp://[::1]:5555 does"
        )
    if is_bracketed and ":" not in host:  # [] or [name]: brackets hold an IPv6 address
        return "has brackets around no IPv6 address: write tcp://[::1]:5555 or tcp://HOST:5555"
    return None


def check_connect_endpoint(endpoint: str, env: str) -> None:
    """`check_endpoint_value` for where a client connects: ``tcp://*:PORT`` names
    where a worker binds, every address, and is none to connect to (libzmq
    refuses the connect with "Invalid argument")."""
    check_endpoint_value(endpoint, env)
    tcp = TcpEndpoint.parse(endpoint)
    if tcp is not None and tcp.host == "*":
        raise ConfigError(
            f"{env}={endpoint} is where a worker binds, on every address; connect to "
            f"one of them, such as {tcp.at(host='127.0.0.1')} (a worker binds every "
            f"address with WORKER_BIND={endpoint})"
        )


def probe_binds(
    host: str | None, port: int, v6only: bool = False
) -> list[tuple[str, OSError | None]]:
    """Bind ``port`` at each address ``host`` resolves to, as a listener is about
    to, and let go at once: each address with None where it can, else why not.
    SO_REUSEADDR as ZMQ and asyncio bind (TIME_WAIT is no obstacle); ``v6only``
    as asyncio binds IPv6, leaving the same port's IPv4 address to its own socket.
    An address of a family this kernel cannot open a socket for (IPv6 turned
    off) is left out, as asyncio's server leaves it. Raises OSError (or
    UnicodeError) for a host that does not resolve."""
    results: list[tuple[str, OSError | None]] = []
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in infos:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if v6only and family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                results.append((str(address[0]), exc))
            else:
                results.append((str(address[0]), None))
    return results
