"""Drafting pauses (specdraft.engine.pause): a request whose drafts do not pay for their host time stops
drafting for a few steps where drafting is dear next to a step, never where it is cheap, and the
output stays exactly plain decoding's."""

from __future__ import annotations

import pytest
import torch
from conftest import OracleSource, RandomGuess, reference_greedy
from transformers import AutoModelForCausalLM, LlamaConfig

from specdraft import Decoder
from specdraft.budget import Budget
from specdraft.budget.whole_tree import CHOICE, WHOLE, WholeTreeTrial
from specdraft.engine.pause import MAX_PAUSE, DraftPause

SHARE = 0.05  # the budget's default drafting_share
from specdraft.sources import Context, Draft


def test_the_pause_doubles_with_each_draft_that_does_not_pay_up_to_what_drafting_costs():
    pause = DraftPause()
    pause.drafted(0.001)  # a draft costs a quarter of a 4 ms plain step: look every 5th step at most
    assert pause.longest(0.004, SHARE) == 4
    lengths = []
    for _ in range(11):  # drafts that buy nothing: the average falls from one token by 0.8 a draft
        pause.settled(0, 0.004, SHARE)
        lengths.append(pause.left)
        while pause.skip():
            pass
    # it pays while the average times 4 ms reaches the 1 ms draft (0.8**6 = 0.26 tokens)
    assert lengths == [0] * 6 + [1, 2, 4, 4, 4]
    pause.settled(3, 0.004, SHARE)  # a draft that committed three draft tokens ends the pause
    assert pause.left == 0 and pause.idle == 0
    for _ in range(3):
        pause.settled(0, 0.004, SHARE)
    assert pause.left == 0  # the average it brought takes misses in a row to wear off again


@pytest.mark.parametrize("draft_seconds, step_seconds, longest", [
    (0.0005, 0.030, 0),  # a CPU: drafting is under 5% of a step, never pause
    (0.001, 0.004, 4),  # a GPU's graph replay
    (0.1, 0.001, MAX_PAUSE),  # never longer than MAX_PAUSE
])
def test_the_longest_pause_keeps_drafting_within_its_share_of_a_step(draft_seconds, step_seconds, longest):
    pause = DraftPause()
    pause.drafted(draft_seconds)
    assert pause.longest(step_seconds, SHARE) == longest
    if 0 < longest < MAX_PAUSE:  # drafting once every longest + 1 steps costs at most SHARE of a step
        assert draft_seconds / (longest + 1) <= SHARE * step_seconds * (1 + 1e-9)
        assert draft_seconds / longest > SHARE * step_seconds


def test_a_pause_whose_drafts_run_behind_the_forward_lasts_up_to_max_pause_and_ends_when_they_pay():
    """Lagged drafts (made behind a forward, on an accelerator) cost no step anything: the pause
    doubles up to MAX_PAUSE whatever drafting costs, and a lagged draft that pays ends it at once."""
    pause = DraftPause()
    pause.drafted(0.001)  # a draft costs a quarter of a 4 ms plain step: on time, pauses of at most 4
    assert pause.longest(0.004, SHARE) == 4
    lengths = []
    for _ in range(12):
        pause.settled(0, 0.004, SHARE, hidden=True)
        lengths.append(pause.left)
    assert lengths == [0] * 6 + [1, 2, 4, 8, MAX_PAUSE, MAX_PAUSE]
    pause.skip()
    pause.settled(2, 0.004, SHARE, hidden=True)
    assert pause.left == 0 and pause.idle == 0


def test_no_pause_before_anything_is_known():
    pause = DraftPause()
    for _ in range(20):
        pause.settled(0, 0.004, SHARE)  # no draft timed yet
    assert pause.left == 0
    pause.drafted(0.001)
    pause.settled(0, None, SHARE)  # no price of a plain step (or a budget that does not choose)
    assert pause.left == 0
    assert not pause.skip()


class SimulatedClock:
    """A clock that moves only when something is charged to it: a source's draft, a forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class DearGuess(RandomGuess):
    """Random, nearly always wrong drafts, each costing ``seconds`` on the simulated clock."""

    def __init__(self, clock: SimulatedClock, seconds: float) -> None:
        super().__init__(seed=3, vocab_size=64, copy_prob=0.0, name="dear")
        self.clock = clock
        self.seconds = seconds
        self.drafts = 0  # proposes with a budget (a pause asks with 0)

    def propose(self, context: Context, budget: int) -> Draft:
        if budget > 0:
            self.clock.now += self.seconds
            self.drafts += 1
        return super().propose(context, budget)


def _model_on(clock: SimulatedClock, plain_seconds: float) -> torch.nn.Module:
    """A tiny float64 Llama whose forward of ``k`` rows costs ``plain_seconds * (1 + (k - 1) / 4)``
    on ``clock``: wide rows are dear, so the budget declines trees that miss."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="sdpa").eval()

    def charge(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        clock.now += plain_seconds * (1 + (ids.shape[-1] - 1) / 4)

    model.register_forward_pre_hook(charge, with_kwargs=True)
    return model


def _decoder(draft_seconds: float, plain_seconds: float = 0.004, **options) -> tuple[Decoder, DearGuess]:
    clock = SimulatedClock()
    model = _model_on(clock, plain_seconds)
    source = DearGuess(clock, draft_seconds)
    dec = Decoder(model, sources=[source], max_tree_nodes=16, cpu_kernels="stock", **options)
    dec.clock = clock
    return dec, source


PROMPTS = [[5, 9, 13, 2, 5, 9, 13, 7, 1, 4], [3, 3, 8, 21, 40, 8, 21], [30, 31, 32, 33, 34, 35, 36, 37]]


def test_dear_drafts_that_buy_nothing_pause_and_the_output_stays_exact():
    dec, source = _decoder(draft_seconds=0.002)
    out = dec.generate(PROMPTS[0], max_new_tokens=64)
    assert out.token_ids == reference_greedy(dec.model, PROMPTS[0], 64)
    assert out.stats.skipped_drafts > 10
    assert source.drafts + out.stats.skipped_drafts == out.stats.steps - 1  # the prompt step drafts nothing
    assert source.calls == out.stats.steps - 1  # a pause asks with a budget of 0: every observe has its propose
    assert out.stats.as_dict()["skipped_drafts"] == out.stats.skipped_drafts


def test_cheap_drafts_never_pause():
    dec, source = _decoder(draft_seconds=0.00001)
    out = dec.generate(PROMPTS[0], max_new_tokens=64)
    assert out.token_ids == reference_greedy(dec.model, PROMPTS[0], 64)
    assert out.stats.skipped_drafts == 0
    assert source.drafts == out.stats.steps - 1


def test_a_drafting_share_of_zero_never_pauses():
    dec, source = _decoder(draft_seconds=0.002)
    dec.budget.drafting_share = 0.0
    out = dec.generate(PROMPTS[0], max_new_tokens=64)
    assert out.stats.skipped_drafts == 0
    assert source.drafts == out.stats.steps - 1
    with pytest.raises(ValueError, match="drafting_share"):
        Budget(16, 1, drafting_share=1.5)


def test_a_fixed_budget_always_drafts():
    dec, source = _decoder(draft_seconds=0.002, adaptive_budget=False)
    out = dec.generate(PROMPTS[0], max_new_tokens=64)
    assert out.stats.skipped_drafts == 0
    assert source.drafts == out.stats.steps - 1


def test_requests_of_a_batch_pause_alone_and_stay_exact():
    dec, _ = _decoder(draft_seconds=0.002)
    outs = dec.generate_batch(PROMPTS, max_new_tokens=48, concurrency=3)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_greedy(dec.model, prompt, 48)
    assert all(out.stats.skipped_drafts > 0 for out in outs)


@pytest.mark.parametrize("hidden", [False, True])
def test_pauses_leave_seeded_sampling_as_it_was(hidden: bool):
    """A seed gives one output whatever the drafts were, so pausing them (or, in the accelerator's
    order, drafting behind the forward in the pause's steps) changes no sampled token."""
    outputs = []
    for share in (0.05, 0.0):
        dec, _ = _decoder(draft_seconds=0.002)
        dec.engine.hide_host_work = hidden
        dec.budget.drafting_share = share
        out = dec.generate(PROMPTS[1], max_new_tokens=64, do_sample=True, temperature=0.8, top_k=20, seed=7)
        outputs.append((out.token_ids, out.stats.skipped_drafts))
    (paused, skipped), (unpaused, none) = outputs
    assert skipped > 0 and none == 0
    assert paused == unpaused


def test_pauses_on_the_simulated_device_read_once_per_step_and_stay_exact():
    """On a device (simulated: its reads and uploads counted) paused steps choose their row there
    like any other step: one read per step, and the output is still ``generate``'s."""
    from specdraft.simulated_device import SimulatedDevice

    clock = SimulatedClock()
    model = _model_on(clock, 0.004)
    reference = reference_greedy(model, PROMPTS[0], 48)
    sim = SimulatedDevice()
    sim.adopt(model)
    with sim, sim.patched_generator():
        dec = Decoder(model, sources=[DearGuess(clock, 0.002)], max_tree_nodes=16)
        dec.clock = clock
        sim.reset_counts()
        out = dec.generate(PROMPTS[0], max_new_tokens=48)
    assert out.token_ids == reference
    assert out.stats.skipped_drafts > 0
    assert sim.counts.syncs == out.stats.steps, sim.counts.log


class DearOneToken(OracleSource):
    """The true next token (one, whatever the budget), each draft costing ``seconds`` on ``clock``."""

    def __init__(self, sequence, clock: SimulatedClock, seconds: float) -> None:
        super().__init__(sequence, name="dear-one")
        self.clock, self.seconds = clock, seconds

    def propose(self, context: Context, budget: int) -> Draft:
        if budget > 0:
            self.clock.now += self.seconds
        return super().propose(context, min(budget, 1))


@pytest.mark.parametrize("learns_from_explored", [False, True])
def test_steps_the_whole_tree_trial_explores_teach_the_pause_nothing(monkeypatch, learns_from_explored):
    """The trial runs its arm that is not leading on some steps only to measure it: there the
    choice (a plain step here) checks nothing, which says nothing of what the drafts buy. Every
    whole tree commits its one draft token, which pays for the draft; a pause that counted the
    explored steps' nothing would see half a token per draft and pause."""
    clock = SimulatedClock()
    model = _model_on(clock, 0.004)
    new = 48
    sequence = PROMPTS[0] + reference_greedy(model, PROMPTS[0], new)
    dec = Decoder(model, sources=[DearOneToken(sequence, clock, 0.004)], max_tree_nodes=16, cpu_kernels="stock")
    dec.clock = clock
    dec.budget.warmup = 0
    dec.budget.whole_tree = trial = WholeTreeTrial(explore_every=2, first_steps=10**6)  # the whole tree leads
    monkeypatch.setattr(dec.budget, "_best_prefix", lambda asks, offered, limit=None: [0] * len(asks))
    if learns_from_explored:
        monkeypatch.setattr(type(dec.budget), "exploring", property(lambda self: False))
    out = dec.generate(PROMPTS[0], max_new_tokens=new)
    assert out.token_ids == sequence[len(PROMPTS[0]):]
    assert trial.steps[CHOICE] > 5 and trial.leading == WHOLE
    assert (out.stats.skipped_drafts > 0) == learns_from_explored
