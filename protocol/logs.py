"""How every process of the server logs: INFO and up, to stderr, each line
naming its process and pid, so that the interleaved output of `minibatch-serve`
(or of a compose stack) says who wrote what:

    2026-12-06 21:00:00,000 worker[4242] INFO worker.serve.server: ...
"""

from __future__ import annotations

import logging


def log_as(process: str, force: bool = False) -> None:
    """Set up this process's logging as ``process`` (``frontend``, ``worker``,
    ``fork-server``, ``supervisor``). ``force``: replace a set-up inherited
    (a worker forked from the fork server)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {process}[%(process)d] %(levelname)s %(name)s: %(message)s",
        force=force,
    )
