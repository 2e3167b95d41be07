"""Structured outputs in the worker: each request's grammar compiled against the
model's tokenizer, one matcher per constrained sequence, and a batch's masks.

A grammar (`GenerateRequest.grammar`, llguidance's format, made by the frontend
from response_format or structured_outputs) can take a tenth of a second to
compile when its schema is large. So it compiles on a thread of its own while
its request waits in the queue (`Grammars.prepare`): the running batch and the
heartbeats never wait for it (llguidance lets go of the GIL while it compiles).
Each is kept until its request is admitted, and the latest others too, so that
a schema sent again compiles once; each sequence advances a copy of its own, one
token at a time, from its first output token (resumed ones included).
Torch-free: the fake engine uses it too, and `worker.model.token_mask` applies
the masks to a batch's logits.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask
from tokenizers import AddedToken, Tokenizer

from protocol import ErrorCode, GenerateRequest, GrammarKind
from protocol.limits import GRAMMAR_LIMITS, MAX_GRAMMAR_ERROR_CHARS
from protocol.wire import shorten
from worker.engine.interface import RequestRejected

if TYPE_CHECKING:
    from worker.engine.sequence import Sequence

log = logging.getLogger(__name__)

# Grammars kept compiled, the most recently used, besides those queued requests
# wait to use (at most one per request the scheduler prepares ahead). Each may
# hold up to ~35 MB of its lexer's expressions (GRAMMAR_LIMITS' initial_lexer_fuel).
MAX_COMPILED = 16
_NOT_VERBOSE = "<non-verbose/>"  # what llguidance puts in place of its parser's state


class GrammarError(Exception):
    """A grammar that cannot constrain this model's output; ``code`` for the client."""

    def __init__(self, message: str, code: str = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


def parser_limits() -> llguidance.LLParserLimits:
    """What compiling a grammar and computing each step's mask may cost (the
    frontend checks grammars against the same limits)."""
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False)


class BackendTokenizer(Protocol):
    """A Hugging Face `tokenizers.Tokenizer`, as much of it as llguidance reads."""

    def to_str(self) -> str: ...

    def get_vocab_size(self, with_added_tokens: bool) -> int: ...


def hf_grammar_tokenizer(
    backend: BackendTokenizer, eos_token_id: int | None, vocab_size: int
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer. Its vocabulary covers the
    model's (a model may have more rows than the tokenizer has tokens) and the
    tokenizer's (a small test model may have fewer; masks are cut to the model's)."""
    num_tokens = max(vocab_size, backend.get_vocab_size(True))
    return llguidance.LLTokenizer(
        _with_eos_special(backend.to_str(), eos_token_id),
        n_vocab=num_tokens,
        eos_token=eos_token_id,
    )


def _with_eos_special(tokenizer_json: str, eos_token_id: int | None) -> str:
    """The tokenizer, with its end token marked special where it was not (a
    model's tokenizer.json may not mark it): llguidance reads an unmarked
    one as text, and '<|endoftext|>' would then fit inside a JSON string or a
    regex's dot and end the output there, unfinished."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos = None if eos_token_id is None else tokenizer.id_to_token(eos_token_id)
    if eos is None or any(
        added.content == eos and added.special
        for added in tokenizer.get_added_tokens_decoder().values()
    ):
        return tokenizer_json
    tokenizer.add_special_tokens([AddedToken(eos, special=True)])
    assert tokenizer.token_to_id(eos) == eos_token_id  # marked, not added anew
    return str(tokenizer.to_str())


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(
        self, matcher: llguidance.LLMatcher, eos_token_id: int, eos_text: str, field: str
    ) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id  # allowed where the grammar may end
        self.eos_text = eos_text  # the end token's text, for errors
        self.field = field  # the request field the grammar came from, for errors
        self.takes_eos_midway = False

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it, or has
        failed (see `error`)."""
        # llguidance tokenizes the end token's text in a grammar (a choice
        # "a<|endoftext|>") as the end token, offers it there, then refuses it as
        # text; a Lark grammar may name the token itself (`"b" <|endoftext|> "a"`),
        # and takes it. Only so is the end token offered where the grammar cannot
        # end, and either way the output cannot go on past it: the request fails.
        # A grammar that names it last (`"a" <|endoftext|>`) ends with it, and so
        # does the output.
        is_eos_before_the_end = (
            token_id == self.eos_token_id
            and not self.matcher.is_error()
            and not self.matcher.is_accepting()
        )
        is_taken = bool(self.matcher.consume_token(token_id))
        self.takes_eos_midway = is_eos_before_the_end and not (
            is_taken and self.matcher.is_accepting()
        )
        return is_taken and not self.takes_eos_midway

    @property
    def is_done(self) -> bool:
        """The grammar is complete and allows nothing more: the output ends."""
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    @property
    def error(self) -> str:
        """Why the grammar failed, naming the request field."""
        if self.takes_eos_midway:
            return (
                f"{self.field}: the grammar asks for {self.eos_text!r} where it cannot end, "
                "and this model's tokenizer keeps that for its end token, after which "
                "nothing follows; leave it out of the grammar"
            )
        problem = _explained(self.matcher.get_error()) or "the token was not one the grammar allows"
        return f"{self.field}: the output could not follow the grammar: {problem}"


class TokenMasks:
    """A batch's constrained rows and the tokens each may take next: bit t % 32 of
    word t // 32 of ``bitmask[k]`` is set when row ``rows[k]`` may take token t
    (llguidance's layout)."""

    def __init__(self, rows: list[int], bitmask: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        self.rows = rows
        self.bitmask = bitmask  # (R, W) int32

    def allowed(self, vocab_size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """(R, vocab_size) 1 where a token is allowed, 0 where not (and for tokens
        past the grammar's vocabulary)."""
        return np.unpackbits(
            self.bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little"
        )

    def rows_that_must_end(self, seqs: list[Sequence]) -> set[int]:
        """Rows still within their min_tokens whose grammar allows nothing but their
        stop tokens (its own end): the grammar wins, and its end stays allowed."""
        ending = set()
        for k, i in enumerate(self.rows):
            seq = seqs[i]
            if seq.is_within_min_tokens and seq.stop_token_ids:
                bits = np.unpackbits(self.bitmask[k].view(np.uint8), bitorder="little")
                stops = [t for t in seq.stop_token_ids if t < bits.size]
                if int(bits.sum()) == int(bits[stops].sum()):
                    ending.add(i)
        return ending


class Grammars:
    """Compiles grammars for one tokenizer on a thread of its own, keeps those
    that prepared requests wait to use and the latest `MAX_COMPILED` others, and
    computes masks. The tokenizer and the thread start with the first grammar: a
    worker that serves none pays nothing, and nothing starts before a warm
    start's fork."""

    def __init__(self, make_tokenizer: Callable[[], llguidance.LLTokenizer]) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._compiler: ThreadPoolExecutor | None = None
        # By grammar text; touched by the engine thread only.
        self._compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        # By grammar text: the ids of the requests prepared for it and not yet
        # admitted, refused or gone. Their grammars are never dropped: dropped, a
        # compile for the back of the queue took the place of one done for its
        # front, compiled again on the engine thread at its admission while the
        # batch waited (40 queued grammars, 8 slots: 64 to 88 compiles, admissions
        # waiting up to 180 ms).
        self._waiting: dict[str, set[str]] = {}

    def prepare(self, request: GenerateRequest) -> bool:
        """Start compiling ``request``'s grammar unless it is compiled or compiling,
        and keep it until `forget`; return whether it is done (a grammar that
        failed is done too)."""
        self._waiting.setdefault(request.grammar, set()).add(request.request_id)
        return self._compiling(request.grammar).done()

    def forget(self, request: GenerateRequest) -> None:
        """``request`` was admitted, refused, or left the queue: its grammar need
        not be kept for it, and its compile, if no other request waits for it and
        it has not started, is dropped."""
        waiting = self._waiting.get(request.grammar)
        if waiting is None:
            return
        waiting.discard(request.request_id)
        if waiting:
            return
        del self._waiting[request.grammar]
        future = self._compiled.get(request.grammar)
        if future is not None and future.cancel():
            del self._compiled[request.grammar]
        self._forget_stale()

    def matcher(self, request: GenerateRequest) -> GrammarMatcher:
        """A fresh matcher for the request's grammar, which is compiled here if it
        was not prepared. Raises RequestRejected, naming the request field, for a
        grammar that cannot be used."""
        field = GrammarKind.field(request.grammar_kind)
        try:
            compiled = self._compiling(request.grammar).result()
        except GrammarError as exc:
            raise RequestRejected(request.request_id, exc.code, f"{field}: {exc}") from None
        tokenizer = self._tokenizer
        assert tokenizer is not None  # made by the compile
        eos = tokenizer.eos_token
        return GrammarMatcher(compiled.deep_copy(), eos, tokenizer.decode_str([eos]), field)

    def masks(self, seqs: list[Sequence]) -> TokenMasks | None:
        """The masks of the rows of ``seqs`` that have a grammar and are not
        finished; None, at the cost of one scan, when there are none."""
        constrained = [
            (i, seq.grammar)
            for i, seq in enumerate(seqs)
            if seq.grammar is not None and seq.finish_reason is None
        ]
        if not constrained:
            return None
        assert self._tokenizer is not None
        num_words = (self._tokenizer.vocab_size + 31) // 32
        bitmask = np.empty((len(constrained), num_words), dtype=np.int32)
        matchers = [grammar.matcher for _, grammar in constrained]
        for k, matcher in enumerate(matchers):
            # On this thread, one row after another: a row takes microseconds (a
            # millisecond where its lexer meets a new state), and threads of
            # llguidance's own would preempt torch's, whose steps wait for their
            # slowest thread.
            fill_next_token_bitmask(matcher, bitmask, k)
            if matcher.is_error():
                # Any token: `accept` then fails, and the sequence ends with the error.
                bitmask[k] = -1
        return TokenMasks([i for i, _ in constrained], bitmask)

    def _compiling(self, grammar: str) -> Future[llguidance.LLMatcher]:
        future = self._compiled.get(grammar)
        if future is not None:
            self._compiled.move_to_end(grammar)
            return future
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        future = self._compiled[grammar] = self._compiler.submit(self._compile, grammar)
        self._forget_stale()
        return future

    def _forget_stale(self) -> None:
        """Drop the least recently used compiled grammars beyond MAX_COMPILED,
        but for those prepared requests wait for (and those still compiling: a
        queued request waits on each)."""
        unwaited = [grammar for grammar in self._compiled if grammar not in self._waiting]
        excess = len(unwaited) - MAX_COMPILED
        stale = [grammar for grammar in unwaited if self._compiled[grammar].done()]
        for grammar in stale[: max(0, excess)]:
            del self._compiled[grammar]

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        """On the compile thread. Raises GrammarError."""
        tokenizer = self._grammar_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        # A grammar too costly for its first step fails here, before its request
        # is admitted, rather than after its first token.
        if not matcher.is_error():
            first_step = matcher.deep_copy()
            first_step.compute_bitmask()
            matcher = matcher if not first_step.is_error() else first_step
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {_explained(matcher.get_error())}")
        return matcher

    def _grammar_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = self._make_tokenizer()
                except Exception as exc:
                    log.exception("llguidance cannot use this model's tokenizer")
                    raise GrammarError(
                        f"this model's tokenizer cannot constrain output ({exc})",
                        ErrorCode.UNSUPPORTED,
                    ) from None
            return self._tokenizer


# What llguidance's terse reasons for stopping (the first word of its error when
# its errors are not verbose) mean to the client who wrote the grammar.
_NEVER_ENDS = (
    "no output can complete it: some rule never ends (as `start: start` "
    "or a schema whose $ref leads only back to itself), or a number's bounds with "
    "its multipleOf leave llguidance no value it can write (as 0.25 to 0.35 in "
    "steps of 0.1 does, though 0.3 fits: widen the bounds, or drop multipleOf)"
)
_TOO_COSTLY = (
    "it is too costly to follow within this server's limits (as an ambiguous rule "
    "like `x: x x`, a rule that never ends or hundreds of optional keys are)"
)
_TOO_LARGE = (
    "its regular expressions are too large to build within this server's limits "
    "(as a repeat like a{100000} is): write smaller repeats, or + and *"
)
_STOP_REASONS = {
    "NoExtension": _NEVER_ENDS,
    "NoExtensionBias": _NEVER_ENDS,
    "ParserTooComplex": _TOO_COSTLY,
    "LexerTooComplex": "its tokens are too costly to match within this server's limits",
}


def _explained(error: str) -> str:
    """llguidance's error, with a bare reason for stopping said in words."""
    words = error.replace(_NOT_VERBOSE, "").split()
    if len(words) == 1 and words[0] in _STOP_REASONS:
        return _STOP_REASONS[words[0]]
    if "Too many items" in error:  # past GRAMMAR_LIMITS' step_max_items or max_items_in_row
        return f"{_TOO_COSTLY}; llguidance: {_short(error)}"
    if "too many expressions constructed" in error:  # past the lexer's fuel
        return f"{_TOO_LARGE}; llguidance: {_short(error)}"
    return _short(error)


def _short(message: str) -> str:
    message = " ".join(message.replace(_NOT_VERBOSE, "").split())
    return shorten(message, MAX_GRAMMAR_ERROR_CHARS)
