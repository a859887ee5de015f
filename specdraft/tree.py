"""The token tree: every source's guesses merged into one structure the model checks at once.

Node 0 is the root (the newest committed token, not yet in the KV cache). Every other node is a
draft token whose parent is the token before it. Branches that share a prefix share nodes
("hierarchical" multi-branch drafts in the Ant paper), so a tree of ``n`` nodes costs one forward
pass of ``n`` tokens however many branches it holds. Pure Python/numpy, no model.

Merging by expected value
    Several sources' branches become one tree of at most ``n`` nodes by value, not by source
    order: each candidate node has a conditional acceptance rate (the chance the model accepts it
    once its parent is accepted), given per source by a rate function (the decoder's is learned
    online, :mod:`specdraft.calibration`); a node's value is the product of the rates along its
    path, its probability of being accepted. The tree is the best-first selection over the
    frontier (a max-heap; a node enters only after its parent, as in EAGLE-2 and Sequoia), so a
    source whose nodes are accepted fills the budget before one whose nodes are not, whatever
    the order the sources were listed in. The selection never depends on ``n``: the tree of
    budget ``n`` is exactly the first ``n`` nodes of the full tree, which the adaptive budget
    relies on (:mod:`specdraft.budget`).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

import numpy as np

#: ``rate(source_index, depth, rank) -> probability``: the chance that a node a source proposed at
#: ``depth`` (1 = a child of the root) as its ``rank``-th child of that parent (0 = the source's
#: first) is accepted, given that its parent is.
RateFn = Callable[[int, int, int], float]

#: Rates are kept inside this interval: a log of 0 is undefined, and a rate of 1 would tie a node
#: with its parent.
_RATE_FLOOR = 1e-6
_RATE_CEIL = 1.0 - 1e-6


def prior_rate(source_index: int, depth: int, rank: int) -> float:
    """The rate assumed before anything is observed: the same for every source and depth (so
    equal sources share the budget fairly), halved, thirded, ... for a source's later siblings,
    so its own best-first order is kept (a source's second guess for the same position is
    worth less than its first)."""
    return 0.5 / (1 + rank)


def combined_rate(proposers: Sequence[tuple[int, int]], depth: int, rate: RateFn) -> float:
    """The conditional acceptance rate of a node proposed by several ``(source, rank)`` pairs: a
    noisy-or of their rates (agreement is evidence: a node two sources propose is worth at least
    what the better one alone says), clipped to ``(0, 1)``."""
    miss = 1.0
    for source_index, rank in proposers:
        miss *= 1.0 - rate(source_index, depth, rank)
    return min(max(1.0 - miss, _RATE_FLOOR), _RATE_CEIL)


class TokenTree:
    """Flat arrays ``tokens``, ``parents``, ``depth`` plus a bit set of proposing sources per node.

    Nodes are stored in insertion order, which is always topological (a parent precedes its
    children), so ``range(len(tree))`` is a valid evaluation order and node ``i``'s ancestors all
    have smaller indices. ``proposers[i]`` lists the ``(source index, rank)`` pairs that proposed
    node ``i`` (``rank``: the node's place among that source's children of the same parent), which
    is what calibration learns from. ``full`` is the tree this one was cut from by :meth:`prefix`
    (``None`` for a tree built whole), so whoever needs the uncut tree does not rebuild it.
    """

    __slots__ = ("tokens", "parents", "depth", "sources", "proposers", "full", "_children")

    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depth: list[int] = [0]
        self.sources: list[int] = [0]
        self.proposers: list[tuple[tuple[int, int], ...]] = [()]
        self.full: TokenTree | None = None
        self._children: list[dict[int, int]] = [{}]

    def __setstate__(self, state: tuple[dict | None, dict]) -> None:
        """Unpickle, also a tree pickled before ``proposers`` and ``full`` existed (a budget's
        shadow trees in a saved benchmark checkpoint): no proposers recorded, built whole."""
        _, slots = state
        for name, value in slots.items():
            setattr(self, name, value)
        if "proposers" not in slots:
            self.proposers = [()] * len(self.tokens)
        if "full" not in slots:
            self.full = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_draft_nodes(self) -> int:
        """Nodes other than the root."""
        return len(self.tokens) - 1

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` carrying ``token``, if the tree has one."""
        return self._children[node].get(token)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in insertion order (for a merged tree: best first)."""
        return list(self._children[node].values())

    def add_branch(self, branch: Sequence[int], source_index: int = 0, max_new_nodes: int | None = None) -> int:
        """Insert ``branch`` below the root, reusing existing nodes for its shared prefix.

        At most ``max_new_nodes`` new nodes are created; the rest of the branch is cut, which keeps
        the tree prefix-closed. Returns the number of nodes created.
        """
        if source_index < 0 or source_index >= 62:
            raise ValueError(f"source_index must be in [0, 62), got {source_index}")
        bit = 1 << source_index
        node, created = 0, 0
        for token in branch:
            token = int(token)
            nxt = self._children[node].get(token)
            if nxt is None:
                if max_new_nodes is not None and created >= max_new_nodes:
                    break
                nxt = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depth.append(self.depth[node] + 1)
                self.sources.append(0)
                self.proposers.append(())
                self._children.append({})
                self._children[node][token] = nxt
                created += 1
            if not self.sources[nxt] & bit:
                rank = sum(1 for c in self._children[node].values() if c != nxt and self.sources[c] & bit)
                self.proposers[nxt] += ((source_index, rank),)
                self.sources[nxt] |= bit
            node = nxt
        return created

    @classmethod
    def from_drafts(cls, root_token: int, branches_per_source: Sequence[Sequence[Sequence[int]]], max_nodes: int,
                    rate: RateFn | None = None) -> "TokenTree":
        """Merge several sources' branch lists into one tree of at most ``max_nodes`` draft nodes,
        chosen best first by expected value (see the module docstring).

        ``rate`` gives each source's conditional acceptance rate by depth and sibling rank
        (:data:`RateFn`); without one, :func:`prior_rate`. A node several sources propose combines
        their rates (:func:`combined_rate`) and names them all in ``sources``. Ties (equal
        values) go to the node met first when the sources' branches are read in turns (first
        branch of every source, then the second, ...), so equal sources share the budget and
        the result is deterministic. The first ``n`` nodes never depend on ``max_nodes``: a
        smaller budget gives a prefix of the same tree.
        """
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        rate = prior_rate if rate is None else rate
        tree = cls(root_token)
        if max_nodes == 0:
            return tree
        # The frontier is expanded lazily: a node's children are made from the branches passing
        # through it only once it is selected, so the tails of branches that never make the cut
        # cost nothing. An entry is (k, source, branch), k the branch's place when the sources'
        # branches are read in turns; a node's tie-break is (smallest k through it, depth), packed
        # in one int, the order in which reading the branches in turns would first meet it (a
        # unique key, so the heap never compares further).
        width = len(branches_per_source)
        entries = [(r * width + s, s, branches[r]) for r in range(max((len(b) for b in branches_per_source), default=0))
                   for s, branches in enumerate(branches_per_source) if r < len(branches) and len(branches[r])]
        if width > 62 and any(entry[1] >= 62 for entry in entries):
            raise ValueError(f"at most 62 sources can be merged (a node's sources are a 62-bit set), got {width}")
        memo: dict[tuple[int, int, int], float] = {}
        log = math.log
        push, pop = heapq.heappush, heapq.heappop
        floor, ceil = _RATE_FLOOR, _RATE_CEIL
        tokens, parents, depths, sources, proposed, children = (tree.tokens, tree.parents, tree.depth, tree.sources,
                                                                tree.proposers, tree._children)
        # heap items: (-log value, tie-break, token, parent's index, entries through it, proposers, bits)
        heap: list[tuple[float, int, int, int, list, tuple, int]] = []
        # expand the node just selected (the root first): push its children, made from the branches
        # through it, unless the tree is full already
        index, depth, neg, passing = 0, 0, 0.0, entries
        while True:
            if len(passing) == 1:  # one branch's tail (the common case): one child, no grouping
                k, source, branch = passing[0]
                if len(branch) > depth:
                    key = (source, depth + 1, 0)
                    r = memo.get(key)
                    if r is None:
                        r = memo[key] = rate(source, depth + 1, 0)
                    q = floor if r < floor else ceil if r > ceil else r
                    child_neg, child_key = neg - log(q), (k << 32) | (depth + 1)
                    if not heap or child_neg < heap[0][0] or (child_neg == heap[0][0] and child_key < heap[0][1]):
                        # it beats the whole frontier: select it now (what a push and a pop would do)
                        token, parent, index = int(branch[depth]), index, len(tokens)
                        depth, neg = depth + 1, child_neg
                        tokens.append(token)
                        parents.append(parent)
                        depths.append(depth)
                        sources.append(1 << source)
                        proposed.append(((source, 0),))
                        children.append({})
                        children[parent][token] = index
                        if len(tokens) > max_nodes:
                            break
                        continue
                    push(heap, (child_neg, child_key, int(branch[depth]), index, passing, ((source, 0),), 1 << source))
            else:
                groups: dict[int, list] = {}
                ranks: dict[int, int] = {}
                for entry in passing:
                    k, source, branch = entry
                    if len(branch) <= depth:
                        continue
                    token = branch[depth]
                    group = groups.get(token)
                    if group is None:
                        group = groups[token] = [k, [], [], 0]
                    if not group[3] >> source & 1:
                        rank = ranks.get(source, 0)
                        ranks[source] = rank + 1
                        group[2].append((source, rank))
                        group[3] |= 1 << source
                    group[1].append(entry)
                child_depth = depth + 1
                for token, (k, through, proposers, bits) in groups.items():
                    miss = 1.0
                    for source, rank in proposers:
                        key = (source, child_depth, rank)
                        r = memo.get(key)
                        if r is None:
                            r = memo[key] = rate(source, child_depth, rank)
                        miss *= 1.0 - r
                    q = 1.0 - miss
                    q = floor if q < floor else ceil if q > ceil else q
                    push(heap, (neg - log(q), (k << 32) | child_depth, int(token), index, through, tuple(proposers),
                                bits))
            if not heap or len(tokens) > max_nodes:
                break
            # select the most valuable node of the frontier
            neg, key, token, parent, passing, proposers, bits = pop(heap)
            index = len(tokens)
            depth = key & 0xFFFFFFFF
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            sources.append(bits)
            proposed.append(proposers)
            children.append({})
            children[parent][token] = index
            if len(tokens) > max_nodes:
                break
        return tree

    def prefix(self, max_nodes: int) -> "TokenTree":
        """The first ``max_nodes`` draft nodes of this tree (all of it if it has fewer), as a new
        tree whose :attr:`full` is this one's full tree. A merged tree lists its nodes best first,
        so this is the tree a budget of ``max_nodes`` gets."""
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        n = min(len(self.tokens), max_nodes + 1)
        cut = TokenTree(self.tokens[0])
        cut.tokens = self.tokens[:n]
        cut.parents = self.parents[:n]
        cut.depth = self.depth[:n]
        cut.sources = self.sources[:n]
        cut.proposers = self.proposers[:n]
        cut.full = self.full if self.full is not None else self
        children: list[dict[int, int]] = [{} for _ in range(n)]
        tokens, parents = cut.tokens, cut.parents
        for i in range(1, n):
            children[parents[i]][tokens[i]] = i
        cut._children = children
        return cut

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        path.reverse()
        return path

    def ancestor_mask(self) -> np.ndarray:
        """``mask[i, j]`` is True when node ``j`` is ``i`` itself or one of its ancestors.

        This is the attention pattern of the tree: each node sees exactly the tokens that precede
        it on its own branch, as it would in a plain left-to-right pass.
        """
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def position_offsets(self) -> np.ndarray:
        """Each node's position relative to the root (= its depth)."""
        return np.asarray(self.depth, dtype=np.int64)

    def branches(self) -> list[list[int]]:
        """The token sequences of every root-to-leaf path (for inspection and tests)."""
        leaves = [i for i in range(1, len(self.tokens)) if not self._children[i]]
        return [[self.tokens[j] for j in self.path_to(leaf)] for leaf in leaves]

    def __repr__(self) -> str:
        return f"TokenTree(root={self.tokens[0]}, nodes={len(self.tokens)}, branches={len(self.branches())})"
