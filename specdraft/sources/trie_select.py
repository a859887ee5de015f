"""The frequency trie's retrieval: the most frequent prefix-closed subtree below a matched suffix.

Multi-stage retrieval (Zhao et al., Sec. 4.3.2): match the longest suffix of the context (at most
``branch_length`` tokens) that is a key and whose subtree offers at least ``min_nodes`` nodes;
shorten it until one does (if none does, the stage that offered the most nodes wins, the longer
suffix on ties). Below the match, take the ``k`` most frequent nodes, best first, ties to the most
recently touched: a prefix-closed subtree (Sec. 4.2's hierarchical draft), because a child is never
more frequent than its parent and enters the frontier only after it. Its root-to-leaf paths are
the draft, the most frequent leaf first.

A request drafts from two stores read as one: the shared store and its own overlay (what it
taught in its prompt and output so far; see :mod:`specdraft.sources.trie`). A key's counts are
the sum of its counts in both; its stamp is the overlay's when the overlay has it (overlay stamps
start past any shared stamp: what the request itself saw is the most recent), the shared one
otherwise. Sums keep the invariant the selection rests on (a parent is at least as frequent as
its children). Ties in ``(frequency, stamp)`` do not happen between frontier nodes: an equal
stamp means the same last window, hence one path, and an ancestor and its descendant are never
in the frontier together.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from .trie_store import NodeStore

__all__ = ["Selected", "branches", "retrieve"]

#: One selected node: (token, frequency, depth, index of its parent in the selection or -1).
Selected = tuple[int, float, int, int]

def retrieve(shared: NodeStore, overlay: NodeStore | None, tokens: Sequence[int], k: int, branch_length: int,
             min_nodes: int) -> list[Selected]:
    """Multi-stage retrieval over ``shared`` and ``overlay`` read as one (see the module
    docstring); returns the selection (empty when no suffix of ``tokens`` matches)."""
    n = len(tokens)
    need = min(min_nodes, k)
    best: list[Selected] = []
    for m in range(min(branch_length, n), 0, -1):
        s = shared.find(tokens, n - m, n)
        o = overlay.find(tokens, n - m, n) if overlay is not None else -1
        if (s < 0 or not shared.children[s]) and (o < 0 or not overlay.children[o]):  # type: ignore[union-attr]
            continue
        selected = select(shared, s, overlay, o, k)
        if len(selected) >= need:
            return selected
        if len(selected) > len(best):
            best = selected
    return best


def select(shared: NodeStore, s: int, overlay: NodeStore | None, o: int, k: int) -> list[Selected]:
    """The ``k`` most frequent nodes below shared node ``s`` and overlay node ``o`` (either may be
    -1: absent), best first, as :data:`Selected` tuples. Below a node only one store has, only that
    store is read, so a request without an overlay costs what a single trie does."""
    w = shared.prompt_weight
    s_out, s_stamp, s_children = shared.out, shared.stamp, shared.children
    # the shared store holds prompt counts only in the eliminate=False ablation: skip them otherwise
    s_prompt = shared.prompt if shared.holds_prompt else None
    if overlay is not None:
        o_out, o_prompt, o_stamp, o_children = overlay.out, overlay.prompt, overlay.stamp, overlay.children
        level = overlay.depth[o] + 1 if o >= 0 else shared.depth[s] + 1
    else:
        o_out = o_prompt = o_stamp = o_children = []  # never read: every overlay node is -1
        level = shared.depth[s] + 1
    push, pop = heapq.heappush, heapq.heappop
    heap: list[tuple[float, int, int, int, int, int]] = []
    selected: list[Selected] = []
    if k <= 0:
        return selected
    cs, co, index = s, o, -1
    while True:  # push the children of (cs, co), then pop the best node of the frontier
        shared_kids = s_children[cs] if cs >= 0 else None
        own_kids = o_children[co] if co >= 0 else None
        if own_kids is None:
            if shared_kids is None:
                pass
            elif s_prompt is None:
                for t, c in shared_kids.items():
                    push(heap, (-s_out[c], -s_stamp[c], t, c, -1, index))
            else:
                for t, c in shared_kids.items():
                    push(heap, (-(s_out[c] + w * s_prompt[c]), -s_stamp[c], t, c, -1, index))
        elif shared_kids is None:
            for t, d in own_kids.items():
                push(heap, (-(o_out[d] + w * o_prompt[d]), -o_stamp[d], t, -1, d, index))
        else:
            get = own_kids.get
            for t, c in shared_kids.items():
                f = s_out[c] if s_prompt is None else s_out[c] + w * s_prompt[c]
                d = get(t, -1)
                if d < 0:
                    push(heap, (-f, -s_stamp[c], t, c, -1, index))
                else:
                    push(heap, (-(f + o_out[d] + w * o_prompt[d]), -o_stamp[d], t, c, d, index))
            for t, d in own_kids.items():
                if t not in shared_kids:
                    push(heap, (-(o_out[d] + w * o_prompt[d]), -o_stamp[d], t, -1, d, index))
        if not heap:
            return selected
        f, _, t, cs, co, parent = pop(heap)
        index = len(selected)
        depth = level if parent < 0 else selected[parent][2] + 1
        selected.append((t, -f, depth, parent))
        if index + 1 >= k:
            return selected


def branches(selected: list[Selected], k: int, parallel: bool) -> list[list[int]]:
    """Root-to-leaf token paths of a selection, most frequent leaf first (deeper first on ties,
    then selection order). Parallel mode keeps whole paths while their total length fits ``k``
    (the last one cut to fit), shared prefixes counted once per branch."""
    has_child = [False] * len(selected)
    for _, _, _, parent in selected:
        if parent >= 0:
            has_child[parent] = True
    leaves = [i for i in range(len(selected)) if not has_child[i]]
    leaves.sort(key=lambda i: (-selected[i][1], -selected[i][2], i))
    paths: list[list[int]] = []
    for leaf in leaves:
        path = []
        i = leaf
        while i >= 0:
            t, _, _, i = selected[i]
            path.append(t)
        path.reverse()
        paths.append(path)
    if parallel:
        kept, left = [], k
        for path in paths:
            if left <= 0:
                break
            kept.append(path[:left])
            left -= len(kept[-1])
        paths = kept
    return paths
