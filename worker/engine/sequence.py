"""One sequence's life in a slot: its tokens, its text and when it must stop.

Every engine shares this bookkeeping, so that finishing rules (EOS, stop token
ids, stop strings, max_new_tokens, a grammar's end) and incremental
detokenization behave the same whatever computes the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

from protocol import FinishReason, GenerateRequest
from worker.engine.logprobs import UNSCORED, TokenLogprob

if TYPE_CHECKING:
    from worker.engine.grammar import GrammarMatcher

# A byte-level BPE token may end in the middle of a multi-byte character; its text
# is held back until the character completes, or this many tokens have passed
# (the model emitted bytes that never form valid UTF-8).
_MAX_PENDING_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"
# The finish reason of a sequence whose grammar refused its token (see `error`):
# the engine reports it as failed, never as finished.
FAILED = "error"


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Seq[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class Sequence:
    """A request being generated. ``append`` is called once per new token.

    With a ``grammar``, each token advances it; the grammar's end (its last
    token, or the end-of-sequence token where it may end) ends the output with
    finish_reason stop, even within min_tokens, since nothing else may follow."""

    def __init__(
        self,
        request: GenerateRequest,
        prompt_token_ids: list[int],
        tokenizer: Tokenizer,
        slot: int,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text: str | None = None  # the prompt as text, when echo needs it
        self.output_token_ids: list[int] = []
        self.slot = slot
        self.num_cached_tokens = 0  # prompt rows taken from the prefix cache, not computed
        self.finish_reason: str | None = (
            FinishReason.LENGTH if request.max_new_tokens == 0 else None
        )
        self._tokenizer = tokenizer
        self._stop_ids = set(request.stop_token_ids)
        if tokenizer.eos_token_id is not None and not request.ignore_eos:
            self._stop_ids.add(tokenizer.eos_token_id)
        self.grammar = grammar
        self.error: str | None = None  # why the grammar refused a token
        if grammar is not None:
            # Allowed only where the grammar may end, so ignore_eos has no say.
            self._stop_ids.add(grammar.eos_token_id)
        # Logprobs of output tokens this attempt generated (not resumed ones, which
        # an earlier attempt delivered), and of the prompt: each delivered once.
        self._logprobs: list[TokenLogprob] = []
        self._num_delivered_logprobs = 0
        self._num_resumed = 0
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self._prompt_scores: list[TokenLogprob] = []  # of the chunks scored so far
        self._is_prompt_scored = False
        # Text is built as tokens arrive only when something needs it before the
        # end: stop strings or streaming. Otherwise it is decoded once, at finish.
        self._tracks_text = bool(request.stop) or request.stream
        self._text = ""
        self._num_settled_tokens = 0  # output tokens whose text is in _text
        self._num_text_tokens = 0  # output tokens that produce text (not a stop token)
        self._num_streamed_tokens = 0
        self._num_streamed_chars = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    @property
    def context_token_ids(self) -> list[int]:
        """Prompt and output so far: what the model has read before the next token."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def stop_token_ids(self) -> set[int]:
        return self._stop_ids

    @property
    def is_within_min_tokens(self) -> bool:
        """No stop may end the output yet: it has fewer than min_tokens tokens."""
        return len(self.output_token_ids) < self.request.min_tokens

    @property
    def cache_salt(self) -> str:
        """Prefix-cache rows are shared only among prompts of one salt."""
        return self.request.cache_salt

    @property
    def scores_prompt(self) -> bool:
        """This attempt's prefill scores the prompt, before it has and after:
        asked for, and not delivered by an earlier attempt (whose first delta
        carried them, with its first token). Every position of such a prompt is
        computed, so its rows and the logits after it are never the prefix
        cache's."""
        return self.request.prompt_logprobs is not None and not self.request.resume_token_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prefill must score the prompt: `scores_prompt`, and not done yet."""
        return self.scores_prompt and not self._is_prompt_scored

    def prompt_targets(self, start: int, end: int) -> list[int]:
        """The prompt tokens that context positions [start, end) predict: each
        position's next token, within the prompt (the one after its last
        position is the output's first)."""
        return self.prompt_token_ids[start + 1 : end + 1]

    def score_prompt_chunk(self, start: int, end: int, scores: list[TokenLogprob]) -> None:
        """The logprobs of `prompt_targets(start, end)`, a chunk's (a chunk run
        again after a failure replaces what it gave before). The prompt's first
        token has none. Once a chunk reaches the prompt's end, `prompt_logprobs`
        holds it all."""
        first = 0 if start == 0 else start + 1
        del self._prompt_scores[first:]
        self._prompt_scores += [UNSCORED, *scores] if start == 0 else scores
        if end == len(self.prompt_token_ids):
            self.prompt_logprobs, self._prompt_scores = self._prompt_scores, []
            self._is_prompt_scored = True

    def record_logprob(self, score: TokenLogprob) -> None:
        """The logprobs of the token about to be appended."""
        self._logprobs.append(score)

    def take_logprobs(self) -> tuple[list[int], list[TokenLogprob], list[bool]]:
        """Output tokens whose logprobs are not delivered yet, those logprobs, and
        whether each token is in the text (the end token and a stop token are not)."""
        start = self._num_delivered_logprobs
        scores = self._logprobs[start:]
        self._num_delivered_logprobs = len(self._logprobs)
        first = self._num_resumed + start
        token_ids = self.output_token_ids[first : first + len(scores)]
        eos = self._tokenizer.eos_token_id
        in_text = [
            index < self._num_text_tokens and token_id != eos
            for index, token_id in enumerate(token_ids, first)
        ]
        return token_ids, scores, in_text

    def take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        scores, self.prompt_logprobs = self.prompt_logprobs, None
        return scores

    @property
    def is_resumed(self) -> bool:
        """Whether it carries output an earlier attempt streamed (see `resume`)."""
        return self._num_resumed > 0

    def resume(self, token_ids: Seq[int], num_chars_shown: int) -> None:
        """Replay output that an earlier attempt already streamed: ``token_ids``, of
        whose text ``num_chars_shown`` characters were shown. The sequence is then in
        the state the uninterrupted run had (held-back text, half a character, a
        stop string begun) and its next delta starts after what was shown. It may be
        finished already. Raises ValueError for output the uninterrupted run could
        not have streamed."""
        for num_replayed, token_id in enumerate(token_ids):
            if self.finish_reason is not None:
                raise ValueError(
                    f"resume_token_ids: the output finished ({self.finish_reason}) after "
                    f"{num_replayed} of its {len(token_ids)} tokens"
                )
            self.append(token_id)
            if self.error is not None:
                raise ValueError(
                    f"resume_token_ids: token {num_replayed} ({token_id}) is not one the "
                    f"grammar allows there ({self.error})"
                )
        num_chars_showable = self._showable_text()[1]
        if not 0 <= num_chars_shown <= num_chars_showable:
            raise ValueError(
                f"resume_text_len: must be in [0, {num_chars_showable}], the characters "
                f"resume_token_ids can show, got {num_chars_shown}"
            )
        self._num_streamed_tokens = len(self.output_token_ids)
        self._num_streamed_chars = num_chars_shown
        self._num_resumed = len(self.output_token_ids)

    def append(self, token_id: int) -> str | None:
        """Record a generated token; return the finish reason if it ends the sequence."""
        assert self.finish_reason is None, f"{self.request_id} is already finished"
        self.output_token_ids.append(token_id)
        ends_grammar = is_grammar_end_token = False
        if self.grammar is not None:
            if not self.grammar.accept(token_id):
                self.error = self.grammar.error
                self.finish_reason = FAILED
                return self.finish_reason
            ends_grammar = self.grammar.is_done
            is_grammar_end_token = ends_grammar and token_id == self.grammar.eos_token_id
        # As vLLM: none of the first min_tokens tokens is a stop, nor ends a stop
        # string (this one is among them while the output is no longer than
        # that); they stay in the text. But nothing can follow a grammar's end:
        # it ends the output there, and its end token is never text.
        may_stop = len(self.output_token_ids) > self.request.min_tokens
        if (may_stop or is_grammar_end_token) and token_id in self._stop_ids:
            self.finish_reason = FinishReason.STOP
            return self.finish_reason
        self._num_text_tokens = len(self.output_token_ids)
        is_last = ends_grammar or len(self.output_token_ids) >= self.request.max_new_tokens
        # The last token's text is flushed, even half a character, so that a stop
        # string before that half character still ends the sequence as "stop".
        num_chars_before = len(self._text)
        if (
            self._tracks_text
            and self._extend_text(flush=is_last)
            and may_stop
            and self._cut_at_stop_string(num_chars_before)
        ) or ends_grammar:
            self.finish_reason = FinishReason.STOP
        elif is_last:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason

    def abort(self) -> None:
        self.finish_reason = FinishReason.ABORT

    def final_text(self) -> str:
        """The whole output text (stop token and stop string excluded)."""
        if not self._tracks_text:
            return self._decode_output(self.output_token_ids[: self._num_text_tokens])
        self._extend_text(flush=True)
        return self._text

    def take_delta(self) -> tuple[list[int], str]:
        """Tokens and text not yet streamed. Text that may still turn out to be the
        start of a stop string, or half a character, is held back until it is not."""
        token_ids = self.output_token_ids[self._num_streamed_tokens :]
        self._num_streamed_tokens = len(self.output_token_ids)
        text, num_showable = self._showable_text()
        delta = text[self._num_streamed_chars : num_showable]
        self._num_streamed_chars = max(self._num_streamed_chars, num_showable)
        return token_ids, delta

    def _showable_text(self) -> tuple[str, int]:
        """The output text so far and how many of its characters a client may see
        now (all of them once finished)."""
        if self.finish_reason is not None:
            text = self.final_text()
            return text, len(text)
        return self._text, len(self._text) - self._stop_string_prefix_len()

    def _extend_text(self, flush: bool = False) -> bool:
        """Decode settled tokens onto the text; return whether text was added."""
        pending = self.output_token_ids[self._num_settled_tokens : self._num_text_tokens]
        if not pending:
            return False
        piece = self._decode_output(pending)
        num_settling = len(pending)
        if piece.endswith(_REPLACEMENT_CHAR) and not flush:
            if len(pending) < _MAX_PENDING_TOKENS:
                return False
            # Held long enough (the model wrote a "\ufffd" itself, or bytes that are
            # no UTF-8): settle the text that no later token can change, keeping
            # back the tokens of a character that may still complete.
            num_settling = self._last_character_boundary(pending, piece)
            piece = self._decode_output(pending[:num_settling])
        self._text += piece
        self._num_settled_tokens += num_settling
        return True

    def _last_character_boundary(self, pending: list[int], text: str) -> int:
        """The most tokens of ``pending`` (whose text is ``text``) after which no
        character continues: decoded apart, the two parts give the same text as
        together, so the bytes after the cut cannot complete one before it. All
        of them where there is no such cut."""
        for cut in range(len(pending) - 1, 0, -1):
            head, tail = self._decode_output(pending[:cut]), self._decode_output(pending[cut:])
            if tail and head + tail == text:
                return cut
        return len(pending)

    def _decode_output(self, token_ids: list[int]) -> str:
        """Output tokens as text, the end-of-sequence token's left out: generated
        past (ignore_eos), it is a marker, not the text "<|endoftext|>". vLLM and
        llama.cpp's servers leave it out too."""
        eos = self._tokenizer.eos_token_id
        if eos is not None and eos in token_ids:
            token_ids = [token_id for token_id in token_ids if token_id != eos]
        return self._tokenizer.decode(token_ids)

    def _cut_at_stop_string(self, num_chars_before: int) -> bool:
        """Cut the text before the earliest stop string in it; return whether cut.

        Only a stop string that ends in the new text can be there (an earlier one
        would have ended the sequence), so the search starts just before it."""
        cuts = [
            i
            for s in self.request.stop
            if (i := self._text.find(s, max(0, num_chars_before - len(s) + 1))) >= 0
        ]
        if not cuts:
            return False
        self._text = self._text[: min(cuts)]
        # Tokens still held back (half a character) come after the stop string:
        # none of their text may follow it.
        self._num_settled_tokens = self._num_text_tokens
        return True

    def _stop_string_prefix_len(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.request.stop:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
