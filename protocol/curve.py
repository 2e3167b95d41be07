"""Optional ZMQ CURVE on the worker socket: only clients holding an allowed key
may talk to the worker.

With CURVE on, the worker's ROUTER is a CURVE server and a ZAP authenticator
checks each connecting client's public key against the allowed set. A peer
without CURVE, or with a key not in the set, fails the handshake inside libzmq:
none of its frames reach the worker's code, so it gets nothing back, not even a
hello. The frontend, the supervisor's watch, the probe and the benchmark client
connect as CURVE clients.

A key setting holds a 40-character Z85 key or the path of a certificate file
written by `zmq.auth.create_certificates`, which is what `minibatch-keys DIR`
runs (``NAME.key`` holds the public key, ``NAME.key_secret`` both).
"""

from __future__ import annotations

import argparse
import logging
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from protocol.settings import ConfigError, env_name
from protocol.throttled import Throttled

# Named, not __name__: run as python -m, this module is __main__ to the log.
log = logging.getLogger("protocol.curve")

_Z85_KEY_LENGTH = 40


@dataclass(frozen=True)
class ServerKeys:
    """The worker's side: its secret key and the clients it lets in (all Z85)."""

    secret_key: bytes
    client_public_keys: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    """A client's side: the worker's public key and the client's secret key (Z85)."""

    server_public_key: bytes
    secret_key: bytes


def read_public_key(value: str) -> bytes:
    """A Z85 public key, or the one in a certificate file (``.key`` or ``.key_secret``)."""
    certificate = _certificate(value)
    return value.encode("ascii") if certificate is None else certificate[0]


def read_secret_key(value: str) -> bytes:
    """A Z85 secret key, or the one in a ``.key_secret`` certificate file."""
    certificate = _certificate(value)
    if certificate is None:
        return value.encode("ascii")
    if certificate[1] is None:
        raise ValueError(f"{value} holds only a public key; give the .key_secret file")
    return certificate[1]


def read_public_keys(value: str) -> frozenset[bytes]:
    """A directory of ``.key`` certificate files, or a comma-separated list of
    public keys (each Z85 or a certificate file)."""
    if Path(value).is_dir():
        # Each file read as a lone one is, so that a malformed key is refused by name.
        keys = frozenset(read_public_key(str(path)) for path in sorted(Path(value).glob("*.key")))
        if not keys:
            raise ValueError(f"the directory {value} holds no .key certificate files")
        return keys
    keys = frozenset(read_public_key(item.strip()) for item in value.split(",") if item.strip())
    if not keys:
        raise ValueError("no public key given")
    return keys


def _certificate(value: str) -> tuple[bytes, bytes | None] | None:
    """The (public, secret) keys of the certificate file ``value``, or None when
    ``value`` is itself a Z85 key."""
    if Path(value).is_file():
        return _load_certificate(value)
    # Checked before the path guess below: '/' and '.' are Z85 characters too.
    problem = _key_problem(value)
    if problem is None:
        return None
    if "/" in value or value.endswith((".key", ".key_secret")):
        raise ValueError(f"no certificate file at {value}")
    # The value may be a secret: say what is wrong with it without echoing it.
    raise ValueError(
        f"neither a certificate file nor a Z85 key: the value {problem}. "
        "Give the path of a file written by minibatch-keys, or the key inside it"
    )


def _load_certificate(path: str) -> tuple[bytes, bytes | None]:
    """The (public, secret) keys of the certificate file at ``path``, each checked
    as a key given by value is: libzmq would take a malformed one only when the
    socket is set up, long after the settings were read, and fail there."""
    try:
        public_key, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the certificate {path}: {exc}") from None
    for kind, key in (("public", public_key), ("secret", secret_key)):
        problem = None if key is None else _key_problem(key)
        if problem is not None:
            raise ValueError(
                f"the {kind} key in the certificate {path} {problem}; "
                "write a new pair with minibatch-keys"
            )
    return public_key, secret_key


def _key_problem(key: str | bytes) -> str | None:
    """What keeps ``key`` from being a Z85 CURVE key (40 characters, 32 bytes once
    decoded), or None."""
    if len(key) != _Z85_KEY_LENGTH:
        return f"is {len(key)} characters, not {_Z85_KEY_LENGTH}"
    try:
        z85.decode(key)
    except (KeyError, ValueError, struct.error):
        return "has characters outside the Z85 alphabet"
    return None


def secure_server(socket: zmq.Socket[Any], keys: ServerKeys | None) -> Callable[[], None]:
    """Make ``socket`` (before it binds) a CURVE server that lets in only the allowed
    clients, or leave it as it is without keys. Returns what stops the
    authenticator: call it after closing the socket and before terminating the
    context, whose term() would otherwise wait for the authenticator forever."""
    if keys is None:
        return lambda: None
    authenticator = ThreadAuthenticator(socket.context)
    authenticator.start()
    authenticator.configure_curve_callback(
        domain="*", credentials_provider=_AllowedKeys(keys.client_public_keys)
    )
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key)
    return authenticator.stop


def secure_client(socket: zmq.Socket[Any], keys: ClientKeys | None) -> None:
    """Make ``socket`` (before it connects) a CURVE client of the worker, or leave it
    as it is without keys."""
    if keys is None:
        return
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public_key)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, zmq.curve_public(keys.secret_key))
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key)


class _AllowedKeys:
    """The authenticator's credentials provider: a fixed set of Z85 public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        # Warning, not debug: a frontend with the wrong key otherwise just never
        # hears the worker, and nothing says why. At most one a second: 15,000
        # handshakes with random keys wrote 2 MB of them in 40 s.
        self._refusals = Throttled(log, "refused CURVE clients")

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self._refusals.warn(
            f"refused a CURVE client whose public key {key.decode()} is not allowed"
        )
        return False


def read_curve_keys(
    config: object, *settings: tuple[str, Callable[[str], Any]]
) -> list[Any] | None:
    """Read the CURVE settings ``(field name, reader)``: None when all are unset
    (CURVE off), every key when all are set, and a ConfigError otherwise."""
    given = {name: getattr(config, name) for name, _ in settings if getattr(config, name)}
    if not given:
        return None
    if len(given) < len(settings):
        (missing,) = (name for name, _ in settings if name not in given)
        raise ConfigError(
            f"{env_name(type(config), missing)} is unset or empty, but "
            f"{', '.join(env_name(type(config), name) for name in given)} is set: CURVE "
            "needs both (minibatch-keys writes them), or neither to leave it off"
        )
    keys = []
    for name, read in settings:
        try:
            keys.append(read(given[name]))
        except ValueError as exc:
            raise ConfigError(f"{env_name(type(config), name)}: {exc}") from None
    return keys


def main(argv: Sequence[str] | None = None) -> int:
    """`minibatch-keys DIR`: write a worker and a client certificate pair."""
    parser = argparse.ArgumentParser(
        prog="minibatch-keys",
        description="Write CURVE certificates for the worker socket: worker.key and "
        "worker.key_secret, client.key and client.key_secret, in DIR.",
    )
    parser.add_argument("directory", metavar="DIR")
    directory = Path(parser.parse_args(argv).directory)
    existing = [p for p in directory.glob("*.key*") if p.stem in ("worker", "client")]
    if existing:
        print(
            f"minibatch-keys: {directory} already holds {', '.join(map(str, existing))}; "
            "remove them or choose another directory",
            file=sys.stderr,
        )
        return 1
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("worker", "client"):
        _, secret_file = zmq.auth.create_certificates(directory, name)
        Path(secret_file).chmod(0o600)
    print(
        f"# the worker:\n"
        f"CURVE_SERVER_SECRET_KEY={directory / 'worker.key_secret'}\n"
        f"CURVE_CLIENT_KEYS={directory / 'client.key'}\n"
        f"# the frontend, minibatch-serve and minibatch-probe:\n"
        f"CURVE_SERVER_PUBLIC_KEY={directory / 'worker.key'}\n"
        f"CURVE_CLIENT_SECRET_KEY={directory / 'client.key_secret'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
