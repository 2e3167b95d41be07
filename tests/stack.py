"""The local stack (`bench.stack`) as the tests run it: the fake engine, and
liveness tuned so that restart tests run in seconds, not minutes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import openai

from bench import stack as local
from bench.stack import ENTRY_POINTS, Stack, first_of_free_ports, free_port

FAST_LIVENESS = {
    "HEARTBEAT_INTERVAL_S": "0.1",
    "PING_INTERVAL_S": "0.1",
    "HEARTBEAT_TIMEOUT_S": "1.0",
    "STEP_TIMEOUT_S": "2.0",
    "RESTART_BACKOFF_S": "0.2",
}

__all__ = ["ENTRY_POINTS", "Stack", "first_of_free_ports", "free_port"]


def stack_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    return local.stack_env({"MODEL_ID": "fake", **FAST_LIVENESS, **(overrides or {})})


@contextmanager
def running_stack(
    tmp_path: Path,
    overrides: Mapping[str, str] | None = None,
    supervised: bool = True,
    start: tuple[str, ...] = ("worker", "frontend"),
) -> Iterator[Stack]:
    """The stack under the supervisor, or its processes started alone."""
    with local.running_stack(tmp_path, stack_env(overrides), supervised, start) as stack:
        yield stack


@contextmanager
def live_stack(tmp_path: Path, overrides: Mapping[str, str] | None = None) -> Iterator[Stack]:
    """A worker and a frontend, started alone and live."""
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        yield stack


@contextmanager
def openai_client(stack: Stack) -> Iterator[openai.OpenAI]:
    """The official client on ``stack``; it never retries behind a test's back."""
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        yield client
