"""Where the workers are: fixed endpoints, or host names looked up again and again.

Each address a name resolves to is a worker: that is how `docker compose up
--scale worker=3` and a Kubernetes headless Service publish their replicas.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

from protocol.endpoints import TcpEndpoint

log = logging.getLogger(__name__)


class Discovery:
    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        # The endpoints that name a host, to look up again and again.
        self._named_endpoints = {e: tcp for e in endpoints if (tcp := _named(e)) is not None}
        self._failed: set[str] = set()  # names whose last look-up failed, logged once

    @property
    def is_static(self) -> bool:
        return not self._named_endpoints

    async def resolve(self) -> tuple[set[str], bool]:
        """Every worker endpoint now, and whether every name resolved (if one did
        not, the endpoints it had are missing from the set, not gone)."""
        found = {e for e in self.endpoints if e not in self._named_endpoints}
        is_complete = True
        for tcp in self._named_endpoints.values():
            addresses = await _look_up(tcp.host)
            if not addresses:
                is_complete = False
                if tcp.host not in self._failed:
                    log.warning("cannot resolve %s; retrying, and keeping its workers", tcp.host)
                    self._failed.add(tcp.host)
                continue
            self._failed.discard(tcp.host)
            found.update(tcp.at(host=address) for address in addresses)
        return found, is_complete


def _named(endpoint: str) -> TcpEndpoint | None:
    """A tcp:// endpoint that names its host; None for an address or another transport."""
    tcp = TcpEndpoint.parse(endpoint)
    if tcp is None or tcp.host == "*":
        return None
    try:
        ipaddress.ip_address(tcp.host)
    except ValueError:
        return tcp
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
