"""The workers this frontend serves through, and the two loops that keep them.

One `WorkerLink` per worker found at WORKER_ENDPOINT (a list, or a host name
looked up again every WORKER_RESOLVE_INTERVAL_S: new workers are connected,
those gone are dropped), and a tick every PING_INTERVAL_S, on which the client
pings and judges each worker. Also the workers as /health sees them: one
verdict and one hello for all of them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import zmq.asyncio

from frontend.config import FrontendConfig
from frontend.discovery import Discovery
from frontend.tasks import start_task, stop_tasks
from frontend.worker_link import LinkEvents, WorkerLink
from protocol import Hello
from protocol.liveness import Verdict, WorkerState

log = logging.getLogger(__name__)


class PoolEvents(LinkEvents, Protocol):
    """What the pool reports, besides what each of its links does."""

    def on_tick(self) -> None:
        """Every PING_INTERVAL_S."""

    def on_gone(self, link: WorkerLink) -> None:
        """A worker that is not live is gone from WORKER_ENDPOINT's addresses:
        its link is no longer in the pool, and closes once this returns."""


class WorkerPool:
    def __init__(self, config: FrontendConfig, events: PoolEvents) -> None:
        self._config = config
        self._events = events
        self._links: dict[str, WorkerLink] = {}  # by endpoint
        self._discovery = Discovery(config.endpoints)
        self._context = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self._update_links()
        self._tasks = [start_task(self._tick_loop(), "worker-tick")]
        if not self._discovery.is_static:
            self._tasks.append(start_task(self._discovery_loop(), "worker-discovery"))

    async def close(self) -> None:
        await stop_tasks(self._tasks)
        for link in self._links.values():
            await link.close()
        self._context.term()

    def links(self) -> list[WorkerLink]:
        return list(self._links.values())

    def verdict(self) -> Verdict:
        """Live while any worker is; otherwise why none is."""
        verdicts = [link.verdict() for link in self._links.values()]
        if len(verdicts) == 1:
            return verdicts[0]
        num_live = sum(verdict.is_live for verdict in verdicts)
        if num_live:
            return Verdict(WorkerState.LIVE, f"{num_live} of {len(verdicts)} workers live")
        if not verdicts:
            endpoints = ", ".join(self._config.endpoints)
            return Verdict(WorkerState.CONNECTING, f"no worker found at {endpoints} yet")
        state = min((verdict.state for verdict in verdicts), key=_STATE_ORDER.index)
        # Each reason once: "no worker has said hello yet" twice said nothing more.
        distinct = list(dict.fromkeys(verdict.reason for verdict in verdicts))
        reasons = "; ".join(distinct[:3])
        more = f"; and {len(distinct) - 3} more" if len(distinct) > 3 else ""
        return Verdict(state, f"no worker is live: {reasons}{more}")

    @property
    def hello(self) -> Hello | None:
        """The hello of a live worker, else of any worker that has said one."""
        links = sorted(self._links.values(), key=lambda link: not link.verdict().is_live)
        return next((link.hello for link in links if link.hello is not None), None)

    async def _tick_loop(self) -> None:
        while True:
            self._events.on_tick()
            await asyncio.sleep(self._config.ping_interval_s)

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.worker_resolve_interval_s)
            await self._update_links()

    async def _update_links(self) -> None:
        """Connect to every worker found; drop one whose address is gone once it is
        no longer live (a live one serves on until its connection closes)."""
        endpoints, is_complete = await self._discovery.resolve()
        for endpoint in sorted(endpoints - self._links.keys()):
            log.info("connecting to a worker at %s", endpoint)
            link = WorkerLink(endpoint, self._config, self._context, self._events)
            self._links[endpoint] = link
            link.start()
        gone = self._links.keys() - endpoints if is_complete else set()
        for endpoint in sorted(gone):
            link = self._links[endpoint]
            if not link.verdict().is_live:
                log.info("the worker at %s is gone from %s", endpoint, self._config.endpoints)
                del self._links[endpoint]
                self._events.on_gone(link)
                await link.close()


_STATE_ORDER = [WorkerState.HUNG, WorkerState.DEAD, WorkerState.CONNECTING, WorkerState.LIVE]
