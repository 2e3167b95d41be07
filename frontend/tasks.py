"""Background tasks of the frontend, which end the process if they fail."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine, Iterable
from typing import Any

from protocol.exit_codes import ExitCode

log = logging.getLogger(__name__)


def start_task(coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """Run ``coroutine`` in the background; if it raises, the frontend exits."""
    task = asyncio.create_task(coroutine, name=name)
    task.add_done_callback(_exit_if_failed)
    return task


async def stop_tasks(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until each has ended."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _exit_if_failed(task: asyncio.Task[None]) -> None:
    """A background task that ends by an exception leaves the frontend half alive
    (no replies, or no liveness): end the process loudly so that it is replaced."""
    if task.cancelled() or task.exception() is None:
        return
    log.critical(
        "background task %s failed; exiting so that the frontend is restarted",
        task.get_name(),
        exc_info=task.exception(),
    )
    logging.shutdown()
    os._exit(ExitCode.THREAD_DIED)
