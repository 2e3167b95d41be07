"""A batch's grammar masks on its logits (`worker.model.token_mask`): only the
constrained rows change, each only where its grammar bans a token."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from worker.engine.grammar import TokenMasks  # noqa: E402
from worker.model.token_mask import apply_token_masks  # noqa: E402


def _masks(rows: list[int], allowed: list[set[int]], vocab_size: int) -> TokenMasks:
    bits = np.zeros((len(rows), (vocab_size + 31) // 32 * 32), dtype=np.uint8)
    for k, tokens in enumerate(allowed):
        bits[k, sorted(tokens)] = 1
    words = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    return TokenMasks(rows, np.ascontiguousarray(words))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_only_the_constrained_rows_change_and_only_where_banned(dtype: torch.dtype) -> None:
    vocab_size = 70  # not a multiple of 32: the last word is cut
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[3, 7] = float("-inf")  # min_tokens suppression before the mask stays
    before = logits.clone()
    allowed = [{0, 7, 69}, {5}]
    apply_token_masks(logits, _masks([1, 3], allowed, vocab_size))
    for row in (0, 2, 4):
        assert torch.equal(logits[row], before[row])
    for row, tokens in zip([1, 3], allowed, strict=True):
        kept = sorted(tokens)
        assert torch.equal(logits[row, kept], before[row, kept])
        banned = [t for t in range(vocab_size) if t not in tokens]
        assert bool((logits[row, banned] <= -1e30).all())
        assert not logits[row].isnan().any()
    assert int(logits[1].argmax()) in allowed[0]
    assert int(logits[3].argmax()) == 5


def test_tokens_past_the_grammars_vocabulary_are_banned() -> None:
    """A model with more rows than the grammar's tokenizer has tokens."""
    logits = torch.zeros(1, 100)
    apply_token_masks(logits, _masks([0], [{1, 2}], vocab_size=40))
    assert torch.equal((logits[0] == 0).nonzero()[:, 0], torch.tensor([1, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_banned_token_stays_banned_however_high_its_logit(dtype: torch.dtype) -> None:
    """A repetition penalty of 1e-31 lifts a repeated token's logit past 1e30:
    lowered by 1e30, where the mask was -1e30, it still won over the allowed.
    (The penalties leave no logit infinite.)"""
    highest = torch.finfo(dtype).max
    logits = torch.tensor([[min(1e32, highest), 1.0, highest, 2.0]], dtype=dtype)
    apply_token_masks(logits, _masks([0], [{1, 3}], vocab_size=4))
    assert int(logits[0].argmax()) == 3
    assert logits[0].tolist() == [float("-inf"), 1.0, float("-inf"), 2.0]
