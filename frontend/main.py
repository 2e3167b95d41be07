"""`minibatch-frontend`: serve the HTTP API and forward requests to the worker."""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from frontend.app import create_app
from frontend.auth import OPEN_PATHS
from frontend.config import FrontendConfig
from frontend.http_protocol import PROBE_ROOM, connection_cap, edge_protocol
from frontend.worker_client import WorkerClient
from protocol.endpoints import probe_binds
from protocol.exit_codes import ExitCode
from protocol.lifeline import follow_supervisor
from protocol.logs import log_as
from protocol.open_files import raise_open_file_limit
from protocol.settings import ConfigError, exit_refusing, load
from protocol.stop_timing import FRONTEND_STOP_GRACE_S
from protocol.throttled import ThrottleWarnings

# Named, not __name__: run as python -m, this module is __main__ to the log.
log = logging.getLogger("frontend.main")

# What a stopping frontend gives its requests under way to finish.
GRACEFUL_SHUTDOWN_S = FRONTEND_STOP_GRACE_S


def main(argv: Sequence[str] | None = None) -> None:
    log_as("frontend")
    follow_supervisor("frontend")
    try:
        config = load(FrontendConfig, argv, description="MiniBatch-LLM HTTP frontend")
        check_can_listen(config.host, config.port)
    except ConfigError as exc:
        exit_refusing("frontend", exc, FrontendConfig, argv)
    log_access(config)
    cap = connection_cap(raise_open_file_limit())
    if cap < config.max_connections + PROBE_ROOM:
        log.warning(
            "the open-file limit (ulimit -n) lets this frontend hold %d connections, fewer "
            "than MAX_CONNECTIONS=%d and %d for the probes: past %d a new connection "
            "closes an idle one, or itself; raise the limit, or lower MAX_CONNECTIONS",
            cap,
            config.max_connections,
            PROBE_ROOM,
            cap,
        )
    app = create_app(config)
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        # uvicorn's own lines through this process's format, which names it:
        # its default "INFO:     Shutting down" could be any frontend's.
        log_config=None,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=edge_protocol(config, app, cap),
        timeout_keep_alive=config.keep_alive_timeout_s,
        limit_concurrency=config.max_connections,
    )
    # uvicorn logs a warning for each malformed request and websocket upgrade, and
    # asyncio an error for each connection it cannot accept: a client could write
    # the log at will.
    logging.getLogger("uvicorn.error").addFilter(ThrottleWarnings())
    logging.getLogger("asyncio").addFilter(ThrottleWarnings())
    server = _Server(server_config, app.state.client)
    # /ready says "full" while every connection uvicorn takes is in use.
    app.state.count_connections = lambda: len(server.server_state.connections)
    app.state.connection_room = cap - PROBE_ROOM
    # SIGHUP (a closed terminal) stops it as SIGTERM does; uvicorn handles only
    # SIGINT and SIGTERM, and SIGHUP's default cut every request in flight.
    signal.signal(signal.SIGHUP, lambda _, frame: server.handle_exit(signal.SIGTERM, frame))
    # Once it has shut down gracefully, uvicorn raises the signal again under the
    # handler that was there before: a stop asked for is a clean exit (0), as
    # the worker's and the supervisor's are, not a process killed by SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(ExitCode.STOPPED))
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn shut down gracefully on ^C, then raised the signal again, as
        # the default handler would: end as a process stopped by ^C does, without
        # the traceback of that re-raise.
        sys.exit(ExitCode.INTERRUPTED)


def log_access(config: FrontendConfig) -> None:
    """Who may use the API, and whether workers are reached with CURVE, said once
    at start: an operator sees whether API_KEY and the CURVE keys took effect
    without sending a request."""
    if config.api_key:
        open_paths = ", ".join(sorted(OPEN_PATHS))
        log.info("API_KEY is set: every path but %s needs 'Authorization: Bearer'", open_paths)
    elif _is_every_address(config.host):  # a container's too: compose publishes its own
        log.info(
            "no API_KEY: anyone who reaches port %d on any address here (HOST=%s; in a "
            "container, wherever its published port leads) may use the API",
            config.port,
            config.host,
        )
    else:
        where = f"[{config.host}]" if ":" in config.host else config.host  # IPv6, bracketed
        log.info("no API_KEY: anyone who reaches %s:%d may use the API", where, config.port)
    if config.curve is not None:
        log.info("CURVE is on: workers are reached with the key in CURVE_CLIENT_SECRET_KEY")


def _is_every_address(host: str) -> bool:
    """0.0.0.0, ::, or another spelling of them (::0, 0:0::0, or 0, as the C
    library reads an IPv4 address)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        pass
    try:
        return socket.inet_aton(host) == bytes(4)
    except OSError:  # a name
        return False


_LISTEN_HINTS = {
    errno.EADDRINUSE: "stop the program that holds it, or set PORT to a free port",
    errno.EADDRNOTAVAIL: "set HOST to an address of this machine (0.0.0.0: all of them)",
    errno.EACCES: "ports below 1024 need privileges; set PORT to 1024 or above",
}


def check_can_listen(host: str, port: int) -> None:
    """Raises ConfigError unless every address uvicorn is about to listen on for
    (host, port) is free. A port another program holds fails at every start, so it
    is refused here, naming the setting, rather than by uvicorn's exit, which the
    supervisor would take for a crash and retry."""
    try:
        probed = probe_binds(host, port, v6only=True)  # as asyncio's server binds
    except (OSError, UnicodeError) as exc:  # UnicodeError: a name no IDNA encodes
        raise ConfigError(
            f"HOST {host!r} is not an address to listen on ({exc}): set HOST to an address "
            "or a name of this machine (0.0.0.0: all of them)"
        ) from exc
    for address, failure in probed:
        if failure is not None:
            hint = _LISTEN_HINTS.get(failure.errno or 0, "check HOST and PORT")
            raise ConfigError(
                f"cannot listen on {address} port {port} (HOST, PORT): {failure.strerror}; {hint}"
            ) from failure


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the worker client when its graceful shutdown
    begins (SIGTERM, ^C), so that requests no worker holds are answered then."""

    def __init__(self, config: uvicorn.Config, client: WorkerClient) -> None:
        super().__init__(config)
        self._client = client
        self._has_ended_all = False  # a second ^C answered every request at once

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT and not self._has_ended_all:
            # A second ^C: uvicorn's "force quit" stopped waiting, and the exit
            # then cut every answer under way (streams with no end, a plain-text
            # 500). Each is answered now instead, as the grace's end would, and
            # the connections close as those answers end. A third forces it.
            self._has_ended_all = True
            self._client.end_all_soon("a second ^C ended it at once")
            return
        self._client.shut_down_soon(self.config.timeout_graceful_shutdown or 0.0)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    main()
