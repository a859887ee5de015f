"""One tree budget for every request of a batch: spend the forward's rows where they buy the most.

In a batched forward every request pays for its root row, and the rows left over can go to any
request's tree. On a machine where a forward of a few rows costs about one row (bfloat16 on a CPU
with FBGEMM, any GPU at small batch), those rows are nearly free when few requests run, and dear
when many do. So the question is not "how wide a tree for this request" but "which requests'
next draft nodes are worth a row of this forward".

The rule
    Each request keeps its own acceptance estimate per insertion rank (``p_r``, learned through
    shadow trees exactly as the one-request :class:`~specdraft.budget.AdaptiveBudget` learns it:
    every step's full tree is checked against the tokens committed after it). A step's expected
    tokens are ``sum over requests of (1 + sum of p_r over its checked ranks)``, its cost is the
    price of the forward's total width from the machine's cost curve
    (:class:`~specdraft.step_costs.StepCosts`, in one-row forwards), plus each row's attention
    over its own request's context (:mod:`specdraft.attention_cost`: the curve prices the linear
    layers only, and at several requests of a few hundred positions attention is a good part of
    a forward). Nodes are offered best first,
    the next node of whichever request has the highest ``p`` for it (a request's first node also
    brings its side block's rows), and the allocation kept is the prefix of that order with the
    most expected tokens per unit of cost. With no node at all the step is batched plain decoding,
    so speculation is only chosen where it is expected to beat it.

    Few requests: the forward is narrow, extra rows are cheap on the curve, trees widen. Many
    requests: the base width is already where rows cost their full price, and trees shrink
    towards plain decoding.

Requests start from the long-run acceptance of all the batch's traffic (one shared slow
average), as a request of the one-request budget does.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from .budget import AdaptiveBudget
from .step_costs import StepCosts


@dataclass(frozen=True)
class Ask:
    """What one request brings to a step's allocation: its acceptance by rank, how many draft
    nodes its sources offered (its full tree), its side-block rows (they ride only with a tree),
    and rows it needs whatever the budget says (its root, or a prompt chunk)."""

    rates: Sequence[float | None]
    offered: int
    side_rows: int
    fixed_rows: int
    decoding: bool = True
    #: cached positions the request's rows attend over (each row's attention grows with it)
    context: int = 0


class BatchBudget:
    """See the module docstring. ``adaptive=False`` gives every request its full tree (for
    benchmarks of fixed budgets); ``max_nodes`` caps any one request's tree."""

    def __init__(self, max_nodes: int, cost_curve: Sequence[float] | None = None, adaptive: bool = True,
                 smoothing: float = 0.5, attention_seconds: float = 0.0) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        if not attention_seconds >= 0.0:
            raise ValueError(f"attention_seconds must be >= 0, got {attention_seconds}")
        self.max_nodes = max_nodes
        self.adaptive = adaptive
        self.costs = StepCosts(cost_curve, smoothing)
        #: seconds of attention per row per cached position (:mod:`specdraft.attention_cost`), priced
        #: against the one-row forward of the curve (in seconds) or, without one, of the steps
        self.attention_seconds = attention_seconds
        self._one_row_seconds = float(cost_curve[0]) if cost_curve else None
        self.long_run_rate: list[float | None] = [None] * max_nodes

    def tracker(self) -> AdaptiveBudget:
        """A new request's acceptance estimate (an :class:`AdaptiveBudget` used for its shadow
        trees only), starting from the shared long-run averages, which it keeps feeding."""
        tracker = AdaptiveBudget(self.max_nodes)
        tracker.long_run_rate = self.long_run_rate  # one list, shared: every request's outcomes feed it
        tracker.start_request()
        return tracker

    def allocate(self, asks: Sequence[Ask]) -> list[int]:
        """Draft nodes to check for each request this step (0 for a request not decoding)."""
        nodes = [0] * len(asks)
        offered = [min(a.offered, self.max_nodes) if a.decoding else 0 for a in asks]
        if not self.adaptive:
            nodes = offered
        else:
            attention = self._attention_price()
            width = sum(a.fixed_rows for a in asks)
            row_columns = sum(a.fixed_rows * a.context for a in asks)
            tokens = float(sum(1 for a in asks if a.decoding))
            best_rate = tokens / (self.costs.shape(width) + attention * row_columns) if tokens else 0.0
            picks: list[int] = []
            best = 0
            # ties go to the request with the fewest nodes so far, so equal requests share the rows
            heap = [(-(a.rates[0] or 0.0), 0, i) for i, a in enumerate(asks) if offered[i] > 0 and a.rates]
            heapq.heapify(heap)
            taken = [0] * len(asks)
            while heap:
                negative_p, _, i = heapq.heappop(heap)
                if -negative_p <= 0.0:
                    break  # nothing left that is expected to be accepted
                rows = 1 + (asks[i].side_rows if taken[i] == 0 else 0)
                width += rows
                row_columns += rows * asks[i].context
                tokens += -negative_p
                taken[i] += 1
                picks.append(i)
                rate = tokens / (self.costs.shape(width) + attention * row_columns)
                if rate > best_rate * (1 + 1e-9):
                    best_rate, best = rate, len(picks)
                if taken[i] < offered[i] and taken[i] < len(asks[i].rates):
                    heapq.heappush(heap, (-(asks[i].rates[taken[i]] or 0.0), taken[i], i))
            for i in picks[:best]:
                nodes[i] += 1
        return nodes

    def _attention_price(self) -> float:
        """A row's attention per cached position, in one-row forwards (0 when unknown)."""
        if not self.attention_seconds:
            return 0.0
        unit = self._one_row_seconds or self.costs.seconds(1)
        return self.attention_seconds / unit if unit else 0.0

    def observe(self, width: int, seconds: float) -> None:
        """A batched step of ``width`` rows took ``seconds`` (the machine's present speed)."""
        self.costs.observe(width, seconds)

    def set_cost_curve(self, curve: Sequence[float] | None) -> None:
        self.costs.set_curve(curve)
        self._one_row_seconds = float(curve[0]) if curve else None
