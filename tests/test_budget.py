"""The adaptive budget controller on synthetic cost curves and acceptance streams (no model)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _budget_driver import OneRequest
from specdraft.budget import Ask, Budget, Grant

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
             seed: int = 0) -> list[Grant]:
    """Drive the controller as the decoder does: each step the sources offer ``available`` nodes
    (default: all ``max_nodes``) laid out as one chain, of which the first ``accept_len(step)``
    are right; the controller checks a prefix of them, pays for that width, and learns from the
    full chain (the decoder's shadow verification)."""
    rng = random.Random(seed)
    ctl = OneRequest(Budget(max_nodes))
    decisions = []
    offered = max_nodes if available is None else available
    for step in range(steps):
        d = ctl.choose(offered)
        right = min(offered, accept_len(step, rng))
        width = 1 + d.nodes
        ctl.budget.observe_step(width, curve[_bucket(width)])
        ctl.observe_chain(offered, right)
        decisions.append(d)
    return decisions


def priced(max_nodes: int, curve: dict[int, float], **options) -> OneRequest:
    """A budget past its warm-up that has seen a step of every width of ``curve``."""
    ctl = OneRequest(Budget(max_nodes, warmup=0, **options))
    for width, seconds in curve.items():
        ctl.budget.observe_step(width, seconds)
    return ctl


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
    ctl = priced(32, CPU_FP32)
    for _ in range(10):  # ten requests of novel text: drafts never accepted
        ctl.start_request()
        for _ in range(20):
            ctl.observe_chain(32, 0)
    ctl.start_request()  # ... then one that ends in a copy
    for _ in range(3):
        ctl.budget.observe_step(1, CPU_FP32[1])
        ctl.observe_chain(32, 32)
    assert ctl.choose(32).nodes >= 31  # during the copy: the whole tree
    ctl.start_request()
    assert ctl.choose(32).nodes == 0  # the next request: plain steps until its own drafts pay
    ctl.budget.observe_step(1, CPU_FP32[1])
    ctl.observe_chain(32, 0)
    assert ctl.choose(32).nodes == 0  # (not only its first step, which is held back anyway, see below)
    assert 0 < ctl.budget.acceptance.long_run_ranks[0] < 0.1  # the copy is in the long run, weighed as one of many


@pytest.mark.parametrize("curve, first_is_plain", [(CPU_FP32, True), (FLAT, False)], ids=["costly-width", "flat"])
def test_a_requests_first_step_is_plain_only_when_width_is_dear(curve, first_is_plain):
    """Before a request has shown anything, a wide step that costs twice a plain one is a gamble a
    short answer cannot win back: the first step stays plain. Where width is nearly free it does not."""
    ctl = priced(32, curve)
    for _ in range(5):
        ctl.observe_chain(32, 8)  # the long run says: the first 8 ranks hit
    ctl.start_request()
    first = ctl.choose(32)
    assert (first.nodes == 0) == first_is_plain
    ctl.budget.observe_step(1 + first.nodes, curve[_bucket(1 + first.nodes)])
    ctl.observe_chain(32, 8)
    assert ctl.choose(32).nodes >= 7  # from the second step on the averages decide
    never = OneRequest(Budget(32, warmup=0, opening_cost_ratio=math.inf))
    never.budget.costs = ctl.budget.costs
    never.budget.acceptance.long_run_ranks = list(ctl.budget.acceptance.long_run_ranks)
    never.start_request()
    assert never.choose(32).nodes >= 7


def test_rank_rates_follow_what_the_full_tree_would_have_committed():
    ctl = OneRequest(Budget(4, acceptance_smoothing=1.0))
    ctl.observe_chain(4, 2)
    assert ctl.rates == [1.0, 1.0, 0.0, 0.0]  # 1 + 2 tokens expected from a tree of 2 or more nodes


def test_a_plain_step_leaves_the_side_block_out():
    """A plain step runs the root alone (the engine drops side blocks on it), so it is priced at
    width 1, not 1 + side: a costly window must not make plain decoding look as dear as drafting."""
    ctl = OneRequest(Budget(1, smoothing=1.0, acceptance_smoothing=1.0, warmup=0))
    ctl.budget.observe_step(1, 0.1)
    ctl.budget.observe_step(8, 0.2)
    ctl.request.rank_rates[0] = 0.6  # a one-node tree commits 1.6 tokens on average
    ctl.request.tree_steps = 1  # past the opening
    # 6 side tokens: drafting costs width 8 (0.2 s) for 1.6 tokens; plain costs width 1 (0.1 s)
    assert ctl.choose(1, side=6) == Grant(0, False)
    assert ctl.choose(1, side=0) == Grant(1, True)  # without side tokens the draft is cheap and pays


def test_the_warm_up_and_a_fixed_budget_give_the_full_tree_with_its_side_blocks():
    """Jacobi's window needs steps before its drafts mean anything: during the warm-up (and with a
    fixed budget) every request gets its full tree, side blocks included, even an empty tree."""
    warm = OneRequest(Budget(8, warmup=3))
    assert warm.choose(5, side=4) == Grant(5, True) and warm.choose(0, side=4) == Grant(0, True)
    fixed = OneRequest(Budget(8, adaptive=False, warmup=0))
    fixed.budget.observe_step(1, 0.1)
    assert fixed.choose(12, side=4) == Grant(8, True)


def test_max_nodes_zero_is_plain_decoding():
    assert OneRequest(Budget(0)).choose(5, side=3) == Grant(0, False)


@pytest.mark.parametrize("bad", [{"max_nodes": -1}, {"max_nodes": 4, "smoothing": 0.0},
                                 {"max_nodes": 4, "acceptance_smoothing": 0.0},
                                 {"max_nodes": 4, "prior_smoothing": 0.0}, {"max_nodes": 4, "prior_smoothing": 1.5},
                                 {"max_nodes": 4, "opening_cost_ratio": 0.5}, {"max_nodes": 4, "warmup": -1},
                                 {"max_nodes": 4, "attention_seconds": -1.0}])
def test_bad_parameters_raise(bad):
    with pytest.raises(ValueError):
        Budget(**bad)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=80),
       st.integers(0, 40), st.integers(0, 6))
def test_choice_always_within_bounds(stream, max_nodes, side):
    ctl = OneRequest(Budget(max_nodes))
    for offered, accepted in stream:
        d = ctl.choose(min(offered, max_nodes), side)
        assert 0 <= d.nodes <= min(offered, max_nodes)
        ctl.budget.observe_step(1 + d.nodes + (side if d.side_blocks else 0), 0.01 * (1 + (d.nodes > 0)))
        ctl.observe_chain(min(offered, max_nodes), min(accepted, offered))


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


def test_a_narrow_offer_is_priced_at_the_width_it_runs_at():
    """When the sources offer only 2 nodes, the forward has 3 rows, which on MKL-like kernels can
    cost more than 8: two sure hits (3 tokens) do not buy a 3.1-step forward, but do buy a 2.9-step one."""
    curve = [1.0, 2.0, 3.1, 2.1] + [2.2] * 60  # seconds of 1, 2, 3, 4, ... rows (relative)
    budget = Budget(8, warmup=0, smoothing=1.0, acceptance_smoothing=1.0, cost_curve=curve)
    budget.observe_step(1, 1.0)
    ask = Ask([1.0] * 8, 2, 0, 1)
    assert budget.allocate([ask]) == [Grant(0, False)]  # 3 tokens for 3.1 steps: plain is better
    budget.set_cost_curve([1.0, 2.0, 2.9, 2.1] + [2.2] * 60)
    assert budget.allocate([ask]) == [Grant(2, True)]  # 3 tokens for 2.9 steps: worth it


@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("side", [0, 3])
def test_a_step_stays_within_the_widest_bucket(warm: bool, side: int):
    """On a GPU a forward wider than the widest bucket runs eagerly, at several times a captured
    one's price (and in exact mode wider than the rule covers, other bits): eight requests that
    each offer 32 nodes share the 64 rows, in the warm-up and once prices are known, and each
    gets its turn."""
    from specdraft.model.static import Buckets

    budget = Budget(32, warmup=3 if warm else 0, cost_curve=[1.0] * 64)
    budget.costs.padding = Buckets((1, 8, 16, 32, 64))
    if not warm:
        budget.observe_step(1, 0.01)
    asks = [Ask([0.9] * 32, 32, side, 1, context=100) for _ in range(8)]
    grants = budget.allocate(asks)
    rows = sum(1 + (g.nodes + side if g.side_blocks else 0) for g in grants)
    assert rows <= 64
    assert all(g.nodes > 0 for g in grants) and max(g.nodes for g in grants) - min(g.nodes for g in grants) <= 1
    one = budget.allocate(asks[:1])  # one request alone keeps its whole tree
    assert one == [Grant(32, True)]


def test_without_buckets_the_step_is_not_limited():
    budget = Budget(32, warmup=3)
    asks = [Ask([0.9] * 32, 32, 0, 1) for _ in range(8)]
    assert budget.row_limit is None and budget.allocate(asks) == [Grant(32, True)] * 8


def test_where_plain_steps_run_padded_their_width_is_the_unit_of_price():
    """On a GPU in exact mode every forward runs at 16 rows or more: a one-token step is observed
    at 16 rows. Its time must still be the unit every width is priced in, or no plain step is
    ever seen, every width gets the same guessed price, and a 64-row tree that doubles the step
    looks as cheap as a plain one."""
    from specdraft.model.static import Buckets

    budget = Budget(48, warmup=0, smoothing=1.0, acceptance_smoothing=1.0)
    budget.costs.padding = Buckets((16, 32, 64))
    budget.observe_step(16, 0.004)  # a plain step (or a tree of up to 15 nodes): 16 rows
    budget.observe_step(64, 0.008)
    assert budget.costs.level == pytest.approx(0.004)
    assert budget.costs.shape(1) == budget.costs.shape(16) == 1.0
    assert budget.costs.shape(64) == pytest.approx(2.0)
    assert budget.costs.seconds(1) == pytest.approx(0.004)
    # 15 sure nodes ride in the plain step's 16 rows for free; 33 more that never hit do not buy
    # twice the price
    ask = Ask([1.0] * 15 + [0.0] * 33, 48, 0, 1)
    assert budget.allocate([ask]) == [Grant(15, True)]


def test_rows_the_forward_is_padded_to_anyway_carry_drafts():
    """A forward padded to a bucket computes its padding rows whatever they hold: the next drafts
    go there, even drafts never seen to hit (Token Recycling learns from every row the model
    computes), as long as the step's price stays the same. Where attention is priced per row, a
    row is never free, and nothing is added."""
    from specdraft.model.static import Buckets

    budget = Budget(63, warmup=0, smoothing=1.0, acceptance_smoothing=1.0)
    budget.costs.padding = Buckets((16, 32, 64))
    budget.observe_step(16, 0.004)
    budget.observe_step(32, 0.0046)
    budget.observe_step(64, 0.006)
    nothing = Ask([0.0] * 63, 63, 0, 1)
    assert budget.allocate([nothing]) == [Grant(15, True)]  # the 15 rows beside the root
    assert budget.allocate([Ask([0.0] * 63, 6, 0, 1)]) == [Grant(6, True)]  # no more than offered
    some = Ask([0.9] * 20 + [0.0] * 43, 63, 0, 1)  # 20 good nodes: 21 rows, run at 32
    assert budget.allocate([some]) == [Grant(31, True)]
    # four requests share the padding of their 16-row forward, one node each in turn
    four = budget.allocate([Ask([0.0] * 63, 63, 0, 1)] * 4)
    assert sorted(g.nodes for g in four) == [3, 3, 3, 3]
    # a side block's rows come with a request's first node: they must fit too
    assert budget.allocate([Ask([0.0] * 63, 63, 20, 1)]) == [Grant(0, False)]

    priced = Budget(63, warmup=0, attention_seconds=1e-7)
    priced.costs.padding = Buckets((16, 32, 64))
    priced.observe_step(16, 0.004)
    assert priced.allocate([Ask([0.0] * 63, 63, 0, 1, context=500)]) == [Grant(0, False)]


def test_without_padding_nothing_is_added():
    budget = Budget(32, warmup=0)
    budget.observe_step(1, 0.004)
    assert budget.allocate([Ask([0.0] * 32, 32, 0, 1)]) == [Grant(0, False)]
