"""`minibatch-worker`: load the engine and serve it on WORKER_ENDPOINT."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from collections.abc import Sequence

from protocol.exit_codes import ExitCode
from protocol.lifeline import follow_supervisor
from protocol.logs import log_as
from protocol.open_files import raise_open_file_limit
from protocol.settings import ConfigError, exit_refusing, load
from worker.engine.fake_engine import FAKE_MODEL_NAME, FakeEngine, FakeEngineConfig
from worker.engine.interface import InferenceEngine
from worker.serve.config import WorkerConfig, check_endpoint_free
from worker.serve.scheduler import Scheduler
from worker.serve.server import WorkerServer

# Named, not __name__: run as python -m, this module is __main__ to the log.
log = logging.getLogger("worker.serve.main")


def build_engine(config: WorkerConfig) -> InferenceEngine:
    if config.model_id == FAKE_MODEL_NAME:
        log.info("worker loading %s", FAKE_MODEL_NAME)
        fake = load(FakeEngineConfig, [])
        time.sleep(fake.fake_start_delay_s)  # a model that takes this long to load
        return FakeEngine(
            config.max_batch_size,
            step_delay_s=fake.fake_step_delay_s,
            crash_prompt=fake.fake_crash_prompt,
            # In chunks, as a real model's prompts go in by default; it has no prefix cache.
            prefill_chunk_tokens=config.prefill_chunk_tokens,
        )
    from worker.serve.load import load_engine  # torch loads only for a real model

    return load_engine(config)


class _StopWhileStarting(BaseException):
    """A stop signal came before the worker served: nothing to hand back. No
    Exception, which the model's loading code may catch."""


def _stop_while_starting(signum: int, _: object) -> None:
    for stop_signal in _STOP_SIGNALS:  # a second one (a double ^C) changes nothing now
        signal.signal(stop_signal, signal.SIG_IGN)
    raise _StopWhileStarting(signal.Signals(signum).name)


# SIGHUP too (a closed terminal): its default ended the worker at once.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: Sequence[str] | None = None) -> None:
    log_as("worker", force=True)  # a worker forked from the fork server inherits its set-up
    # Told to stop while its model loads, a worker stops as it does when serving
    # (exit 0), not killed by the signal or with a KeyboardInterrupt's traceback.
    for stop_signal in _STOP_SIGNALS:
        signal.signal(stop_signal, _stop_while_starting)
    try:
        follow_supervisor("worker")
        # Every peer's connection to its port is a file, a stranger's too.
        raise_open_file_limit()
        config = load(WorkerConfig, argv, description="MiniBatch-LLM engine worker")
        check_endpoint_free(config)
        engine = build_engine(config)
        server = WorkerServer(Scheduler(engine, config.max_queue_depth), config)

        def stop_serving(signum: int, _: object) -> None:
            log.info("worker told to stop (%s); stopping", signal.Signals(signum).name)
            server.stop()

        for stop_signal in _STOP_SIGNALS:
            signal.signal(stop_signal, stop_serving)
    except ConfigError as exc:  # a bad value, or a model or device that cannot be used
        exit_refusing("worker", exc, WorkerConfig, argv)
    except _StopWhileStarting as stop:
        log.info("worker told to stop (%s) while starting; stopped", stop)
        logging.shutdown()
        # At once: an interpreter's shutdown (torch's exit hooks: most of a second)
        # is no time to be in, and nothing of the worker needs closing yet.
        os._exit(ExitCode.STOPPED)
    # `kill -USR1 <pid>`: every thread's stack to the log, for a worker that seems
    # stuck; written by the interpreter's C code, so even a wedged one answers.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        server.serve_forever()
    except ConfigError as exc:  # its endpoint cannot be bound
        exit_refusing("worker", exc, WorkerConfig, argv)


if __name__ == "__main__":
    main()
