"""A seeded, variable-length workload shared by the engine, ZMQ and HTTP benchmarks.

Prompts are text built from a fixed list of common English words, each about one
GPT-2 token, so prompt lengths vary as asked whichever path carries them; output
lengths are drawn from a few budgets, so static batching waits on its longest row.
Every request ignores EOS, so it delivers exactly its budget on every path and
server, and the token counts of two runs compare.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from protocol import GenerateRequest

MAX_NEW_TOKENS_CHOICES = (8, 16, 32, 48)

_WORD_TEXT = (
    "the of and to in is was for that with as on by at from his her this which but "
    "not are they be had have one all were when an their there she been has more "
    "time would will who so if out no into up what about than some could them other "
    "new can only these its two may first then do any like my now over such our man "
    "me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
)
_WORDS = _WORD_TEXT.split()


def words(rng: random.Random, num: int) -> str:
    """``num`` common words, drawn with ``rng``: about as many GPT-2 tokens."""
    return " ".join(rng.choice(_WORDS) for _ in range(num))


def make_workload(
    num_requests: int = 32,
    seed: int = 0,
    prompt_words: tuple[int, int] = (16, 160),
    max_new_tokens_choices: Sequence[int] = MAX_NEW_TOKENS_CHOICES,
    ignore_eos: bool = True,
) -> list[GenerateRequest]:
    """``num_requests`` greedy requests: prompts of ``prompt_words`` (inclusive range)
    words, max_new_tokens drawn from ``max_new_tokens_choices``; same seed, same list."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        num_words = rng.randint(*prompt_words)
        prompt = words(rng, num_words).capitalize()
        requests.append(
            GenerateRequest(
                request_id=f"bench-{i}",
                prompt=prompt,
                max_new_tokens=rng.choice(list(max_new_tokens_choices)),
                ignore_eos=ignore_eos,
            )
        )
    return requests
