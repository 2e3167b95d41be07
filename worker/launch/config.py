"""The supervisor's config (`minibatch-serve`): how many processes it runs, and
how it restarts one that died or hung; it judges workers as any client does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from protocol.client_config import WorkerClientConfig
from protocol.endpoints import DEFAULT_HTTP_PORT, DEFAULT_WORKER_ENDPOINT, MAX_PORT
from protocol.settings import ConfigError, env_name, require_positive, setting
from worker.serve.config import WorkerConfig, check_torch_threads

NO_WORKER_ENDPOINTS = (
    "WORKER_ENDPOINTS is for a frontend run alone (minibatch-frontend): "
    "minibatch-serve tells its frontends the endpoints of the workers it starts, "
    "on WORKER_ENDPOINT and the ports after it (NUM_WORKERS); unset it"
)

# Workers or frontends one supervisor runs: each worker holds a copy of the model,
# and each frontend a link to every worker.
MAX_CHILDREN = 64


@dataclass(frozen=True)
class SupervisorConfig(WorkerClientConfig):
    """The local launcher: how many processes it runs, and how it restarts a worker
    that died or hung."""

    COMMAND: ClassVar[str] = "minibatch-serve"
    # It tells its frontends where the workers it starts are: a list of its own
    # is refused (`check_no_worker_endpoints`), so --help offers no flag for it.
    WITHOUT_FLAGS: ClassVar[Mapping[str, str]] = {"WORKER_ENDPOINTS": NO_WORKER_ENDPOINTS}
    # A worker's flag given here is refused saying to set its variable instead,
    # which the workers inherit.
    INHERITED_BY: ClassVar[tuple[type, ...]] = (WorkerConfig,)
    HELP_EPILOG: ClassVar[str] = (
        "The workers and frontends it starts read their own settings (MODEL_ID, "
        "MAX_BATCH_SIZE, STOP_GRACE_S, API_KEY...) from the environment they inherit: "
        "set them there, as in `MAX_BATCH_SIZE=16 minibatch-serve`; `minibatch-worker "
        "--help` and `minibatch-frontend --help` list them."
    )

    worker_endpoint: str = setting(
        "WORKER_ENDPOINT",
        DEFAULT_WORKER_ENDPOINT,
        "the first worker's ZMQ endpoint: NUM_WORKERS bind it and the ports after it "
        "(WORKER_BIND's, if set), and the frontends connect to each",
    )
    num_workers: int = setting(
        "NUM_WORKERS",
        1,
        "workers to run, on WORKER_ENDPOINT's port and the ones after it (or numbered "
        "ipc paths); each gets an even share of the cores unless TORCH_THREADS is set",
    )
    torch_threads: int = setting(
        "TORCH_THREADS",
        0,
        "threads each worker computes with; 0 splits the cores evenly between the workers",
    )
    num_frontends: int = setting(
        "NUM_FRONTENDS",
        1,
        "frontends to run, on PORT and the ports after it; each serves every worker",
    )
    warm_start: bool = setting(
        "WARM_START",
        True,
        "fork each worker from a process that has loaded the model already, so that a "
        "replacement serves within a second and the workers share the weights; 0 "
        "starts each from scratch",
    )
    restart_backoff_s: float = setting(
        "RESTART_BACKOFF_S",
        0.5,
        "wait before restarting a child that died before serving; doubles with each death "
        "before coming up in a row (one that had served restarts at once)",
    )
    restart_backoff_max_s: float = setting(
        "RESTART_BACKOFF_MAX_S", 10.0, "the longest wait between restarts"
    )
    crash_loop_limit: int = setting(
        "CRASH_LOOP_LIMIT",
        5,
        "give up after a child dies this many times in a row before serving (a frontend) or "
        "before coming up (a worker: its model loaded, its socket bound), or ends itself as "
        "broken (a worker: exit 4 or 5)",
    )
    worker_start_timeout_s: float = setting(
        "WORKER_START_TIMEOUT_S",
        300.0,
        "kill and replace a worker that has not said hello this long after it started; "
        "long enough for a first start to download the model",
    )

    port: int = setting(
        "PORT",
        DEFAULT_HTTP_PORT,
        "the first frontend's HTTP port; NUM_FRONTENDS take it and the ports after it",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "restart_backoff_s", "restart_backoff_max_s", "crash_loop_limit")
        require_positive(self, "worker_start_timeout_s", "num_workers", "num_frontends", "port")
        check_torch_threads(self.torch_threads)
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError(
                f"RESTART_BACKOFF_MAX_S={self.restart_backoff_max_s:g} is below "
                f"RESTART_BACKOFF_S={self.restart_backoff_s:g}, the first wait it caps: "
                "raise it, or lower RESTART_BACKOFF_S"
            )
        for name in ("num_workers", "num_frontends"):
            if getattr(self, name) > MAX_CHILDREN:
                raise ConfigError(
                    f"{env_name(type(self), name)} must be at most {MAX_CHILDREN}, got "
                    f"{getattr(self, name)}"
                )
        last_port = self.port + self.num_frontends - 1
        if last_port > MAX_PORT:
            raise ConfigError(
                f"PORT={self.port} with NUM_FRONTENDS={self.num_frontends} takes ports up to "
                f"{last_port}, past {MAX_PORT}: lower PORT"
            )
