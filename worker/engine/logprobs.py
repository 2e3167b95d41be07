"""Per-token log-probabilities as the engine computes them, and their wire form.

An engine records one `TokenLogprob` per scored token; `pack_logprobs` turns a run of them
into the protocol's `Logprobs`, with every token's text, since the frontend has
no tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from protocol import Logprobs


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    logprob: float  # of the token itself; NaN where there is none (a prompt's first)
    top_token_ids: list[int]  # the likeliest tokens, best first
    top_logprobs: list[float]


UNSCORED = TokenLogprob(math.nan, [], [])


def pack_logprobs(
    token_ids: list[int],
    scores: list[TokenLogprob],
    num_top: int,
    token_text: Callable[[int], str],
    token_bytes: Callable[[int], bytes],
    in_text: list[bool] | None = None,
) -> Logprobs:
    """``scores[i]`` belongs to ``token_ids[i]``; an unscored token gets ``num_top``
    placeholder alternatives (id 0, NaN), so that every token has as many. A
    token not ``in_text`` (all are, by default) travels without bytes."""
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    texts: list[str] = []
    pieces: list[bytes] = []
    for i, (token_id, score) in enumerate(zip(token_ids, scores, strict=True)):
        scored_ids = score.top_token_ids[:num_top]
        missing = num_top - len(scored_ids)
        top_ids += scored_ids + [0] * missing
        top_logprobs += score.top_logprobs[:num_top] + [math.nan] * missing
        texts.append(token_text(token_id))
        texts += [token_text(t) for t in scored_ids] + [""] * missing
        pieces.append(token_bytes(token_id) if in_text is None or in_text[i] else b"")
        pieces += [token_bytes(t) for t in scored_ids] + [b""] * missing
    return Logprobs(
        num_top=num_top,
        token_ids=token_ids,
        logprobs=[score.logprob for score in scores],
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
        texts="".join(texts),
        text_lens=[len(text) for text in texts],
        token_bytes=b"".join(pieces),
        byte_lens=[len(piece) for piece in pieces],
    )
