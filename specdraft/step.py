"""One request's committed sequence and one step's tree, laid out for a forward.

Shared by the one-request loop (:mod:`specdraft.decoder`) and the batched one
(:mod:`specdraft.batch`): what a request holds between steps, how a step's tree and side blocks
become one forward's rows, and how a request's sources are finished.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .budget import BudgetDecision
from .sources.base import Context, Draft, DraftSource, SideBlock, TokenView
from .tree import TokenTree

#: Request ids, unique in the process: sources shared by several decoders (or by the requests of a
#: batch) keep per-request state under them.
request_ids = itertools.count(1)


def step_input(tree: TokenTree, sides: Sequence[SideBlock | None]
                ) -> tuple[list[int], np.ndarray, np.ndarray, list[slice | None]]:
    """Lay out one forward: tree nodes, then each source's side block, with the block mask and
    each source's rows of the output (``None`` for a source without a side block this step).

    Tree nodes see their ancestors; side tokens see themselves, the root (if asked) and what their
    own mask allows; nothing crosses between the tree and a side block or between two side blocks.
    """
    n = len(tree)
    total = n + sum(len(s.tokens) for s in sides if s is not None)
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
    return tokens, np.concatenate(offsets), block, slices


@dataclass
class Request:
    """The committed sequence of one request (prompt + output) and its id."""

    committed: list[int]
    prompt_length: int
    request_id: int

    @property
    def root(self) -> int:
        return self.committed[-1]

    @property
    def output(self) -> list[int]:
        return self.committed[self.prompt_length :]

    def context(self) -> Context:
        """The sequence as the sources see it: a read-only view, not a copy (O(1) per step)."""
        return Context(TokenView(self.committed), self.prompt_length, self.request_id)

    def prompt_context(self) -> Context:
        """The prompt alone (what ``begin`` sees), as a view even after tokens were committed."""
        return Context(TokenView(self.committed, self.prompt_length), self.prompt_length, self.request_id)

    def commit(self, tokens: Sequence[int]) -> int:
        """Append ``tokens``; returns the index of the first of them."""
        start = len(self.committed)
        self.committed.extend(tokens)
        return start


@dataclass
class Step:
    """One step between its drafting and its verification. Step 0, the prompt's prefill verified
    on a root-only tree, has no drafts and no ``forward_input`` of its own."""

    tree: TokenTree
    drafts: list[Draft]
    side_slices: list[slice | None]  # each source's side-block rows of the forward's output
    forward_input: tuple[list[int], np.ndarray, np.ndarray] | None  # tokens, position offsets, mask
    decision: BudgetDecision
    started: float
    #: each node's path tokens on the device, ``[nodes, depth]`` (repetition penalty, batched rows)
    path_tokens: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return len(self.forward_input[0]) if self.forward_input is not None else 1


def path_tokens(tree: TokenTree) -> np.ndarray:
    """``[nodes, depth]``: row ``i`` holds the tokens on node ``i``'s path below the root, padded
    with the root's token (which the committed prefix holds already, so padding changes no mask)."""
    n, depth = len(tree), max(1, max(tree.depth))
    out = np.full((n, depth), tree.tokens[0], dtype=np.int64)
    for i in range(1, n):
        d = tree.depth[i]
        out[i, : d - 1] = out[tree.parents[i], : d - 1]
        out[i, d - 1] = tree.tokens[i]
    return out


def eos_ids(model: Any) -> list[int]:
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def finish_sources(sources: Sequence[DraftSource], context: Context, failed: bool) -> None:
    """End every begun source, or, when the request failed, ``abort`` those that can undo what it
    taught them (see :class:`~specdraft.sources.base.DraftSource`). Every source is finished even
    if one raises; the first such error is raised afterwards (unless the request already failed,
    whose own error then stands)."""
    error: BaseException | None = None
    for source in sources:
        finish = getattr(source, "abort", None) if failed else None
        try:
            (finish or source.end)(context)
        except Exception as exc:  # noqa: BLE001 - finish the others first
            error = error or exc
    if error is not None and not failed:
        raise error
