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

import functools
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

    @classmethod
    def from_drafts(cls, root_token: int, branches_per_source: Sequence[Sequence[Sequence[int]]], max_nodes: int,
                    rate: RateFn | None = None) -> "TokenTree":
        """Merge several sources' branch lists into one tree of at most ``max_nodes`` draft nodes,
        chosen best first by expected value (see the module docstring).

        ``rate`` gives each source's conditional acceptance rate by depth and sibling rank
        (:data:`RateFn`); without one, :func:`prior_rate`. A node several sources propose combines
        their rates by a noisy-or (agreement is evidence: a node two sources propose is worth at
        least what the better one alone says) and names them all in ``sources``. Ties (equal
        values) go to the node met first when the sources' branches are read in turns (first
        branch of every source, then the second, ...), so equal sources share the budget and
        the result is deterministic. The first ``n`` nodes never depend on ``max_nodes``: a
        smaller budget gives a prefix of the same tree.
        """
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        tree = cls(root_token)
        if max_nodes == 0:
            return tree
        # each rate remembered for this merge, which asks for the same ones again and again
        rate_of = functools.cache(prior_rate if rate is None else rate)
        # The frontier is expanded lazily: a node's children are made from the branches passing
        # through it only once it is selected, so the tails of branches that never make the cut
        # cost nothing. A node's tie-break is (smallest k through it, depth) packed in one int,
        # k a branch's place when the sources' branches are read in turns: the order in which
        # reading the branches in turns would first meet it (a unique key, so the heap never
        # compares further). Heap items: (-log value, tie-break, token, parent, entries through
        # it, proposers, source bits).
        log, push, pop = math.log, heapq.heappush, heapq.heappop
        tokens, select = tree.tokens, tree._select
        heap: list[tuple[float, int, int, int, list, tuple, int]] = []
        # expand the node just selected (the root first): push its children, unless the tree is full
        index, depth, neg, passing = 0, 0, 0.0, _entries(branches_per_source)
        # ``run``: how many more depths every entry of ``passing`` (several, selected together as
        # one agreeing group) goes on with one same token; there the group is the same each time
        # (its entries, proposers and bits), so it is made without asking every entry again
        run, run_proposers, run_bits = 0, (), 0
        while len(tokens) <= max_nodes:
            # the node's one child, when it has one: (k, token, entries through it, proposers,
            # source bits, rate); it is selected at once if it beats the whole frontier
            if run:  # what _only_child would find: every entry goes on with the first one's token
                run -= 1
                child = (passing[0][0], int(passing[0][2][depth]), passing, run_proposers, run_bits,
                         _noisy_or(rate_of, run_proposers, depth + 1))
            else:
                child = _only_child(heap, passing, depth, index, neg, rate_of)
            if child is not None:
                k, token, through, proposers, bits, q = child
                child_neg, child_key = neg - log(q), (k << 32) | (depth + 1)
                if not heap or child_neg < heap[0][0] or (child_neg == heap[0][0] and child_key < heap[0][1]):
                    # it beats the whole frontier: select it now (what a push and a pop would do)
                    index = select(token, index, depth + 1, bits, proposers)
                    if through is not passing and len(through) > 1:
                        run, run_proposers, run_bits = _agreeing(through, depth + 1), proposers, bits
                    depth, neg, passing = depth + 1, child_neg, through
                    continue
                push(heap, (child_neg, child_key, token, index, through, proposers, bits))
            if not heap:
                break
            # select the most valuable node of the frontier
            neg, key, token, parent, passing, proposers, bits = pop(heap)
            depth = key & 0xFFFFFFFF
            index = select(token, parent, depth, bits, proposers)
            run = 0
        return tree

    def _select(self, token: int, parent: int, depth: int, bits: int, proposers: tuple) -> int:
        """Append a node :meth:`from_drafts` selected; returns its index."""
        index = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(depth)
        self.sources.append(bits)
        self.proposers.append(proposers)
        self._children.append({})
        self._children[parent][token] = index
        return index

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
        cut._children = [{} for _ in range(n)]
        for i in range(1, n):
            cut._children[cut.parents[i]][cut.tokens[i]] = i
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
        # Each row as a Python int of bits (a parent precedes its children, so one pass suffices),
        # unpacked to bools at once: a row copy per node in numpy costs several times more, and
        # this runs between a step's read and the next forward's launch.
        parents = self.parents
        n = len(parents)
        rows = [1]
        for i in range(1, n):
            rows.append(rows[parents[i]] | (1 << i))
        width = (n + 7) // 8
        packed = np.frombuffer(b"".join([r.to_bytes(width, "little") for r in rows]), dtype=np.uint8)
        return np.unpackbits(packed.reshape(n, width), axis=1, count=n, bitorder="little").view(bool)

    def position_offsets(self) -> np.ndarray:
        """Each node's position relative to the root (= its depth)."""
        return np.asarray(self.depth, dtype=np.int64)

    def branches(self) -> list[list[int]]:
        """The token sequences of every root-to-leaf path (for inspection and tests)."""
        leaves = [i for i in range(1, len(self.tokens)) if not self._children[i]]
        return [[self.tokens[j] for j in self.path_to(leaf)] for leaf in leaves]

    def __repr__(self) -> str:
        return f"TokenTree(root={self.tokens[0]}, nodes={len(self.tokens)}, branches={len(self.branches())})"


def _entries(branches_per_source: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, int, Sequence[int]]]:
    """Every non-empty branch as (k, source, branch), k its place when the sources' branches are
    read in turns (first branch of every source, then the second, ...)."""
    width = len(branches_per_source)
    longest = max((len(b) for b in branches_per_source), default=0)
    entries = [(r * width + s, s, branches[r]) for r in range(longest)
               for s, branches in enumerate(branches_per_source) if r < len(branches) and len(branches[r])]
    if width > 62 and any(entry[1] >= 62 for entry in entries):
        raise ValueError(f"at most 62 sources can be merged (a node's sources are a 62-bit set), got {width}")
    return entries


def _only_child(heap: list, passing: list, depth: int, index: int, neg: float,
                rate_of: Callable[[int, int, int], float]) -> tuple | None:
    """The one child of node ``index`` (at ``depth``, value ``-neg`` in log space) when every branch
    ``passing`` through it that goes on carries the same next token: ``(k, token, entries through
    it, proposers, source bits, rate)``, as :func:`_push_groups` would make it. ``None`` when no
    branch goes on, or when the branches part: then :func:`_push_groups` pushes its children on
    ``heap``. Sources often agree, and this skips the grouping."""
    if len(passing) == 1:  # one branch's tail (the common case): its own rate, no grouping
        k, source, branch = passing[0]
        if len(branch) <= depth:
            return None
        return k, int(branch[depth]), passing, ((source, 0),), 1 << source, _clipped(rate_of(source, depth + 1, 0))
    token = None
    through: list = []
    proposers: list[tuple[int, int]] = []
    bits = 0
    for entry in passing:
        branch = entry[2]
        if len(branch) <= depth:
            continue
        if token is None:
            token = branch[depth]
        elif branch[depth] != token:  # the branches part: a child per next token
            _push_groups(heap, passing, depth, index, neg, rate_of)
            return None
        source = entry[1]
        if not bits >> source & 1:
            proposers.append((source, 0))  # each source's first entry through the child: rank 0
            bits |= 1 << source
        through.append(entry)
    if token is None:
        return None
    return through[0][0], int(token), through, tuple(proposers), bits, _noisy_or(rate_of, proposers, depth + 1)


def _agreeing(entries: list, depth: int) -> int:
    """How many depths from ``depth`` on every one of ``entries`` goes on, all with the same token
    (0 when one ends or they part at ``depth``, or a branch is not a list: then each depth is
    grouped by :func:`_only_child`). Compared by slices, not token by token."""
    first = entries[0][2]
    if first.__class__ is not list:
        return 0
    stop = len(first)
    for entry in entries:
        branch = entry[2]
        if branch.__class__ is not list:
            return 0
        if len(branch) < stop:
            stop = len(branch)
    if stop <= depth:
        return 0
    ref = first[depth:stop]
    for entry in entries:
        other = entry[2][depth:stop]
        if other != ref:
            same = 0
            for mine, theirs in zip(ref, other):
                if theirs != mine:  # as _only_child compares: the entry's token against the first one's
                    break
                same += 1
            if not same:
                return 0
            stop, ref = depth + same, ref[:same]
    return stop - depth


def _push_groups(heap: list, passing: list, depth: int, index: int, neg: float,
                 rate_of: Callable[[int, int, int], float]) -> None:
    """Push the children of node ``index`` (at ``depth``, value ``-neg`` in log space) made from
    the branches ``passing`` through it: one child per distinct next token, proposed by every
    source whose branch carries it (its rate: their noisy-or, agreement being evidence)."""
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
        q = _noisy_or(rate_of, proposers, child_depth)
        heapq.heappush(heap, (neg - math.log(q), (k << 32) | child_depth, int(token), index, through,
                              tuple(proposers), bits))


def _noisy_or(rate_of: Callable[[int, int, int], float], proposers: Sequence[tuple[int, int]], depth: int) -> float:
    """The rate of a node at ``depth`` that ``proposers`` ((source, rank) pairs) all propose: the
    noisy-or of their rates (agreement being evidence), :func:`_clipped`."""
    miss = 1.0
    for source, rank in proposers:
        miss *= 1.0 - rate_of(source, depth, rank)
    return _clipped(1.0 - miss)


def _clipped(q: float) -> float:
    """A node's rate clipped to (0, 1): a log of 0 is undefined, a rate of 1 would tie a node with
    its parent."""
    return _RATE_FLOOR if q < _RATE_FLOOR else _RATE_CEIL if q > _RATE_CEIL else q
