"""Adaptive tree budget: size each step's tree to maximise accepted tokens per second.

Speculation pays only when the extra width of a forward pass buys enough accepted tokens. On a
small CPU a multi-token forward can cost twice a one-token step (see ``shared/models/README.md``),
and on novel text drafts rarely hit, so a fixed tree can make decoding *slower* than plain
decoding. The Ant paper calls the best width the "critical decoding length" and picks it offline;
we measure both sides online and re-pick it every step.

The rule
    Trees are merged in priority order and cut at the budget in that same order, so the tree of
    budget ``n`` is exactly the first ``n`` nodes of a bigger tree, and a node accepted in the
    bigger tree is accepted in the cut one too (its ancestors come earlier). Hence::

        E[tokens committed | budget n] = 1 + sum_{r < n} p_r

    where ``p_r`` is the probability that the node inserted ``r``-th is on the accepted path. We
    keep an exponential moving average of ``p_r`` for every rank we observe, and of the measured
    step time ``cost(q)`` per forward width ``q`` (root + tree + side tokens, in power-of-two
    buckets). Each step picks ``n`` maximising ``(1 + sum_{r<n} p_r) / cost(1 + n + side)`` over
    ``n = 0`` (plain decoding) and the bucket edges up to ``max_nodes``.

Exploration
    Ranks beyond the current budget are not observed, so every ``probe_every`` steps the budget is
    raised to the next bucket to refresh them. A probe that finds nothing doubles the interval (up
    to ``max_probe_interval``: on hopeless text the probes cost about 2% of a plain decode); one that
    finds accepted tokens beyond the budget probes again at once, one bucket wider, and so does a
    regular step whose newest node was accepted (the tree was too small for the run of hits), so a
    prompt that starts copying regains the full tree in a few steps. Acceptance comes in runs
    (a copy starts, goes on, ends), so the averages weigh the newest step heavily (0.5). The first ``warmup`` steps use the full
    budget so the estimates start from data.

The budget changes only which drafts are checked, never how they are verified, so output stays
exactly lossless whatever this controller decides.
"""

from __future__ import annotations

from dataclasses import dataclass


def _bucket(width: int) -> int:
    """Power-of-two bucket of a forward width: 1, 2, 3-4 -> 4, 5-8 -> 8, ..."""
    b = 1
    while b < width:
        b *= 2
    return b


@dataclass
class BudgetDecision:
    """The budget for one step and why (for statistics and debugging)."""

    nodes: int
    expected_tokens: float
    expected_cost: float
    probe: bool


class AdaptiveBudget:
    """Online controller of the tree size (see the module docstring for the rule).

    Parameters
    ----------
    max_nodes:
        The largest tree (draft nodes below the root) it may choose.
    smoothing:
        Weight of the newest observation in the moving averages of acceptance and cost.
    warmup:
        Steps at the full budget before the controller starts choosing.
    probe_every, max_probe_interval:
        How often ranks above the current budget are re-measured (see Exploration).
    probe_smoothing:
        Weight of a probe's observation of ranks above the regular budget (seen only on probes).
    """

    def __init__(self, max_nodes: int, smoothing: float = 0.5, warmup: int = 3, probe_every: int = 8,
                 max_probe_interval: int = 64, probe_smoothing: float = 0.5) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.max_nodes = max_nodes
        self.smoothing = smoothing
        self.probe_smoothing = probe_smoothing
        self.warmup = warmup
        self.base_probe_interval = max(1, probe_every)
        self.max_probe_interval = max(self.base_probe_interval, max_probe_interval)
        self.accept_rate: list[float | None] = [None] * max_nodes  # p_r, None until observed
        self.cost: dict[int, float] = {}  # bucket -> seconds per step
        self.steps = 0
        self._probe_interval = self.base_probe_interval
        self._since_probe = 0
        self._probe_nodes = 0  # a probe uses at least this many nodes
        self._last_choice = max_nodes

    # -- estimates ------------------------------------------------------------------------

    def expected_tokens(self, nodes: int) -> float:
        """Expected tokens committed by a step with a tree of ``nodes`` draft nodes."""
        return 1.0 + sum(p for p in self.accept_rate[:nodes] if p is not None)

    def expected_cost(self, width: int) -> float | None:
        """Estimated seconds of a step of forward width ``width``; ``None`` if nothing is known.

        An unmeasured bucket borrows the nearest narrower measured one, or half the narrowest one
        when it is narrower than all (optimistic guesses that make the controller try it, after
        which it is measured).
        """
        if not self.cost:
            return None
        b = _bucket(width)
        if b in self.cost:
            return self.cost[b]
        smaller = [k for k in self.cost if k < b]
        if smaller:
            return self.cost[max(smaller)]
        return 0.5 * self.cost[min(self.cost)]  # narrower than anything measured: guess cheaper, then measure

    # -- the decision ----------------------------------------------------------------------

    def choose(self, side_tokens: int = 0) -> BudgetDecision:
        """The budget for the next step, given the side-block tokens that will ride along."""
        if self.max_nodes == 0:
            return BudgetDecision(0, 1.0, self.expected_cost(1 + side_tokens) or 0.0, False)
        if self.steps < self.warmup or not self.cost:
            return BudgetDecision(self.max_nodes, self.expected_tokens(self.max_nodes), 0.0, True)
        candidates = sorted({0, self.max_nodes} | {e - 1 - side_tokens for e in self._edges()
                                                   if 0 < e - 1 - side_tokens < self.max_nodes})
        best, best_rate = 0, -1.0
        for n in candidates:
            cost = self.expected_cost(1 + n + side_tokens)
            rate = self.expected_tokens(n) / cost if cost else 0.0
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        probe = False
        self._since_probe += 1
        if self._since_probe >= self._probe_interval and best < self.max_nodes:
            bigger = [n for n in candidates if n > best]
            above = [n for n in bigger if n >= self._probe_nodes]
            best, probe = (above[0] if above else bigger[-1]), True
            self._since_probe = 0
        cost = self.expected_cost(1 + best + side_tokens) or 0.0
        return BudgetDecision(best, self.expected_tokens(best), cost, probe)

    def _edges(self) -> list[int]:
        edges, e = [], 2
        while e <= 2 * (self.max_nodes + 1):
            edges.append(e)
            e *= 2
        return edges

    def new_request(self) -> None:
        """A request starts: probe on its first step, since what paid off for the previous
        request (or did not) says little about this prompt."""
        self._probe_interval = self.base_probe_interval
        self._since_probe = self._probe_interval

    # -- learning -------------------------------------------------------------------------

    def record(self, decision: BudgetDecision, tree_nodes: int, accepted_ranks: list[int], width: int,
               seconds: float) -> None:
        """Learn from a finished step.

        ``tree_nodes`` draft nodes were actually built (sources may offer fewer than the budget);
        ``accepted_ranks`` are the insertion ranks (0-based, root excluded) of the accepted nodes;
        ``width`` is the forward width and ``seconds`` the step's wall time.
        """
        probing = decision.probe and self.steps >= self.warmup
        accepted = set(accepted_ranks)
        for r in range(min(tree_nodes, self.max_nodes)):
            # ranks above the regular budget are seen only on probes: let those count more
            a = self.probe_smoothing if probing and r >= self._last_choice else self.smoothing
            hit = 1.0 if r in accepted else 0.0
            old = self.accept_rate[r]
            self.accept_rate[r] = hit if old is None else (1 - a) * old + a * hit
        b = _bucket(width)
        old_cost = self.cost.get(b)
        self.cost[b] = seconds if old_cost is None else (1 - self.smoothing) * old_cost + self.smoothing * seconds
        if probing:
            if any(r >= self._last_choice for r in accepted):
                # the probe found tokens beyond the budget: look further, right away
                self._probe_interval = 1
                self._probe_nodes = decision.nodes + 1
            else:
                self._probe_interval = min(self.max_probe_interval, 2 * max(self._probe_interval, self.base_probe_interval // 2))
                self._probe_nodes = 0
        else:
            self._last_choice = decision.nodes
            if tree_nodes and accepted and max(accepted) == tree_nodes - 1 and decision.nodes < self.max_nodes:
                # the newest node was accepted: the tree was too small for this run of hits
                # (a copy in progress), so try a wider one right away
                self._since_probe = self._probe_interval
                self._probe_nodes = decision.nodes + 1
        self.steps += 1
