"""Prompt lookup's incremental n-gram index drafts exactly what a full rescan of the context does.

The index (``_TailIndex``) is grown by the tokens each step commits instead of rescanning the whole
context every step; the reference below is that rescan (the source's earlier implementation), so
any difference in which matches are found, their order (most recent first), the branch lengths or
the de-duplication shows up here.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st
from numpy.lib.stride_tricks import sliding_window_view

from conftest import FAST
from specdraft.sources import Context, PromptLookup
from specdraft.sources.base import TokenView


def rescan_draft(source: PromptLookup, tokens: list[int], budget: int) -> list[list[int]]:
    """Match the tail against every window of the context, longest n first (a full rescan)."""
    array = np.asarray(tokens, dtype=np.int64)
    length = len(array)
    for n in range(min(source.max_ngram, length - 1), source.min_ngram - 1, -1):
        windows = sliding_window_view(array[:-1], n)
        starts = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if len(starts) == 0:
            continue
        branches: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        left = budget
        for begin in starts[::-1] + n:
            if len(branches) >= source.max_branches or left <= 0:
                break
            cont = tuple(array[begin : begin + min(source.num_tokens, left)].tolist())
            if cont and cont not in seen and not any(s[: len(cont)] == cont for s in seen):
                seen.add(cont)
                branches.append(list(cont))
                left -= len(cont)
        return branches
    return []


@FAST
@given(prompt=st.lists(st.integers(0, 5), min_size=1, max_size=40),
       steps=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=12),
       max_ngram=st.integers(1, 4), budget=st.integers(0, 12), branches=st.integers(1, 3))
def test_incremental_index_drafts_what_a_rescan_drafts(prompt, steps, max_ngram, budget, branches) -> None:
    source = PromptLookup(max_ngram=max_ngram, min_ngram=1, num_tokens=5, max_branches=branches)
    committed = list(prompt)
    source.begin(Context(TokenView(committed), len(prompt), 7))
    for chunk in [[]] + steps:
        committed.extend(chunk)
        context = Context(TokenView(committed), len(prompt), 7)
        assert source.propose(context, budget).branches == rescan_draft(source, committed, budget)
    source.end(Context(TokenView(committed), len(prompt), 7))
    assert source.active_requests == 0


def test_token_view_is_a_fixed_window_of_a_growing_list() -> None:
    tokens = [5, 6, 7]
    view = TokenView(tokens)
    tokens.extend([8, 9])
    assert len(view) == 3 and list(view) == [5, 6, 7] and view[-1] == 7 and view[1:] == [6, 7]
    assert view == (5, 6, 7) and view == [5, 6, 7] and np.asarray(view).tolist() == [5, 6, 7]
    try:
        view[3]
    except IndexError:
        pass
    else:
        raise AssertionError("a view must not reach past its length")
