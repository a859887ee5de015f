"""The budget's second opinion where width is nearly free: its choice or the whole tree, whichever
has committed more tokens per second (:mod:`specdraft.budget.whole_tree`)."""

from __future__ import annotations

import copy

import pytest

from _budget_driver import OneRequest
from specdraft import Decoder
from specdraft.bench.methods import build_method
from specdraft.budget import Budget
from specdraft.budget.whole_tree import CHOICE, WHOLE, WholeTreeTrial
from specdraft.simulated_device import SimulatedDevice

from conftest import reference_greedy, tiny_model

PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6, 7]


def run(trial: WholeTreeTrial, steps: int, measure) -> list[int]:
    """``steps`` differing steps; ``measure(arm, step)`` gives a step's (tokens, seconds)."""
    arms = []
    for step in range(steps):
        arm = trial.pick()
        trial.observe(*measure(arm, step))
        arms.append(arm)
    return arms


def test_the_whole_tree_leads_and_the_choice_is_tried_every_nth_step() -> None:
    trial = WholeTreeTrial(explore_every=8, first_steps=3)
    speeds = {CHOICE: (1, 0.010), WHOLE: (3, 0.012)}  # 100 against 250 tokens per second
    arms = run(trial, 64, lambda arm, step: speeds[arm])
    assert [i for i, arm in enumerate(arms, start=1) if arm == CHOICE] == list(range(8, 65, 8))
    assert trial.speed(WHOLE) == pytest.approx(250) and trial.speed(CHOICE) == pytest.approx(100)


@pytest.mark.parametrize("choice_speedup, leads", [(1.1, WHOLE), (1.3, CHOICE)])
def test_the_choice_leads_once_measured_faster_by_more_than_the_margin(choice_speedup, leads) -> None:
    trial = WholeTreeTrial(explore_every=4, first_steps=3, margin=0.2)
    arms = run(trial, 12, lambda arm, step: (2, 0.02) if arm == WHOLE else (2, 0.02 / choice_speedup))
    assert arms == [WHOLE, WHOLE, WHOLE, CHOICE] * 3  # the choice's first 3 steps: it may lead from now on
    later = run(trial, 16, lambda arm, step: (2, 0.02) if arm == WHOLE else (2, 0.02 / choice_speedup))
    assert later.count(leads) == 12 and trial.leading == leads


def test_a_leading_choice_that_slows_down_gives_the_lead_back() -> None:
    trial = WholeTreeTrial(explore_every=4, first_steps=2, margin=0.2)

    def measure(arm: int, step: int) -> tuple[int, float]:
        if step < 40:
            return (2, 0.01) if arm == CHOICE else (2, 0.02)
        return (2, 0.04) if arm == CHOICE else (2, 0.02)  # the choice now takes twice the whole tree's time

    arms = run(trial, 120, measure)
    assert arms[20:40].count(CHOICE) == 15
    assert trial.leading == WHOLE and arms[-20:].count(WHOLE) == 15


def test_a_step_of_the_whole_tree_computes_no_choice() -> None:
    """The host work between two forwards is then that of a fixed budget."""
    budget = Budget(8, warmup=0, cost_curve=[1.0] * 64)
    budget.whole_tree = trial = WholeTreeTrial(first_steps=1, explore_every=4)
    ctl = OneRequest(budget)
    budget.observe_step(1, 0.01)
    chosen = []
    best_prefix = budget._best_prefix
    budget._best_prefix = lambda *args: chosen.append(1) or best_prefix(*args)
    for _ in range(12):
        ctl.choose(8)
        budget.observe_step(9, 0.01, tokens=3 if trial.pending == WHOLE else 1)
    assert trial.steps[WHOLE] == 12 - len(chosen) and trial.leading == WHOLE
    assert len(chosen) == 3  # the 4th, 8th and 12th steps


def plain_choosing(steps: int, whole_step: tuple[int, float]) -> tuple[list[int], Budget, OneRequest]:
    """A budget that sees wide steps as dear and drafts as weak, so its choice is a plain step,
    with a trial (a try every 8th step), run for ``steps`` steps: a plain step commits 1 token in
    10 ms, a whole tree of 16 nodes ``whole_step`` (tokens, seconds). Returns the nodes granted."""
    budget = Budget(16, warmup=0, cost_curve=[1.0] + [3.0] * 63)
    budget.whole_tree = WholeTreeTrial(explore_every=8, first_steps=2)
    ctl = OneRequest(budget)
    for _ in range(20):
        ctl.observe_chain(16, 0)
    budget.observe_step(1, 0.01)
    granted = []
    for _ in range(steps):
        nodes = ctl.choose(16).nodes
        granted.append(nodes)
        tokens, seconds = whole_step if nodes else (1, 0.010)
        budget.observe_step(17 if nodes else 1, seconds, tokens=tokens)
    return granted, budget, ctl


def test_where_the_choice_is_plain_the_whole_tree_keeps_the_lead_while_measured_faster() -> None:
    """Measured, the whole tree commits more per second (as where sources learn from every
    row), so it keeps the lead, with the choice's plain step every 8th step."""
    granted, budget, ctl = plain_choosing(40, whole_step=(4, 0.012))
    assert set(granted) == {0, 16}
    assert [i for i, nodes in enumerate(granted, start=1) if nodes == 0] == [8, 16, 24, 32, 40]
    assert budget.whole_tree.leading == WHOLE
    # without the trial the same budget stays plain
    budget.whole_tree = None
    assert ctl.choose(16).nodes == 0


def test_where_the_whole_tree_is_measured_slower_the_choice_takes_over() -> None:
    """On a device where the whole tree's forward costs five plain ones and buys little: after
    the choice's first steps, its plain steps run and the whole tree is tried every 8th step."""
    granted, budget, _ = plain_choosing(64, whole_step=(2, 0.05))
    assert budget.whole_tree.leading == CHOICE
    assert [i for i, nodes in enumerate(granted, start=1) if nodes == 16][-4:] == [40, 48, 56, 64]
    assert granted[16:].count(0) == 42


def test_a_step_the_budget_does_not_price_leaves_the_trial_untouched() -> None:
    budget = Budget(16, warmup=0, cost_curve=[1.0] + [3.0] * 63)
    budget.whole_tree = trial = WholeTreeTrial()
    ctl = OneRequest(budget)
    budget.observe_step(1, 0.01)
    ctl.choose(16)
    assert trial.pending is not None
    ctl.choose(16)  # the step before was not observed (a prompt chunk rode along): nothing learned
    budget.observe_step(1, 0.01)  # (no tokens counted)
    assert trial.steps == [0, 0]


@pytest.mark.parametrize("bad", [dict(explore_every=1), dict(explore_every=True), dict(first_steps=0),
                                 dict(smoothing=0.0), dict(smoothing=1.5)])
def test_bad_parameters_raise(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        WholeTreeTrial(**bad)


def test_a_decoder_weighs_the_whole_tree_on_a_gpu_only() -> None:
    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    assert Decoder(model, None).budget.whole_tree is None
    sim = SimulatedDevice()
    sim.adopt(model)
    with sim, sim.patched_generator():
        assert isinstance(Decoder(model, None).budget.whole_tree, WholeTreeTrial)
        # the bench's @notrial runs the same decoder without it
        assert isinstance(build_method("default", model, None, 8).decoder.budget.whole_tree, WholeTreeTrial)
        assert build_method("default@notrial", model, None, 8).decoder.budget.whole_tree is None


@pytest.mark.parametrize("concurrency", [1, 3])
def test_outputs_stay_greedy_whichever_arm_runs(concurrency: int) -> None:
    """Both arms every other step, on static buckets under the simulated device: every output is
    still the model's greedy one."""
    reference = tiny_model("llama", "sdpa")
    model = copy.deepcopy(reference)
    sim = SimulatedDevice()
    sim.adopt(model)
    prompts = [PROMPT, PROMPT[3:], PROMPT[:11]]
    with sim, sim.patched_generator():
        dec = Decoder(model, None, max_tree_nodes=12)
        dec.budget.warmup = 0
        dec.budget.whole_tree = trial = WholeTreeTrial(explore_every=2, first_steps=1)
        outputs = dec.generate_batch(prompts, max_new_tokens=24, concurrency=concurrency)
    assert [o.token_ids for o in outputs] == [reference_greedy(reference, p, 24) for p in prompts]
    assert min(trial.steps) >= 1


def test_a_seeded_sample_is_the_plain_decoders_whichever_arm_runs() -> None:
    """On a device every row's token is drawn with the noise of its position in the answer, so a
    seeded sample does not depend on which trees were checked: the trial's is plain decoding's."""
    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    sim = SimulatedDevice()
    sim.adopt(model)
    settings = dict(max_new_tokens=24, do_sample=True, seed=7, temperature=0.9, top_k=20)
    with sim, sim.patched_generator():
        dec = Decoder(model, None, max_tree_nodes=12)
        dec.budget.warmup = 0
        dec.budget.whole_tree = trial = WholeTreeTrial(explore_every=2, first_steps=1)
        sampled = dec.generate(PROMPT, **settings)
        plain = Decoder(model, None, max_tree_nodes=0).generate(PROMPT, **settings)
    assert sampled.token_ids == plain.token_ids
    assert min(trial.steps) >= 1 and sampled.stats.steps < len(sampled.token_ids)
