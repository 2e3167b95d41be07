"""Which prompt rows each KV-cache slot holds, for reuse by later prompts.

A sequence's keys and values stay in its slot after it leaves, until the slot
is needed. A newcomer whose prompt begins with tokens some slot holds takes
those rows instead of computing them: in place when the slot is free, or copied
within the cache tensor from a busy one. Matching is per slot, as llama.cpp's
server does it; there are as many entries as slots, so nothing grows.
Rows are shared only between prompts of the same salt (a request's
``cache_salt``, "" without one): one tenant's prompts never serve another's.

Only rows that prefill wrote in whole aligned blocks of ``block`` tokens are
reused, never rows written by decode: the engine prefills every prompt in those
blocks (see `worker.engine.prefill_plan`), so a block's keys depend only on the
tokens up to it, and a reused row is bit for bit the row the newcomer would
have computed. Output with the cache is then the output without it, and a
request resumed on another worker is still exact. A newcomer always computes
its own last block, whose logits give its first token, unless a slot holds its
whole prompt and the logits after it (`Entry.is_whole`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Entry:
    """One slot's reusable rows: the prompt tokens at positions 0.. whose keys and
    values prefill wrote there."""

    token_ids: list[int] = field(default_factory=list)
    salt: str = ""  # of the prompt that wrote them
    # The rows are a whole prompt and the engine kept the logits after it.
    is_whole: bool = False
    last_used: int = -1  # when a sequence last left the slot; -1: never


@dataclass(frozen=True, slots=True)
class Match:
    slot: int
    num_tokens: int  # rows to take from that slot
    is_whole: bool  # the whole prompt, and the logits after it


class PrefixCache:
    def __init__(self, num_slots: int, block: int) -> None:
        if block <= 0:
            raise ValueError(f"a prefix cache needs a block of at least 1 token, got {block}")
        self.block = block
        self._entries = [Entry() for _ in range(num_slots)]
        self._clock = 0

    def num_reusable(self, prompt: Sequence[int], slot: int, *, salt: str = "") -> int:
        """How many of ``prompt``'s first rows may be taken from ``slot``: whole
        blocks of the longest common prefix, leaving at least the prompt's last
        token to compute; or all of them when the slot holds exactly this prompt
        with its logits. None from rows of another ``salt``."""
        entry = self._entries[slot]
        if entry.salt != salt:
            return 0
        return self.num_shared(prompt, entry.token_ids, entry.is_whole)

    def num_shared(self, prompt: Sequence[int], rows: Sequence[int], is_whole: bool) -> int:
        """How many of ``prompt``'s first rows could be taken from a slot holding
        the rows of ``rows`` (``is_whole``: a whole prompt, with its logits)."""
        if is_whole and _equal(rows, prompt):
            return len(prompt)
        shared = _common_prefix(rows, prompt)
        return min(shared, len(prompt) - 1) // self.block * self.block

    def best_match(
        self, prompt: Sequence[int], slots: Sequence[int] | None = None, *, salt: str = ""
    ) -> Match | None:
        """The slot (of ``slots``, default all) with the most rows to reuse for
        ``prompt`` of ``salt``; None when none has any."""
        best: Match | None = None
        for slot in range(len(self._entries)) if slots is None else slots:
            num_tokens = self.num_reusable(prompt, slot, salt=salt)
            if num_tokens and (best is None or num_tokens > best.num_tokens):
                is_whole = num_tokens == len(prompt)
                best = Match(slot, num_tokens, is_whole)
        return best

    def choose_free_slot(
        self, prompt: Sequence[int] | None, free: Sequence[int], *, salt: str = ""
    ) -> int:
        """The free slot for a newcomer: the one holding most of its ``prompt``
        (None: one that will reuse nothing), unless the newcomer would overwrite
        rows there that it does not use while another free slot is empty or was
        used longer ago (it then takes that one and the rows by copy, and the
        longer prompt stays: A, then B sharing its system prompt, then A's next
        turn finds all of A); else an empty one, else the least recently used,
        so that recent prompts stay longest."""

        def last_used(slot: int) -> int:
            return self._entries[slot].last_used

        empty = [slot for slot in free if not self._entries[slot].token_ids]
        match = None if prompt is None else self.best_match(prompt, free, salt=salt)
        if match is None:
            return min(empty or free, key=last_used)
        others = [slot for slot in free if slot != match.slot]
        uses_all = match.num_tokens == self.num_rows_held(match.slot)
        if uses_all or not others:
            return match.slot
        other = min(empty or others, key=last_used)
        return other if other in empty or last_used(other) < last_used(match.slot) else match.slot

    def claim(self, slot: int, prompt: Sequence[int], *, salt: str = "") -> None:
        """A newcomer took ``slot``: only the rows it reuses in place stay valid,
        since it overwrites the rest."""
        num_tokens = self.num_reusable(prompt, slot, salt=salt)
        entry = self._entries[slot]
        entry.is_whole = entry.is_whole and num_tokens == len(prompt)
        entry.salt = salt
        del entry.token_ids[num_tokens:]

    def copied(self, source: Match, slot: int) -> None:
        """``slot`` received ``source``'s rows; the source counts as just used."""
        entry, other = self._entries[slot], self._entries[source.slot]
        entry.token_ids = other.token_ids[: source.num_tokens]
        entry.is_whole = source.is_whole
        entry.salt = other.salt
        self.released(source.slot)

    def written(self, slot: int, prompt: Sequence[int], end: int, *, salt: str = "") -> None:
        """Prefill wrote ``prompt``'s rows up to ``end`` into ``slot`` (the logits
        after it kept when that is the whole prompt)."""
        entry = self._entries[slot]
        entry.token_ids = list(prompt[:end])
        entry.is_whole = end == len(prompt)
        entry.salt = salt

    def forget(self, slot: int) -> None:
        """``slot``'s rows can no longer be trusted (they were not all written by
        aligned prefill, or a failed step may have left them half written)."""
        self._entries[slot].token_ids = []
        self._entries[slot].is_whole = False

    def forget_all(self) -> None:
        for slot in range(len(self._entries)):
            self.forget(slot)

    def released(self, slot: int) -> None:
        """A sequence left ``slot`` (or its rows were just reused): its rows are
        the last to be evicted."""
        self._clock += 1
        self._entries[slot].last_used = self._clock

    def num_rows_held(self, slot: int) -> int:
        return len(self._entries[slot].token_ids)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    num = min(len(a), len(b))
    for i in range(num):
        if a[i] != b[i]:
            return i
    return num


def _equal(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and _common_prefix(a, b) == len(a)
