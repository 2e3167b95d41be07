"""Imported once, by the fork server that the supervisor forks workers from
(`worker.launch.warm_start`), never by a worker itself: it imports torch and
transformers and loads the model, so that each worker forked afterwards starts
with all of it in memory, shared copy-on-write.

Whatever goes wrong here is only logged: a worker then loads the model itself,
and reports the same problem where the supervisor's restart policy sees it.
"""

from __future__ import annotations

import logging
import os

from setproctitle import setproctitle

from protocol.lifeline import follow_supervisor
from protocol.logs import log_as
from protocol.settings import ConfigError, load
from worker.engine.fake_engine import FAKE_MODEL_NAME
from worker.launch.warm_start import FORK_SERVER_TITLE
from worker.serve.config import WorkerConfig

log = logging.getLogger(__name__)


def _preload() -> None:
    setproctitle(FORK_SERVER_TITLE)
    # It lives while any worker it forked does (each holds its "alive" pipe): it
    # ends with the supervisor instead (resumed first, if stopped), so that the
    # workers, handed to init, are resumed too and stop themselves.
    follow_supervisor("fork server")
    log_as("fork-server")
    try:
        config = load(WorkerConfig, [], os.environ)
    except ConfigError:
        return  # each worker says what is wrong, and exits
    if config.model_id == FAKE_MODEL_NAME:
        return  # the fake engine needs neither torch nor a model
    try:
        import worker.serve.main  # noqa: F401 - the modules every worker imports
        from worker.serve import load as engine_load

        engine_load.preload(config)
    except ConfigError as exc:  # a model that cannot load: each worker says so, and exits
        log.warning("the model was not preloaded: %s", str(exc).splitlines()[0][:300])
    except KeyboardInterrupt:  # ^C to the process group: the supervisor stops it too
        log.info("preloading interrupted")
    except Exception:  # any other failure only means a cold start
        log.warning(
            "the fork server could not preload the model; each worker loads it itself",
            exc_info=True,
        )


_preload()
