"""What the workers carry now (`PoolLoad`), read for each call of GET /health,
GET /ready or a /metrics scrape, and the two probes' answers built from it.

A dead worker's last heartbeat says nothing of it now, so each total counts the
live workers only; requests waiting in this frontend for a slot count whether
or not a worker is live (when none is, they are all that waits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from frontend.json_response import JSONResponse
from frontend.worker_client import WorkerClient
from protocol import Heartbeat, Hello
from protocol.liveness import Verdict, WorkerState


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as this frontend sees it now."""

    endpoint: str
    verdict: Verdict
    is_stopping: bool  # it takes nothing new
    hello: Hello | None
    heartbeat: Heartbeat | None  # its latest; None while it is dead or not yet heard
    num_held: int  # this frontend's requests it runs or queues

    @property
    def is_live(self) -> bool:
        return self.verdict.is_live


@dataclass(frozen=True)
class PoolLoad:
    """Every worker this frontend knows, and its own requests."""

    verdict: Verdict  # live while any worker is; else why none is
    hello: Hello | None  # a live worker's, else any worker's that has said one
    workers: list[WorkerLoad]
    num_waiting: int  # accepted here, held by no worker yet
    num_inflight: int  # accepted here, not yet answered
    num_restarts: int

    @property
    def live(self) -> list[WorkerLoad]:
        return [worker for worker in self.workers if worker.is_live]

    def _live_heartbeats(self) -> list[Heartbeat]:
        return [worker.heartbeat for worker in self.live if worker.heartbeat]

    @property
    def capacity(self) -> int | None:
        """The live workers' slots; None while no live worker has said hello."""
        hellos = [worker.hello for worker in self.live if worker.hello]
        return sum(hello.capacity for hello in hellos) if hellos else None

    @property
    def num_running(self) -> int | None:
        """Sequences in the live workers' batches; None while none has said."""
        beats = self._live_heartbeats()
        return sum(beat.num_active for beat in beats) if beats else None

    @property
    def num_queued(self) -> int:
        """Requests waiting for a slot: in the live workers' queues, and here."""
        return sum(beat.num_queued for beat in self._live_heartbeats()) + self.num_waiting

    @property
    def num_free_slots(self) -> int:
        """Slots free for new sequences in the live workers that take them (not
        stopping), by their latest heartbeats."""
        return sum(
            worker.hello.capacity - worker.heartbeat.num_active
            for worker in self.live
            if worker.hello and worker.heartbeat and not worker.is_stopping
        )


def pool_load(client: WorkerClient) -> PoolLoad:
    """The workers' load now."""
    workers = []
    for link in client.workers():
        verdict = link.verdict()
        is_dead = verdict.state is WorkerState.DEAD
        workers.append(
            WorkerLoad(
                endpoint=link.endpoint,
                verdict=verdict,
                is_stopping=link.is_stopping,
                hello=link.hello,
                heartbeat=None if is_dead else link.liveness.last_heartbeat,
                num_held=len(link.held),
            )
        )
    return PoolLoad(
        verdict=client.verdict(),
        hello=client.hello,
        workers=workers,
        num_waiting=client.num_waiting,
        num_inflight=client.num_inflight,
        num_restarts=client.num_worker_restarts,
    )


async def health(request: Request) -> Response:
    """200 while a worker is live (judged from its heartbeats), else 503 and why."""
    client: WorkerClient = request.app.state.client
    status = _status(pool_load(client))
    return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503)


async def ready(request: Request) -> Response:
    """For load balancers: 200 only when a worker is live and takes new requests,
    and there is room for more requests and connections; 503 (hold off) otherwise."""
    client: WorkerClient = request.app.state.client
    status = _status(pool_load(client))
    if status["status"] == "ok":
        num_connections = request.app.state.count_connections()
        refusal = _why_not_ready(client, num_connections, request.app.state.connection_room)
        if refusal is not None:
            status["status"], status["reason"] = refusal
    status["ready"] = status["status"] == "ok"
    return JSONResponse(status, status_code=200 if status["ready"] else 503)


def _why_not_ready(
    client: WorkerClient, num_connections: int, connection_room: int
) -> tuple[str, str] | None:
    """Why a new request would wait or be refused 503 now, if it would: every
    live worker is stopping (taking nothing new), no room for it in flight, or
    no connection left (the probe's own counts, as a request's own does when
    `frontend.http_protocol` refuses it past MAX_CONNECTIONS), nor room for one
    beside the probes' within the open-file limit (``connection_room``)."""
    config = client.config
    if not client.any_worker_takes_work():
        return "stopping", "every live worker is stopping, and takes no new request"
    if client.num_inflight >= config.max_inflight_requests:
        return "full", f"MAX_INFLIGHT_REQUESTS={config.max_inflight_requests} requests in flight"
    if num_connections > config.max_connections:
        return "full", f"more than MAX_CONNECTIONS={config.max_connections} connections open"
    if num_connections > connection_room:
        return "full", (
            f"{num_connections} connections open, more than the {connection_room} that the "
            "open-file limit (ulimit -n) leaves room for beside the probes'"
        )
    return None


def _status(load: PoolLoad) -> dict[str, Any]:
    """The JSON of GET /health (docs/api.md names each key)."""
    hello = load.hello
    return {
        "status": "ok" if load.verdict.is_live else "unavailable",
        "worker": load.verdict.state.value,
        "reason": load.verdict.reason,
        "model": hello.model if hello else None,
        "random_weights": hello.is_random_weights if hello else None,
        "instance_id": _instance_id(load.workers[0]) if len(load.workers) == 1 else None,
        "capacity": load.capacity,
        "context_window": hello.context_window if hello else None,
        "queued": load.num_queued,
        "active": load.num_running,
        "inflight": load.num_inflight,
        "worker_restarts": load.num_restarts,
        "workers_live": len(load.live),
        "workers": [_worker_status(worker) for worker in load.workers],
    }


def _instance_id(worker: WorkerLoad) -> str | None:
    return worker.hello.instance_id if worker.hello else None


def _worker_status(worker: WorkerLoad) -> dict[str, Any]:
    hello, heartbeat = worker.hello, worker.heartbeat
    return {
        "endpoint": worker.endpoint,
        "state": worker.verdict.state.value,
        "reason": worker.verdict.reason,
        "stopping": worker.is_stopping,
        "instance_id": _instance_id(worker),
        "capacity": hello.capacity if hello else None,
        "compute": hello.compute if hello else None,
        "active": heartbeat.num_active if heartbeat else None,
        "queued": heartbeat.num_queued if heartbeat else None,
        "finished": heartbeat.num_finished if heartbeat else None,
        "steps": heartbeat.num_steps if heartbeat else None,
        "held": worker.num_held,
    }
