"""The budget: how many of each request's draft nodes a forward checks, for one request or many.

Speculation pays only when the extra rows of a forward buy enough accepted tokens. On a small CPU
a multi-row forward can cost several one-row ones, and on novel text drafts rarely hit, so a fixed
tree can make decoding slower than plain decoding. The Ant paper calls the best width the
"critical decoding length" and picks it offline; here both sides are measured online and the
choice is made again at every step, for every request in the forward at once.

The rule
    Each request's full tree is merged best first (:mod:`specdraft.tree`), so a tree of ``n``
    nodes is the first ``n`` nodes of the full one and is expected to commit ``1 + sum_{r<n} p_r``
    tokens, ``p_r`` the request's acceptance of rank ``r`` (:mod:`specdraft.budget.acceptance`).
    A forward's cost is priced from the machine's cost model (:mod:`specdraft.budget.costs`): its
    total width on the measured kernel curve, plus each row's attention over its request's
    context. Every request pays its root row (or its prompt chunk) whatever happens; the rows left
    over go, best first, to the next node of whichever request has the highest ``p`` for it (a
    request's first node also brings its side blocks' rows), and the allocation kept is the
    prefix of that order with the most expected tokens per unit of cost. With no node at all the
    step is plain decoding, so speculation is chosen only where it is expected to beat it. For one
    request this is the width ``n`` maximising ``(1 + sum p_r) / cost(width(n))``; for many, few
    requests widen their trees where rows are cheap and many shrink them towards plain decoding.

Three guards
    *Warm-up*: for the first ``warmup`` steps of a decoder (and until any step has been priced)
    every request gets its full tree, side blocks included, so wide steps get measured and sources
    that need a few steps before their drafts mean anything (Jacobi fills its window) get them.
    *Opening*: a request's first tree step stays plain when its share of the forward would cost
    more than ``opening_cost_ratio`` times the forward without it: nothing of the request has been
    seen yet, and on a short answer a failed wide step is not won back. Where width is nearly free
    (bf16 on a CPU, GPUs) the rule never fires.
    *Row limit*: where forwards run at fixed widths (:attr:`row_limit`), no step gets more rows
    than the widest, in the warm-up and with a fixed budget too (then one node per request in
    turn): a wider forward would run eagerly on a GPU, or break exact mode's rule.

A second opinion
    Where width is nearly free (a GPU's captured buckets), the decoder gives the budget a
    :class:`~specdraft.budget.whole_tree.WholeTreeTrial` (:attr:`Budget.whole_tree`): whichever of
    the choice above and the whole tree has committed more tokens per second runs, and the other
    is tried now and then (a step the whole tree runs computes no choice). Rates by rank cannot
    see what a whole tree teaches the sources that learn from every row the model computes.

``adaptive=False`` gives every request its full tree every step, within the row limit (for
benchmarks of fixed budgets). The budget changes only which drafts are checked, never how they are verified, so output stays
exactly lossless whatever it decides.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..checks import check_int
from .acceptance import AcceptanceTracker
from .costs import StepCosts
from .whole_tree import WHOLE, WholeTreeTrial


@dataclass(frozen=True)
class Ask:
    """What one request brings to a step's allocation: its acceptance by rank, the draft nodes its
    sources offered (its full tree), its side-block rows (they ride with a tree), the rows it
    needs whatever the budget says (its root, or a prompt chunk), whether it is decoding, the
    cached positions its rows attend over, and whether this is its first tree step."""

    rates: Sequence[float | None]
    offered: int
    side_rows: int
    fixed_rows: int
    decoding: bool = True
    context: int = 0
    opening: bool = False


@dataclass(frozen=True)
class Grant:
    """What one request gets: draft nodes to check, and whether its side blocks ride along."""

    nodes: int
    side_blocks: bool


_NOTHING = Grant(0, False)


class Budget:
    """The allocator (see the module docstring), with the cost model and the acceptance tracker it
    reads. One per decoder: everything it learns carries from request to request."""

    def __init__(self, max_nodes: int, num_sources: int = 0, adaptive: bool = True,
                 cost_curve: Sequence[float] | None = None, attention_seconds: float = 0.0, warmup: int = 3,
                 opening_cost_ratio: float = 1.5, smoothing: float = 0.5, acceptance_smoothing: float = 0.3,
                 prior_smoothing: float = 0.02, drafting_share: float = 0.05) -> None:
        check_int("max_nodes", max_nodes, 0)
        check_int("warmup", warmup, 0)
        if not 0.0 <= drafting_share <= 1.0:
            raise ValueError(f"drafting_share must be in [0, 1] (0: drafting never pauses), got {drafting_share!r}")
        if not opening_cost_ratio >= 1.0:
            raise ValueError(f"opening_cost_ratio must be >= 1 (math.inf: never hold back), got {opening_cost_ratio}")
        self.max_nodes = max_nodes
        self.adaptive = adaptive
        self.warmup = warmup
        self.opening_cost_ratio = opening_cost_ratio
        #: the most of a plain step's time that drafts which buy nothing may cost, on average: a
        #: request pauses its drafting to keep them there (:mod:`specdraft.engine.pause`; 0: never)
        self.drafting_share = float(drafting_share)
        self.costs = StepCosts(cost_curve, smoothing, attention_seconds)
        self.acceptance = AcceptanceTracker(max_nodes, num_sources, fast=acceptance_smoothing, slow=prior_smoothing)
        #: steps priced so far (the warm-up counts them)
        self.steps = 0
        #: the choice against the whole tree, measured (see the module docstring); ``None``: the
        #: choice alone (the decoder sets one on a GPU)
        self.whole_tree: WholeTreeTrial | None = None

    def set_cost_curve(self, curve: Sequence[float] | None) -> None:
        """Price widths from ``curve`` from now on (``None``: learn them from the steps)."""
        self.costs.set_curve(curve)

    def observe_step(self, width: int, seconds: float, tokens: int | None = None) -> None:
        """A decoding step of ``width`` rows took ``seconds`` (drafting and verifying included)
        and committed ``tokens`` over all its requests (``None``: not counted)."""
        self.costs.observe(width, seconds)
        self.steps += 1
        if self.whole_tree is not None and tokens is not None:
            self.whole_tree.observe(tokens, seconds)

    # -- the allocation ---------------------------------------------------------------------

    def allocate(self, asks: Sequence[Ask]) -> list[Grant]:
        """Draft nodes (and side blocks) for each request this step."""
        offered = [min(a.offered, self.max_nodes) if a.decoding else 0 for a in asks]
        trial = self.whole_tree
        if trial is not None:
            trial.pending = None  # (a step the trial measures says so below)
        if self.max_nodes == 0:
            return [_NOTHING] * len(asks)
        limit = self.row_limit
        if not self.chooses or (trial is not None and trial.pick() == WHOLE):
            return self._whole(asks, offered, limit)
        grants = self._opening(asks, self._best_prefix(asks, offered, limit))
        return self._fill_padding(asks, offered, grants, limit)

    @staticmethod
    def _whole(asks: Sequence[Ask], offered: list[int], limit: int | None) -> list[Grant]:
        """Every decoding request's full tree with its side blocks, within ``limit`` rows: where
        they exceed it, one node to each request in turn (:func:`_add_in_turns`)."""
        full = [Grant(n, True) if a.decoding else _NOTHING for a, n in zip(asks, offered)]
        width = sum(a.fixed_rows + (g.nodes + a.side_rows if g.side_blocks else 0) for a, g in zip(asks, full))
        if limit is None or width <= limit:
            return full
        return _add_in_turns(asks, [0] * len(asks), [g.nodes for g in full], lambda rows, _: rows <= limit)

    @property
    def chooses(self) -> bool:
        """Whether :meth:`allocate` weighs drafts against costs now (adaptive, past the warm-up,
        with a step priced), rather than granting every tree whole."""
        return self.adaptive and self.max_nodes > 0 and self.steps >= self.warmup and self.costs.known

    @property
    def exploring(self) -> bool:
        """Whether the last :meth:`allocate` ran the whole-tree trial's arm that is not leading: a
        drafting pause does not learn from such a step (:mod:`specdraft.engine.pause`)."""
        return self.whole_tree is not None and self.whole_tree.exploring

    @property
    def row_limit(self) -> int | None:
        """The most rows a step's forward may have: the widest of the widths forwards run at
        (:attr:`~specdraft.engine.widths.Widths.widest`; a wider one runs eagerly on a GPU, or
        would break exact mode's rule); ``None``: no limit. Rows every request needs anyway (its
        root, a prompt chunk) are never cut: only draft nodes are held back."""
        return getattr(self.costs.padding, "widest", None)

    def _best_prefix(self, asks: Sequence[Ask], offered: list[int], limit: int | None = None) -> list[int]:
        """Nodes per request: the prefix of the best-first order with the most tokens per cost.

        A request's ranks are offered in runs along the upper concave hull of its expected tokens
        (rank rates need not fall with rank: a source whose nodes miss can sit between two that
        hit, and the hit behind a miss is worth taking both), steepest run first across requests;
        nodes are taken one at a time (equal requests share the rows) and every prefix is priced,
        so for one request every tree size is tried."""
        attention = self.costs.attention_price()
        width, row_columns = _rows(asks, [0] * len(asks))
        tokens = float(sum(1 for a in asks if a.decoding))
        best_rate = tokens / (self.costs.shape(width) + attention * row_columns) if tokens else 0.0
        runs = [_hull_runs(a.rates, offered[i]) if offered[i] > 0 else [] for i, a in enumerate(asks)]
        # ties go to the request with the fewest nodes so far, so equal requests share the rows
        heap = [(-r[0][0], 0, i, 0) for i, r in enumerate(runs) if r]
        heapq.heapify(heap)
        taken = [0] * len(asks)
        picks: list[int] = []
        best = 0
        while heap:  # one node at a time, at the slope of the run it belongs to
            _, _, i, k = heapq.heappop(heap)
            ask = asks[i]
            rows = 1 + (ask.side_rows if taken[i] == 0 else 0)
            if limit is not None and width + rows > limit:
                continue  # this request's next node does not fit the widest forward (nor will its later ones)
            width += rows
            row_columns += rows * ask.context
            tokens += ask.rates[taken[i]] or 0.0
            taken[i] += 1
            picks.append(i)
            rate = tokens / (self.costs.shape(width) + attention * row_columns)
            if rate > best_rate * (1 + 1e-9):
                best_rate, best = rate, len(picks)
            if taken[i] == runs[i][k][1]:
                k += 1
            if k < len(runs[i]):
                heapq.heappush(heap, (-runs[i][k][0], taken[i], i, k))
        nodes = [0] * len(asks)
        for i in picks[:best]:
            nodes[i] += 1
        return nodes

    def _opening(self, asks: Sequence[Ask], nodes: list[int]) -> list[Grant]:
        """Grants, with the opening rule applied to requests at their first tree step."""
        width, row_columns = _rows(asks, nodes)
        grants = []
        for a, n in zip(asks, nodes):
            if n and a.opening and math.isfinite(self.opening_cost_ratio):
                extra = n + a.side_rows
                with_it = self.costs.price(width, row_columns)
                without = self.costs.price(width - extra, row_columns - extra * a.context)
                if with_it > self.opening_cost_ratio * without:
                    width -= extra
                    row_columns -= extra * a.context
                    n = 0
            grants.append(Grant(n, n > 0))
        return grants

    def _fill_padding(self, asks: Sequence[Ask], offered: list[int], grants: list[Grant],
                      limit: int | None) -> list[Grant]:
        """``grants`` with more draft nodes in the rows the forward is padded to anyway.

        Where forwards run at fixed widths (a GPU's buckets; exact mode pads a plain step to 16
        rows there), the rows between a step's width and the width it runs at are computed
        whatever they hold, so they may as well hold the next drafts. A node goes in only where
        the step's price stays the same (where attention is priced by row and context, no node
        does), one to each request in turn. It can only add tokens, and the sources that learn
        from every row the model computes (Token Recycling's top-k) learn from it: narrow steps
        would starve their drafts, which the budget, pricing one step at a time, cannot see."""
        if self.costs.padding is None:
            return grants
        nodes = [g.nodes for g in grants]
        price = self.costs.price(*_rows(asks, nodes))

        def fits(width: int, row_columns: int) -> bool:
            return (limit is None or width <= limit) and self.costs.price(width, row_columns) <= price

        return _add_in_turns(asks, nodes, offered, fits)


def _rows(asks: Sequence[Ask], nodes: Sequence[int]) -> tuple[int, int]:
    """The rows of a forward that gives each request ``nodes[i]`` draft nodes (a request's first
    node brings its side blocks' rows), and the cached positions those rows attend over in all."""
    rows = [a.fixed_rows + (n + a.side_rows if n else 0) for a, n in zip(asks, nodes)]
    return sum(rows), sum(r * a.context for r, a in zip(rows, asks))


def _add_in_turns(asks: Sequence[Ask], nodes: Sequence[int], caps: Sequence[int],
                  fits: Callable[[int, int], bool]) -> list[Grant]:
    """Grants of ``nodes`` and more: one node to each request in turn, up to its cap, while
    ``fits(width, row_columns)`` holds for the forward the node makes (a request's first node
    brings its side blocks' rows), so requests share the rows alike."""
    nodes = list(nodes)
    width, row_columns = _rows(asks, nodes)
    growing = True
    while growing:
        growing = False
        for i, a in enumerate(asks):
            rows = 1 + (a.side_rows if nodes[i] == 0 else 0)
            if nodes[i] < caps[i] and fits(width + rows, row_columns + rows * a.context):
                nodes[i] += 1
                width += rows
                row_columns += rows * a.context
                growing = True
    return [Grant(n, n > 0) for n in nodes]


def _hull_runs(rates: Sequence[float | None], offered: int) -> list[tuple[float, int]]:
    """``(slope, end)`` of each run of ranks along the upper concave hull of a request's expected
    extra tokens ``S(n) = sum_{r<n} p_r`` (``n <= offered``), steepest first; runs that add nothing
    are left out."""
    sums = [0.0]
    for r in rates[:offered]:
        sums.append(sums[-1] + (r or 0.0))
    hull = [0]
    for n in range(1, len(sums)):
        while len(hull) >= 2 and (sums[hull[-1]] - sums[hull[-2]]) * (n - hull[-1]) \
                <= (sums[n] - sums[hull[-1]]) * (hull[-1] - hull[-2]):
            hull.pop()
        hull.append(n)
    runs = []
    for a, b in zip(hull, hull[1:]):
        slope = (sums[b] - sums[a]) / (b - a)
        if slope <= 0.0:
            break
        runs.append((slope, b))
    return runs
