"""The frequency trie's retrieval: the most frequent prefix-closed subtree below a matched suffix.

Multi-stage retrieval (Zhao et al., Sec. 4.3.2): match the longest suffix of the context (at most
``branch_length`` tokens) that is a key and whose subtree offers at least ``min_nodes`` nodes;
shorten it until one does (if none does, the stage that offered the most nodes wins, the longer
suffix on ties). Below the match, take the ``k`` most frequent nodes, best first, ties to the most
recently touched: a prefix-closed subtree (Sec. 4.2's hierarchical draft), because a child is never
more frequent than its parent and enters the frontier only after it. Its root-to-leaf paths are
the draft, the most frequent leaf first.

Every request drafts from the store's sums, the shared part and the running part added (see
:mod:`~specdraft.sources.trie_store`): one lookup per node, whatever the number of requests
running. Ties in ``(frequency, stamp)`` do not happen between frontier nodes: an equal stamp means
the same last window, hence one path, and an ancestor and its descendant are never in the frontier
together.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from .base import within_budget
from .trie_store import NodeStore

__all__ = ["Selected", "branches", "retrieve"]

#: One selected node: (token, frequency, depth, index of its parent in the selection or -1).
Selected = tuple[int, float, int, int]


def retrieve(store: NodeStore, tokens: Sequence[int], k: int, branch_length: int, min_nodes: int) -> list[Selected]:
    """Multi-stage retrieval (see the module docstring); returns the selection (empty when no
    suffix of ``tokens`` matches)."""
    n = len(tokens)
    need = min(min_nodes, k)
    best: list[Selected] = []
    for m in range(min(branch_length, n), 0, -1):
        node = store.find(tokens, n - m, n)
        if node < 0 or not store.children[node]:
            continue
        selected = select(store, node, k)
        if len(selected) >= need:
            return selected
        if len(selected) > len(best):
            best = selected
    return best


def select(store: NodeStore, start: int, k: int) -> list[Selected]:
    """The ``k`` (at least 1) most frequent nodes below ``start``, a node with children (best
    first; ties: most recent first), as :data:`Selected` tuples: a prefix-closed subtree, because a
    child is never more frequent than its parent and enters the frontier only after it."""
    w = store.prompt_weight
    out, prompt, stamp, children, token, depth = (store.out, store.prompt, store.stamp, store.children, store.token,
                                                  store.depth)
    heap = [(-(out[c] + w * prompt[c]), -stamp[c], c, -1) for c in children[start].values()]  # type: ignore[union-attr]
    heapq.heapify(heap)
    push, pop, pushpop = heapq.heappush, heapq.heappop, heapq.heappushpop
    selected: list[Selected] = []
    # Items are unique (a node is in them once), so which item each pop gives depends on the set
    # in the heap alone: a node's only child is taken at once when it beats the frontier, and
    # pushed and popped in one call when it does not (a trie's subtrees are mostly chains).
    item = pop(heap) if heap else None
    while item is not None:
        f, _, c, parent = item
        index = len(selected)
        selected.append((token[c], -f, depth[c], parent))
        if index + 1 >= k:
            break
        kids = children[c]
        if kids is not None and len(kids) == 1:
            for d in kids.values():
                child = (-(out[d] + w * prompt[d]), -stamp[d], d, index)
            item = child if not heap or child < heap[0] else pushpop(heap, child)
            continue
        if kids is not None:
            for d in kids.values():
                push(heap, (-(out[d] + w * prompt[d]), -stamp[d], d, index))
        item = pop(heap) if heap else None
    return selected


def branches(selected: list[Selected], k: int, parallel: bool) -> list[list[int]]:
    """Root-to-leaf token paths of a selection, most frequent leaf first (deeper first on ties,
    then selection order). Parallel mode keeps whole paths while their total length fits ``k``
    (the last one cut to fit), shared prefixes counted once per branch."""
    parents = {parent for _, _, _, parent in selected}
    leaves = [i for i in range(len(selected)) if i not in parents]
    leaves.sort(key=lambda i: (-selected[i][1], -selected[i][2], i))
    paths: list[list[int]] = []
    for i in leaves:
        path = []
        while i >= 0:
            t, _, _, i = selected[i]
            path.append(t)
        path.reverse()
        paths.append(path)
    return within_budget(paths, k) if parallel else paths
