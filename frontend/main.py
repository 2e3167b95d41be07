"""`minibatch-frontend`: serve the HTTP API and forward requests to the worker."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import FrameType

import uvicorn

from frontend.app import create_app
from frontend.config import FrontendConfig
from frontend.http_protocol import with_header_timeout
from frontend.worker_client import WorkerClient
from protocol.lifeline import follow_supervisor
from protocol.settings import ConfigError, exit_refusing, load

# What a stopping frontend gives its requests under way to finish.
GRACEFUL_SHUTDOWN_S = 5


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(name)s: %(message)s"
    )
    follow_supervisor("frontend")
    try:
        config = load(FrontendConfig, argv, description="MiniBatch-LLM HTTP frontend")
    except ConfigError as exc:
        exit_refusing("frontend", exc)
    app = create_app(config)
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=with_header_timeout(config.header_timeout_s),
        timeout_keep_alive=config.keep_alive_timeout_s,
        limit_concurrency=config.max_connections,
    )
    _Server(server_config, app.state.client).run()


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the worker client when its graceful shutdown
    begins (SIGTERM, ^C), so that requests no worker holds are answered then."""

    def __init__(self, config: uvicorn.Config, client: WorkerClient) -> None:
        super().__init__(config)
        self._client = client

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._client.shut_down_soon(self.config.timeout_graceful_shutdown or 0.0)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    main()
