"""The adaptive budget cannot miss a copy, however noisy the machine.

Reproduces a measured failure: one decoder reused across code-edit requests speculated on the
first requests, then ran one-token steps for every token of all later ones, while the drafts it
did not check would have been accepted 5-6 tokens at a time. Two things together locked it in:

* a shadow tree still on course after ``SHADOW_PATIENCE`` steps counted every node below its walk
  as rejected, so while running plain steps the controller could never see a draft pay more than
  4 tokens; and
* the price of each width was a moving average of seconds set when that width last ran. A busy
  minute during wide steps left wide prices at several plain steps while plain steps, measured
  every step, went back to normal; since the controller only measures what it runs, those prices
  stayed.

Here a budget is driven as the engine drives it (real token trees, one allocation and one observation per step)
on a simulated clock: novel text first, then requests whose answers copy blocks of their prompts
with small edits, with log-normal noise on every step, a stretch where the machine runs 3.5x
slower, and one 8x outlier.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from _budget_driver import OneRequest
from specdraft.budget import Budget
from specdraft.tree import TokenTree

#: Milliseconds of a forward of k rows, float32 stock kernels, Qwen2.5-Coder-0.5B, AMD EPYC (AVX2):
#: 2-3 rows cost more than 4 (MKL's small-row paths), 32 rows about 4.7 one-row steps.
STOCK_FP32 = {1: 191, 2: 380, 3: 556, 4: 447, 5: 489, 6: 513, 8: 512, 12: 620, 16: 680, 32: 900, 64: 1500}
VOCAB = 1000
LENGTH = 200
MAX_NODES = 32


def forward_ms(width: int) -> float:
    """``STOCK_FP32`` interpolated linearly between the measured widths."""
    if width in STOCK_FP32:
        return STOCK_FP32[width]
    lo = max(k for k in STOCK_FP32 if k < width)
    hi = min(k for k in STOCK_FP32 if k > width)
    return STOCK_FP32[lo] + (STOCK_FP32[hi] - STOCK_FP32[lo]) * (width - lo) / (hi - lo)


@dataclass
class Answer:
    """An answer's tokens and, at each position, how many of the next tokens a copy source drafts
    right (0 in novel text and at the edits)."""

    tokens: list[int]
    copyable: list[int]


def novel(rng: random.Random) -> Answer:
    return Answer([rng.randrange(VOCAB) for _ in range(LENGTH)], [0] * LENGTH)


def code_edit(rng: random.Random) -> Answer:
    """Blocks of 10-40 tokens copied from the prompt, each followed by a 1-3-token edit."""
    tokens: list[int] = []
    copyable: list[int] = []
    while len(tokens) < LENGTH:
        block = rng.randrange(10, 41)
        tokens += [rng.randrange(VOCAB) for _ in range(block)]
        copyable += list(range(block, 0, -1))
        edit = rng.randrange(1, 4)
        tokens += [rng.randrange(VOCAB) for _ in range(edit)]
        copyable += [0] * edit
    return Answer(tokens[:LENGTH], [min(c, LENGTH - i) for i, c in enumerate(copyable[:LENGTH])])


@dataclass
class BusyMachine:
    """Step times of a shared machine: log-normal noise on every step, ``slow`` times slower during
    steps ``slow_steps``, and one ``outlier`` at step ``outlier_step``."""

    noise: float = 0.25
    slow: float = 3.5
    slow_steps: range = range(640, 680)
    outlier: float = 8.0
    outlier_step: int = 700
    seed: int = 0
    step: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def seconds(self, width: int) -> float:
        self.step += 1
        s = forward_ms(width) / 1000 * math.exp(self.rng.gauss(0.0, self.noise))
        if self.step in self.slow_steps:
            s *= self.slow
        if self.step == self.outlier_step:
            s *= self.outlier
        return s


@dataclass
class RequestRun:
    steps: int
    plain_steps: int
    tokens: int
    #: steps taken in copyable stretches with a plain step, counted from each stretch's start
    late_plain: int


def run_request(budget: Budget, answer: Answer, machine: BusyMachine, rng: random.Random) -> RequestRun:
    """Decode ``answer`` as the engine would: each step a copy source drafts 20 tokens (right for
    ``copyable`` of them) and a second source one junk branch; the budget's prefix of the merged
    tree is checked, the step is timed on ``machine``, and the budget learns from the full tree."""
    ctl = OneRequest(budget)
    committed = [VOCAB + 1] * 40  # the prompt
    pos = steps = plain = late_plain = 0
    stretch_step = 0  # steps since the current copyable stretch began
    while pos < len(answer.tokens):
        right = answer.copyable[pos]
        copy = [answer.tokens[pos + j] if j < right else VOCAB + 2 + rng.randrange(VOCAB) for j in range(20)]
        junk = [VOCAB + 2 + rng.randrange(VOCAB) for _ in range(6)]
        branches = [[copy], [junk]]
        full = TokenTree.from_drafts(committed[-1], branches, MAX_NODES)
        decision = ctl.choose(full.num_draft_nodes)
        tree = full.prefix(decision.nodes)
        node = accepted = 0
        while pos + accepted < len(answer.tokens):
            child = tree.child(node, answer.tokens[pos + accepted])
            if child is None:
                break
            node, accepted = child, accepted + 1
        n = min(accepted + 1, len(answer.tokens) - pos)
        start = len(committed)
        committed += answer.tokens[pos : pos + n]
        budget.observe_step(len(tree), machine.seconds(len(tree)))
        ctl.observe(full, committed, start)
        stretch_step = stretch_step + 1 if right >= 4 else 0
        if decision.nodes == 0 and stretch_step > 6:
            late_plain += 1  # a plain step well inside a stretch whose drafts pay
        pos += n
        steps += 1
        plain += decision.nodes == 0
    return RequestRun(steps, plain, len(answer.tokens), late_plain)


#: (seed, first slow step): the slow stretch falls on the first copy requests (after 600 steps of
#: novel text). Each of these locked the earlier controller into plain steps for all later requests
#: or capped it at about 3 tokens a step.
BUSY = [(1, 610), (2, 640), (1, 660), (0, 620)]


@pytest.mark.parametrize("seed, slow_from", BUSY)
@pytest.mark.parametrize("curve", [False, True], ids=["learned-prices", "measured-curve"])
def test_copies_after_novel_text_on_a_busy_machine_are_taken_up(seed: int, slow_from: int, curve: bool) -> None:
    rng = random.Random(seed)
    budget = Budget(MAX_NODES, cost_curve=[forward_ms(w) for w in range(1, 65)] if curve else None)
    machine = BusyMachine(seed=seed, slow_steps=range(slow_from, slow_from + 40), outlier_step=slow_from + 60)
    novel_runs = [run_request(budget, novel(rng), machine, rng) for _ in range(3)]
    copy_runs = [run_request(budget, code_edit(rng), machine, rng) for _ in range(9)]
    assert machine.step > machine.outlier_step  # the slow stretch and the outlier happened
    # novel text: plain steps (drafts never pay), after the warm-up
    assert sum(r.plain_steps for r in novel_runs) >= sum(r.steps for r in novel_runs) - 10
    for i, run in enumerate(copy_runs):
        # the copy source's drafts would commit 6+ tokens a step: every copy request speculates ...
        assert run.tokens / run.steps >= (3.0 if i == 0 else 4.0), (i, run)
        # ... and a stretch of copyable text never runs plain steps once a few steps have shown it
        assert run.late_plain <= 2, (i, run)


def test_a_shadow_still_on_course_does_not_count_the_nodes_below_it_as_rejected() -> None:
    """A copy during plain steps: after the patience, the walked path counts as accepted and the
    rest of the branch is not recorded until the committed tokens reach it (it was recorded as
    rejected, which capped what plain steps could ever see at 4 tokens a step)."""
    budget = Budget(8, warmup=0, smoothing=1.0, acceptance_smoothing=1.0)
    budget.observe_step(1, 0.1)
    ctl = OneRequest(budget)
    answer = list(range(100, 120))
    committed = [1, 2, 3]
    for step in range(8):
        branch = answer[step : step + 8]
        full = TokenTree.from_drafts(committed[-1], [[branch]], 8)
        start = len(committed)
        committed.append(answer[step])  # a plain step: one token
        ctl.observe(full, committed, start)
        if step == 3:  # the first shadow waited 3 steps: 4 nodes known, 4 not yet
            assert ctl.rates[:4] == [1.0] * 4
            assert ctl.rates[4:] == [None] * 4
    assert ctl.rates == [1.0] * 8  # the rest as the walk reached it: never a miss


def test_a_uniform_slowdown_does_not_change_the_chosen_tree() -> None:
    """Prices are relative to the present one-token step: a machine running 3x slower for a while
    makes every width dearer alike."""
    for curve in (None, [forward_ms(w) for w in range(1, 65)]):
        budget = Budget(MAX_NODES, warmup=0, cost_curve=curve)
        for width in (1, 5, 9, 17, 33):
            budget.observe_step(width, forward_ms(width) / 1000)
        budget.observe_step(1, forward_ms(1) / 1000)
        ctl = OneRequest(budget)
        ctl.observe_chain(MAX_NODES, 6)
        before, seconds_before = ctl.choose(MAX_NODES), budget.costs.seconds(1)
        for _ in range(5):
            budget.observe_step(1, 3 * forward_ms(1) / 1000)
        after = ctl.choose(MAX_NODES)
        assert before.nodes == after.nodes and before.nodes > 0
        assert budget.costs.seconds(1) == pytest.approx(3 * seconds_before, rel=0.05)
