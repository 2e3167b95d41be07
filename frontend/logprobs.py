"""The worker's packed `Logprobs` as OpenAI's two shapes: the completions
``{tokens, token_logprobs, top_logprobs, text_offset}`` and the chat
``{content: [{token, logprob, bytes, top_logprobs}]}``."""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from protocol import Logprobs

# JSON has no -inf; vLLM reports a token the model rules out as -9999.0 too.
_FLOOR = -9999.0
_Text = TypeVar("_Text", str, bytes)
_REPLACED = "\N{REPLACEMENT CHARACTER}"  # what bytes that make no character decode to


class Candidate(NamedTuple):
    """One of the likeliest tokens at a position."""

    text: str
    logprob: float
    bytes: bytes


@dataclass(frozen=True, slots=True)
class TokenScore:
    text: str  # U+FFFD where the token holds only part of a character
    bytes: bytes  # what the token adds to the text: none for an end or stop token
    logprob: float | None  # None: unscored (a prompt's first token)
    top: list[Candidate]  # the likeliest tokens, best first


def unpack_logprobs(logprobs: Logprobs | None) -> list[TokenScore]:
    """One `TokenScore` per token (the lists agree: `Logprobs` checks them)."""
    if logprobs is None:
        return []
    num_top = logprobs.num_top
    texts = _split(logprobs.texts, logprobs.text_lens)
    pieces = _split(logprobs.token_bytes, logprobs.byte_lens)
    scores = []
    for i, logprob in enumerate(logprobs.logprobs):
        row = slice(i * (1 + num_top), (i + 1) * (1 + num_top))
        tops = logprobs.top_logprobs[i * num_top : (i + 1) * num_top]
        scored = not math.isnan(logprob)
        top = (
            [
                Candidate(text, _finite(lp), piece)
                for text, piece, lp in zip(texts[row][1:], pieces[row][1:], tops, strict=True)
            ]
            if scored
            else []
        )
        first = row.start
        scores.append(
            TokenScore(texts[first], pieces[first], _finite(logprob) if scored else None, top)
        )
    return scores


class TextOffsets:
    """Where each token begins in the text that the tokens' bytes make, decoded in
    turn: the characters complete before its first byte. A token that begins
    inside a character (CJK and emoji are often split over two tokens) is placed
    where that character begins. One is kept across a stream's chunks, so that a
    stream's offsets are the whole answer's."""

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = start

    def place(self, scores: list[TokenScore]) -> list[int]:
        offsets = []
        for score in scores:
            offsets.append(self._num_chars + self._num_ended_by(score.bytes[:1]))
            self._num_chars += len(self._decoder.decode(score.bytes))
        return offsets

    def _num_ended_by(self, first_byte: bytes) -> int:
        """The characters that bytes held back (the start of a character) make
        once ``first_byte`` shows that they never complete: a U+FFFD before the
        token, which the decoder writes only with the token's own text."""
        held, _ = self._decoder.getstate()
        if not held or not first_byte:
            return 0
        probe = codecs.getincrementaldecoder("utf-8")(errors="replace")
        written = probe.decode(held + first_byte)
        if written == "" or (len(written) == 1 and written != _REPLACED):
            return 0  # the first byte goes on with the held character
        return len(codecs.decode(held, "utf-8", errors="replace"))


def completion_logprobs(scores: list[TokenScore], offsets: list[int]) -> dict[str, Any]:
    """OpenAI's completions logprobs for these tokens, placed at ``offsets``
    (`TextOffsets`). As OpenAI's, each top_logprobs entry also holds the token
    itself."""
    return {
        "tokens": [_completion_name(score.text, score.bytes) for score in scores],
        "token_logprobs": [score.logprob for score in scores],
        "top_logprobs": [_top_map(score) for score in scores],
        "text_offset": offsets,
    }


def chat_logprobs(scores: list[TokenScore]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_chat_token(score.text, score.logprob or 0.0, score.bytes),
                "top_logprobs": [_chat_token(*candidate) for candidate in score.top],
            }
            for score in scores
        ]
    }


def _top_map(score: TokenScore) -> dict[str, float] | None:
    if score.logprob is None:
        return None
    top = {_completion_name(c.text, c.bytes): c.logprob for c in score.top}
    top.setdefault(_completion_name(score.text, score.bytes), score.logprob)
    return top


def _completion_name(text: str, piece: bytes) -> str:
    """A token's name in completions' logprobs, whose top_logprobs are keyed by
    it: its text, or for one that holds only part of a character, whose text is
    U+FFFD as any other such token's (so that they overwrote one another's entry,
    the chosen token's own among them), its bytes: ``bytes:\\xe6\\x9d``."""
    if _REPLACED not in text:
        return text
    try:
        piece.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)
    return text  # a U+FFFD the model wrote: a character of its own


def _chat_token(text: str, logprob: float, piece: bytes) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(piece)}


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR)


def _split(joined: _Text, lengths: list[int]) -> list[_Text]:
    pieces = []
    start = 0
    for length in lengths:
        pieces.append(joined[start : start + length])
        start += length
    return pieces if start == len(joined) else []
