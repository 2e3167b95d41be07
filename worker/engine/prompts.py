"""Long text prompts read off the engine thread.

A request may carry 131,072 characters of prompt (a context window of tokens of
the longest text), and tokenizing that many took 0.1 s as English words and
1.1 s as emoji on the Xeon here (loaded), only to refuse it for length. At
admission, on the engine thread, no stream advanced meanwhile. Hugging Face's
tokenizers let go of the GIL while they encode, so on a thread of their own
the steps go on beside them. A short prompt, the usual kind, is read at
admission as before: it takes a millisecond or two, less than a hand-off to a
thread would delay it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from protocol import GenerateRequest
from worker.engine.admission import Prompt

# Characters of text (or a conversation's contents) from which a prompt is read on
# the prompt thread: 4,096 emoji tokenize in about 5 ms on the Xeon, loaded.
INLINE_PROMPT_CHARS = 4096


class PromptReader:
    """Reads queued requests' long prompts on a thread of its own, started with
    the first such prompt (nothing starts before a warm start's fork), and hands
    each to admission. Holds only the prompts of requests the scheduler prepares
    (a bounded window of its queue), until each is admitted or aborted."""

    def __init__(self, read: Callable[[GenerateRequest], Prompt]) -> None:
        self._read = read  # raises RequestRejected; its future keeps that for `take`
        self._thread: ThreadPoolExecutor | None = None
        # By request id; touched by the engine thread only.
        self._reading: dict[str, tuple[GenerateRequest, Future[Prompt]]] = {}

    def prepare(self, request: GenerateRequest) -> bool:
        """Start reading ``request``'s prompt if it is long and not started;
        return whether `take` would return at once."""
        if _prompt_chars(request) < INLINE_PROMPT_CHARS:
            return True
        entry = self._reading.get(request.request_id)
        if entry is None or entry[0] is not request:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt")
            entry = self._reading[request.request_id] = (
                request,
                self._thread.submit(self._read, request),
            )
        return entry[1].done()

    def cancel(self, request: GenerateRequest) -> None:
        """Forget ``request``'s prompt, which left the queue unadmitted (aborted)."""
        entry = self._reading.pop(request.request_id, None)
        if entry is not None:
            entry[1].cancel()  # a read that has begun runs out; its result is dropped

    def take(self, request: GenerateRequest) -> Prompt:
        """``request``'s prompt, read on the thread if `prepare` started it (waiting
        for it if it is not done), else here. Raises RequestRejected."""
        entry = self._reading.pop(request.request_id, None)
        if entry is None or entry[0] is not request:
            return self._read(request)
        return entry[1].result()


def _prompt_chars(request: GenerateRequest) -> int:
    if request.chat_roles:
        return sum(len(content) for content in request.chat_contents)
    return len(request.prompt)
