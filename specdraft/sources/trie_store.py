"""The frequency trie's node store: counted token windows in flat lists, bounded by pruning.

A :class:`NodeStore` holds every distinct prefix of the windows inserted into it as a node with
two counts, ``out`` (output windows through it) and ``prompt`` (prompt windows through it), and
the clock of the last window that touched it (``stamp``, the tie-break: among equally frequent
nodes the stalest is pruned first and the newest drafted first). Its frequency is
``out + prompt_weight * prompt``. Because a window through a node passes through all its
ancestors, a parent's counts are never below the sum of its children's: frequencies shrink going
down, so "the least frequent nodes" is always closed under descendants once ties go deepest-first,
and pruning them keeps the key set prefix-closed.

Layout. A node is an int, an index into parallel lists (``token``, ``parent``, ``depth``, ``out``,
``prompt``, ``stamp``, ``children``); ``children[n]`` is a dict ``token -> child`` (``None`` while
the node has none). Ints and dicts of ints are not tracked by Python's cyclic garbage collector, so
a store of any size is a handful of tracked objects: a full collection does not scan its nodes,
and a node that goes makes no garbage for the collector to find (a node object linked to its
parent would be a reference cycle). Node 0 is the root, the empty key. A removed node's index is
reused by the next node made.

Bounds. After :meth:`prune_if_needed` no first-token tree (the nodes whose key starts with a
given token, that token's node included) holds more than ``capacity`` nodes, and the store holds at
most ``max_nodes``. A tree past ``capacity`` loses its least frequent nodes down to ``prune_to *
capacity``; the store past ``max_nodes`` its globally least frequent nodes, down to ``prune_to *
max_nodes``. Only the trees that grew since the last check are looked at; a tree's prune ranks
only its own nodes, O(T log T).

Not thread-safe on its own: :class:`~specdraft.sources.trie.FrequencyTrie` guards the shared store
with its lock, and each request's overlay store belongs to that request.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Sequence

__all__ = ["NodeStore", "ROOT"]

#: The root node: the empty key, never counted.
ROOT = 0
#: ``parent`` of a removed node (its index waits in the free list).
_GONE = -2


class NodeStore:
    """Counted windows in flat lists (see the module docstring). ``stamp_base`` starts the store's
    clock: every window inserted stamps the nodes it touches with the next clock value."""

    def __init__(self, capacity: int, max_nodes: int, prompt_weight: float, prune_to: float,
                 stamp_base: int = 0) -> None:
        self.capacity = capacity
        self.max_nodes = max_nodes
        self.prompt_weight = prompt_weight
        self.prune_to = prune_to
        self.token: list[int] = [-1]
        self.parent: list[int] = [-1]
        self.depth: list[int] = [0]
        self.out: list[int] = [0]
        self.prompt: list[int] = [0]
        self.stamp: list[int] = [0]
        self.children: list[dict[int, int] | None] = [None]
        self._free: list[int] = []
        self.size = 0  #: nodes in the store (the root not counted)
        self.tree_size: dict[int, int] = {}  #: first token -> nodes of its tree (its own node included)
        self._grown: set[int] = set()  # first tokens whose tree got new nodes since the last check
        self.clock = stamp_base  #: the stamp of the last window inserted
        self.holds_prompt = False  #: whether a prompt window was ever counted (retrieval skips the column if not)
        self.version = 0  #: structural changes (nodes made or removed): when a view of the keys is stale
        self.prunes = 0  #: how many times pruning ran (per tree or global)
        self.tree_prunes = 0  #: of which per-tree prunes (a tree past ``capacity``)
        self.global_prunes = 0  #: of which global prunes (the store past ``max_nodes``)
        self.pruned_nodes = 0  #: nodes removed by pruning, in total

    # -- counting windows ----------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], start: int, stop: int, as_prompt: bool = False) -> None:
        """Count one window ``tokens[start:stop]`` (as a prompt window or an output window) in every
        node of its path, making the nodes it lacks."""
        self.clock += 1
        clock = self.clock
        if as_prompt:
            self.holds_prompt = True
        counts = self.prompt if as_prompt else self.out
        children, stamp = self.children, self.stamp
        node = ROOT
        i = start
        while i < stop:
            kids = children[node]
            child = kids.get(tokens[i]) if kids is not None else None
            if child is None:
                break
            counts[child] += 1
            stamp[child] = clock
            node = child
            i += 1
        if i < stop:  # below a missing node everything is missing: make the rest, counted once
            self._extend(node, tokens, start, i, stop, counts, clock)

    def insert_all(self, tokens: Sequence[int], first: int, width: int, as_prompt: bool = False) -> None:
        """Count every window of ``tokens`` that starts at ``first`` or later: ``width`` tokens, or
        fewer where the tokens end (a window needs at least two tokens)."""
        n = len(tokens)
        for start in range(first, n - 1):
            self.insert(tokens, start, min(start + width, n), as_prompt)

    def _extend(self, node: int, tokens: Sequence[int], start: int, first: int, stop: int,
                counts: list[int], clock: int) -> None:
        """Make the nodes of ``tokens[first:stop]`` below ``node`` (the node of
        ``tokens[start:first]``), each counted once and stamped ``clock``."""
        children, free = self.children, self._free
        as_prompt = counts is self.prompt
        level = self.depth[node]
        j = first
        while free and j < stop:  # reuse the indexes of removed nodes first
            child = free.pop()
            level += 1
            t = tokens[j]
            self.token[child], self.parent[child], self.depth[child] = t, node, level
            self.out[child], self.prompt[child] = (0, 1) if as_prompt else (1, 0)
            self.stamp[child], children[child] = clock, None
            kids = children[node]
            if kids is None:
                children[node] = {t: child}
            else:
                kids[t] = child
            node = child
            j += 1
        if j < stop:  # then new indexes, appended: one list extend per field
            child = len(self.token)
            n = stop - j
            new = tokens[j:stop]
            kids = children[node]
            if kids is None:
                children[node] = {new[0]: child}
            else:
                kids[new[0]] = child
            self.token.extend(new)
            self.parent.append(node)
            self.parent.extend(range(child, child + n - 1))
            self.depth.extend(range(level + 1, level + n + 1))
            self.out.extend([0 if as_prompt else 1] * n)
            self.prompt.extend([1 if as_prompt else 0] * n)
            self.stamp.extend([clock] * n)
            children.extend([{t: c} for t, c in zip(new[1:], range(child + 1, child + n))])
            children.append(None)
        made = stop - first
        self.size += made
        self.version += 1
        tree = tokens[start]
        self.tree_size[tree] = self.tree_size.get(tree, 0) + made
        self._grown.add(tree)

    # -- reading -------------------------------------------------------------------------------

    def find(self, tokens: Sequence[int], start: int, stop: int) -> int:
        """The node of the key ``tokens[start:stop]``, or -1 if the store lacks it."""
        children = self.children
        node = ROOT
        for i in range(start, stop):
            kids = children[node]
            if kids is None:
                return -1
            node = kids.get(tokens[i], -1)
            if node < 0:
                return -1
        return node

    def frequency(self, node: int) -> float:
        return self.out[node] + self.prompt_weight * self.prompt[node]

    def key(self, node: int) -> tuple[int, ...]:
        """The tokens from the root to ``node``."""
        key = []
        token, parent = self.token, self.parent
        while node != ROOT:
            key.append(token[node])
            node = parent[node]
        return tuple(reversed(key))

    def first_token(self, node: int) -> int:
        """The first token of ``node``'s key: the tree it belongs to."""
        parent = self.parent
        while parent[node] != ROOT:
            node = parent[node]
        return self.token[node]

    def subtree(self, top: int) -> list[int]:
        """``top`` and every node below it."""
        children = self.children
        nodes = []
        stack = [top]
        while stack:
            n = stack.pop()
            nodes.append(n)
            kids = children[n]
            if kids:
                stack.extend(kids.values())
        return nodes

    def items(self) -> Iterator[tuple[tuple[int, ...], int]]:
        """``(key, node)`` for every node, parents before children."""
        children = self.children
        stack: list[tuple[tuple[int, ...], int]] = [((), ROOT)]
        while stack:
            key, node = stack.pop()
            kids = children[node]
            if kids:
                for t, child in kids.items():
                    child_key = key + (t,)
                    yield child_key, child
                    stack.append((child_key, child))

    # -- removing ------------------------------------------------------------------------------

    def remove(self, node: int) -> int:
        """Remove ``node`` and its subtree; returns the number of nodes removed."""
        tree = self.first_token(node)
        parent = self.parent
        kids = self.children[parent[node]]
        del kids[self.token[node]]
        if not kids:
            self.children[parent[node]] = None
        gone = self.subtree(node)
        children, free = self.children, self._free
        for n in gone:
            parent[n] = _GONE
            children[n] = None
        free.extend(gone)
        removed = len(gone)
        self.size -= removed
        self.version += 1
        left = self.tree_size[tree] - removed
        if left:
            self.tree_size[tree] = left
        else:  # the first-token node itself went: the whole tree
            del self.tree_size[tree]
        return removed

    def clear(self) -> None:
        """Forget every node (the counters of past prunes stay)."""
        self.token, self.parent, self.depth = [-1], [-1], [0]
        self.out, self.prompt, self.stamp, self.children = [0], [0], [0], [None]
        self._free = []
        self.size = 0
        self.tree_size.clear()
        self._grown.clear()
        self.version += 1

    # -- pruning (Sec. 4.3.1, node pruning) -----------------------------------------------------

    def tree_watermark(self) -> int:
        return min(self.capacity, int(self.capacity * self.prune_to))

    def global_watermark(self) -> int:
        return min(self.max_nodes, int(self.max_nodes * self.prune_to))

    def prune_if_needed(self) -> None:
        """After every change that may add nodes: prune each grown tree past ``capacity``, then the
        whole store if past ``max_nodes``."""
        if self._grown:
            capacity, sizes = self.capacity, self.tree_size
            over = [t for t in self._grown if sizes.get(t, 0) > capacity]
            self._grown.clear()
            if over:
                low = self.tree_watermark()
                for t in over:
                    self.prune_tree(t, low)
        if self.size > self.max_nodes:
            self.prune_global(self.global_watermark())

    def prune_tree(self, first_token: int, target: int) -> int:
        """Drop the least frequent nodes of ``first_token``'s tree until ``target`` remain in it."""
        kids = self.children[ROOT]
        top = kids.get(first_token) if kids else None
        if top is None or self.tree_size[first_token] <= target:
            return 0
        nodes = self.subtree(top)
        removed = self._drop(nodes, len(nodes) - target)
        self.tree_prunes += 1
        return removed

    def prune_global(self, target: int) -> int:
        """Drop the globally least frequent nodes until ``target`` remain. O(N log N)."""
        if self.size <= target:
            return 0
        nodes = self.subtree(ROOT)[1:]
        removed = self._drop(nodes, self.size - target)
        self.global_prunes += 1
        return removed

    def _drop(self, nodes: list[int], excess: int) -> int:
        """Remove the ``excess`` least frequent of ``nodes`` (a set closed under descendants).

        Order: frequency ascending, then deepest first, then stalest first. A node's descendants
        are never more frequent and always deeper, so they come before it: the dropped set is
        closed under descendants and the store stays prefix-closed.
        """
        if excess <= 0:
            return 0
        w, out, prompt, depth, stamp = self.prompt_weight, self.out, self.prompt, self.depth, self.stamp
        key = lambda n: (out[n] + w * prompt[n], -depth[n], stamp[n])  # noqa: E731
        if excess >= len(nodes):
            victims = nodes
        elif 4 * excess < len(nodes):
            victims = heapq.nsmallest(excess, nodes, key=key)
        else:
            nodes.sort(key=key)
            victims = nodes[:excess]
        doomed = set(victims)
        parent = self.parent
        tops = [n for n in victims if parent[n] not in doomed]  # (the root is never doomed)
        removed = sum(self.remove(n) for n in tops)
        assert removed == len(victims), "pruned set was not closed under descendants"
        self.prunes += 1
        self.pruned_nodes += removed
        return removed

    # -- checks --------------------------------------------------------------------------------

    def check(self) -> dict[tuple[int, ...], int]:
        """Assert the structural invariants (O(size); for tests) and return ``key -> node``: links
        agree, counts are >= 0, every node has a positive frequency, a parent's counts are at least
        the sum of its children's, tree sizes are right and within ``capacity``, the size within
        ``max_nodes``, and no removed index is reachable."""
        keys: dict[tuple[int, ...], int] = {}
        per_tree: dict[int, int] = {}
        out, prompt = self.out, self.prompt
        for key, node in self.items():
            assert self.parent[node] != _GONE, f"removed node {node} reachable under {key}"
            assert self.token[node] == key[-1] and self.depth[node] == len(key), f"node {node} under {key}"
            assert out[node] >= 0 and prompt[node] >= 0, f"negative count at {key}"
            assert out[node] + prompt[node] > 0, f"zero-frequency node kept at {key}"
            kids = self.children[node]
            assert kids is None or kids, f"empty child dict kept at {key}"
            if kids:
                assert all(self.parent[c] == node for c in kids.values()), f"child links disagree at {key}"
                assert out[node] >= sum(out[c] for c in kids.values()), f"out counts grow going down at {key}"
                assert prompt[node] >= sum(prompt[c] for c in kids.values()), f"prompt counts grow at {key}"
            keys[key] = node
            per_tree[key[0]] = per_tree.get(key[0], 0) + 1
        assert len(keys) == self.size, f"size {self.size} but {len(keys)} nodes reachable"
        assert len(keys) + len(self._free) + 1 == len(self.token), "a node index is neither used nor free"
        assert per_tree == self.tree_size, "per-tree node counts are off"
        for t, n in per_tree.items():
            assert n <= self.capacity, f"tree {t} holds {n} nodes, capacity is {self.capacity}"
        assert self.size <= self.max_nodes, f"{self.size} nodes exceed max_nodes {self.max_nodes}"
        return keys
