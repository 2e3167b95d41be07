"""The HTTP frontend's config: where it listens and its request limits, on top of
what every client of workers takes (`protocol.client_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from protocol.client_config import WorkerClientConfig
from protocol.endpoints import DEFAULT_HTTP_HOST, DEFAULT_HTTP_PORT, MAX_PORT
from protocol.settings import ConfigError, require_positive, setting

# A body limit this low still holds a request's fields at their limits (a grammar
# of MAX_GRAMMAR_CHARS, stop strings, logit_bias) beside a prompt; a lower one
# refused everything (MAX_REQUEST_BYTES=10: every request 413).
MIN_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class FrontendConfig(WorkerClientConfig):
    """The HTTP frontend: where it listens, request limits, and worker liveness."""

    COMMAND: ClassVar[str] = "minibatch-frontend"

    host: str = setting("HOST", DEFAULT_HTTP_HOST, "HTTP listen address")
    port: int = setting("PORT", DEFAULT_HTTP_PORT, "HTTP listen port")
    max_new_tokens_limit: int = setting(
        "MAX_NEW_TOKENS_LIMIT", 512, "largest max_new_tokens a request may ask for"
    )
    max_inflight_requests: int = setting(
        "MAX_INFLIGHT_REQUESTS", 1024, "requests accepted and not yet answered, at most"
    )
    request_timeout_s: float = setting("REQUEST_TIMEOUT_S", 120.0, "answer 504 after this long")
    max_worker_deaths: int = setting(
        "MAX_WORKER_DEATHS",
        3,
        "worker deaths a request may be in flight for before it is answered workers_died "
        "(500) instead of replayed (it may be what kills them); one that made no progress "
        "on two workers that died while it ran there alone or on trial is failed after "
        "those two; excused deaths count only past this many (docs/operations.md, "
        "When a worker dies)",
    )
    max_request_bytes: int = setting(
        "MAX_REQUEST_BYTES", 1024 * 1024, "largest request body; 413 beyond it"
    )
    body_timeout_s: float = setting(
        "BODY_TIMEOUT_S",
        30.0,
        "408 when a request body has not fully arrived after this long; a client that "
        "takes no byte of its answer this long has its connection dropped",
    )
    header_timeout_s: float = setting(
        "HEADER_TIMEOUT_S",
        10.0,
        "close a connection that has not sent a whole request head this long after it "
        "opened, or after the first byte of its next request",
    )
    keep_alive_timeout_s: int = setting(
        "KEEP_ALIVE_TIMEOUT_S", 5, "close an idle keep-alive connection after this many seconds"
    )
    max_connections: int = setting(
        "MAX_CONNECTIONS",
        2048,
        "open connections at most; a request beyond them gets 503, a probe's none "
        "(the open-file limit, ulimit -n, must be higher by 288: each process raises "
        "its own to the hard limit)",
    )
    api_key: str = setting(
        "API_KEY",
        "",
        "when set, every endpoint but /health, /ready and /metrics needs "
        "'Authorization: Bearer <key>'",
        is_secret=True,
    )
    cors_allow_origins: str = setting(
        "CORS_ALLOW_ORIGINS",
        "",
        "comma-separated origins whose web pages may call the API from a browser "
        "(https://app.example.com), or * for any; unset: none (no CORS headers)",
    )
    strict_request_fields: bool = setting(
        "STRICT_REQUEST_FIELDS",
        False,
        "1: the OpenAI endpoints, /tokenize and /detokenize refuse unknown request fields "
        "with 422 instead of ignoring them (and naming them in a log line and the "
        "X-Ignored-Fields header)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.host:
            # uvicorn would listen on every interface: not what an unset value means.
            raise ConfigError(
                "HOST must not be empty: 127.0.0.1 (the default) for this machine alone, "
                "0.0.0.0 for every interface"
            )
        require_positive(self, "port", "max_new_tokens_limit", "max_inflight_requests")
        require_positive(self, "max_worker_deaths")
        require_positive(self, "request_timeout_s", "body_timeout_s")
        if self.max_request_bytes < MIN_REQUEST_BYTES:
            raise ConfigError(
                f"MAX_REQUEST_BYTES must be at least {MIN_REQUEST_BYTES:,} (64 KiB), room for "
                "a request's fields at their limits beside a prompt; got "
                f"{self.max_request_bytes:,}"
            )
        require_positive(self, "header_timeout_s", "keep_alive_timeout_s", "max_connections")
        if self.port > MAX_PORT:
            raise ConfigError(f"PORT must be at most {MAX_PORT}, got {self.port}")
        for origin in self.allowed_origins:
            check_origin(origin)
        if self.api_key and not _is_sendable(self.api_key):
            # Not quoted: it is a secret.
            raise ConfigError(
                f"API_KEY ({len(self.api_key)} characters) must be printable ASCII with no "
                "space at either end: clients send it in the header 'Authorization: Bearer "
                "<key>', where such a key cannot arrive as it is set"
            )

    @property
    def allowed_origins(self) -> list[str]:
        """CORS_ALLOW_ORIGINS as a list (empty: CORS off)."""
        return [origin.strip() for origin in self.cors_allow_origins.split(",") if origin.strip()]


def check_origin(origin: str) -> None:
    """Raises ConfigError unless ``origin`` is *, or one a browser sends: a scheme
    and a host (and a port), without a path or a slash at its end, which no
    browser's Origin header would ever match."""
    parts = urlsplit(origin)
    if origin == "*" or (
        parts.scheme and parts.netloc and origin == f"{parts.scheme}://{parts.netloc}"
    ):
        return
    raise ConfigError(
        f"CORS_ALLOW_ORIGINS: {origin!r} is no origin a browser sends: write it as "
        "scheme://host[:port] (https://app.example.com), without a path or a trailing "
        "slash, or * for any"
    )


def _is_sendable(key: str) -> bool:
    """Whether a client can send ``key`` as a header value that arrives unchanged:
    HTTP strips the spaces around a value, and header bytes are not UTF-8."""
    return key == key.strip() and all(" " <= c <= "~" for c in key)
