"""`minibatch-frontend`: serve the HTTP API and forward requests to the worker."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from frontend.app import create_app
from frontend.config import FrontendConfig
from frontend.http_protocol import with_header_timeout
from protocol.settings import ConfigError, load


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load(FrontendConfig, argv, description="MiniBatch-LLM HTTP frontend")
    except ConfigError as exc:
        sys.exit(f"frontend: configuration error: {exc}")
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
        http=with_header_timeout(config.header_timeout_s),
        timeout_keep_alive=config.keep_alive_timeout_s,
        limit_concurrency=config.max_connections,
    )


if __name__ == "__main__":
    main()
