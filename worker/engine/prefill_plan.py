"""Which context tokens of the newcomers still prefilling go into the model this
step (chunked prefill, `PREFILL_CHUNK_TOKENS`), and the aligned blocks prompts
are computed in."""

from __future__ import annotations

from typing import NamedTuple

from worker.engine.prefix_cache import PrefixCache
from worker.engine.sequence import Sequence


class Chunk(NamedTuple):
    """A sequence and the context positions [start, end) to run into its slot."""

    seq: Sequence
    start: int
    end: int


# Context tokens one pass over the model takes at most, when a step prefills more
# (whole prompts, or chunks while no stream waits): a step's prefill runs in such
# passes, each counted as progress by heartbeats, since one pass of 64 prompts of
# 950 tokens took over 30 s on a 2-core EPYC, past the clients' STEP_TIMEOUT_S, and the
# worker was taken for hung. Past a few thousand rows no product gets faster.
PREFILL_PASS_TOKENS = 2048

# A prompt's attention is computed in aligned blocks of this many positions
# (`GPT2.prefill`): a block's keys then depend only on the tokens up to it, so
# the prefix cache can reuse any whole block. Small, as vLLM's 16-token blocks,
# so that a shared prefix leaves little of itself to compute again.
BLOCK_TOKENS = 16


def block_tokens_for(chunk_tokens: int) -> int:
    """The block for a chunk budget of ``chunk_tokens`` (0: whole prompts): never
    larger than the budget, which must hold at least one whole block."""
    return min(BLOCK_TOKENS, chunk_tokens) if chunk_tokens > 0 else BLOCK_TOKENS


def plan_chunks(
    prefilling: list[tuple[Sequence, int]],
    budget: int,
    block: int,
    holds_up_streams: bool,
    cache: PrefixCache | None,
    scored_budget: int,
    scored_token_cost: float = 1.0,
) -> list[Chunk]:
    """This step's chunks for ``prefilling`` (each newcomer with how many of its
    context tokens are in its slot, oldest first): up to ``budget`` more context
    tokens in all, of which each newcomer after the first takes at most a
    ``block``; every token when no stream would be held up (``holds_up_streams``
    False), since then one large prefill is the fastest. A step's first tokens
    leave only once its whole prefill is done, so newer prompts computed beside
    the oldest's would hold its first token back; and newcomers that went in
    together would stay in step (the same output lengths end them together and
    their clients' next requests arrive together), each step then prefilling
    several of them. A block apiece still moves them along.

    A resumed sequence goes in whole whatever the budget: its client is already
    waiting mid-stream (it is a running stream itself, and the sooner every
    resumed one is back the shorter the stall its worker's death caused). A
    prompt to be scored goes in chunks as any other, each scoring its own
    positions: whole, one 1,020-token prompt held every stream about 1 s on a
    quiet 2-core Xeon, and the 8 choices of one such request, all in one step,
    20 to 40 s loaded. Each of its tokens takes ``scored_token_cost`` of the
    budget (the LM head runs at its position too: about 1.9 tokens' work for
    distilgpt2), so that a step stalls the streams about as long either way.
    With no stream held up, a step still scores at most ``scored_budget``
    prompt tokens: 8 such choices in one step made steps of 14 s on a loaded
    Xeon, in which a worker told to stop could not act, nor a newcomer start.

    A chunk inside a prompt ends on a multiple of ``block`` (at most
    ``budget``): the engine computes a prompt's attention in those blocks
    whatever the chunks (over another split it differs in its last bits), so a
    prompt's keys are the same whether it went in beside streams, alone, or
    resumed after a worker's death; which is also what lets the prefix cache
    share them. A newcomer whose next rows an older one computes this step waits
    for them (`_waits_for_shared_rows`)."""
    chunks: list[Chunk] = []
    scored_left = scored_budget
    for seq, done in prefilling:
        if cache is not None and _waits_for_shared_rows(seq, done, chunks, cache):
            continue
        end = len(seq.context_token_ids)
        cost = scored_token_cost if seq.wants_prompt_logprobs else 1.0
        if holds_up_streams and not seq.is_resumed:
            allowed = int((min(budget, block) if chunks else budget) / cost)
            # The oldest always moves by a block at least.
            end = min(end, done + (allowed if chunks else max(allowed, block)))
        elif seq.wants_prompt_logprobs:  # never a resumed one
            end = min(end, done + scored_left)
        if end < len(seq.prompt_token_ids):
            end = end // block * block
        if end <= done:
            continue
        chunks.append(Chunk(seq, done, end))
        budget -= round((end - done) * cost)
        if seq.wants_prompt_logprobs:
            scored_left -= end - done
    return chunks


def _waits_for_shared_rows(
    seq: Sequence, done: int, chunks: list[Chunk], cache: PrefixCache
) -> bool:
    """Whether ``seq``'s next rows are being computed this step by an older
    newcomer whose prompt begins the same way: it takes them from that slot next
    step instead of computing them twice (the n choices of one request, a burst
    of requests with one system prompt)."""
    if seq.scores_prompt:
        return False
    for other, _, end in chunks:
        if not other.scores_prompt and other.cache_salt == seq.cache_salt:
            written = min(end, len(other.prompt_token_ids))
            rows = other.prompt_token_ids[:written]
            is_whole = written == len(other.prompt_token_ids)
            if cache.num_shared(seq.prompt_token_ids, rows, is_whole) > done:
                return True
    return False
