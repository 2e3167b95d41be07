"""The worker's packed `Logprobs` as OpenAI's two shapes: the completions
``{tokens, token_logprobs, top_logprobs, text_offset}`` and the chat
``{content: [{token, logprob, bytes, top_logprobs}]}``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from frontend.errors import ApiError
from protocol import Logprobs

# JSON has no -inf; vLLM reports a token the model rules out as -9999.0 too.
_FLOOR = -9999.0
# What a token's text holds for bytes that are only part of a character.
_REPLACED = "\N{REPLACEMENT CHARACTER}"


@dataclass(frozen=True, slots=True)
class TokenScore:
    text: str
    logprob: float | None  # None: unscored (a prompt's first token)
    top: list[tuple[str, float]]  # the likeliest tokens' texts and logprobs, best first


def unpack(logprobs: Logprobs | None) -> list[TokenScore]:
    """One `TokenScore` per token; a 500 if the worker's lists do not agree."""
    if logprobs is None:
        return []
    num_tokens, num_top = len(logprobs.token_ids), logprobs.num_top
    texts = _split(logprobs.texts, logprobs.text_lens)
    is_whole = (
        num_top >= 0
        and len(logprobs.logprobs) == num_tokens
        and len(logprobs.top_token_ids) == len(logprobs.top_logprobs) == num_tokens * num_top
        and len(texts) == num_tokens * (1 + num_top)
    )
    if not is_whole:
        raise ApiError(500, "the worker sent logprobs whose lists do not agree", "internal")
    scores = []
    for i, logprob in enumerate(logprobs.logprobs):
        row = texts[i * (1 + num_top) : (i + 1) * (1 + num_top)]
        tops = logprobs.top_logprobs[i * num_top : (i + 1) * num_top]
        scored = not math.isnan(logprob)
        top = (
            [(text, _finite(lp)) for text, lp in zip(row[1:], tops, strict=True)] if scored else []
        )
        scores.append(TokenScore(row[0], _finite(logprob) if scored else None, top))
    return scores


def completion_logprobs(
    scores: list[TokenScore], text: str, text_offset: int = 0
) -> dict[str, Any]:
    """OpenAI's completions logprobs for the tokens that make ``text``, which
    starts at ``text_offset`` of the choice's whole text. As OpenAI's, each
    top_logprobs entry also holds the token itself."""
    return {
        "tokens": [score.text for score in scores],
        "token_logprobs": [score.logprob for score in scores],
        "top_logprobs": [_top_map(score) for score in scores],
        "text_offset": token_offsets([score.text for score in scores], text, text_offset),
    }


def token_offsets(token_texts: list[str], text: str, start: int = 0) -> list[int]:
    """Where each token begins in ``text``, the tokens' text (plus ``start``).

    A token may hold only some of a character's bytes: alone, those decode to
    U+FFFD, which ``text`` does not hold, and summing the tokens' lengths would
    put every later token too far. A token that begins a split character is
    placed where its whole part ends (the character's start), the tokens that
    continue it there too, and the text goes on after the first whole text found
    past it: k such tokens make at most k characters."""
    offsets = []
    pos = 0
    num_partial = 0  # tokens in a split character so far
    for token_text in token_texts:
        if num_partial:
            tail = token_text.lstrip(_REPLACED)  # whatever whole text follows the bytes
            found = -1
            if tail and _REPLACED not in tail:
                found = text.find(tail, pos, pos + num_partial + len(token_text))
            offsets.append(start + min(pos, len(text)))
            if found >= 0:
                if tail == token_text:  # not part of the character: it begins after it
                    offsets[-1] = start + found
                pos, num_partial = found + len(tail), 0
            else:
                num_partial += 1
            continue
        offsets.append(start + min(pos, len(text)))
        if text.startswith(token_text, pos):
            pos += len(token_text)
            continue
        whole = token_text.rstrip(_REPLACED)  # the " " of a " \xf0\x9f" token
        if whole and text.startswith(whole, pos):
            pos += len(whole)
        num_partial = 1
    return offsets


def chat_logprobs(scores: list[TokenScore]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_chat_token(score.text, score.logprob or 0.0),
                "top_logprobs": [_chat_token(text, lp) for text, lp in score.top],
            }
            for score in scores
        ]
    }


def _top_map(score: TokenScore) -> dict[str, float] | None:
    if score.logprob is None:
        return None
    top = dict(score.top)
    top.setdefault(score.text, score.logprob)
    return top


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR)


def _split(texts: str, lengths: list[int]) -> list[str]:
    pieces = []
    start = 0
    for length in lengths:
        pieces.append(texts[start : start + length])
        start += length
    return pieces if start == len(texts) else []
