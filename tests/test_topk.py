"""The two-stage top-k gives exactly ``torch.topk``'s ids (no ties in random float64 data)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.engine.topk import BLOCK, top_k_ids


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 5 * BLOCK * 8 + 37), k=st.integers(1, 12), seed=st.integers(0, 10**6))
def test_equals_torch_topk(rows: int, vocab: int, k: int, seed: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected = torch.topk(logits, min(k, vocab), dim=-1).indices
    assert torch.equal(top_k_ids(logits, k), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_vocabulary_sizes(dtype) -> None:
    for vocab in (151936, 32000, 50257):
        logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
        got = top_k_ids(logits, 8)
        # bf16 has ties: compare the values picked, which are what "the top-k" means
        assert torch.equal(logits.gather(1, got), torch.topk(logits, 8, dim=-1).values)


def test_the_winner_hidden_in_a_block_with_a_lower_maximum_is_found() -> None:
    logits = torch.zeros(1, 40 * BLOCK)
    logits[0, 5] = 10.0          # block 0 holds the two best values
    logits[0, 6] = 9.0
    logits[0, 3 * BLOCK] = 8.0   # each other block holds one
    logits[0, 7 * BLOCK] = 7.0
    assert top_k_ids(logits, 4).tolist() == [[5, 6, 3 * BLOCK, 7 * BLOCK]]
