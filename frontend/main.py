"""`minibatch-frontend`: serve the HTTP API and forward requests to the worker."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from frontend.app import create_app
from protocol.config import ConfigError, FrontendConfig, load


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
    )


if __name__ == "__main__":
    main()
