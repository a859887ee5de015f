"""The token tree: every source's guesses merged into one structure the model checks at once.

Node 0 is the root (the newest committed token, not yet in the KV cache). Every other node is a
draft token whose parent is the token before it. Branches that share a prefix share nodes
("hierarchical" multi-branch drafts in the Ant paper), so a tree of ``n`` nodes costs one forward
pass of ``n`` tokens however many branches it holds. Pure Python/numpy, no model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class TokenTree:
    """Flat arrays ``tokens``, ``parents``, ``depth`` plus a bit set of proposing sources per node.

    Nodes are stored in insertion order, which is always topological (a parent precedes its
    children), so ``range(len(tree))`` is a valid evaluation order and node ``i``'s ancestors all
    have smaller indices.
    """

    __slots__ = ("tokens", "parents", "depth", "sources", "_children")

    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depth: list[int] = [0]
        self.sources: list[int] = [0]
        self._children: list[dict[int, int]] = [{}]

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
        """Children of ``node`` in insertion order (which is the sources' priority order)."""
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
                self._children.append({})
                self._children[node][token] = nxt
                created += 1
            self.sources[nxt] |= bit
            node = nxt
        return created

    @classmethod
    def from_drafts(cls, root_token: int, branches_per_source: Sequence[Sequence[Sequence[int]]], max_nodes: int) -> "TokenTree":
        """Merge several sources' branch lists into one tree of at most ``max_nodes`` draft nodes.

        Sources take turns branch by branch (first branch of every source, then the second, ...),
        so no single source can crowd the others out of the budget; each source's own order
        (best first) is kept.
        """
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        tree = cls(root_token)
        rounds = max((len(b) for b in branches_per_source), default=0)
        for r in range(rounds):
            for source_index, branches in enumerate(branches_per_source):
                if r < len(branches):
                    # with no room left this still credits the source for nodes it shares
                    tree.add_branch(branches[r], source_index, max(0, max_nodes - tree.num_draft_nodes))
        return tree

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
