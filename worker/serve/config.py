"""The engine worker's config: model, batch slots, queue, its ZMQ endpoint and
how it computes."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from protocol.curve import ServerKeys, read_curve_keys, read_public_keys, read_secret_key
from protocol.endpoints import (
    DEFAULT_WORKER_ENDPOINT,
    TcpEndpoint,
    check_endpoint,
    probe_binds,
)
from protocol.limits import MIN_MESSAGE_BYTES
from protocol.settings import ConfigError, require_interval, require_positive, setting

DEFAULT_MODEL_ID = "distilgpt2"


def check_torch_threads(num_threads: int) -> None:
    """TORCH_THREADS: 0 (every core), or at most the cores this process may run
    on. More only makes threads wait for cores, and past what the system allows,
    OpenMP fails to start them and the process dies."""
    num_cores = len(os.sched_getaffinity(0))
    if not 0 <= num_threads <= num_cores:
        raise ConfigError(
            f"TORCH_THREADS must be 0 (every core) to {num_cores} (the cores this process may "
            f"run on), got {num_threads}"
        )


@dataclass(frozen=True)
class WorkerConfig:
    """The engine worker: model, batch slots, queue, and its ZMQ endpoint."""

    COMMAND: ClassVar[str] = "minibatch-worker"

    model_id: str = setting(
        "MODEL_ID",
        "",
        f"hub id, local model directory, 'synthetic' (offline random GPT-2) or 'fake'; "
        f"unset serves {DEFAULT_MODEL_ID}, or synthetic where that cannot load",
    )
    max_batch_size: int = setting("MAX_BATCH_SIZE", 8, "sequences decoded together")
    max_queue_depth: int = setting("MAX_QUEUE_DEPTH", 1024, "requests waiting for a slot")
    worker_endpoint: str = setting(
        "WORKER_ENDPOINT",
        DEFAULT_WORKER_ENDPOINT,
        "the ZMQ endpoint it listens on, and that its clients connect to",
    )
    worker_bind: str = setting(
        "WORKER_BIND",
        "",
        "where the worker binds, if not WORKER_ENDPOINT (tcp://*:5555); under "
        "minibatch-serve, on WORKER_ENDPOINT's port and host or a wildcard of its family "
        "(* for IPv4, [::] for IPv6), the first worker's, and the next ports the others'",
    )
    heartbeat_interval_s: float = setting("HEARTBEAT_INTERVAL_S", 0.5, "seconds between heartbeats")
    max_message_bytes: int = setting(
        "MAX_MESSAGE_BYTES",
        2 * 1024 * 1024,
        "largest ZMQ message a peer may send, at least 256 KiB; ZMQ disconnects a peer "
        "that sends more",
    )
    frontend_timeout_s: float = setting(
        "FRONTEND_TIMEOUT_S", 10.0, "drop a frontend's requests after this long without a ping"
    )
    stop_grace_s: float = setting(
        "STOP_GRACE_S",
        3.0,
        "how long a worker told to stop (SIGTERM) lets the requests it runs go on before "
        "it hands the rest back to their frontends (0: at once); it takes nothing new meanwhile",
    )
    engine_watchdog_s: float = setting(
        "ENGINE_WATCHDOG_S",
        90.0,
        "exit when the engine makes no progress this long with work pending, so that a "
        "restart policy (the supervisor, Docker) replaces a wedged worker",
    )
    chat_template: str = setting(
        "CHAT_TEMPLATE",
        "",
        "a Jinja chat template file for /v1/chat/completions, instead of the model's own "
        "(or, for a model without one, the built-in default)",
    )
    device: str = setting("DEVICE", "", "cpu, cuda or cuda:N (default: cuda when available)")
    torch_threads: int = setting(
        "TORCH_THREADS",
        0,
        "threads torch computes with; 0 uses every core this process may run on "
        "(minibatch-serve splits the cores evenly between its workers)",
    )
    num_workers: int = setting(
        "NUM_WORKERS",
        1,
        "workers sharing this host's memory (minibatch-serve sets it for its own): on CPU "
        "the KV caches of all of them must fit in it",
    )
    dtype: str = setting(
        "DTYPE",
        "float32",
        "float32, bfloat16 or float16: how weights and the KV cache are stored (on CPU, "
        "arithmetic stays float32; on CUDA it runs in this type)",
    )
    weights: str = setting(
        "WEIGHTS",
        "",
        "int8: the projections and LM head stored as int8 with a scale per output "
        "channel (CPU only); unset: stored in DTYPE",
    )
    prefill_chunk_tokens: int = setting(
        "PREFILL_CHUNK_TOKENS",
        128,
        "a newcomer's prompt is run into the model at most this many tokens per step, "
        "between decode steps, so that a long prompt does not stall the running streams; "
        "0: each prompt whole, at once",
    )
    prefix_cache: bool = setting(
        "PREFIX_CACHE",
        True,
        "keep each finished prompt's keys and values in its slot until the slot is needed, "
        "and reuse them for a later prompt that begins the same way (whole blocks of 16 "
        "tokens, or of PREFILL_CHUNK_TOKENS if fewer; off when PREFILL_CHUNK_TOKENS is 0, "
        "and for MODEL_ID=fake); 0: every prompt computed in full",
    )
    bfloat16_products: bool = setting(
        "BFLOAT16_PRODUCTS",
        False,
        "with DTYPE=bfloat16 on a CPU with bfloat16 dot products (AVX512-BF16, AMX): "
        "the projections multiply activations rounded to bfloat16, for faster decode and "
        "prefill; an output can then change with its batchmates or across a resume",
    )
    cuda_graphs: bool = setting(
        "CUDA_GRAPHS",
        True,
        "on CUDA, decode steps replay CUDA graphs captured at start, a few batch sizes by "
        "a few attended lengths; 0 runs every step eagerly (slower; for debugging)",
    )
    curve_server_secret_key: str = setting(
        "CURVE_SERVER_SECRET_KEY",
        "",
        "turns CURVE on: the worker's secret key (Z85, or its .key_secret file from "
        "minibatch-keys); needs CURVE_CLIENT_KEYS",
        is_secret=True,
    )
    curve_client_keys: str = setting(
        "CURVE_CLIENT_KEYS",
        "",
        "with CURVE on, the only clients the worker talks to: a directory of .key files, "
        "or comma-separated public keys (each Z85 or a .key file)",
    )

    def __post_init__(self) -> None:
        require_positive(self, "max_batch_size", "max_queue_depth", "num_workers")
        require_interval(self, "heartbeat_interval_s")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ConfigError(
                f"MAX_MESSAGE_BYTES must be at least {MIN_MESSAGE_BYTES:,} (256 KiB), room "
                "for a prompt and a request's other fields at their limits; got "
                f"{self.max_message_bytes:,}"
            )
        require_positive(self, "frontend_timeout_s", "engine_watchdog_s")
        if self.stop_grace_s < 0:
            raise ConfigError(
                f"STOP_GRACE_S must be >= 0 (0: hand back at once), got {self.stop_grace_s:g}"
            )
        check_endpoint(self, "worker_endpoint")
        if self.worker_bind:
            check_endpoint(self, "worker_bind")
        if self.device not in ("", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"DEVICE must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"DTYPE must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weights not in ("", "int8"):
            raise ConfigError(
                f"WEIGHTS must be int8, or unset to store weights in DTYPE, got {self.weights!r}"
            )
        if self.bfloat16_products and self.dtype != "bfloat16":
            raise ConfigError(
                f"BFLOAT16_PRODUCTS=1 needs DTYPE=bfloat16 (it multiplies bfloat16 weights), "
                f"got DTYPE={self.dtype}: set DTYPE=bfloat16 (on a CPU with AVX512-BF16 or "
                f"AMX, which BFLOAT16_PRODUCTS needs too) or unset BFLOAT16_PRODUCTS"
            )
        if self.prefill_chunk_tokens < 0:
            raise ConfigError(
                f"PREFILL_CHUNK_TOKENS must be >= 0 (0: no chunks), got {self.prefill_chunk_tokens}"
            )
        check_torch_threads(self.torch_threads)
        if self.chat_template and not os.path.isfile(self.chat_template):
            raise ConfigError(
                f"CHAT_TEMPLATE={self.chat_template!r} is not a file: name a Jinja template "
                "file, or unset it to use the model's own template"
            )
        _ = self.curve  # a bad key stops the worker at start, not at its first bind

    @cached_property
    def curve(self) -> ServerKeys | None:
        """The worker socket's CURVE keys; None when CURVE is off."""
        keys = read_curve_keys(
            self,
            ("curve_server_secret_key", read_secret_key),
            ("curve_client_keys", read_public_keys),
        )
        return None if keys is None else ServerKeys(*keys)

    @property
    def model_to_load(self) -> str:
        return self.model_id or DEFAULT_MODEL_ID

    @property
    def listen_endpoint(self) -> str:
        return self.worker_bind or self.worker_endpoint

    @property
    def listen_setting(self) -> str:
        """The setting that gave `listen_endpoint`."""
        return "WORKER_BIND" if self.worker_bind else "WORKER_ENDPOINT"


def check_endpoint_free(config: WorkerConfig) -> None:
    """Raises ConfigError when another program listens on the TCP port the worker
    is to bind, or its address is none of this machine's: found before the model
    loads (seconds, minutes for a large one), not by the bind after it."""
    address = tcp_bind_address(config.listen_endpoint)
    if address is None:
        return
    failures = bind_failures(*address)
    if errno.EADDRINUSE in failures:
        name = config.listen_setting
        raise ConfigError(
            f"port {address[1]} ({name}={config.listen_endpoint}) is taken by another "
            f"program, perhaps another worker: set {name} to a free address"
        )
    if all(failure == errno.EADDRNOTAVAIL for failure in failures):  # or no address at all
        raise ConfigError(not_this_machines(config))


def not_this_machines(config: WorkerConfig) -> str:
    """Why the worker cannot bind its endpoint, which names another machine (or
    nothing), and what to set: WORKER_ENDPOINT names where clients connect,
    which behind NAT or in a container is not where the worker binds."""
    name, endpoint = config.listen_setting, config.listen_endpoint
    fix = "set WORKER_BIND to one that is (tcp://*:PORT binds them all)"
    if name == "WORKER_ENDPOINT":
        fix += " and keep WORKER_ENDPOINT for where clients connect"
    return f"cannot bind {name}={endpoint}: it is no address of this machine; {fix}"


def tcp_bind_address(endpoint: str) -> tuple[str, int] | None:
    """The host and port a bind of ``endpoint`` takes (ZMQ's ``*``: IPv4's
    wildcard); None unless it is a TCP endpoint with a port."""
    tcp = TcpEndpoint.parse(endpoint)
    if tcp is None:
        return None
    return "0.0.0.0" if tcp.host == "*" else tcp.host, tcp.port


def is_listened_on(host: str, port: int) -> bool:
    """Whether binding ``host``:``port`` fails for a listener already there (a
    host that is not this machine's is left for the worker's own bind)."""
    return errno.EADDRINUSE in bind_failures(host, port)


def bind_failures(host: str, port: int) -> list[int | None]:
    """Binding ``port`` at each address ``host`` resolves to, as ZMQ binds: None
    where it can, else the errno (EADDRINUSE: a listener is there; EADDRNOTAVAIL:
    no address of this machine); none at all for a name that does not resolve."""
    try:
        probed = probe_binds(host, port)
    except (OSError, UnicodeError):
        return []
    return [None if exc is None else exc.errno for _, exc in probed]
