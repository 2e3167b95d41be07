"""One client request as several worker requests: OpenAI's ``n`` and ``best_of``.

Each choice is a worker request of its own, under an id of its own
(``<request id>-<index>``), so that each keeps what every request has: its place
in the in-flight table, its replay on another worker after a death, its exact
resume, its abort. They go to one worker together (`frontend.dispatch`), which
can prefill their shared prompt once, and the endpoints merge their answers
(`frontend.choice_stream` for streams).

Seeds: choice 0 keeps the request's seed, so that n=1 samples as it always did;
choice i samples with a seed derived from (seed, i), so that the choices differ
from one another and the same request gives the same n answers whatever else is
in the batch. A request without a seed gets one drawn by the frontend
(`frontend.schemas.request_seed`), so its choices differ all the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from frontend.errors import ApiError
from frontend.inflight import InFlight
from protocol import GenerateRequest, GenerateResult
from protocol.limits import MAX_SEED


def num_to_generate(n: int, best_of: int | None, is_stream: bool, max_inflight: int) -> int:
    """How many choices to generate for ``n`` answered: ``best_of`` when set.
    422 when best_of is below n, or when the choices would never fit in the
    frontend's MAX_INFLIGHT_REQUESTS (``max_inflight``) together; 400 when a stream
    asks for more than it shows (the best are known only once all have finished)."""
    if best_of is not None and best_of < n:
        raise ApiError(
            422,
            f"best_of: {best_of} is less than n ({n}); best_of must be at least n",
            "invalid_request",
            "best_of",
        )
    if best_of is not None and best_of > n and is_stream:
        raise ApiError(
            400,
            f"best_of: a stream cannot pick the best {n} of {best_of} choices before they "
            "finish; send stream false, or best_of equal to n",
            "unsupported",
            "best_of",
        )
    num_choices, param = (n, "n") if best_of is None or best_of == n else (best_of, "best_of")
    if num_choices > max_inflight:
        # Each choice is one request in flight: waiting would not make room.
        raise ApiError(
            422,
            f"{param}: {num_choices} choices are {num_choices} requests in flight, more than "
            f"this server ever holds (MAX_INFLIGHT_REQUESTS={max_inflight}); ask for at "
            f"most {max_inflight}",
            "invalid_request",
            param,
        )
    return num_choices


def choice_requests(request: GenerateRequest, num_choices: int) -> list[GenerateRequest]:
    """The worker requests of ``request``'s choices; a lone choice is the request."""
    if num_choices == 1:
        return [request]
    return [
        dataclasses.replace(
            request,
            request_id=f"{request.request_id}-{index}",
            seed=choice_seed(request.seed, index),
        )
        for index in range(num_choices)
    ]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: the request's for choice 0, else a hash of
    (seed, index), which no nearby seed of another request shares (seed + index
    would: seed 5's second choice would be seed 6's first)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


def best_choices(
    entries: Sequence[InFlight], results: Sequence[GenerateResult], n: int
) -> list[int]:
    """The indexes of the ``n`` choices whose output has the highest cumulative
    logprob, best first (the first index of a tie first), as vLLM ranks best_of."""

    def cumulative_logprob(index: int) -> float:
        _, output = entries[index].all_logprobs(results[index])
        return sum(sum(part.logprobs) for part in output)

    return sorted(range(len(results)), key=cumulative_logprob, reverse=True)[:n]
