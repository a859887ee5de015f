"""What the drafts would have achieved: acceptance by insertion rank and by source, learned online.

Two questions need the same observation:

* the **allocator** asks how likely the node inserted ``r``-th into a request's full tree is to be
  on the accepted path (``p_r``, unconditional): a tree of ``n`` nodes is expected to commit
  ``1 + sum_{r<n} p_r`` tokens (:mod:`specdraft.budget.allocator`);
* the **merge** (:meth:`specdraft.tree.TokenTree.from_drafts`) asks how likely a node a source
  proposed at a depth, as its k-th sibling, is to be accepted once its parent is (conditional):
  nodes are picked best first by the product of these rates along their path.

Both are read off the *full* tree of each step (every node the sources offered, not only the ones
the budget checked) by walking it along the tokens committed after its root ("shadow
verification"): under greedy decoding the committed tokens say exactly which nodes would have
been accepted, so every rate is observed every step, for free, even while the allocator runs
plain one-token steps. (Under sampling the walk follows what was drawn, an estimate; it only
sizes and orders trees, never changes what is emitted.)

A walk that is still on its tree when a step's tokens run out waits for the next step's. The
source rates record a node when its parent is passed (its outcome is then known). The rank rates
record everything once the walk leaves the tree or reaches a leaf; a walk still on course after
:data:`SHADOW_PATIENCE` steps records what is known (the walked path accepted, the branches it
left rejected) and leaves the nodes below it for later, so a copy that starts during plain steps
is noticed within a few steps and its deep nodes are never guessed as misses.

Two averages per entry: a slow one over everything the decoder has seen (what a request starts
from; the newest observation weighs ``slow``, or ``1 / (n + 2)`` early on for the source table,
so the prior counts as about one observation), and a fast one per request (acceptance comes in
runs: a copy starts, goes on, ends; the newest observation weighs ``fast``). A request's fast
averages live in its :class:`RequestAcceptance` and end with it.
"""

from __future__ import annotations

from typing import Sequence

from ..checks import check_int
from ..tree import TokenTree, prior_rate

#: Steps a walk waits before what is known of it is recorded in the rank rates (see above).
SHADOW_PATIENCE = 3
#: Depths 1 .. DEPTHS - 1 have their own source-table entries; deeper nodes share the last one.
DEPTHS = 8
#: Sibling ranks 0 .. RANKS - 1 have their own source-table entries; later siblings share the last.
RANKS = 4


def _slot(source_index: int, depth: int, rank: int) -> int:
    """Index of a source-table entry (source-major)."""
    return (source_index * DEPTHS + min(max(depth, 1), DEPTHS) - 1) * RANKS + min(rank, RANKS - 1)


def _moving_average(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average; the first observation is taken as it is."""
    return new if old is None else (1 - weight) * old + weight * new


class SourceRates:
    """A request's fast source table, callable as the merge's :data:`~specdraft.tree.RateFn`."""

    __slots__ = ("values", "sources")

    def __init__(self, values: list[float]) -> None:
        self.values = values
        self.sources = len(values) // (DEPTHS * RANKS)

    def __call__(self, source_index: int, depth: int, rank: int) -> float:
        # the merge calls this for every node it considers: _slot inlined
        if source_index >= self.sources:
            return prior_rate(source_index, depth, rank)
        d = depth if depth < DEPTHS else DEPTHS
        k = rank if rank < RANKS else RANKS - 1
        return self.values[(source_index * DEPTHS + d - 1) * RANKS + k]


class _Walk:
    """A full tree being walked along the committed tokens."""

    __slots__ = ("tree", "node", "next", "age", "recorded")

    def __init__(self, tree: TokenTree, start: int) -> None:
        self.tree = tree
        self.node = 0  # where the committed tokens have led so far
        self.next = start  # index of the next committed token to walk
        self.age = 0  # steps waited
        self.recorded = [False] * len(tree)  # rank outcomes recorded per node


class RequestAcceptance:
    """One request's fast averages (started from the decoder's slow ones) and its pending walks."""

    __slots__ = ("rank_rates", "source_rates", "walks", "tree_steps")

    def __init__(self, rank_rates: list[float | None], source_values: list[float]) -> None:
        #: ``p_r`` by insertion rank (``None`` until observed)
        self.rank_rates = rank_rates
        #: the merge's rate function for this request
        self.source_rates = SourceRates(source_values)
        self.walks: list[_Walk] = []
        #: tree steps observed (the allocator's opening rule looks at the first)
        self.tree_steps = 0


class AcceptanceTracker:
    """The slow averages of a decoder and the learning rule (see the module docstring).

    Parameters
    ----------
    max_nodes:
        Ranks tracked (the largest tree).
    num_sources:
        Sources whose rates are kept (their index in the decoder's list).
    fast, slow:
        Weight of the newest observation in a request's rank rates and in the long-run ones.
    source_fast, source_slow:
        The same for the source table.
    """

    def __init__(self, max_nodes: int, num_sources: int, fast: float = 0.3, slow: float = 0.02,
                 source_fast: float = 0.3, source_slow: float = 0.02) -> None:
        for name, value in (("fast", fast), ("slow", slow), ("source_fast", source_fast), ("source_slow", source_slow)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        check_int("max_nodes", max_nodes, 0)
        check_int("num_sources", num_sources, 0)
        self.max_nodes = max_nodes
        self.num_sources = num_sources
        self.fast, self.slow = fast, slow
        self.source_fast, self.source_slow = source_fast, source_slow
        self.long_run_ranks: list[float | None] = [None] * max_nodes
        self.long_run_sources: list[float] = [prior_rate(s, d, k) for s in range(num_sources)
                                              for d in range(1, DEPTHS + 1) for k in range(RANKS)]
        self.source_counts: list[int] = [0] * len(self.long_run_sources)

    def start(self) -> RequestAcceptance:
        """A request's averages, starting from the long-run ones."""
        return RequestAcceptance(list(self.long_run_ranks), list(self.long_run_sources))

    def count_step(self, request: RequestAcceptance, full: TokenTree, start: int) -> None:
        """Count a tree step and queue its tree's walk from ``start``: what the next plan reads
        (its opening rule counts tree steps), so it never waits."""
        request.tree_steps += 1
        request.walks.append(_Walk(full, start))

    def walk(self, request: RequestAcceptance, committed: Sequence[int]) -> None:
        """Walk every queued tree on along ``committed``, in step order: the learning, which may
        run behind the next forward."""
        request.walks = [walk for walk in request.walks if self._advance(request, walk, committed)]

    # -- the walk ---------------------------------------------------------------------------

    def _advance(self, request: RequestAcceptance, walk: _Walk, committed: Sequence[int]) -> bool:
        """Walk on along the new committed tokens; True while the walk waits for more."""
        tree = walk.tree
        left = False
        while walk.next < len(committed):
            children = tree.children(walk.node)
            if not children:
                break
            token = committed[walk.next]
            for child in children:
                self._record_source(request, tree.proposers[child], tree.depth[child], tree.tokens[child] == token)
            child = tree.child(walk.node, token)
            if child is None:
                left = True
                break
            walk.node, walk.next = child, walk.next + 1
        if left or not tree.children(walk.node):
            self._record_ranks(request, walk, range(1, len(tree)))
            return False
        if walk.age >= SHADOW_PATIENCE:
            self._record_ranks(request, walk, _outside_subtree(tree, walk.node))
        walk.age += 1
        return True

    def _record_ranks(self, request: RequestAcceptance, walk: _Walk, nodes: Sequence[int] | range) -> None:
        """Record the rank outcome of ``nodes`` not recorded yet (hit: on the path walked)."""
        fresh = [n for n in nodes if not walk.recorded[n] and n <= self.max_nodes]
        if not fresh:
            return
        on_path = set(walk.tree.path_to(walk.node))
        fast, slow, rates, long_run = self.fast, self.slow, request.rank_rates, self.long_run_ranks
        for n in fresh:
            walk.recorded[n] = True
            hit = 1.0 if n in on_path else 0.0
            rates[n - 1] = _moving_average(rates[n - 1], hit, fast)
            long_run[n - 1] = _moving_average(long_run[n - 1], hit, slow)

    def _record_source(self, request: RequestAcceptance, proposers: Sequence[tuple[int, int]], depth: int,
                       hit: bool) -> None:
        outcome = 1.0 if hit else 0.0
        values, long_run, counts = request.source_rates.values, self.long_run_sources, self.source_counts
        for source_index, rank in proposers:
            if source_index >= self.num_sources:
                continue
            slot = _slot(source_index, depth, rank)
            values[slot] += self.source_fast * (outcome - values[slot])
            counts[slot] += 1
            long_run[slot] += max(self.source_slow, 1.0 / (counts[slot] + 1)) * (outcome - long_run[slot])


def _outside_subtree(tree: TokenTree, node: int) -> list[int]:
    """Draft nodes of ``tree`` not strictly below ``node`` (their outcome is known once the
    committed tokens have walked to ``node``)."""
    below = [False] * len(tree)
    for j in range(node + 1, len(tree)):
        parent = tree.parents[j]
        below[j] = parent == node or below[parent]
    return [j for j in range(1, len(tree)) if not below[j]]
