"""How a client reaches and judges workers: where they are, how often it pings,
when it declares one dead or hung, and the CURVE keys it connects with. The
frontend, the supervisor, the probe and the benchmarks' ZMQ clients all take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from protocol.curve import ClientKeys, read_curve_keys, read_public_key, read_secret_key
from protocol.endpoints import DEFAULT_WORKER_ENDPOINT, check_connect_endpoint
from protocol.settings import ConfigError, require_interval, require_positive, setting


@dataclass(frozen=True)
class WorkerClientConfig:
    """A client of workers."""

    worker_endpoint: str = setting(
        "WORKER_ENDPOINT",
        DEFAULT_WORKER_ENDPOINT,
        "the worker's ZMQ endpoint; a host name is re-resolved every "
        "WORKER_RESOLVE_INTERVAL_S and every address it resolves to is a worker",
    )
    worker_endpoints: str = setting(
        "WORKER_ENDPOINTS",
        "",
        "comma-separated ZMQ endpoints of several workers; when set, WORKER_ENDPOINT is unused",
    )
    worker_resolve_interval_s: float = setting(
        "WORKER_RESOLVE_INTERVAL_S",
        2.0,
        "seconds between look-ups of a host name in WORKER_ENDPOINT(S), to find workers "
        "added or gone (compose --scale, a Kubernetes headless Service)",
    )
    heartbeat_timeout_s: float = setting(
        "HEARTBEAT_TIMEOUT_S", 3.0, "declare the worker dead after this long without a heartbeat"
    )
    step_timeout_s: float = setting(
        "STEP_TIMEOUT_S", 30.0, "declare the worker hung after this long without progress"
    )
    ping_interval_s: float = setting("PING_INTERVAL_S", 0.5, "seconds between frontend pings")
    curve_server_public_key: str = setting(
        "CURVE_SERVER_PUBLIC_KEY",
        "",
        "for a worker with CURVE on: its public key (Z85, or its .key file); needs "
        "CURVE_CLIENT_SECRET_KEY",
    )
    curve_client_secret_key: str = setting(
        "CURVE_CLIENT_SECRET_KEY",
        "",
        "for a worker with CURVE on: this client's secret key (Z85, or its .key_secret "
        "file), whose public key the worker's CURVE_CLIENT_KEYS allows",
        is_secret=True,
    )

    def __post_init__(self) -> None:
        require_positive(self, "heartbeat_timeout_s", "step_timeout_s")
        require_interval(self, "ping_interval_s", "worker_resolve_interval_s")
        check_connect_endpoint(self.worker_endpoint, "WORKER_ENDPOINT")
        if self.worker_endpoints.strip() and any(
            not endpoint.strip() for endpoint in self.worker_endpoints.split(",")
        ):
            raise ConfigError(
                f"WORKER_ENDPOINTS={self.worker_endpoints!r} has an empty entry: list the "
                "endpoints with one comma between each two, or unset it to use "
                "WORKER_ENDPOINT"
            )
        for endpoint in self.endpoints:
            check_connect_endpoint(endpoint, "WORKER_ENDPOINTS")
        _ = self.curve  # a bad key stops the process at start, not at its first connect

    def timing_problems(self, heartbeat_interval_s: float, frontend_timeout_s: float) -> list[str]:
        """Where this client's timing and a worker's (as its hello says; a
        ``frontend_timeout_s`` of 0 is unknown) cannot work together: each side is
        configured alone, and a mismatch shows only as workers declared dead, or
        requests dropped, while nothing is wrong."""
        problems = []
        if self.heartbeat_timeout_s < 2 * heartbeat_interval_s:
            problems.append(
                f"HEARTBEAT_TIMEOUT_S={self.heartbeat_timeout_s:g} is less than twice the "
                f"worker's HEARTBEAT_INTERVAL_S={heartbeat_interval_s:g}: the worker "
                "will be declared dead between heartbeats; raise HEARTBEAT_TIMEOUT_S"
            )
        if self.step_timeout_s < 2 * heartbeat_interval_s:
            # Its progress, idle or busy, shows only in its heartbeats.
            problems.append(
                f"STEP_TIMEOUT_S={self.step_timeout_s:g} is less than twice the worker's "
                f"HEARTBEAT_INTERVAL_S={heartbeat_interval_s:g}: the worker, idle or "
                "busy, will be declared hung between heartbeats; raise STEP_TIMEOUT_S"
            )
        if frontend_timeout_s and 2 * self.ping_interval_s > frontend_timeout_s:
            problems.append(
                f"PING_INTERVAL_S={self.ping_interval_s:g} is more than half the worker's "
                f"FRONTEND_TIMEOUT_S={frontend_timeout_s:g}: it will drop this client's "
                "requests between pings; lower PING_INTERVAL_S"
            )
        return problems

    @property
    def endpoints(self) -> list[str]:
        """Where the workers are: WORKER_ENDPOINTS, else WORKER_ENDPOINT."""
        given = [e.strip() for e in self.worker_endpoints.split(",") if e.strip()]
        return given or [self.worker_endpoint]

    @cached_property
    def curve(self) -> ClientKeys | None:
        """The keys to connect to a worker with CURVE on; None when CURVE is off."""
        keys = read_curve_keys(
            self,
            ("curve_server_public_key", read_public_key),
            ("curve_client_secret_key", read_secret_key),
        )
        return None if keys is None else ClientKeys(*keys)
