"""Adaptive tree budget: size each step's tree to maximise accepted tokens per second.

Speculation pays only when the extra width of a forward pass buys enough accepted tokens. On a
small CPU a multi-token forward can cost several one-token steps (``docs/cpu-fast-path.md``),
and on novel text drafts rarely hit, so a fixed tree can make decoding *slower* than plain
decoding. The Ant paper calls the best width the "critical decoding length" and picks it offline;
we measure both sides online and re-pick it every step.

The rule
    Trees are merged in priority order and cut at the budget in that same order, so the tree of
    budget ``n`` is exactly the first ``n`` nodes of the full tree, and a node accepted in the
    full tree is accepted in the cut one too (its ancestors come earlier). Hence::

        E[tokens committed | budget n] = 1 + sum_{r < n} p_r

    where ``p_r`` is the probability that the node inserted ``r``-th is on the accepted path. We
    keep an exponential moving average of every ``p_r`` and of the measured step time
    ``cost(q)`` per forward width ``q`` (root + tree + side tokens, in power-of-two buckets). Each
    step picks ``n`` maximising ``(1 + sum_{r<n} p_r) / cost(width(n))`` over ``n = 0`` (plain
    decoding) and the bucket edges up to ``max_nodes``, where ``width(0) = 1`` and
    ``width(n) = 1 + n + side``: a plain step leaves the side blocks (Jacobi's window) out too, so
    a source whose window does not pay stops costing anything until drafts pay again.

Shadow verification instead of probing
    The decoder always builds the *full* tree, checks only its first ``n`` nodes, and keeps the
    full tree aside: under greedy decoding the tokens committed over the next steps say exactly
    which of its nodes would have been accepted, so every ``p_r`` is observed every step, for
    free, even while the controller runs plain one-token steps. A copy that starts in the middle of
    novel text is noticed at once, without paying for exploratory wide forwards. (Under sampling the
    shadow check is an estimate; it only sizes the tree, never changes what is emitted.)
    Acceptance comes in runs (a copy starts, goes on, ends), so the averages weigh the newest
    observation heavily (``smoothing=0.5``). Costs of widths never run are guessed optimistically
    (the nearest narrower measured bucket, or half the narrowest), so the controller tries them
    when the acceptance says they might pay, and then knows.

Between requests
    A run of acceptance ends with its request: a new prompt owes nothing to how the last answer
    ended. So each request starts from slow averages of every observation so far (weight
    ``prior_smoothing``, the long-run acceptance of this decoder's traffic), and the fast averages
    take over from there.

    A request's first tree step also stays plain when the tree the averages call for would cost
    more than ``opening_cost_ratio`` (1.5) plain steps: nothing of the request has been seen yet,
    and on a short answer a failed wide step is not won back. Where width is nearly free (bf16 on
    a CPU, GPUs) the rule never fires.

How these rules and constants were chosen (the replays, what was tried and rejected) is told in
the documentation's "How the defaults were chosen" page.

The interface
    The decoder asks :meth:`AdaptiveBudget.choose` how wide to go before each step's forward and
    reports the step with one :meth:`AdaptiveBudget.observe` call after it (a :class:`StepOutcome`);
    everything else (shadow trees, acceptance by rank, step costs) stays in here.
    :class:`FixedBudget` has the same interface and always answers the cap.

The budget changes only which drafts are checked, never how they are verified, so output stays
exactly lossless whatever this controller decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from .tree import TokenTree

#: Steps a shadow tree may wait for its outcome; after that the part walked so far counts as
#: accepted and the rest as not, so a copy that starts during plain one-token steps is noticed
#: within a few steps instead of only when its whole draft has been committed.
SHADOW_PATIENCE = 3


def _moving_average(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average; the first observation is taken as it is."""
    return new if old is None else (1 - weight) * old + weight * new


def _bucket(width: int) -> int:
    """Power-of-two bucket of a forward width: 1, 2, 3-4 -> 4, 5-8 -> 8, ..."""
    b = 1
    while b < width:
        b *= 2
    return b


@dataclass
class BudgetDecision:
    """The budget for one step and what the controller expected of it.

    ``side_blocks`` says whether the sources' side blocks (Jacobi's window) ride along; ``None``
    means "only when the tree is not empty": a plain step leaves them out too, so a source whose
    window does not pay stops costing width until drafts pay again.
    """

    nodes: int
    expected_tokens: float
    expected_cost: float
    side_blocks: bool | None = None

    @property
    def keeps_side_blocks(self) -> bool:
        return self.nodes > 0 if self.side_blocks is None else self.side_blocks


@dataclass(frozen=True)
class StepOutcome:
    """What a budget learns from one step, reported once after its forward and verification.

    ``tree`` is the tree that was checked (cut at ``decision.nodes``); ``branches`` are every
    source's full branch lists, from which the full tree is rebuilt when the checked one was cut;
    ``committed`` is the whole sequence after the step, whose tokens from index ``start`` on were
    committed by it; ``width`` is the forward's width and ``seconds`` the step's time.
    """

    decision: BudgetDecision
    tree: TokenTree
    branches: Sequence[Sequence[Sequence[int]]]
    committed: Sequence[int]
    start: int
    width: int
    seconds: float


class Budget(Protocol):
    """What the decoder needs of a tree budget: one question before a step, one report after."""

    max_nodes: int

    def start_request(self) -> None: ...

    def choose(self, side_tokens: int = 0) -> BudgetDecision: ...

    def observe(self, outcome: StepOutcome) -> None: ...


class FixedBudget:
    """Always the cap (``Decoder(adaptive_budget=False)``): for benchmarks of fixed tree sizes."""

    def __init__(self, max_nodes: int) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        self.max_nodes = max_nodes

    def start_request(self) -> None:
        """Nothing carries between requests."""

    def choose(self, side_tokens: int = 0) -> BudgetDecision:
        return BudgetDecision(self.max_nodes, 0.0, 0.0, side_blocks=True)

    def observe(self, outcome: StepOutcome) -> None:
        """A fixed budget learns nothing."""


class AdaptiveBudget:
    """Online controller of the tree size (see the module docstring for the rule).

    Parameters
    ----------
    max_nodes:
        The largest tree (draft nodes below the root) it may choose.
    smoothing:
        Weight of the newest observation in the moving averages of acceptance and cost.
    warmup:
        Steps at the full budget before the controller starts choosing (so the cost of a wide
        step is measured; sources that need longer, like Jacobi's window, can ask for more).
    prior_smoothing:
        Weight of the newest observation in the slow, long-run averages each request starts from.
    opening_cost_ratio:
        A request's first tree step stays plain when the chosen tree would cost more than this
        many plain steps (``math.inf``: never).
    """

    def __init__(self, max_nodes: int, smoothing: float = 0.5, warmup: int = 3,
                 prior_smoothing: float = 0.02, opening_cost_ratio: float = 1.5) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0.0 < prior_smoothing <= 1.0:
            raise ValueError(f"prior_smoothing must be in (0, 1], got {prior_smoothing}")
        if not opening_cost_ratio >= 1.0:
            raise ValueError(f"opening_cost_ratio must be >= 1 (math.inf: never hold back), got {opening_cost_ratio}")
        self.max_nodes = max_nodes
        self.smoothing = smoothing
        self.prior_smoothing = prior_smoothing
        self.opening_cost_ratio = opening_cost_ratio
        self.warmup = warmup
        self.accept_rate: list[float | None] = [None] * max_nodes  # p_r, None until observed
        self.long_run_rate: list[float | None] = [None] * max_nodes  # the slow averages
        self.cost: dict[int, float] = {}  # bucket -> seconds per step
        self.steps = 0
        self.request_steps = 0  # steps of the current request
        self._shadows: list[tuple[TokenTree, int, int]] = []  # (full tree, start, age) awaiting outcome

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_shadows", [])  # budgets pickled before shadows lived here
        self.__dict__.update(state)

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
        return 0.5 * self.cost[min(self.cost)]

    # -- the decision ----------------------------------------------------------------------

    @staticmethod
    def width(nodes: int, side_tokens: int) -> int:
        """Forward width of a step with ``nodes`` draft nodes: a plain step (``nodes == 0``) runs
        the root alone, without side blocks (the decoder drops them), else root + tree + side."""
        return 1 if nodes == 0 else 1 + nodes + side_tokens

    def choose(self, side_tokens: int = 0) -> BudgetDecision:
        """The budget for the next step, given the side-block tokens that will ride along."""
        if self.max_nodes == 0:
            return BudgetDecision(0, 1.0, self.expected_cost(1) or 0.0)
        if self.steps < self.warmup or not self.cost:
            return BudgetDecision(self.max_nodes, self.expected_tokens(self.max_nodes), 0.0)
        candidates = sorted({0, self.max_nodes} | {e - 1 - side_tokens for e in self._edges()
                                                   if 0 < e - 1 - side_tokens < self.max_nodes})
        best, best_rate = 0, -1.0
        for n in candidates:
            cost = self.expected_cost(self.width(n, side_tokens))
            rate = self.expected_tokens(n) / cost if cost else 0.0
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        cost = self.expected_cost(self.width(best, side_tokens)) or 0.0
        plain = self.expected_cost(1)
        if best and self.request_steps == 0 and plain and cost > self.opening_cost_ratio * plain:
            return BudgetDecision(0, 1.0, plain)  # the request's first step: no gamble yet
        return BudgetDecision(best, self.expected_tokens(best), cost)

    def _edges(self) -> list[int]:
        edges, e = [], 2
        while e <= 2 * (self.max_nodes + 1):
            edges.append(e)
            e *= 2
        return edges

    def start_request(self) -> None:
        """A request starts: the acceptance averages restart from the long-run ones (see "Between
        requests" above); step costs carry over (they belong to the model and the machine).
        Shadow trees of an earlier request are dropped unresolved."""
        self.accept_rate = list(self.long_run_rate)
        self.request_steps = 0
        self._shadows = []

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from one step: its cost, and (through shadow trees) which ranks of the *full* tree
        were or would have been accepted, resolved as later steps commit tokens."""
        self.observe_cost(outcome.width, outcome.seconds)
        tree = outcome.tree
        if outcome.decision.nodes < self.max_nodes:
            tree = TokenTree.from_drafts(tree.tokens[0], outcome.branches, self.max_nodes)
        self._shadows.append((tree, outcome.start, 0))
        self._resolve_shadows(outcome.committed)

    def _resolve_shadows(self, committed: Sequence[int]) -> None:
        """Walk each pending full tree along the tokens committed since it was drafted; a walk that
        leaves the tree, reaches a leaf or runs out of patience (:data:`SHADOW_PATIENCE`) tells
        which ranks would have been accepted. Trees still on course wait for more tokens."""
        waiting = []
        for tree, start, age in self._shadows:
            node, i = 0, start
            while i < len(committed):
                child = tree.child(node, committed[i])
                if child is None:
                    break
                node, i = child, i + 1
            if i == len(committed) and tree.children(node) and age < SHADOW_PATIENCE:
                waiting.append((tree, start, age + 1))  # still on the tree: the outcome is not known yet
                continue
            self.observe_acceptance(tree.num_draft_nodes, [n - 1 for n in tree.path_to(node)])
        self._shadows = waiting

    # -- learning -------------------------------------------------------------------------

    def observe_acceptance(self, tree_nodes: int, accepted_ranks: list[int]) -> None:
        """A (full or shadow) tree of ``tree_nodes`` draft nodes was resolved: the nodes with these
        insertion ranks (0-based, root excluded) were, or would have been, accepted."""
        accepted = set(accepted_ranks)
        for r in range(min(tree_nodes, self.max_nodes)):
            hit = 1.0 if r in accepted else 0.0
            self.accept_rate[r] = _moving_average(self.accept_rate[r], hit, self.smoothing)
            self.long_run_rate[r] = _moving_average(self.long_run_rate[r], hit, self.prior_smoothing)

    def observe_cost(self, width: int, seconds: float) -> None:
        """A step of forward width ``width`` took ``seconds`` (drafting and verifying included)."""
        b = _bucket(width)
        self.cost[b] = _moving_average(self.cost.get(b), seconds, self.smoothing)
        self.steps += 1
        self.request_steps += 1

    def record(self, decision: BudgetDecision, tree_nodes: int, accepted_ranks: list[int], width: int,
               seconds: float) -> None:
        """Both observations of a step whose checked tree was the full tree."""
        self.observe_acceptance(tree_nodes, accepted_ranks)
        self.observe_cost(width, seconds)
