"""Long prompts tokenized while their requests wait in the queue, on a thread of
their own, so that the engine thread never waits on one.

Tokenizing is the part of admitting a request whose cost its client sets: a text
of 131,000 characters took 50 to 90 ms to tokenize on a 2-vCPU Xeon, only to be
refused for the context window, and 16 clients sending such prompts in a loop
held a stream's tokens up to 1.45 s apart, every step waiting on them. A text
longer than `INLINE_PROMPT_CHARS` (a conversation's contents, summed) is now
rendered and tokenized on this thread, at the lowest priority, and the
scheduler admits its request once that is done (`InferenceEngine.prepare`);
the batch steps on meanwhile. A shorter one is tokenized at admission, where
the hand-off would cost more than the work (a step's wait).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from protocol import GenerateRequest

# Characters of text tokenized on the engine thread at admission: about 1 ms at
# most (GPT-2's BPE took 0.4 to 0.7 us a character on random text), and more
# than most prompts have.
INLINE_PROMPT_CHARS = 2048
# The thread's nice value, the lowest priority: it runs on what torch's threads
# leave. At normal priority it took one of their two cores, and a flood of
# refused prompts still held a stream's tokens 0.9 to 1.5 s apart (against
# 0.5 to 0.6 s niced; docs/performance.md). A long prompt then waits longer
# for its turn only on a machine busy with other work.
PROMPTS_NICE = 19

# A request's prompt as token ids, and its text (a conversation as rendered)
# unless it came as ids.
PromptTokens = tuple[list[int], str | None]


class PromptTokenizer:
    """Tokenizes requests' prompts with ``tokenize`` (which raises RequestRejected
    for a prompt it refuses): long ones on a thread of its own, started by
    `prepare`, short ones when asked for. The thread starts with the first long
    prompt: nothing starts before a warm start's fork."""

    def __init__(self, tokenize: Callable[[GenerateRequest], PromptTokens]) -> None:
        self._tokenize = tokenize
        self._thread: ThreadPoolExecutor | None = None
        # By request id, each started by `prepare`; touched by the engine thread
        # only. At most the queued requests the scheduler prepares: each is
        # forgotten once admitted, refused or gone from the queue.
        self._started: dict[str, Future[PromptTokens]] = {}

    def __len__(self) -> int:
        """Prompts started and not yet forgotten."""
        return len(self._started)

    def prepare(self, request: GenerateRequest) -> bool:
        """Start tokenizing ``request``'s prompt if it is long; return whether
        `take` would not wait (it does not for a short prompt, nor one done,
        refused included)."""
        future = self._started.get(request.request_id)
        if future is None:
            if prompt_chars(request) <= INLINE_PROMPT_CHARS:
                return True
            if self._thread is None:
                self._thread = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="prompts", initializer=_yield_to_the_engine
                )
            future = self._started[request.request_id] = self._thread.submit(
                self._tokenize, request
            )
        return future.done()

    def take(self, request: GenerateRequest) -> PromptTokens:
        """``request``'s prompt tokens: what `prepare` started (waited for), else
        tokenized here. Raises what ``tokenize`` raised. Kept until `forget`, so
        that an admission tried again does not tokenize again."""
        future = self._started.get(request.request_id)
        return self._tokenize(request) if future is None else future.result()

    def forget(self, request: GenerateRequest) -> None:
        """Drop ``request``'s prompt tokens (it was admitted, refused, or left the
        queue), and its tokenizing if that has not started."""
        future = self._started.pop(request.request_id, None)
        if future is not None:
            future.cancel()


def prompt_chars(request: GenerateRequest) -> int:
    """Characters ``request`` gives to tokenize: its text, or its conversation's
    roles and contents; none when its prompt comes as token ids."""
    if request.prompt_token_ids is not None:
        return 0
    if request.chat_roles:
        return sum(map(len, request.chat_roles)) + sum(map(len, request.chat_contents))
    return len(request.prompt)


def _yield_to_the_engine() -> None:
    """Lower this thread's priority, so that it takes the cores that torch's
    threads leave, not theirs: a step waits for its slowest thread, and one
    preempted by a prompt's tokenizing held it up. Linux only: there a thread
    has a nice value of its own, under its thread id (elsewhere that id could
    name another process)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROMPTS_NICE)
