"""Logprobs as the frontend shows them: each token's bytes, and completions'
text offsets where tokens split characters."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.logprobs import (
    TextOffsets,
    TokenScore,
    chat_logprobs,
    completion_logprobs,
    unpack_logprobs,
)
from worker.engine.logprobs import TokenLogprob, pack_logprobs


def _scores(*pieces: bytes) -> list[TokenScore]:
    return [TokenScore(piece.decode(errors="replace"), piece, -1.0, []) for piece in pieces]


@pytest.mark.parametrize(
    ("pieces", "offsets"),
    [
        ([b"a", b"b c"], [0, 1]),
        # GPT-2 writes " 🎉" as three tokens: the first holds the space, the others
        # begin inside the emoji, which begins at 2.
        ([b"a", b" \xf0\x9f", b"\x8e", b"\x89", b" ok"], [0, 1, 2, 2, 3]),
        # A token that ends a character and goes on begins with that character.
        ([b"a\xf0", b"\x9f\x8e\x89b", b"c"], [0, 1, 3]),
        (["hé".encode(), b"llo"], [0, 2]),
        # Bytes that are no UTF-8, and a U+FFFD the model wrote: one character each.
        ([b"a", b"\xff", "\ufffd".encode(), b"b"], [0, 1, 2, 3]),
        # An end token adds nothing to the text.
        ([b"a", b"", b"b"], [0, 1, 1]),
        # The start of a character that never completes is one U+FFFD of its own,
        # before the token that shows it never completes.
        ([b"Hello", b"\xe6", b"a"], [0, 5, 6]),
        ([b"\xe6", b"\xe6", b"\xe6", b"\xe6"], [0, 1, 2, 3]),
        ([b"\xe6\x9d", b"\xf0\x9f\x98\x80"], [0, 1]),
    ],
)
def test_each_token_is_placed_where_its_first_bytes_character_begins(
    pieces: list[bytes], offsets: list[int]
) -> None:
    assert TextOffsets().place(_scores(*pieces)) == offsets
    assert TextOffsets(10).place(_scores(*pieces)) == [10 + offset for offset in offsets]


# Whole characters, pieces of 2-, 3- and 4-byte ones, and bytes that are no UTF-8.
_token_bytes = st.lists(
    st.sampled_from(
        [b"a", b" ", "é".encode(), b"\xe6", b"\x9d\xb1", b"\xf0\x9f", b"\x98\x80", b"\xff", b""]
    ),
    max_size=30,
)


@given(_token_bytes, st.lists(st.integers(min_value=0, max_value=30), max_size=5))
def test_a_streams_offsets_are_the_whole_answers_however_it_is_cut(
    pieces: list[bytes], cuts: list[int]
) -> None:
    scores = _scores(*pieces)
    whole = TextOffsets().place(scores)
    streamed, offsets, start = [], TextOffsets(), 0
    for cut in [*sorted(cuts), len(scores)]:
        streamed += offsets.place(scores[start : max(start, cut)])
        start = max(start, cut)
    assert streamed == whole
    text = b"".join(pieces).decode(errors="replace")
    assert whole == sorted(whole) and all(offset <= len(text) for offset in whole)


def test_chat_bytes_are_the_tokens_own_and_those_of_its_alternatives() -> None:
    own = {1: b" \xf0\x9f", 2: b"\x98\x80", 3: b"!", 4: b"<|endoftext|>"}
    scores = [TokenLogprob(-0.5, [1, 3], [-0.5, -1.0]), TokenLogprob(-0.1, [2, 4], [-0.1, -3.0])]
    packed = pack_logprobs(
        [1, 2], scores, 2, lambda t: own[t].decode(errors="replace"), own.__getitem__
    )
    content = chat_logprobs(unpack_logprobs(packed))["content"]
    assert b"".join(bytes(token["bytes"]) for token in content).decode() == " 😀"
    assert [token["token"] for token in content] == [" \ufffd", "\ufffd\ufffd"]
    assert [entry["bytes"] for entry in content[1]["top_logprobs"]] == [
        list(b"\x98\x80"),
        list(b"<|endoftext|>"),
    ]
    # A token the text leaves out (an end or stop token) travels without bytes.
    left_out = pack_logprobs(
        [4], [scores[1]], 0, lambda t: "<|endoftext|>", own.__getitem__, [False]
    )
    assert unpack_logprobs(left_out)[0].bytes == b""


def test_completions_name_a_token_that_splits_a_character_by_its_bytes() -> None:
    """Keyed by text, every such token was U+FFFD: they overwrote one another in
    top_logprobs, the chosen token's own logprob among them, and entries went
    missing."""
    own = {1: b"\xe6\x9d", 2: b"\xe6\xbc", 3: b"\xf0\x9f", 4: "\ufffd".encode(), 5: b"a"}
    scores = [TokenLogprob(-2.0, [2, 3, 1, 4, 5], [-0.5, -1.0, -2.0, -3.0, -4.0])]
    packed = pack_logprobs(
        [1], scores, 5, lambda t: own[t].decode(errors="replace"), own.__getitem__
    )
    logprobs = completion_logprobs(unpack_logprobs(packed), [0])
    assert logprobs["tokens"] == ["bytes:\\xe6\\x9d"]
    assert logprobs["top_logprobs"] == [
        {
            "bytes:\\xe6\\xbc": -0.5,
            "bytes:\\xf0\\x9f": -1.0,
            "bytes:\\xe6\\x9d": -2.0,  # the chosen token's own
            "\ufffd": -3.0,  # a U+FFFD the model writes: a whole character
            "a": -4.0,
        }
    ]


def test_logprobs_whose_lists_do_not_agree_or_score_above_0_are_refused() -> None:
    """Where a frame is read (the codec builds the message), so that a worker's
    broken answer fails its request there, not half way through a stream."""
    packed = pack_logprobs([1], [TokenLogprob(-0.5, [], [])], 0, lambda t: "a", lambda t: b"a")
    assert unpack_logprobs(packed)[0].bytes == b"a"
    for broken in ({"byte_lens": [1, 0]}, {"token_bytes": b"ab"}, {"text_lens": [2]}):
        with pytest.raises(ValueError, match="whose lists do not agree"):
            dataclasses.replace(packed, **broken)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logprobs above 0"):
        dataclasses.replace(packed, logprobs=[math.inf])
