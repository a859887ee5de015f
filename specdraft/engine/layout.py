"""Lay out: a request's checked tree and side blocks as rows of the forward.

Rows are the tree's nodes (root first, in tree order) followed by each source's side block. Tree
nodes see their ancestors; side tokens see themselves, the root (if asked) and what their own mask
allows; nothing crosses between the tree and a side block or between two side blocks. Positions
are depths below the root (side tokens give their own offsets), counted from the first position
after the request's cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..sources.base import SideBlock
from ..tree import TokenTree


@dataclass(frozen=True)
class Rows:
    """One request's rows of a forward: token ids, positions relative to the root, the block mask
    among them, and each source's side-block rows (``None``: none this step)."""

    tokens: list[int]
    offsets: np.ndarray
    block: np.ndarray
    side_slices: list[slice | None]


def tree_rows(tree: TokenTree, sides: Sequence[SideBlock | None]) -> Rows:
    """The rows of ``tree`` and ``sides`` (see the module docstring)."""
    n = len(tree)
    total = n + sum(len(s.tokens) for s in sides if s is not None)
    if total == n:  # no side block this step (the common case): the tree's own mask is the block
        return Rows(list(tree.tokens), tree.position_offsets(), tree.ancestor_mask(), [None] * len(sides))
    block = np.zeros((total, total), dtype=bool)
    block[:n, :n] = tree.ancestor_mask()
    tokens = list(tree.tokens)
    offsets = [tree.position_offsets()]
    slices: list[slice | None] = []
    at = n
    for side in sides:
        if side is None or not side.tokens:
            slices.append(None)
            continue
        m = len(side.tokens)
        # a side token always sees itself, so no attention row is empty (an empty row is NaN in
        # eager attention, and a NaN there spreads to every token at the next layer)
        block[at : at + m, at : at + m] = side.mask | np.eye(m, dtype=bool)
        if side.sees_root:
            block[at : at + m, 0] = True
        tokens.extend(int(t) for t in side.tokens)
        offsets.append(np.asarray(side.positions, dtype=np.int64))
        slices.append(slice(at, at + m))
        at += m
    return Rows(tokens, np.concatenate(offsets), block, slices)
