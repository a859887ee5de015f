"""The adaptive budget controller on synthetic cost curves and acceptance streams (no model)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.budget import AdaptiveBudget, BudgetDecision, _bucket

# Step cost in seconds by forward width, shaped like Qwen-0.5B fp32 on this CPU (README of models):
# any multi-token forward costs about twice a one-token step.
CPU_FP32 = {1: 0.145, 2: 0.29, 4: 0.25, 8: 0.30, 16: 0.39, 32: 0.57, 64: 0.9}
# A GPU-like curve: width is nearly free.
FLAT = {1: 0.10, 2: 0.10, 4: 0.10, 8: 0.101, 16: 0.102, 32: 0.105, 64: 0.11}


def simulate(curve: dict[int, float], accept_len, steps: int, max_nodes: int = 32, available: int | None = None,
             seed: int = 0) -> list[BudgetDecision]:
    """Drive the controller: each step the sources offer ``available`` nodes (default: the budget)
    laid out as one chain, and the first ``accept_len(step)`` of them are accepted."""
    rng = random.Random(seed)
    ctl = AdaptiveBudget(max_nodes)
    ctl.new_request()
    decisions = []
    for step in range(steps):
        d = ctl.choose(0)
        built = min(d.nodes, available if available is not None else d.nodes)
        k = min(built, accept_len(step, rng))
        width = 1 + built
        ctl.record(d, built, list(range(k)), width, curve[_bucket(width)])
        decisions.append(d)
    return decisions


def test_shrinks_to_plain_decoding_when_nothing_is_accepted():
    decisions = simulate(CPU_FP32, lambda step, rng: 0, steps=200)
    late = decisions[100:]
    plain = sum(1 for d in late if d.nodes == 0)
    assert plain >= 0.9 * len(late), [d.nodes for d in late]
    # exploration becomes rare: the probe interval backs off
    assert sum(1 for d in late if d.probe) <= 5


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


def test_recovers_when_drafts_start_paying_again():
    decisions = simulate(CPU_FP32, lambda step, rng: 0 if step < 100 else 10**6, steps=260)
    assert decisions[99].nodes == 0 or decisions[98].nodes == 0
    assert all(d.nodes >= 31 for d in decisions[230:]), [d.nodes for d in decisions[200:]]


def test_new_request_probes_first():
    ctl = AdaptiveBudget(16)
    for _ in range(40):
        d = ctl.choose()
        ctl.record(d, d.nodes, [], 1 + d.nodes, CPU_FP32[_bucket(1 + d.nodes)])
    assert ctl.choose().nodes == 0
    ctl.new_request()
    d = ctl.choose()
    assert d.probe and d.nodes > 0


def test_expected_tokens_is_one_plus_rank_rates():
    ctl = AdaptiveBudget(4, smoothing=1.0)
    ctl.record(BudgetDecision(4, 0, 0, False), 4, [0, 1], 5, 0.1)
    assert ctl.expected_tokens(0) == 1.0
    assert ctl.expected_tokens(1) == 2.0
    assert ctl.expected_tokens(4) == 3.0


def test_max_nodes_zero_is_plain_decoding():
    ctl = AdaptiveBudget(0)
    assert ctl.choose().nodes == 0


@pytest.mark.parametrize("bad", [{"max_nodes": -1}, {"max_nodes": 4, "smoothing": 0.0}])
def test_bad_parameters_raise(bad):
    with pytest.raises(ValueError):
        AdaptiveBudget(**bad)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=80),
       st.integers(0, 40), st.integers(0, 6))
def test_choice_always_within_bounds(stream, max_nodes, side):
    ctl = AdaptiveBudget(max_nodes)
    for built, accepted in stream:
        d = ctl.choose(side)
        assert 0 <= d.nodes <= max_nodes
        built = min(built, d.nodes)
        ctl.record(d, built, list(range(min(accepted, built))), 1 + built + side, 0.01 * (1 + (built > 0)))


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
