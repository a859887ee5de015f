"""A second opinion for the budget where width is nearly free: its choice or the whole tree, by
measured tokens per second.

The allocator (:mod:`specdraft.budget.allocator`) sizes each tree from the acceptance it has
seen by rank. Where a forward of 64 rows costs little more than one of 1 (a GPU's captured
buckets), two things it cannot see make the whole tree worth more than those rates promise:
sources that learn from every row the model computes (Token Recycling's top-k) draft better
when more rows are computed, and nodes deep in a tree hit in runs that the per-rank averages
smooth away. Whether that outweighs the price of the wider forward depends on the device, the
model and the text, so it is measured rather than assumed.

Every step the budget judges runs one of two *arms*: the allocator's choice or the whole tree
(each request's full tree, within the row limit). Each arm keeps moving averages of the tokens a
step of it commits and the seconds it takes; their ratio is the arm's speed. The faster arm
runs, and every :data:`EXPLORE_EVERY`-th step runs the other, so that a change in the text or
the load is noticed. Until each arm has :data:`FIRST_STEPS` steps the two alternate. The arm is
drawn by this schedule alone, whatever the step's drafts, so each arm's steps are a fair sample
of all steps (where the two would grant the same trees, both arms learn the same); and a step
the whole tree runs needs no choice computed, so the host work on the critical path is that of a
fixed budget.

Either arm checks drafts only; verification is the same, so output stays exactly lossless.
"""

from __future__ import annotations

#: Steps of each arm measured before the faster one leads (the two alternate until then).
FIRST_STEPS = 3

#: One step in this many runs the arm that is not leading.
EXPLORE_EVERY = 16

#: Weight of a new step in an arm's moving averages of tokens and seconds per step. A step's
#: tokens vary by factors (1 on most chat steps, 8 on a copied line), so the averages must be long
#: for the slower arm not to lead by chance: in a simulation of 700 steps where whole trees were
#: 15% faster per step (the corrected emulation's MT-Bench figures), 0.05 with a try every 16
#: steps ran them on 84% of steps, 0.1 with one every 8 on 72%.
SMOOTHING = 0.05

CHOICE, WHOLE = 0, 1


class WholeTreeTrial:
    """The two arms' measured speeds and which arm runs (see the module docstring). One per
    budget: it carries from request to request, as the budget's costs do."""

    def __init__(self, explore_every: int = EXPLORE_EVERY, first_steps: int = FIRST_STEPS,
                 smoothing: float = SMOOTHING) -> None:
        if isinstance(explore_every, bool) or not isinstance(explore_every, int) or explore_every < 2:
            raise ValueError(f"explore_every must be an int >= 2, got {explore_every!r}")
        if isinstance(first_steps, bool) or not isinstance(first_steps, int) or first_steps < 1:
            raise ValueError(f"first_steps must be an int >= 1, got {first_steps!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.explore_every = explore_every
        self.first_steps = first_steps
        self.smoothing = smoothing
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

    @property
    def leader(self) -> int | None:
        """The faster arm, once both have their first steps (``None`` before)."""
        if min(self.steps) < self.first_steps:
            return None
        choice, whole = self.speed(CHOICE), self.speed(WHOLE)
        return WHOLE if whole is not None and (choice is None or whole > choice) else CHOICE

    def pick(self) -> int:
        """The arm of the next step."""
        self.picked += 1
        leader = self.leader
        if leader is None:
            arm = CHOICE if self.steps[CHOICE] <= self.steps[WHOLE] else WHOLE
        else:
            arm = 1 - leader if self.picked % self.explore_every == 0 else leader
        self.pending = arm
        return arm

    def observe(self, tokens: int, seconds: float) -> None:
        """The step in flight committed ``tokens`` in ``seconds``: its arm learns it."""
        arm, self.pending = self.pending, None
        if arm is None or seconds <= 0:
            return
        weight = max(self.smoothing, 1.0 / (self.steps[arm] + 1))  # a plain mean until it is long enough
        self.tokens[arm] += weight * (tokens - self.tokens[arm])
        self.seconds[arm] += weight * (seconds - self.seconds[arm])
        self.steps[arm] += 1
