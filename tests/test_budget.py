"""The adaptive budget controller on synthetic cost curves and acceptance streams (no model)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.budget import AdaptiveBudget, BudgetDecision

# Step cost in seconds by forward width, shaped like Qwen-0.5B fp32 on this CPU (README of models):
# any multi-token forward costs about twice a one-token step.
CPU_FP32 = {1: 0.145, 2: 0.29, 4: 0.25, 8: 0.30, 16: 0.39, 32: 0.57, 64: 0.9}
# A GPU-like curve: width is nearly free.
FLAT = {1: 0.10, 2: 0.10, 4: 0.10, 8: 0.101, 16: 0.102, 32: 0.105, 64: 0.11}


def _bucket(width: int) -> int:
    """The curves above are given at powers of two; a width costs what its power-of-two bucket does."""
    b = 1
    while b < width:
        b *= 2
    return b


def simulate(curve: dict[int, float], accept_len, steps: int, max_nodes: int = 32, available: int | None = None,
             seed: int = 0) -> list[BudgetDecision]:
    """Drive the controller as the decoder does: each step the sources offer ``available`` nodes
    (default: all ``max_nodes``) laid out as one chain, of which the first ``accept_len(step)``
    are right; the controller checks a prefix of them, pays for that width, and learns from the
    full chain (the decoder's shadow verification)."""
    rng = random.Random(seed)
    ctl = AdaptiveBudget(max_nodes)
    ctl.start_request()
    decisions = []
    offered = max_nodes if available is None else available
    for step in range(steps):
        d = ctl.choose(0)
        right = min(offered, accept_len(step, rng))
        built = min(d.nodes, offered)
        width = 1 + built
        ctl.observe_cost(width, curve[_bucket(width)])
        ctl.observe_acceptance(offered, list(range(right)))
        decisions.append(d)
    return decisions


def test_shrinks_to_plain_decoding_when_nothing_is_accepted():
    decisions = simulate(CPU_FP32, lambda step, rng: 0, steps=200)
    assert all(d.nodes == 0 for d in decisions[5:]), [d.nodes for d in decisions[:20]]


def test_grows_to_the_full_budget_when_everything_is_accepted():
    decisions = simulate(CPU_FP32, lambda step, rng: 10**6, steps=60)
    # 31 nodes (width 32) beats 32 nodes (width 33, the next cost bucket) on this curve
    assert all(d.nodes >= 31 for d in decisions[10:]), [d.nodes for d in decisions]


def test_flat_cost_keeps_a_wide_tree_even_for_modest_acceptance():
    # 40% chance per rank of a hit among the first few ranks: on a flat curve width is free
    decisions = simulate(FLAT, lambda step, rng: sum(1 for _ in range(4) if rng.random() < 0.4), steps=120)
    assert sum(d.nodes for d in decisions[60:]) / 60 >= 3


def test_costly_width_with_weak_acceptance_prefers_plain_decoding():
    # about 0.5 extra token per step cannot pay for a forward that costs 2x
    decisions = simulate(CPU_FP32, lambda step, rng: 1 if rng.random() < 0.5 else 0, steps=200)
    late = decisions[100:]
    assert sum(1 for d in late if d.nodes == 0) >= 0.8 * len(late)


def test_recovers_at_once_when_drafts_start_paying_again():
    # shadow verification sees the copy start even while the controller runs plain steps
    decisions = simulate(CPU_FP32, lambda step, rng: 0 if step < 100 else 10**6, steps=130)
    assert decisions[99].nodes == 0
    assert all(d.nodes >= 31 for d in decisions[103:]), [d.nodes for d in decisions[98:110]]


def test_runs_of_hits_are_followed_quickly():
    # novel text with copies of 20 tokens every 40 steps: the tree is wide during copies only
    def copying(step, rng):
        return 10**6 if step % 40 >= 20 else 0

    decisions = simulate(CPU_FP32, copying, steps=200)
    wide = [d.nodes for i, d in enumerate(decisions[40:], 40) if i % 40 >= 22]  # one step after the copy starts
    narrow = [d.nodes for i, d in enumerate(decisions[40:], 40) if 6 <= i % 40 < 20]  # a few steps after it ends
    assert min(wide) >= 31 and max(narrow) == 0


def test_a_request_starts_from_the_long_run_acceptance_not_the_tail_of_the_last_one():
    """A new prompt owes nothing to how the last answer ended: after a copy that ran the tree wide,
    the next request opens with plain steps when this decoder's traffic rarely accepts drafts
    (carrying the fast averages over made such requests open with failing wide trials)."""
    ctl = AdaptiveBudget(32, warmup=0)
    for width, seconds in CPU_FP32.items():
        ctl.observe_cost(width, seconds)
    for _ in range(10):  # ten requests of novel text: drafts never accepted
        ctl.start_request()
        for _ in range(20):
            ctl.observe_acceptance(32, [])
    ctl.start_request()  # ... then one that ends in a copy
    for _ in range(3):
        ctl.observe_cost(1, CPU_FP32[1])
        ctl.observe_acceptance(32, list(range(32)))
    assert ctl.choose().nodes >= 31  # during the copy: the whole tree
    ctl.start_request()
    assert ctl.choose().nodes == 0  # the next request: plain steps until its own drafts pay
    ctl.observe_cost(1, CPU_FP32[1])
    assert ctl.choose().nodes == 0  # (not only its first step, which is held back anyway, see below)
    assert 0 < ctl.long_run_rate[0] < 0.1  # the copy is in the long-run averages, weighed as one of many


@pytest.mark.parametrize("curve, first_is_plain", [(CPU_FP32, True), (FLAT, False)], ids=["costly-width", "flat"])
def test_a_requests_first_step_is_plain_only_when_width_is_dear(curve, first_is_plain):
    """Before a request has shown anything, a wide step that costs twice a plain one is a gamble a
    short answer cannot win back: the first step stays plain. Where width is nearly free it does not."""
    ctl = AdaptiveBudget(32, warmup=0)
    for width, seconds in curve.items():
        ctl.observe_cost(width, seconds)
    for _ in range(5):
        ctl.observe_acceptance(32, list(range(8)))  # the long run says: the first 8 ranks hit
    ctl.start_request()
    first = ctl.choose()
    assert (first.nodes == 0) == first_is_plain
    ctl.observe_cost(1 if first.nodes == 0 else 1 + first.nodes, curve[_bucket(1 + first.nodes)])
    assert ctl.choose().nodes >= 7  # from the second step on the averages decide
    never = AdaptiveBudget(32, warmup=0, opening_cost_ratio=math.inf)
    never.costs, never.long_run_rate = ctl.costs, list(ctl.long_run_rate)
    never.start_request()
    assert never.choose().nodes >= 7


def test_expected_tokens_is_one_plus_rank_rates():
    ctl = AdaptiveBudget(4, smoothing=1.0, acceptance_smoothing=1.0)
    ctl.record(BudgetDecision(4, 0, 0), 4, [0, 1], 5, 0.1)
    assert ctl.expected_tokens(0) == 1.0
    assert ctl.expected_tokens(1) == 2.0
    assert ctl.expected_tokens(4) == 3.0


def test_a_plain_step_leaves_the_side_block_out():
    """A plain step runs the root alone (the decoder drops side blocks on it), so it is priced at
    width 1, not 1 + side: a costly window must not make plain decoding look as dear as drafting."""
    ctl = AdaptiveBudget(1, smoothing=1.0, acceptance_smoothing=1.0, warmup=0)
    ctl.observe_cost(1, 0.1)
    ctl.observe_cost(8, 0.2)
    ctl.accept_rate[0] = 0.6  # a one-node tree commits 1.6 tokens on average
    # 6 side tokens: drafting costs width 8 (0.2 s) for 1.6 tokens; plain costs width 1 (0.1 s)
    decision = ctl.choose(side_tokens=6)
    assert decision.nodes == 0 and decision.expected_cost == 0.1
    assert ctl.choose(side_tokens=0).nodes == 1  # without side tokens the draft is cheap and pays
    assert AdaptiveBudget.width(0, 6) == 1 and AdaptiveBudget.width(3, 6) == 10


def test_max_nodes_zero_is_plain_decoding():
    ctl = AdaptiveBudget(0)
    assert ctl.choose().nodes == 0


@pytest.mark.parametrize("bad", [{"max_nodes": -1}, {"max_nodes": 4, "smoothing": 0.0},
                                 {"max_nodes": 4, "acceptance_smoothing": 0.0},
                                 {"max_nodes": 4, "prior_smoothing": 0.0}, {"max_nodes": 4, "prior_smoothing": 1.5},
                                 {"max_nodes": 4, "opening_cost_ratio": 0.5}])
def test_bad_parameters_raise(bad):
    with pytest.raises(ValueError):
        AdaptiveBudget(**bad)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=80),
       st.integers(0, 40), st.integers(0, 6))
def test_choice_always_within_bounds(stream, max_nodes, side):
    ctl = AdaptiveBudget(max_nodes)
    for offered, accepted in stream:
        d = ctl.choose(side)
        assert 0 <= d.nodes <= max_nodes
        built = min(offered, d.nodes)
        ctl.observe_cost(1 + built + side, 0.01 * (1 + (built > 0)))
        ctl.observe_acceptance(min(offered, max_nodes), list(range(min(accepted, offered))))


def test_decoder_with_adaptive_budget_stays_exact():
    """Whatever the controller decides, greedy output equals model.generate."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specdraft import Decoder, PromptLookup

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="sdpa").eval()
    dec = Decoder(model, sources=[PromptLookup()], max_tree_nodes=24, adaptive_budget=True)
    rng = random.Random(1)
    sizes = set()
    for _ in range(6):
        prompt = [rng.randrange(48) for _ in range(rng.randrange(2, 16))] * 2
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
        out = dec.generate(prompt, max_new_tokens=40)
        assert out.token_ids == ref
        sizes.update(out.stats.tree_sizes)
    assert dec.budget is not None and dec.budget.steps > 0
    assert len(sizes) > 1  # the controller really varied the tree


def test_a_cap_the_sources_do_not_fill_is_priced_at_the_width_it_runs_at():
    """When the sources offered only 2 nodes last step, a budget of 7 runs a 3-row forward, which on
    MKL-like kernels costs more than an 8-row one: it is priced as the dearest of the two, so two
    sure hits (3 tokens) do not buy a 3.1-step forward."""
    from specdraft.budget import StepOutcome
    from specdraft.tree import TokenTree

    curve = [1.0, 2.0, 3.1, 2.1] + [2.2] * 60  # seconds of 1, 2, 3, 4, ... rows (relative)
    ctl = AdaptiveBudget(8, warmup=0, smoothing=1.0, acceptance_smoothing=1.0, cost_curve=curve)
    committed = [1, 2, 3]
    for step in range(6):  # a two-token draft that is always right
        branch = [10 + step, 11 + step]
        decision = ctl.choose()
        tree = TokenTree.from_drafts(committed[-1], [[branch]], decision.nodes)
        start = len(committed)
        committed += branch + [99] if decision.nodes >= 2 else branch[:1]
        ctl.observe(StepOutcome(decision, tree, [[branch]], committed, start, len(tree), 0.1))
    assert ctl.accept_rate[:2] == [1.0, 1.0] and ctl._offered == 2
    assert ctl.choose().nodes == 0  # 3 tokens for 3.1 steps: plain is better
    ctl.set_cost_curve([1.0, 2.0, 2.9, 2.1] + [2.2] * 60)
    assert ctl.choose().nodes >= 2  # 3 tokens for 2.9 steps: worth it
