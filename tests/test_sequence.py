"""Finishing rules and incremental detokenization of one sequence."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import GenerateRequest
from worker.engine.fake_engine import CharTokenizer
from worker.engine.logprobs import UNSCORED, TokenLogprob
from worker.engine.sequence import Sequence

EOS = 0


class ByteTokenizer:
    """Each token is one UTF-8 byte, so a multi-byte character spans tokens."""

    eos_token_id: int | None = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Seq[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


def make(
    tokenizer: CharTokenizer | ByteTokenizer | None = None,
    max_new_tokens: int = 64,
    **fields: object,
) -> Sequence:
    tokenizer = tokenizer or ByteTokenizer()
    request = GenerateRequest("r", "p", max_new_tokens, **fields)  # type: ignore[arg-type]
    return Sequence(request, tokenizer.encode("p"), tokenizer, slot=0)


def feed_ids(seq: Sequence, token_ids: list[int]) -> list[str]:
    """Append the tokens one at a time; return the streamed text deltas."""
    deltas = []
    for token_id in token_ids:
        if seq.finish_reason is not None:
            break
        seq.append(token_id)
        deltas.append(seq.take_delta()[1])
    return deltas


def feed(seq: Sequence, text: str | bytes) -> list[str]:
    """Append the text's tokens (its bytes) one at a time; return the streamed deltas."""
    return feed_ids(seq, list(text.encode() if isinstance(text, str) else text))


def test_stop_string_split_across_tokens_cuts_the_output_before_it() -> None:
    seq = make(stop=["END"])
    feed(seq, "abcENDxyz")
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "abc"
    assert len(seq.output_token_ids) == len("abcEND")


def test_stop_string_inside_one_multi_char_token_is_found() -> None:
    seq = make(CharTokenizer(), stop=["b"])
    seq.append(ord("a"))
    assert seq.finish_reason is None
    seq.append(ord("b"))
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "a"


def test_earliest_of_several_stop_strings_wins() -> None:
    # "cd" and "bcd" both complete with the token "d"; "bcd" starts earlier.
    seq = make(CharTokenizer(), stop=["xyz", "cd", "bcd"])
    feed_chars(seq, "abcde")
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "a"


def feed_chars(seq: Sequence, text: str) -> None:
    for char in text:
        if seq.finish_reason is None:
            seq.append(ord(char))


def test_earliest_stop_string_wins_when_both_complete_in_one_token() -> None:
    tokenizer = MultiCharTokenizer({1: "a", 2: "XYZW"})
    seq = make(tokenizer, stop=["ZW", "XY"])  # type: ignore[arg-type]
    seq.append(1)
    seq.append(2)
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "a"


class MultiCharTokenizer:
    eos_token_id: int | None = None

    def __init__(self, vocab: dict[int, str]) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, token_ids: Seq[int]) -> str:
        return "".join(self.vocab[t] for t in token_ids)


def test_streaming_never_emits_a_stop_string_prefix_that_becomes_a_stop() -> None:
    seq = make(stop=["STOP"], stream=True)
    deltas = feed(seq, "go ST STO STOP tail")
    assert seq.finish_reason == "stop"
    assert "".join(deltas) == "go ST STO "
    assert seq.final_text() == "go ST STO "
    for delta in deltas:
        assert "STOP" not in delta


def test_held_back_stop_prefix_is_released_when_it_does_not_complete() -> None:
    seq = make(stop=["abc"], stream=True)
    deltas = feed(seq, "xab")
    assert "".join(deltas) == "x"  # "ab" might still become "abc"
    deltas += feed(seq, "d")
    assert "".join(deltas) == "xabd"


def test_held_back_stop_prefix_is_released_at_length() -> None:
    seq = make(max_new_tokens=3, stop=["abc"], stream=True)
    deltas = feed(seq, "xab")
    assert seq.finish_reason == "length"
    assert "".join(deltas) == "xab"


def test_multi_byte_characters_are_never_split_across_deltas() -> None:
    text = "añ€😀z"
    seq = make(stream=True)
    deltas = feed(seq, text)
    assert "".join(deltas) == text
    for delta in deltas:
        assert "\ufffd" not in delta
    assert [d for d in deltas if d] == ["a", "ñ", "€", "😀", "z"]


def test_stop_string_after_a_multi_byte_character() -> None:
    seq = make(stop=["é!"], stream=True)
    deltas = feed(seq, "caf\u00e9!more")
    assert seq.finish_reason == "stop"
    assert "".join(deltas) == "caf"
    assert seq.final_text() == "caf"


class BytesVocabTokenizer:
    """Tokens are byte strings, like byte-level BPE: one may end mid-character."""

    eos_token_id: int | None = None

    def __init__(self, vocab: dict[int, bytes]) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, token_ids: Seq[int]) -> str:
        return b"".join(self.vocab[t] for t in token_ids).decode(errors="replace")


def test_stop_string_is_found_when_length_ends_inside_a_held_back_character() -> None:
    # The last token holds a stop string and then starts a multi-byte character:
    # its text is held back, but the finish reason is still stop, not length.
    tokenizer = BytesVocabTokenizer({1: b"a", 2: b"x\xc3"})
    seq = make(tokenizer, max_new_tokens=2, stop=["x"])  # type: ignore[arg-type]
    seq.append(1)
    seq.append(2)
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "a"


# Byte-level BPE tokens: whole characters, a literal replacement character (GPT-2
# has one), the pieces of "€" (E2 82 AC) and "😀" (F0 9F 98 80), stray bytes.
PIECES = {
    1: b"a",
    2: "\ufffd".encode(),
    3: b"\xe2",
    4: b"\x82",
    5: b"\xac",
    6: b"\xe2\x82",
    7: b"\xf0\x9f",
    8: b"\x98\x80",
    9: b"\xff",
    10: "é".encode(),
}


def test_a_character_split_after_replacement_characters_is_whole() -> None:
    # Six tokens held (five literal replacement characters and a lead byte):
    # what is released must not cut the euro sign that the next two complete.
    tokenizer = BytesVocabTokenizer(PIECES)
    seq = make(tokenizer, stream=True, stop=["€"])  # type: ignore[arg-type]
    deltas = feed_ids(seq, [2, 2, 2, 2, 2, 3, 4, 5, 1])
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "\ufffd" * 5
    assert "".join(deltas) == "\ufffd" * 5


@settings(max_examples=300)
@given(st.lists(st.sampled_from(sorted(PIECES)), min_size=6, max_size=24))
def test_streamed_text_is_the_text_of_all_the_tokens_whatever_the_bytes(
    token_ids: list[int],
) -> None:
    tokenizer = BytesVocabTokenizer(PIECES)
    seq = make(tokenizer, max_new_tokens=len(token_ids) + 1, stream=True)  # type: ignore[arg-type]
    deltas = feed_ids(seq, token_ids)
    seq.abort()
    deltas.append(seq.take_delta()[1])
    assert "".join(deltas) == seq.final_text() == tokenizer.decode(token_ids)


STOPS = ["\ufffd", "\ufffd\ufffd", "a\ufffd", "\u20ac", "\u00e9", "\U0001f600", "aa"]


@settings(max_examples=300)
@given(
    st.lists(st.sampled_from(sorted(PIECES)), min_size=1, max_size=24),
    st.lists(st.sampled_from(STOPS), min_size=1, max_size=2),
)
def test_the_text_ends_before_the_first_stop_string_whatever_the_bytes(
    token_ids: list[int], stop: list[str]
) -> None:
    """Streamed or not, the output is the tokens' text up to the first stop
    string in it, and no character of a stop string is ever shown."""
    tokenizer = BytesVocabTokenizer(PIECES)
    for stream in (False, True):
        seq = make(tokenizer, max_new_tokens=len(token_ids), stream=stream, stop=stop)  # type: ignore[arg-type]
        deltas = feed_ids(seq, token_ids)
        text = tokenizer.decode(seq.output_token_ids)
        cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
        assert seq.final_text() == text[:cut]
        assert seq.finish_reason == ("stop" if cut < len(text) else "length")
        if stream:
            assert "".join(deltas) == text[:cut]


def test_invalid_utf8_is_released_after_a_few_tokens() -> None:
    seq = make(stream=True)
    deltas = feed(seq, b"a" + b"\xff" * 8)
    assert "".join(deltas).startswith("a\ufffd")
    assert seq.finish_reason is None


def test_a_stop_string_that_ends_within_min_tokens_stays_in_the_text() -> None:
    """vLLM's rule: stop strings are looked for only in the text of the tokens
    after the first min_tokens, and may begin before them."""
    for min_tokens, text, kept in [
        (0, "ENDxyz", ""),
        (2, "ENDxyz", ""),  # ends with the third token: cut
        (3, "ENDxyzEND", "ENDxyz"),  # ends with the third: kept; the next one cuts
        (3, "xENDab", "x"),  # begins within them, ends after them
    ]:
        seq = make(stop=["END"], min_tokens=min_tokens)
        feed(seq, text)
        assert seq.final_text() == kept, (min_tokens, text)
        assert seq.finish_reason == "stop", (min_tokens, text)


def test_stop_token_id_ends_the_sequence_and_is_not_in_the_text() -> None:
    seq = make(stop_token_ids=[ord("#")])
    feed(seq, "ab#cd")
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids[-1] == ord("#")
    assert seq.final_text() == "ab"


def test_eos_ends_the_sequence() -> None:
    seq = make()
    feed(seq, b"ab\x00cd")
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "ab"


def test_ignore_eos_generates_through_eos_until_length_and_leaves_its_text_out() -> None:
    seq = make(max_new_tokens=5, ignore_eos=True, stream=True)
    deltas = feed(seq, b"ab\x00cd")
    assert seq.finish_reason == "length"
    assert len(seq.output_token_ids) == 5
    assert "".join(deltas) == seq.final_text() == "abcd"


def test_a_sequence_resumed_past_an_ignored_eos_has_the_same_text() -> None:
    seq = make(max_new_tokens=6, ignore_eos=True, stream=True)
    seq.resume(list(b"ab\x00"), num_chars_shown=2)
    assert "".join(feed(seq, b"cde")) == "cde"
    assert seq.final_text() == "abcde"


def test_ignore_eos_still_honours_stop_token_ids() -> None:
    seq = make(ignore_eos=True, stop_token_ids=[ord("c")])
    feed(seq, b"ab\x00cd")
    assert seq.finish_reason == "stop"
    assert seq.final_text() == "ab"


def test_length_finishes_at_max_new_tokens() -> None:
    seq = make(max_new_tokens=3)
    feed(seq, "abcdef")
    assert seq.finish_reason == "length"
    assert seq.final_text() == "abc"


def test_streamed_deltas_add_up_to_the_final_text() -> None:
    seq = make(stream=True, stop=["zz"])
    deltas = feed(seq, "héllo wörld zz")
    assert "".join(deltas) == seq.final_text() == "héllo wörld "


def test_a_resumed_sequence_keeps_the_text_it_held_back() -> None:
    # "Hi\n" was streamed as "Hi": the "\n" may begin the stop string.
    seq = make(stop=["\n\n"], stream=True)
    seq.resume(list(b"Hi\n"), num_chars_shown=2)
    assert seq.take_delta() == ([], "")
    assert feed(seq, "\nmore") == [""]
    assert (seq.finish_reason, seq.final_text()) == ("stop", "Hi")


def test_a_resumed_sequence_completes_a_character_split_at_the_cut() -> None:
    seq = make(stream=True)
    seq.resume("a€".encode()[:2], num_chars_shown=1)
    assert feed(seq, "€".encode()[1:]) == ["", "€"]


def test_a_prompt_scored_in_chunks_is_whole_once_and_a_chunk_run_again_replaces_its_own() -> None:
    request = GenerateRequest("r", "prompt", 4, prompt_logprobs=0)
    seq = Sequence(request, list(b"prompt"), ByteTokenizer(), slot=0)
    assert seq.prompt_targets(0, 2) == list(b"ro") and seq.prompt_targets(4, 6) == list(b"t")
    scores = [UNSCORED, *(TokenLogprob(-float(i), [], []) for i in range(1, 6))]
    seq.score_prompt_chunk(0, 2, scores[1:3])
    assert seq.wants_prompt_logprobs and seq.take_prompt_logprobs() is None
    seq.score_prompt_chunk(2, 4, scores[3:5])
    seq.score_prompt_chunk(2, 4, scores[3:5])  # that chunk again, after a failure
    seq.score_prompt_chunk(4, 6, scores[5:])
    assert not seq.wants_prompt_logprobs
    assert seq.take_prompt_logprobs() == scores
