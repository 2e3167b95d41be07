"""Completions logprobs' text offsets, where tokens split characters."""

from __future__ import annotations

import pytest

from frontend.logprobs import token_offsets

SPLIT = "\N{REPLACEMENT CHARACTER}"  # a token's text for part of a character's bytes


@pytest.mark.parametrize(
    ("tokens", "text", "offsets"),
    [
        (["a", "b c"], "ab c", [0, 1]),
        # GPT-2 writes " 🎉" as three tokens: " \xf0\x9f", "\x8e", "\x89".
        (["a", f" {SPLIT}", SPLIT, SPLIT, " ok"], "a 🎉 ok", [0, 1, 2, 2, 3]),
        # A token that ends a character and goes on: it begins with the character.
        (["a" + SPLIT, SPLIT * 3 + "b", "c"], "a🎉bc", [0, 1, 3]),
        (["hé", "llo"], "héllo", [0, 2]),
        # Cut mid-character at the end, or by a stop string: never past the text.
        (["x", SPLIT], "x", [0, 1]),
        (["a", " stop"], "a", [0, 1]),
        # A text that holds U+FFFD itself.
        (["a", SPLIT, "b"], f"a{SPLIT}b", [0, 1, 2]),
    ],
)
def test_each_token_is_placed_where_its_text_begins(
    tokens: list[str], text: str, offsets: list[int]
) -> None:
    assert token_offsets(tokens, text) == offsets
    assert token_offsets(tokens, text, start=10) == [10 + offset for offset in offsets]
