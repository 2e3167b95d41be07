"""An OpenAI stream of one or more choices (``n``): each choice's chunks as they
arrive, interleaved and each with its ``index``; once every choice has sent its
finish chunk, the usage chunk (with include_usage) counting them all, then
``data: [DONE]``. An error in any choice ends the stream with an error event
and ``[DONE]``; the other choices are aborted (`frontend.accepted`).

The endpoints bring the chunks of one choice (`ChoiceChunks`); this module
merges them, so that the completions and chat streams end the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from frontend.errors import ApiError, error_body
from frontend.openai_common import Envelope, UsageStream, results_usage
from frontend.streaming import sse_frame
from protocol import GenerateResult, TokenDelta


class ChoiceChunks(Protocol):
    """One choice's chunks, each carrying the choice's index."""

    def delta(self, delta: TokenDelta) -> str | None:
        """The chunk for one delta, or None to send nothing for it."""

    def final(self, result: GenerateResult) -> list[str]:
        """The chunks that end the choice (its finish reason)."""


class ChoiceStream:
    """A `frontend.streaming.StreamFormat` for OpenAI's endpoints."""

    def __init__(
        self,
        envelope: Envelope,
        chunk_kind: str,
        usage: UsageStream,
        num_choices: int,
        choice: Callable[[int], ChoiceChunks],
    ) -> None:
        """``choice(index)`` makes choice ``index``'s chunks; they share ``usage``,
        so that continuous usage counts every choice's tokens so far."""
        self.envelope = envelope
        self.chunk_kind = chunk_kind
        self.usage = usage
        self.choices = [choice(index) for index in range(num_choices)]

    def delta(self, index: int, delta: TokenDelta) -> str | None:
        return self.choices[index].delta(delta)

    def final(self, index: int, result: GenerateResult) -> list[str]:
        return self.choices[index].final(result)

    def end(self, results: list[GenerateResult]) -> list[str]:
        frames = []
        if self.usage.is_final:
            chunk = self.envelope.wrap(self.chunk_kind, [], results_usage(results))
            frames.append(sse_frame(chunk))
        return [*frames, sse_frame("[DONE]")]

    def error(self, error: ApiError) -> list[str]:
        return [sse_frame(error_body(error)), sse_frame("[DONE]")]
