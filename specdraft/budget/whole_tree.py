"""A second opinion for the budget where width is nearly free: its choice or the whole tree, by
measured tokens per second.

The allocator (:mod:`specdraft.budget.allocator`) sizes each tree from the acceptance it has
seen by rank. Where a forward of 64 rows costs little more than one of 1 (a GPU's captured
buckets), whole trees have committed more tokens per step than those rates promise: sources
that learn from every row the model computes (Token Recycling's top-k) draft better when more
rows are computed, which rates measured one step at a time cannot see. Whether that outweighs
the price of the wider forward depends on the device, the model and the text, so it is
measured rather than assumed.

Every step the budget judges runs one of two *arms*: the allocator's choice or the whole tree
(each request's full tree, within the row limit). Each arm keeps moving averages of the tokens a
step of it commits and the seconds it takes; their ratio is the arm's speed. The whole tree
leads: it runs every step but every :data:`EXPLORE_EVERY`-th, which runs the choice. Once the
choice has :data:`FIRST_STEPS` steps and is measured faster by more than :data:`MARGIN`, it
leads instead, until the whole tree is measured faster again. The arm is
drawn by this schedule alone, whatever the step's drafts, so each arm's steps are a fair sample
of all steps (a step where the two would grant the same trees counts for the arm that ran it);
and a step the whole tree runs needs no choice computed, so its host work on the critical path
is that of a fixed budget.

Either arm checks drafts only; verification is the same, so output stays exactly lossless.
"""

from __future__ import annotations

from ..checks import check_int

#: Steps of the choice measured before it may lead (the whole tree leads until then).
FIRST_STEPS = 8

#: One step in this many runs the arm that is not leading. Trying the choice more often until it
#: has its first steps (every 4th) would let a device where whole trees are dear hand the lead
#: over after 32 steps instead of 128; but in the GPU emulation, where whole trees win, it cost
#: a decoder's first prompt 13% on MT-Bench and 10% on HumanEval, with the later prompts' medians
#: within 3% (``benchmarks/results/gpu-emulation-2026-11-27-eaef319``). Both are one-off costs
#: at a decoder's start, so the schedule favours the devices measured so far.
EXPLORE_EVERY = 16

#: Weight of a new step in an arm's moving averages of tokens and seconds per step (a plain mean
#: over an arm's first 20 steps). A step's tokens vary by factors (1 on most chat steps, 8 on a
#: copied line), so the averages are long. In a simulation of 700 steps drawn like the
#: emulation's MT-Bench steps (``benchmarks/whole_tree_trial_sim.py``), the trial ran at 0.99 of
#: the faster arm's speed where whole trees were 15% faster, 0.94 where the choice was 25%
#: faster, and 0.84 where the whole tree cost twice the choice per step (its first 128 steps are
#: mostly whole trees); smoothing 0.02 or 0.1 moved these by 0.01 at most.
SMOOTHING = 0.05

#: How much faster per step the choice must measure to lead (0.2: 20%). Step for step, the arms
#: understate the whole tree: both draw on the same sources, and while the whole tree leads, its
#: rows feed the sources that learn from every computed row, so the choice's own steps draft
#: better too (and while the choice leads, the whole tree's steps draft worse). In the corrected
#: emulation's first MT-Bench prompt, a trial that let the faster arm lead from the start settled
#: on the choice and committed 1.28 tokens per step, as the choice alone did, where whole trees
#: committed 1.50 (ms per token: 4.27, 4.25 and 3.80).
MARGIN = 0.2

CHOICE, WHOLE = 0, 1


class WholeTreeTrial:
    """The two arms' measured speeds and which arm runs (see the module docstring). One per
    budget: it carries from request to request, as the budget's costs do."""

    def __init__(self, explore_every: int = EXPLORE_EVERY, first_steps: int = FIRST_STEPS,
                 smoothing: float = SMOOTHING, margin: float = MARGIN) -> None:
        check_int("explore_every", explore_every, 2)
        check_int("first_steps", first_steps, 1)
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not margin >= 0.0:
            raise ValueError(f"margin must be >= 0, got {margin!r}")
        self.explore_every = explore_every
        self.first_steps = first_steps
        self.smoothing = smoothing
        self.margin = float(margin)
        #: the arm that runs all steps but every ``explore_every``-th (see :meth:`_lead`)
        self.leading = WHOLE
        #: per arm (:data:`CHOICE`, :data:`WHOLE`): steps measured, and moving averages of the
        #: tokens committed and the seconds taken per step
        self.steps = [0, 0]
        self.tokens = [0.0, 0.0]
        self.seconds = [0.0, 0.0]
        #: steps an arm was picked for, measured or not
        self.picked = 0
        #: the arm of the step in flight (``None``: none, or it is not measured)
        self.pending: int | None = None

    def speed(self, arm: int) -> float | None:
        """Tokens per second of ``arm``'s steps (``None`` before its first)."""
        return self.tokens[arm] / self.seconds[arm] if self.steps[arm] and self.seconds[arm] > 0 else None

    def _lead(self) -> int:
        """The arm that leads from now on: the whole tree, until the choice has its first steps
        and is measured faster by more than :attr:`margin`; then the choice, until the whole tree
        is measured faster again."""
        choice, whole = self.speed(CHOICE), self.speed(WHOLE)
        if self.steps[CHOICE] < self.first_steps or choice is None or whole is None:
            self.leading = WHOLE
        elif self.leading == WHOLE and choice > whole * (1 + self.margin):
            self.leading = CHOICE
        elif self.leading == CHOICE and whole > choice:
            self.leading = WHOLE
        return self.leading

    def pick(self) -> int:
        """The arm of the next step."""
        self.picked += 1
        leader = self._lead()
        arm = 1 - leader if self.picked % self.explore_every == 0 else leader
        self.pending = arm
        return arm

    @property
    def exploring(self) -> bool:
        """Whether the step in flight runs the arm that is not leading (a measurement of that arm:
        what its drafts commit says nothing of what the leader's would)."""
        return self.pending is not None and self.pending != self.leading

    def observe(self, tokens: int, seconds: float) -> None:
        """The step in flight committed ``tokens`` in ``seconds``: its arm learns it."""
        arm, self.pending = self.pending, None
        if arm is None or seconds <= 0:
            return
        weight = max(self.smoothing, 1.0 / (self.steps[arm] + 1))  # a plain mean until it is long enough
        self.tokens[arm] += weight * (tokens - self.tokens[arm])
        self.seconds[arm] += weight * (seconds - self.seconds[arm])
        self.steps[arm] += 1
