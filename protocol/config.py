"""Process configuration: the one module that reads the environment.

Each process has one frozen dataclass. A field's metadata names its environment
variable; `load` reads the variables, lets command-line flags override them
(``--max-batch-size 4`` for MAX_BATCH_SIZE) and validates the result. A bad
value raises `ConfigError` naming the variable, and the entry points exit with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from protocol.curve import (
    ClientKeys,
    ServerKeys,
    read_public_key,
    read_public_keys,
    read_secret_key,
)

DEFAULT_MODEL_ID = "distilgpt2"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the variable."""


def _setting(env: str, default: Any, help: str, is_secret: bool = False) -> Any:
    # A secret stays out of repr(), so that logging a config cannot leak it.
    return field(default=default, repr=not is_secret, metadata={"env": env, "help": help})


def _positive(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            env = _env_name(type(config), name)
            raise ConfigError(f"{env} must be > 0, got {getattr(config, name)!r}")


def _env_name(cls: type[Any], name: str) -> str:
    return str({f.name: f.metadata["env"] for f in dataclasses.fields(cls)}[name])


def _curve_keys(config: object, *settings: tuple[str, Callable[[str], Any]]) -> list[Any] | None:
    """Read the CURVE settings ``(field name, reader)``: None when all are unset
    (CURVE off), every key when all are set, and a ConfigError otherwise."""
    given = {name: getattr(config, name) for name, _ in settings if getattr(config, name)}
    if not given:
        return None
    if len(given) < len(settings):
        (missing,) = (name for name, _ in settings if name not in given)
        raise ConfigError(
            f"{_env_name(type(config), missing)} is unset, but "
            f"{', '.join(_env_name(type(config), name) for name in given)} is set: CURVE "
            "needs both (minibatch-keys writes them), or neither to leave it off"
        )
    keys = []
    for name, read in settings:
        try:
            keys.append(read(given[name]))
        except ValueError as exc:
            raise ConfigError(f"{_env_name(type(config), name)}: {exc}") from None
    return keys


def _check_endpoint(config: object, name: str) -> None:
    endpoint = getattr(config, name)
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(
            f"{_env_name(type(config), name)} must be a ZMQ endpoint such as "
            f"tcp://127.0.0.1:5555, got {endpoint!r}"
        )


@dataclass(frozen=True)
class WorkerConfig:
    """The engine worker: model, batch slots, queue, and its ZMQ endpoint."""

    model_id: str = _setting(
        "MODEL_ID",
        "",
        f"hub id, local model directory, 'synthetic' (offline random GPT-2) or 'fake'; "
        f"unset serves {DEFAULT_MODEL_ID}, or synthetic where that cannot load",
    )
    max_batch_size: int = _setting("MAX_BATCH_SIZE", 8, "sequences decoded together")
    max_queue_depth: int = _setting("MAX_QUEUE_DEPTH", 1024, "requests waiting for a slot")
    endpoint: str = _setting("WORKER_ENDPOINT", "tcp://127.0.0.1:5555", "ZMQ endpoint")
    bind_endpoint: str = _setting(
        "WORKER_BIND", "", "where the worker binds, if not WORKER_ENDPOINT (tcp://*:5555)"
    )
    heartbeat_interval_s: float = _setting(
        "HEARTBEAT_INTERVAL_S", 0.5, "seconds between heartbeats"
    )
    max_message_bytes: int = _setting(
        "MAX_MESSAGE_BYTES",
        2 * 1024 * 1024,
        "largest ZMQ message a peer may send; ZMQ disconnects a peer that sends more",
    )
    frontend_timeout_s: float = _setting(
        "FRONTEND_TIMEOUT_S", 10.0, "drop a frontend's requests after this long without a ping"
    )
    engine_watchdog_s: float = _setting(
        "ENGINE_WATCHDOG_S",
        90.0,
        "exit when the engine makes no progress this long with work pending, so that a "
        "restart policy (the supervisor, Docker) replaces a wedged worker",
    )
    chat_template: str = _setting(
        "CHAT_TEMPLATE",
        "",
        "a Jinja chat template file for /v1/chat/completions, instead of the model's own "
        "(or, for a model without one, the built-in default)",
    )
    device: str = _setting("DEVICE", "", "cpu or cuda (default: cuda when available)")
    torch_threads: int = _setting(
        "TORCH_THREADS",
        0,
        "threads torch computes with; 0 uses every core this process may run on "
        "(minibatch-serve splits the cores evenly between its workers)",
    )
    dtype: str = _setting(
        "DTYPE",
        "float32",
        "float32, bfloat16 or float16: how weights and the KV cache are stored (on CPU, "
        "arithmetic stays float32; on CUDA it runs in this type)",
    )
    weights: str = _setting(
        "WEIGHTS",
        "",
        "int8: the projections and LM head stored as int8 with a scale per output "
        "channel (CPU only); unset: stored in DTYPE",
    )
    prefill_chunk_tokens: int = _setting(
        "PREFILL_CHUNK_TOKENS",
        128,
        "a newcomer's prompt is run into the model at most this many tokens per step, "
        "between decode steps, so that a long prompt does not stall the running streams; "
        "0: each prompt whole, at once",
    )
    bfloat16_products: bool = _setting(
        "BFLOAT16_PRODUCTS",
        False,
        "with DTYPE=bfloat16 on a CPU with bfloat16 dot products (AVX512-BF16, AMX): "
        "the projections multiply activations rounded to bfloat16, for faster decode and "
        "prefill; an output can then change with its batchmates or across a resume",
    )
    cuda_graphs: bool = _setting(
        "CUDA_GRAPHS",
        True,
        "on CUDA, decode steps replay CUDA graphs captured at start, a few batch sizes by "
        "a few attended lengths; 0 runs every step eagerly (slower; for debugging)",
    )
    fake_step_delay_s: float = _setting(
        "FAKE_STEP_DELAY_S", 0.0, "seconds each step of the fake engine sleeps"
    )
    curve_server_secret_key: str = _setting(
        "CURVE_SERVER_SECRET_KEY",
        "",
        "turns CURVE on: the worker's secret key (Z85, or its .key_secret file from "
        "minibatch-keys); needs CURVE_CLIENT_KEYS",
        is_secret=True,
    )
    curve_client_keys: str = _setting(
        "CURVE_CLIENT_KEYS",
        "",
        "with CURVE on, the only clients the worker talks to: a directory of .key files, "
        "or comma-separated public keys (each Z85 or a .key file)",
    )
    fake_start_delay_s: float = _setting(
        "FAKE_START_DELAY_S",
        0.0,
        "test only: seconds the fake engine takes to load, to simulate a slow or stuck start",
    )
    fake_crash_prompt: str = _setting(
        "FAKE_CRASH_PROMPT",
        "",
        "test only: a fake-engine worker that admits a prompt containing this text exits "
        "at once, to simulate a request that kills every worker that runs it",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_batch_size", "max_queue_depth", "heartbeat_interval_s")
        _positive(self, "max_message_bytes")
        _positive(self, "frontend_timeout_s", "engine_watchdog_s")
        _check_endpoint(self, "endpoint")
        if self.bind_endpoint:
            _check_endpoint(self, "bind_endpoint")
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
                f"got DTYPE={self.dtype}: set DTYPE=bfloat16 or unset BFLOAT16_PRODUCTS"
            )
        if self.fake_step_delay_s < 0:
            raise ConfigError(f"FAKE_STEP_DELAY_S must be >= 0, got {self.fake_step_delay_s}")
        if self.prefill_chunk_tokens < 0:
            raise ConfigError(
                f"PREFILL_CHUNK_TOKENS must be >= 0 (0: no chunks), got {self.prefill_chunk_tokens}"
            )
        if self.torch_threads < 0:
            raise ConfigError(f"TORCH_THREADS must be >= 0, got {self.torch_threads}")
        if self.fake_start_delay_s < 0:
            raise ConfigError(f"FAKE_START_DELAY_S must be >= 0, got {self.fake_start_delay_s}")
        if self.chat_template and not os.path.isfile(self.chat_template):
            raise ConfigError(
                f"CHAT_TEMPLATE={self.chat_template!r} is not a file: name a Jinja template "
                "file, or unset it to use the model's own template"
            )
        _ = self.curve  # a bad key stops the worker at start, not at its first bind

    @cached_property
    def curve(self) -> ServerKeys | None:
        """The worker socket's CURVE keys; None when CURVE is off."""
        keys = _curve_keys(
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
        return self.bind_endpoint or self.endpoint


@dataclass(frozen=True)
class FrontendConfig:
    """The HTTP frontend: where it listens, request limits, and worker liveness."""

    host: str = _setting("HOST", "127.0.0.1", "HTTP listen address")
    port: int = _setting("PORT", 8000, "HTTP listen port")
    worker_endpoint: str = _setting(
        "WORKER_ENDPOINT",
        "tcp://127.0.0.1:5555",
        "the worker's ZMQ endpoint; a host name is re-resolved every "
        "WORKER_RESOLVE_INTERVAL_S and every address it resolves to is a worker",
    )
    worker_endpoints: str = _setting(
        "WORKER_ENDPOINTS",
        "",
        "comma-separated ZMQ endpoints of several workers; when set, WORKER_ENDPOINT is unused",
    )
    worker_resolve_interval_s: float = _setting(
        "WORKER_RESOLVE_INTERVAL_S",
        2.0,
        "seconds between look-ups of a host name in WORKER_ENDPOINT(S), to find workers "
        "added or gone (compose --scale, a Kubernetes headless Service)",
    )
    max_new_tokens_limit: int = _setting(
        "MAX_NEW_TOKENS_LIMIT", 512, "largest max_new_tokens a request may ask for"
    )
    max_queue_depth: int = _setting(
        "MAX_QUEUE_DEPTH", 1024, "requests accepted and not yet answered, at most"
    )
    heartbeat_timeout_s: float = _setting(
        "HEARTBEAT_TIMEOUT_S", 3.0, "declare the worker dead after this long without a heartbeat"
    )
    step_timeout_s: float = _setting(
        "STEP_TIMEOUT_S", 30.0, "declare the worker hung after this long without progress"
    )
    request_timeout_s: float = _setting("REQUEST_TIMEOUT_S", 120.0, "answer 504 after this long")
    ping_interval_s: float = _setting("PING_INTERVAL_S", 0.5, "seconds between frontend pings")
    max_request_bytes: int = _setting(
        "MAX_REQUEST_BYTES", 1024 * 1024, "largest request body; 413 beyond it"
    )
    body_timeout_s: float = _setting(
        "BODY_TIMEOUT_S", 30.0, "408 when a request body has not fully arrived after this long"
    )
    header_timeout_s: float = _setting(
        "HEADER_TIMEOUT_S",
        10.0,
        "close a connection that has not sent a whole request head this long after it "
        "opened or after its previous response",
    )
    keep_alive_timeout_s: int = _setting(
        "KEEP_ALIVE_TIMEOUT_S", 5, "close an idle keep-alive connection after this many seconds"
    )
    max_connections: int = _setting(
        "MAX_CONNECTIONS",
        2048,
        "open connections at most; a request beyond them gets 503 "
        "(the open-file limit, ulimit -n, must be higher)",
    )
    api_key: str = _setting(
        "API_KEY",
        "",
        "when set, every endpoint but /health, /ready and /metrics needs "
        "'Authorization: Bearer <key>'",
        is_secret=True,
    )
    curve_server_public_key: str = _setting(
        "CURVE_SERVER_PUBLIC_KEY",
        "",
        "for a worker with CURVE on: its public key (Z85, or its .key file); needs "
        "CURVE_CLIENT_SECRET_KEY",
    )
    curve_client_secret_key: str = _setting(
        "CURVE_CLIENT_SECRET_KEY",
        "",
        "for a worker with CURVE on: this client's secret key (Z85, or its .key_secret "
        "file), whose public key the worker's CURVE_CLIENT_KEYS allows",
        is_secret=True,
    )
    strict_request_fields: bool = _setting(
        "STRICT_REQUEST_FIELDS",
        False,
        "1: the OpenAI endpoints refuse unknown request fields with 422 instead of "
        "ignoring them (and naming them in a log line and the X-Ignored-Fields header)",
    )

    def __post_init__(self) -> None:
        _positive(self, "port", "max_new_tokens_limit", "max_queue_depth", "ping_interval_s")
        _positive(self, "heartbeat_timeout_s", "step_timeout_s", "request_timeout_s")
        _positive(self, "max_request_bytes", "body_timeout_s", "header_timeout_s")
        _positive(self, "keep_alive_timeout_s", "max_connections", "worker_resolve_interval_s")
        _check_endpoint(self, "worker_endpoint")
        for endpoint in self.endpoints:
            if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(
                    "WORKER_ENDPOINTS must be comma-separated ZMQ endpoints such as "
                    f"tcp://10.0.0.5:5555,tcp://10.0.0.6:5555, got {endpoint!r}"
                )
        if self.port > 65535:
            raise ConfigError(f"PORT must be at most 65535, got {self.port}")
        _ = self.curve  # a bad key stops the process at start, not at its first connect

    @property
    def endpoints(self) -> list[str]:
        """Where the workers are: WORKER_ENDPOINTS, else WORKER_ENDPOINT."""
        given = [e.strip() for e in self.worker_endpoints.split(",") if e.strip()]
        return given or [self.worker_endpoint]

    @cached_property
    def curve(self) -> ClientKeys | None:
        """The keys to connect to a worker with CURVE on; None when CURVE is off."""
        keys = _curve_keys(
            self,
            ("curve_server_public_key", read_public_key),
            ("curve_client_secret_key", read_secret_key),
        )
        return None if keys is None else ClientKeys(*keys)


@dataclass(frozen=True)
class SupervisorConfig:
    """The local launcher: how many processes it runs, and how it restarts a worker
    that died or hung."""

    num_workers: int = _setting(
        "NUM_WORKERS",
        1,
        "workers to run, on WORKER_ENDPOINT's port and the ones after it; each gets "
        "an even share of the cores unless TORCH_THREADS is set",
    )
    torch_threads: int = _setting(
        "TORCH_THREADS",
        0,
        "threads each worker computes with; 0 splits the cores evenly between the workers",
    )
    num_frontends: int = _setting(
        "NUM_FRONTENDS",
        1,
        "frontends to run, on PORT and the ports after it; each serves every worker",
    )
    warm_start: bool = _setting(
        "WARM_START",
        True,
        "fork each worker from a process that has loaded the model already, so that a "
        "replacement serves within a second and the workers share the weights; 0 "
        "starts each from scratch",
    )
    restart_backoff_s: float = _setting(
        "RESTART_BACKOFF_S",
        0.5,
        "wait before restarting a child that died before serving; doubles with each such "
        "death in a row (one that had served restarts at once)",
    )
    restart_backoff_max_s: float = _setting(
        "RESTART_BACKOFF_MAX_S", 10.0, "the longest wait between restarts"
    )
    crash_loop_limit: int = _setting(
        "CRASH_LOOP_LIMIT", 5, "give up after this many workers in a row die before serving"
    )
    worker_start_timeout_s: float = _setting(
        "WORKER_START_TIMEOUT_S",
        300.0,
        "kill and replace a worker that has not said hello this long after it started; "
        "long enough for a first start to download the model",
    )

    def __post_init__(self) -> None:
        _positive(self, "restart_backoff_s", "restart_backoff_max_s", "crash_loop_limit")
        _positive(self, "worker_start_timeout_s", "num_workers", "num_frontends")
        if self.torch_threads < 0:
            raise ConfigError(f"TORCH_THREADS must be >= 0, got {self.torch_threads}")


C = TypeVar("C")


def load(
    cls: type[C],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    description: str | None = None,
) -> C:
    """Build ``cls`` from the environment, overridden by command-line flags."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        env = f.metadata["env"]
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            metavar=env,
            help=f"{f.metadata['help']} (env {env}, default {f.default!r})",
        )
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        env = f.metadata["env"]
        raw = getattr(args, f.name)
        if raw is None:
            raw = environ.get(env)
        if raw is None:
            continue
        values[f.name] = _parse(env, raw, hints[f.name])
    return cls(**values)


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True}
_BOOLEANS.update({"0": False, "false": False, "no": False, "off": False, "": False})


def _parse(env: str, raw: str, kind: Any) -> Any:
    if kind is str:
        return raw
    if kind is bool:
        if raw.strip().lower() not in _BOOLEANS:
            raise ConfigError(f"{env} must be 1 or 0 (true or false), got {raw!r}")
        return _BOOLEANS[raw.strip().lower()]
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{env} must be {kind.__name__}, got {raw!r}") from None


__all__ = ["ConfigError", "FrontendConfig", "SupervisorConfig", "WorkerConfig", "load"]
