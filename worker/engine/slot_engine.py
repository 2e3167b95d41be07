"""Slot bookkeeping shared by every engine: admission checks, slot allocation,
finishing and streaming deltas, and the schedule of chunked prefill. A subclass
computes next tokens: `_decode`, and the chunk hooks (`_start_prefill`,
`_prefill_chunks`), which serve chunked prefill and whole prompts alike (one
without them, a test's, overrides `_prefill`). The prefix cache needs the hooks
that copy rows and keep logits too (`_copy_rows`, `_first_token_from_kept_logits`),
which the torch engine implements and the fake one does not."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from typing import TypeVar

from protocol import ErrorCode, FinishReason, GenerateRequest, Logprobs, TokenDelta
from protocol.request_checks import sampling_problem
from protocol.throttled import Throttled
from worker.engine.admission import new_sequence, tokenize_prompt
from worker.engine.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, jinja_template
from worker.engine.grammar import Grammars
from worker.engine.interface import (
    FinishedSequence,
    InferenceEngine,
    ModelInfo,
    RequestRejected,
    StepOutput,
)
from worker.engine.logprobs import TokenLogprob, pack_logprobs
from worker.engine.prefill_plan import PREFILL_PASS_TOKENS, Chunk, block_tokens_for, plan_chunks
from worker.engine.prefix_cache import Match, PrefixCache
from worker.engine.prompt_tokens import PromptTokenizer, PromptTokens
from worker.engine.sequence import Sequence, Tokenizer

log = logging.getLogger(__name__)
_Item = TypeVar("_Item")


class SlotEngine(InferenceEngine):
    # What a prompt token to be scored costs against one only prefilled (see
    # `plan_chunks`); an engine whose model says otherwise sets its own.
    scored_token_cost = 1.0

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Tokenizer,
        capacity: int,
        *,
        chat_template: ChatTemplate | None = None,
        prefill_chunk_tokens: int = 0,
        prefix_cache: bool = False,
        grammars: Grammars | None = None,
        block_tokens: int = 0,
    ) -> None:
        """``prefill_chunk_tokens`` > 0: newcomers' contexts are run into their
        slots at most that many tokens per step, between decode steps, so that a
        long prompt does not hold up the running streams (0: whole, at admit).
        ``prefix_cache``: reuse the rows of prompts seen before (`PrefixCache`),
        in whole aligned blocks of ``block_tokens`` (0: `block_tokens_for` the
        chunk budget); it needs chunked prefill. ``grammars`` compiles requests'
        grammars; without it a request with one is refused."""
        self.info = info
        self.grammars = grammars
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.block_tokens = block_tokens or block_tokens_for(prefill_chunk_tokens)
        if prefill_chunk_tokens and self.block_tokens > prefill_chunk_tokens:
            raise ValueError(
                f"a block of {self.block_tokens} tokens does not fit a chunk of "
                f"{prefill_chunk_tokens}: prompts could never go in beside streams"
            )
        self.prefix_cache = (
            PrefixCache(capacity, self.block_tokens)
            if prefix_cache and prefill_chunk_tokens > 0
            else None
        )
        # Admitted sequences whose context is not yet all in their slot, by request
        # id in admission order (oldest first), each with how many of its context
        # tokens are.
        self._num_prefilled: dict[str, int] = {}
        self.tokenizer = tokenizer
        self.chat_template = chat_template or jinja_template(DEFAULT_CHAT_TEMPLATE, "default")
        self.prompts = PromptTokenizer(self._tokenize_prompt)
        self._slots: list[Sequence | None] = [None] * capacity
        self._by_id: dict[str, Sequence] = {}
        self._token_texts: dict[int, str] = {}  # each token's own text, for logprobs
        self._token_bytes_seen: dict[int, bytes] = {}  # and its bytes
        self._num_extra_prefill_passes = 0
        self._beside_decode_failed = Throttled(log, "failed prefills beside the decode")

    # --- what a subclass computes -------------------------------------------------

    def _prefill(self, newcomers: list[Sequence]) -> list[int]:
        """Run the newcomers' contexts (prompt, then any resumed output) into their
        slots; return each one's next token. Must change nothing a live sequence
        depends on if it raises. An engine with the chunk hooks runs each whole
        context as one chunk."""
        self._start_prefill(newcomers)
        return self._prefill_chunks(
            [Chunk(seq, 0, len(seq.context_token_ids)) for seq in newcomers]
        )

    def _start_prefill(self, newcomers: list[Sequence]) -> None:
        """Hook, for chunked prefill: check the newcomers and set up their slots
        without running them; raise as `_prefill` would."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither _prefill nor the chunk hooks"
        )

    def _prefill_chunks(self, chunks: list[Chunk]) -> list[int]:
        """For chunked prefill: run context positions [start, end) of each
        sequence into its slot, its earlier positions being there already; return
        the next token of each whose chunk ends its context (in order)."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither _prefill nor the chunk hooks"
        )

    @abstractmethod
    def _decode(self, active: list[Sequence]) -> list[int]:
        """Feed each sequence's last token at its position; return the next tokens."""

    def _prefill_beside_decode(
        self, chunks: list[Chunk], decoding: list[Sequence]
    ) -> tuple[list[int], list[int]] | None:
        """Hook: run ``chunks`` (as `_prefill_chunks`) and a decode step of
        ``decoding`` (as `_decode`) in one pass over the model, which reads its
        weights once for both; return what each would. None: this engine runs
        them one after the other. If this raises, they run apart (`_run_chunks`
        then `_decode`), so it must leave nothing that running them again would
        get wrong."""
        return None

    def _release(self, slot: int) -> None:
        """Hook: a slot was freed."""

    def _copy_rows(self, source: Match, slot: int, start: int) -> None:
        """For the prefix cache: copy cache rows [start, source.num_tokens) of
        ``source.slot`` into ``slot``, and the logits kept after its prompt when
        ``source.is_whole``."""
        raise NotImplementedError(f"{type(self).__name__} has no prefix cache")

    def _first_token_from_kept_logits(self, seq: Sequence) -> int:
        """For the prefix cache: ``seq``'s first token, from the logits kept in its
        slot after its whole prompt (`_prefill_chunks` keeps them for every
        prompt it completes that is not scored)."""
        raise NotImplementedError(f"{type(self).__name__} has no prefix cache")

    # --- the seam -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return len(self._slots)

    def num_active(self) -> int:
        return len(self._by_id)

    def active_sequences(self) -> list[Sequence]:
        return [seq for seq in self._slots if seq is not None]

    def decoding_sequences(self) -> list[Sequence]:
        """The active sequences whose whole context is in their slots."""
        return [
            seq
            for seq in self._slots
            if seq is not None and seq.request_id not in self._num_prefilled
        ]

    def prepare(self, request: GenerateRequest) -> bool:
        has_prompt = self.prompts.prepare(request)
        if not request.grammar or self.grammars is None:
            return has_prompt
        return self.grammars.prepare(request) and has_prompt

    def unprepare(self, request: GenerateRequest) -> None:
        self.prompts.forget(request)
        if request.grammar and self.grammars is not None:
            self.grammars.forget(request)

    def admit(self, requests: Seq[GenerateRequest]) -> list[str]:
        free = [i for i, seq in enumerate(self._slots) if seq is None]
        if len(requests) > len(free):
            raise ValueError(f"{len(requests)} requests for {len(free)} free slots")
        # Refused before any slot, or the prefix cache's record of one, changes.
        for request in requests:
            problem = sampling_problem(request)
            if problem is not None:
                raise RequestRejected(request.request_id, *problem)
        newcomers = [self._new_sequence(request, free[0]) for request in requests]
        self._place(newcomers, free)  # each its own slot
        # A resumed sequence whose streamed output already finished it (its result
        # was lost with the old worker), or one asked for no tokens, needs no model
        # unless its prompt is to be scored: the next step answers it.
        to_prefill = [
            seq for seq in newcomers if seq.finish_reason is None or seq.wants_prompt_logprobs
        ]
        chunked = self.prefill_chunk_tokens > 0
        if chunked and to_prefill:
            self._start_prefill(to_prefill)  # the next steps run them
        first_tokens = self._prefill_whole(to_prefill) if to_prefill and not chunked else []
        for seq in newcomers:
            self._slots[seq.slot] = seq
            self._by_id[seq.request_id] = seq
        if chunked:
            self._num_prefilled.update((seq.request_id, 0) for seq in to_prefill)
        else:
            for seq, token_id in zip(to_prefill, first_tokens, strict=True):
                self._take_first_token(seq, token_id)
        for request in requests:
            self.unprepare(request)  # admitted: what was prepared for it is used
        return [seq.request_id for seq in newcomers]

    def num_extra_prefill_passes(self) -> int:
        return self._num_extra_prefill_passes

    def _prefill_whole(self, newcomers: list[Sequence]) -> list[int]:
        """Without chunks: each context whole, in passes."""
        first_tokens: list[int] = []
        for k, group in enumerate(_passes(newcomers, lambda seq: len(seq.context_token_ids))):
            if k:  # the pass before this one is done: progress
                self._num_extra_prefill_passes += 1
            first_tokens += self._prefill(group)
        return first_tokens

    def _place(self, newcomers: list[Sequence], free: list[int]) -> None:
        """Give each newcomer a free slot: in order; with the prefix cache, the one
        holding most of its prompt, else the least recently used. Those that find
        their prompt choose first, so that the others do not evict it, and a slot
        whose rows one of them copies elsewhere is the last the others take."""
        cache = self.prefix_cache
        if cache is None:
            for seq, slot in zip(newcomers, free, strict=False):
                seq.slot = slot
            return
        reusing = [
            seq
            for seq in newcomers
            if not seq.scores_prompt
            and cache.best_match(seq.prompt_token_ids, free, salt=seq.cache_salt)
        ]
        sources: set[int] = set()  # free slots whose rows a newcomer copies from
        in_order = reusing + [seq for seq in newcomers if seq not in reusing]
        for num_placed, seq in enumerate(in_order):
            prompt = None if seq.scores_prompt else seq.prompt_token_ids
            candidates = [slot for slot in free if slot not in sources] or free
            seq.slot = cache.choose_free_slot(prompt, candidates, salt=seq.cache_salt)
            match = None if prompt is None else cache.best_match(prompt, free, salt=seq.cache_salt)
            if match is not None and match.slot != seq.slot:
                # Copied from when it prefills, if the newcomers after it leave
                # that slot alone; else its rows are taken in place.
                num_after = len(in_order) - num_placed - 1
                if len(free) - 1 - len(sources | {match.slot}) >= num_after:
                    sources.add(match.slot)
                else:
                    seq.slot = match.slot
            free.remove(seq.slot)
            cache.claim(seq.slot, seq.prompt_token_ids, salt=seq.cache_salt)
            if seq.scores_prompt:
                cache.forget(seq.slot)  # a scored prompt's every row is computed

    def step(self, on_prefilled: Callable[[StepOutput], None] | None = None) -> StepOutput:
        output = StepOutput()
        # prefill, and the decode with it where the engine runs both in one pass
        if self._num_prefilled:
            # A resumed newcomer is a stream too: its client waits mid-answer.
            holds_up_streams = bool(self.decoding_sequences()) or any(
                self._by_id[request_id].is_resumed for request_id in self._num_prefilled
            )
            if self._prefill_step(holds_up_streams, output):
                self._collect(output)
                return output
            if not holds_up_streams and self._num_prefilled and self.prefix_cache is not None:
                # Newcomers that waited for rows computed just now (the first wave
                # of a burst with one system prompt, n choices) take them and go in
                # at once: no stream was decoding to be held up. (Prompts to be
                # scored share no rows: they had this step's scoring.)
                self._prefill_step(False, output, may_score=False)
        # Newcomers whose first token finished them leave before the decode.
        self._collect(output)
        if on_prefilled is not None and (output.deltas or output.finished or output.failed):
            on_prefilled(output)
            output = StepOutput()
        # decode
        decoding = self.decoding_sequences()
        if decoding:
            for seq, token_id in zip(decoding, self._decode(decoding), strict=True):
                seq.append(token_id)
            self._collect(output)
        return output

    def _reuse_cached_rows(self, cache: PrefixCache, output: StepOutput) -> None:
        """Move each newcomer still prefilling past the rows of its prompt that a
        slot holds (copied in when that slot is another's); one whose whole
        prompt a slot holds, with the logits after it, takes its first token
        from those logits and prefills nothing. A failure falls on its own
        sequence alone, as in `_run_chunks`."""
        for request_id, done in list(self._num_prefilled.items()):
            seq = self._by_id[request_id]
            if seq.scores_prompt:
                continue
            try:
                self._reuse_rows_for(seq, done, cache)
            except Exception as exc:
                log.exception("taking cached rows failed for request %s", request_id)
                output.failed.append((request_id, exc))
                cache.forget(seq.slot)  # a copy may have stopped half way
                self._free(seq)

    def _reuse_rows_for(self, seq: Sequence, done: int, cache: PrefixCache) -> None:
        match = cache.best_match(seq.prompt_token_ids, salt=seq.cache_salt)
        if match is None or match.num_tokens <= done:
            return
        if match.slot != seq.slot:
            self._copy_rows(match, seq.slot, done)
            cache.copied(match, seq.slot)
        seq.num_cached_tokens += match.num_tokens - done
        self._num_prefilled[seq.request_id] = match.num_tokens
        if match.num_tokens == len(seq.context_token_ids):
            del self._num_prefilled[seq.request_id]
            self._take_first_token(seq, self._first_token_from_kept_logits(seq))

    def _prefill_step(
        self, holds_up_streams: bool, output: StepOutput, may_score: bool = True
    ) -> bool:
        """Take what the prefix cache holds, then run this step's chunks
        (`plan_chunks`; ``holds_up_streams``: keep to the chunk budget, and
        decode the streams in the same pass where the engine can; ``may_score``:
        score up to a pass of prompt tokens). Returns whether the streams were
        decoded."""
        if self.prefix_cache is not None:
            self._reuse_cached_rows(self.prefix_cache, output)
        decoding: list[Sequence] = []
        if holds_up_streams:
            self._collect(output)  # those a first token finished leave before any decode
            decoding = self.decoding_sequences()
        prefilling = [
            (self._by_id[request_id], done) for request_id, done in self._num_prefilled.items()
        ]
        chunks = plan_chunks(
            prefilling,
            self.prefill_chunk_tokens,
            self.block_tokens,
            holds_up_streams,
            self.prefix_cache,
            scored_budget=PREFILL_PASS_TOKENS if may_score else 0,
            scored_token_cost=self.scored_token_cost,
        )
        decoded = False
        for k, group in enumerate(_passes(chunks, lambda chunk: chunk.end - chunk.start)):
            if k:
                self._num_extra_prefill_passes += 1
            if decoding and not decoded and self._run_beside_decode(group, decoding):
                decoded = True
            else:
                self._run_chunks(group, output)
        return decoded

    def _run_beside_decode(self, chunks: list[Chunk], decoding: list[Sequence]) -> bool:
        """Prefill ``chunks`` and decode ``decoding`` in one pass where the engine
        can (`_prefill_beside_decode`); False where it cannot or that failed:
        then they run apart, each failure on its own sequence."""
        try:
            tokens = self._prefill_beside_decode(chunks, decoding)
        except Exception:
            # Throttled: should it fail every step, a traceback a step would flood the log.
            self._beside_decode_failed.warn(
                "a prefill beside the decode failed; running them one after the other",
                exc_info=True,
            )
            return False
        if tokens is None:
            return False
        first_tokens, next_tokens = tokens
        self._chunks_ran(chunks, first_tokens)
        for seq, token_id in zip(decoding, next_tokens, strict=True):
            seq.append(token_id)
        return True

    def _run_chunks(self, chunks: list[Chunk], output: StepOutput) -> None:
        """Prefill ``chunks``. If that fails, each is run alone, so that a failure
        falls only on the sequence that causes it: it is dropped, and reported in
        ``output.failed``; the others, and every decoding sequence, go on."""
        try:
            first_tokens = self._prefill_chunks(chunks)
        except Exception as exc:
            if len(chunks) > 1:
                log.warning("prefill failed for %d sequences; running each alone", len(chunks))
                for chunk in chunks:
                    self._run_chunks([chunk], output)
                return
            seq = chunks[0].seq
            log.exception("prefill failed for request %s", seq.request_id)
            output.failed.append((seq.request_id, exc))
            self._free(seq)
            return
        self._chunks_ran(chunks, first_tokens)

    def _chunks_ran(self, chunks: list[Chunk], first_tokens: list[int]) -> None:
        """Record that ``chunks`` are in their slots; those that end their context
        take their first token."""
        for seq, _, end in chunks:
            self._num_prefilled[seq.request_id] = end
            if self.prefix_cache is not None and not seq.scores_prompt:
                written = min(end, len(seq.prompt_token_ids))
                self.prefix_cache.written(
                    seq.slot, seq.prompt_token_ids, written, salt=seq.cache_salt
                )
        finished = [seq for seq, _, end in chunks if end == len(seq.context_token_ids)]
        for seq, token_id in zip(finished, first_tokens, strict=True):
            del self._num_prefilled[seq.request_id]
            self._take_first_token(seq, token_id)

    def _take_first_token(self, seq: Sequence, token_id: int) -> None:
        if seq.finish_reason is None:
            seq.append(token_id)

    def abort(self, request_ids: Seq[str]) -> list[FinishedSequence]:
        aborted = []
        for request_id in request_ids:
            seq = self._by_id.get(request_id)
            if seq is not None:
                seq.abort()
                aborted.append(self._finish(seq))
        return aborted

    def reset(self) -> list[str]:
        dropped = list(self._by_id)
        for seq in list(self._by_id.values()):
            self._free(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_all()  # the failed step may have half written rows
        return dropped

    # --- internals --------------------------------------------------------------------

    def _new_sequence(self, request: GenerateRequest, slot: int) -> Sequence:
        if request.request_id in self._by_id:
            raise RequestRejected(
                request.request_id,
                ErrorCode.INVALID_REQUEST,
                f"request {request.request_id} is already being generated",
            )
        prompt = self.prompts.take(request)
        return new_sequence(request, prompt, slot, self.tokenizer, self.info, self.grammars)

    def _tokenize_prompt(self, request: GenerateRequest) -> PromptTokens:
        """On the engine thread, or on the prompts' own (`PromptTokenizer`)."""
        return tokenize_prompt(request, self.tokenizer, self.chat_template, self.info)

    def _scratch_position(self, slot: int) -> int:
        """A position of ``slot``'s cache row that a dummy decode row (for a slot
        not decoding this step) may write: one that nothing reads before its
        owner writes it. A free slot's first one the prefix cache does not hold;
        a prefilling one's next position."""
        seq = self._slots[slot]
        if seq is not None:
            return self._num_prefilled.get(seq.request_id, 0)
        if self.prefix_cache is None:
            return 0
        position = self.prefix_cache.num_rows_held(slot)
        if position >= self.info.context_window:
            self.prefix_cache.forget(slot)
            return 0
        return position

    def _collect(self, output: StepOutput) -> None:
        # A sequence still prefilling has nothing to send, and is not done even if
        # its resumed output finished it: its prompt is being scored.
        for seq in self.decoding_sequences():
            if seq.error is not None:  # its grammar refused the token: it fails alone
                rejected = RequestRejected(seq.request_id, ErrorCode.INVALID_REQUEST, seq.error)
                output.failed.append((seq.request_id, rejected))
                self._free(seq)
                continue
            if seq.request.stream:
                # A finishing sequence's last delta goes out before its result.
                token_ids, text = seq.take_delta()
                if token_ids or text:
                    output.deltas.append(
                        TokenDelta(
                            seq.request_id,
                            token_ids,
                            text,
                            prompt_tokens=len(seq.prompt_token_ids),
                            logprobs=self._take_logprobs(seq),
                            prompt_logprobs=self._take_prompt_logprobs(seq),
                        )
                    )
            if seq.finish_reason is not None:
                output.finished.append(self._finish(seq))

    def _finish(self, seq: Sequence) -> FinishedSequence:
        finished = FinishedSequence(
            request_id=seq.request_id,
            token_ids=list(seq.output_token_ids),
            text=seq.final_text(),
            finish_reason=seq.finish_reason or FinishReason.ABORT,
            num_prompt_tokens=len(seq.prompt_token_ids),
            logprobs=self._take_logprobs(seq),
            prompt_logprobs=self._take_prompt_logprobs(seq),
            prompt_token_ids=list(seq.prompt_token_ids) if seq.request.echo else None,
            prompt_text=seq.prompt_text,
            num_looked_up_tokens=(
                0 if self.prefix_cache is None or seq.scores_prompt else len(seq.prompt_token_ids)
            ),
            num_cached_tokens=seq.num_cached_tokens,
        )
        self._free(seq)
        return finished

    def _take_logprobs(self, seq: Sequence) -> Logprobs | None:
        if seq.request.logprobs is None:
            return None
        token_ids, scores, in_text = seq.take_logprobs()
        return self._pack(token_ids, scores, seq.request.logprobs, in_text) if scores else None

    def _take_prompt_logprobs(self, seq: Sequence) -> Logprobs | None:
        scores = seq.take_prompt_logprobs()
        if scores is None or seq.request.prompt_logprobs is None:
            return None
        return self._pack(seq.prompt_token_ids, scores, seq.request.prompt_logprobs)

    def _pack(
        self,
        token_ids: list[int],
        scores: list[TokenLogprob],
        num_top: int,
        in_text: list[bool] | None = None,
    ) -> Logprobs:
        return pack_logprobs(
            token_ids, scores, num_top, self._token_text, self._token_bytes, in_text
        )

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._token_bytes_seen.get(token_id)
        if piece is None:
            piece = self._token_bytes_seen[token_id] = self.tokenizer.token_bytes(token_id)
        return piece

    def _free(self, seq: Sequence) -> None:
        self._slots[seq.slot] = None
        del self._by_id[seq.request_id]
        self._num_prefilled.pop(seq.request_id, None)  # aborted before all of it was in
        if self.prefix_cache is not None:
            self.prefix_cache.released(seq.slot)
        self._release(seq.slot)


def _passes(items: list[_Item], num_tokens: Callable[[_Item], int]) -> Iterator[list[_Item]]:
    """``items`` in order, in runs of at most PREFILL_PASS_TOKENS tokens (one
    item past it alone)."""
    run: list[_Item] = []
    total = 0
    for item in items:
        if run and total + num_tokens(item) > PREFILL_PASS_TOKENS:
            yield run
            run, total = [], 0
        run.append(item)
        total += num_tokens(item)
    if run:
        yield run
