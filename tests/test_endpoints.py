"""protocol/endpoints.py: the one reading of a tcp:// endpoint, and the checks
every process makes of an endpoint setting."""

from __future__ import annotations

import re

import pytest

from protocol.endpoints import TcpEndpoint, check_connect_endpoint, check_endpoint_value
from protocol.settings import ConfigError


@pytest.mark.parametrize(
    ("endpoint", "host", "port"),
    [
        ("tcp://127.0.0.1:5555", "127.0.0.1", 5555),
        ("tcp://worker:1", "worker", 1),
        ("tcp://*:65535", "*", 65535),
        ("tcp://[::1]:5555", "::1", 5555),
        ("tcp://[fe80::1%eth0]:7000", "fe80::1%eth0", 7000),
    ],
)
def test_a_tcp_endpoint_is_read_as_its_host_and_port(endpoint: str, host: str, port: int) -> None:
    tcp = TcpEndpoint.parse(endpoint)
    assert tcp == TcpEndpoint(host, port)
    assert tcp.at() == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///run/minibatch.sock",
        "inproc://worker",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:65536",
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:\uff15\uff15",  # digits, but not ASCII ones
        "tcp://127.0.0.1:-1",
    ],
)
def test_anything_but_a_tcp_endpoint_with_a_usable_port_is_none(endpoint: str) -> None:
    assert TcpEndpoint.parse(endpoint) is None


def test_at_writes_an_ipv6_address_in_brackets() -> None:
    tcp = TcpEndpoint("127.0.0.1", 5555)
    assert tcp.at(port=5556) == "tcp://127.0.0.1:5556"
    assert tcp.at(host="::1") == "tcp://[::1]:5555"
    assert TcpEndpoint("::1", 5555).at(port=5557) == "tcp://[::1]:5557"


def test_only_a_wildcard_is_every_address() -> None:
    assert TcpEndpoint("*", 1).is_every_address
    assert TcpEndpoint("0.0.0.0", 1).is_every_address
    assert not TcpEndpoint("127.0.0.1", 1).is_every_address


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://h:65536", "tcp://h"])
def test_a_setting_with_no_usable_port_is_refused_naming_it(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"WORKER_ENDPOINT must end in a port from 1 to 65535"):
        check_endpoint_value(endpoint, "WORKER_ENDPOINT")


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        # Each passed the check, then failed a reading of it with a traceback (exit
        # 1), or was bound or connected to where nothing could ever be reached.
        ("tcp://::1:5555", r"has a colon in its host: write an IPv6 address in brackets"),
        ("tcp://a:b:5555", r"has a colon in its host"),
        ("tcp://[::1:5555", r"has unmatched brackets"),
        ("tcp://::1]:5555", r"has unmatched brackets"),
        ("tcp://[[::1]]:5555", r"has unmatched brackets"),
        ("tcp://[::1]]:5555", r"has unmatched brackets"),
        ("tcp://[::1]x]:5555", r"has unmatched brackets"),
        ("tcp://[]:5555", r"has brackets around no IPv6 address"),
        ("tcp://[worker]:5555", r"has brackets around no IPv6 address"),
        ("tcp://10.0.0.1:5556;10.0.0.2:5555", r"names a source address"),
        ("tcp://:5555", r"names no host: tcp://127\.0\.0\.1:5555 is one"),
        ("inproc://worker", r"inproc:// reaches only threads of one process"),
    ],
)
def test_an_endpoint_no_process_can_use_is_refused_saying_how_to_write_one(
    endpoint: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^WORKER_ENDPOINT={re.escape(endpoint)}:? {message}"):
        check_endpoint_value(endpoint, "WORKER_ENDPOINT")


@pytest.mark.parametrize("endpoint", ["tcp://[::1]:5555", "tcp://*:1", "tcp://worker:65535"])
def test_a_usable_endpoint_passes(endpoint: str) -> None:
    check_endpoint_value(endpoint, "WORKER_ENDPOINT")


def test_connecting_to_a_wildcard_is_refused_with_a_loopback_to_try() -> None:
    with pytest.raises(
        ConfigError, match=r"such as tcp://127\.0\.0\.1:5555 .*WORKER_BIND=tcp://\*:5555"
    ):
        check_connect_endpoint("tcp://*:5555", "WORKER_ENDPOINTS")
    check_connect_endpoint("tcp://127.0.0.1:5555", "WORKER_ENDPOINTS")
