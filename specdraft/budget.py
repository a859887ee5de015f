"""Adaptive tree budget: size each step's tree to maximise accepted tokens per second.

Speculation pays only when the extra width of a forward pass buys enough accepted tokens. On a
small CPU a multi-token forward can cost several one-token steps (``docs/cpu-fast-path.md``),
and on novel text drafts rarely hit, so a fixed tree can make decoding *slower* than plain
decoding. The Ant paper calls the best width the "critical decoding length" and picks it offline;
we measure both sides online and re-pick it every step.

The rule
    Trees are merged best first by each node's calibrated chance of acceptance
    (:mod:`specdraft.tree`, :mod:`specdraft.calibration`) and cut at the budget in that same
    order, so the tree of budget ``n`` is exactly the first ``n`` nodes of the full tree, and a
    node accepted in the full tree is accepted in the cut one too (its ancestors come earlier).
    The decoder hands over the full tree the checked one was cut from, so it is never rebuilt
    with other scores. Hence::

        E[tokens committed | budget n] = 1 + sum_{r < n} p_r

    where ``p_r`` is the probability that the node inserted ``r``-th is on the accepted path. We
    keep an exponential moving average of every ``p_r``, and price a step of forward width ``q``
    (root + tree + side tokens) as ``cost(q)`` one-token steps, each width on its own, from a
    measured cost curve when the decoder has one, else learned from the steps
    (:mod:`specdraft.step_costs`). Each step picks ``n`` maximising
    ``(1 + sum_{r<n} p_r) / cost(width(n))`` over every ``n`` from 0 (plain decoding) to
    ``max_nodes``, where ``width(0) = 1`` and ``width(n) = 1 + n + side``: a plain step leaves the
    side blocks (Jacobi's window) out too, so a source whose window does not pay stops costing
    anything until drafts pay again. Prices are relative to the present one-token step, so a busy
    machine that slows every step alike does not change the choice.

Shadow verification instead of probing
    The decoder always builds the *full* tree, checks only its first ``n`` nodes, and keeps the
    full tree aside: under greedy decoding the tokens committed over the next steps say exactly
    which of its nodes would have been accepted, so every ``p_r`` is observed every step, for
    free, even while the controller runs plain one-token steps. A copy that starts in the middle of
    novel text is noticed at once, without paying for exploratory wide forwards. (Under sampling the
    shadow check is an estimate; it only sizes the tree, never changes what is emitted.)
    Acceptance comes in runs (a copy starts, goes on, ends), so the averages weigh the newest
    observation heavily (``acceptance_smoothing=0.3``: a copy's end still shrinks the tree within a
    few steps, while a tree merged from several sources, whose later ranks hit now and then, is not
    cut back after every miss). A shadow tree still on course after
    :data:`SHADOW_PATIENCE` steps records what is known (the walked path accepted, the branches it
    left rejected); the nodes below the walk are recorded as the committed tokens reach them,
    never guessed as rejected, so plain steps see a long copy's full worth. Without a cost curve,
    widths never run are priced optimistically (interpolated between measured ones), so the
    controller tries them when the acceptance says they might pay, and then knows.

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

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from .step_costs import StepCosts
from .tree import TokenTree

#: Steps a shadow tree waits before what is known of it is recorded: after that the part walked
#: so far counts as accepted and the branches it left as not, so a copy that starts during plain
#: one-token steps is noticed within a few steps instead of only when its whole draft has been
#: committed. The nodes below the walk are not known yet and are recorded later, as the walk goes
#: on: counting them as misses (as this once did) told a controller running plain steps that no
#: draft deeper than 4 tokens ever pays, so it could never buy its way back to wide trees.
SHADOW_PATIENCE = 3


def _moving_average(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average; the first observation is taken as it is."""
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class _Shadow:
    """A full tree waiting for the committed tokens to say which of its nodes would have been accepted."""

    tree: TokenTree
    start: int  # index of the first token committed after its root
    age: int = 0  # steps it has waited
    #: per node, whether its outcome is recorded already (a list, not a set: a copied budget pickles alike)
    recorded: list[bool] = field(default_factory=list)


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

    ``tree`` is the tree that was checked (cut at ``decision.nodes``, by
    :meth:`~specdraft.tree.TokenTree.prefix` when its :attr:`~specdraft.tree.TokenTree.full` tree
    is known); ``branches`` are every source's full branch lists, from which the full tree is
    rebuilt (with the merge's prior rates) when the checked tree was cut and does not carry it;
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
        Weight of the newest observation in the moving average of the machine's step speed.
    acceptance_smoothing:
        Weight of the newest observation in a request's moving averages of acceptance by rank.
    warmup:
        Steps at the full budget before the controller starts choosing (so the cost of a wide
        step is measured; sources that need longer, like Jacobi's window, can ask for more).
    prior_smoothing:
        Weight of the newest observation in the slow, long-run averages each request starts from.
    opening_cost_ratio:
        A request's first tree step stays plain when the chosen tree would cost more than this
        many plain steps (``math.inf``: never).
    cost_curve:
        The measured cost of a forward of 1, 2, ... rows on this machine and model (any unit, see
        :mod:`specdraft.kernel_costs`): widths are priced from it from the first step, and steps
        only tell how fast the machine runs now. ``None`` learns each width's price from its steps.
    """

    def __init__(self, max_nodes: int, smoothing: float = 0.5, warmup: int = 3,
                 prior_smoothing: float = 0.02, opening_cost_ratio: float = 1.5,
                 cost_curve: Sequence[float] | None = None, acceptance_smoothing: float = 0.3) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0.0 < acceptance_smoothing <= 1.0:
            raise ValueError(f"acceptance_smoothing must be in (0, 1], got {acceptance_smoothing}")
        if not 0.0 < prior_smoothing <= 1.0:
            raise ValueError(f"prior_smoothing must be in (0, 1], got {prior_smoothing}")
        if not opening_cost_ratio >= 1.0:
            raise ValueError(f"opening_cost_ratio must be >= 1 (math.inf: never hold back), got {opening_cost_ratio}")
        self.max_nodes = max_nodes
        self.smoothing = smoothing
        self.acceptance_smoothing = acceptance_smoothing
        self.prior_smoothing = prior_smoothing
        self.opening_cost_ratio = opening_cost_ratio
        self.warmup = warmup
        self.accept_rate: list[float | None] = [None] * max_nodes  # p_r, None until observed
        self.long_run_rate: list[float | None] = [None] * max_nodes  # the slow averages
        self.costs = StepCosts(cost_curve, smoothing)  # seconds per step, by forward width
        self.steps = 0
        self.request_steps = 0  # steps of the current request
        self._shadows: list[_Shadow] = []  # full trees awaiting their outcome
        self._offered: int | None = None  # draft nodes the sources offered last step (the full tree's)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_shadows", [])  # budgets pickled before shadows lived here
        state.setdefault("_offered", None)
        state.setdefault("acceptance_smoothing", state.get("smoothing", 0.5))  # one weight for both, before
        if "costs" not in state:  # budgets pickled when costs were kept in power-of-two buckets
            costs = StepCosts(None, state.get("smoothing", 0.5))
            for bucket, seconds in sorted(state.pop("cost", {}).items()):
                costs.observe(bucket, seconds)
            state["costs"] = costs
        state["_shadows"] = [s for s in state["_shadows"] if isinstance(s, _Shadow)]
        self.__dict__.update(state)

    def set_cost_curve(self, curve: Sequence[float] | None) -> None:
        """Price widths from ``curve`` (the cost of a forward of 1, 2, ... rows) from now on;
        ``None`` goes back to learning each width's price from its own steps."""
        self.costs.set_curve(curve)

    # -- estimates ------------------------------------------------------------------------

    def expected_tokens(self, nodes: int) -> float:
        """Expected tokens committed by a step with a tree of ``nodes`` draft nodes."""
        return 1.0 + sum(p for p in self.accept_rate[:nodes] if p is not None)

    def expected_cost(self, width: int) -> float | None:
        """Estimated seconds of a step of forward width ``width``; ``None`` if nothing is known.

        Each width is priced on its own, as the machine's present one-token step time times the
        width's price in one-token steps (see :mod:`specdraft.step_costs`).
        """
        return self.costs.seconds(width)

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
        if self.steps < self.warmup or not self.costs.known:
            return BudgetDecision(self.max_nodes, self.expected_tokens(self.max_nodes), 0.0)
        # every tree size is a candidate, priced at its own width: the rate compared is tokens per
        # one-token step, which does not depend on how fast the machine happens to run just now.
        # A budget of n nodes is a cap: when the sources offered fewer nodes last step (``offered``),
        # the forward may be narrower, and a narrower forward can cost more (2-3 rows on MKL cost
        # more than 4), so such an n is priced at the dearest width between the two.
        shapes = self.costs.shapes(self.width(self.max_nodes, side_tokens))
        offered = self._offered if self._offered is not None else self.max_nodes
        narrow = 1 + offered + side_tokens  # the width if the sources offer what they did last step
        best, best_rate, best_price, tokens = 0, 1.0, 1.0, 1.0
        dearest: float | None = None
        for n, p in enumerate(self.accept_rate, 1):
            tokens += p or 0.0
            wide = self.width(n, side_tokens)
            if n <= offered:
                price = shapes[wide - 1]
            else:
                dearest = max(shapes[narrow - 1 : wide]) if dearest is None else max(dearest, shapes[wide - 1])
                price = dearest
            rate = tokens / price
            if rate > best_rate * (1 + 1e-9):
                best, best_rate, best_price = n, rate, price
        plain = self.expected_cost(1) or 0.0
        if best and self.request_steps == 0 and best_price > self.opening_cost_ratio:
            return BudgetDecision(0, 1.0, plain)  # the request's first step: no gamble yet
        return BudgetDecision(best, self.expected_tokens(best), plain * best_price)

    def start_request(self) -> None:
        """A request starts: the acceptance averages restart from the long-run ones (see "Between
        requests" above); step costs carry over (they belong to the model and the machine).
        Shadow trees of an earlier request are dropped; what was not yet known of them is not
        recorded at all."""
        self.accept_rate = list(self.long_run_rate)
        self.request_steps = 0
        self._shadows = []

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from one step: its cost, and (through shadow trees) which ranks of the *full* tree
        were or would have been accepted, resolved as later steps commit tokens."""
        self.observe_cost(outcome.width, outcome.seconds)
        self.observe_drafts(outcome)

    def observe_drafts(self, outcome: StepOutcome) -> None:
        """The acceptance half of :meth:`observe`: shadow-verify the step's full tree (its cost is
        not recorded; a batched decoder prices the whole forward once, not per request)."""
        tree = outcome.tree
        if tree.full is not None:  # the checked tree was cut from this one: same order, no rebuild
            tree = tree.full
        elif outcome.decision.nodes < self.max_nodes:
            tree = TokenTree.from_drafts(tree.tokens[0], outcome.branches, self.max_nodes)
        self._offered = tree.num_draft_nodes
        self._shadows.append(_Shadow(tree, outcome.start))
        self._resolve_shadows(outcome.committed)

    def _resolve_shadows(self, committed: Sequence[int]) -> None:
        """Walk each pending full tree along the tokens committed since it was drafted. A walk that
        leaves the tree or reaches a leaf settles every node. A walk still on the tree waits; once it
        has waited :data:`SHADOW_PATIENCE` steps, what is known is recorded (the walked path
        accepted, the branches it left rejected) and the nodes below it wait for more tokens."""
        waiting = []
        for shadow in self._shadows:
            tree, node, i = shadow.tree, 0, shadow.start
            while i < len(committed):
                child = tree.child(node, committed[i])
                if child is None:
                    break
                node, i = child, i + 1
            settled = not (i == len(committed) and tree.children(node))
            if settled:
                self._record_nodes(tree, node, range(1, len(tree)), shadow.recorded)
                continue
            if shadow.age >= SHADOW_PATIENCE:
                self._record_nodes(tree, node, _outside_subtree(tree, node), shadow.recorded)
            shadow.age += 1
            waiting.append(shadow)
        self._shadows = waiting

    def _record_nodes(self, tree: TokenTree, reached: int, nodes: Sequence[int] | range, recorded: list[bool]) -> None:
        """Record the outcome of ``nodes`` of ``tree`` (accepted: on the path to ``reached``) that
        ``recorded`` does not mark yet, and mark them."""
        if not recorded:
            recorded.extend([False] * len(tree))
        on_path = set(tree.path_to(reached))
        fresh = [n for n in nodes if not recorded[n] and n <= self.max_nodes]
        if not fresh:
            return
        for n in fresh:
            recorded[n] = True
        self._observe_ranks([n - 1 for n in fresh], {n - 1 for n in fresh if n in on_path})

    # -- learning -------------------------------------------------------------------------

    def observe_acceptance(self, tree_nodes: int, accepted_ranks: list[int]) -> None:
        """A (full or shadow) tree of ``tree_nodes`` draft nodes was resolved: the nodes with these
        insertion ranks (0-based, root excluded) were, or would have been, accepted."""
        self._observe_ranks(range(min(tree_nodes, self.max_nodes)), set(accepted_ranks))

    def _observe_ranks(self, ranks: Sequence[int] | range, accepted: set[int]) -> None:
        """These ranks' outcomes are known: those in ``accepted`` hit, the others missed."""
        for r in ranks:
            hit = 1.0 if r in accepted else 0.0
            self.accept_rate[r] = _moving_average(self.accept_rate[r], hit, self.acceptance_smoothing)
            self.long_run_rate[r] = _moving_average(self.long_run_rate[r], hit, self.prior_smoothing)

    def observe_cost(self, width: int, seconds: float) -> None:
        """A step of forward width ``width`` took ``seconds`` (drafting and verifying included)."""
        self.costs.observe(width, seconds)
        self.steps += 1
        self.request_steps += 1

    def record(self, decision: BudgetDecision, tree_nodes: int, accepted_ranks: list[int], width: int,
               seconds: float) -> None:
        """Both observations of a step whose checked tree was the full tree."""
        self.observe_acceptance(tree_nodes, accepted_ranks)
        self.observe_cost(width, seconds)


def _outside_subtree(tree: TokenTree, node: int) -> list[int]:
    """Draft nodes of ``tree`` that are not strictly below ``node`` (their outcome is known once the
    committed tokens have walked to ``node``)."""
    below = [False] * len(tree)
    for j in range(node + 1, len(tree)):
        parent = tree.parents[j]
        below[j] = parent == node or below[parent]
    return [j for j in range(1, len(tree)) if not below[j]]
