"""Where the workers are: fixed endpoints, or host names looked up again and again.

Each address a name resolves to is a worker: that is how `docker compose up
--scale worker=3` and a Kubernetes headless Service publish their replicas.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


class Discovery:
    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self._names = {e: name for e in endpoints if (name := _host_name(e)) is not None}
        self._failed: set[str] = set()  # names whose last look-up failed, logged once

    @property
    def is_static(self) -> bool:
        return not self._names

    async def resolve(self) -> tuple[set[str], bool]:
        """Every worker endpoint now, and whether every name resolved (if one did
        not, the endpoints it had are missing from the set, not gone)."""
        found = {e for e in self.endpoints if e not in self._names}
        is_complete = True
        for endpoint, name in self._names.items():
            addresses = await _look_up(name)
            if not addresses:
                is_complete = False
                if name not in self._failed:
                    log.warning("cannot resolve %s; retrying, and keeping its workers", name)
                    self._failed.add(name)
                continue
            self._failed.discard(name)
            port = urlsplit(endpoint).port
            found.update(_endpoint(address, port) for address in addresses)
        return found, is_complete


def _host_name(endpoint: str) -> str | None:
    """The host name in a tcp:// endpoint; None for an address or another transport."""
    if not endpoint.startswith("tcp://"):
        return None
    host = urlsplit(endpoint).hostname
    if host is None:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return None


async def _look_up(name: str) -> list[str]:
    """The name's IPv4 addresses, or its IPv6 ones if it has none; [] if it fails."""
    loop = asyncio.get_running_loop()
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = await loop.getaddrinfo(name, None, family=family, type=socket.SOCK_STREAM)
        except OSError:
            continue
        if infos:
            return sorted({str(info[4][0]) for info in infos})
    return []


def _endpoint(address: str, port: int | None) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"tcp://{host}:{port}"
