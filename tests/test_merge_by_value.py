"""The merge by expected value: a mix of sources does about as well as its best member, whatever
the order they are listed in, because each source's acceptance is learned online
(:mod:`specdraft.budget.acceptance`) and the tree is filled best first (:meth:`TokenTree.from_drafts`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft import Decoder
from specdraft.budget import AcceptanceTracker, RequestAcceptance
from specdraft.budget.acceptance import SourceRates
from specdraft.sources.base import Context, Draft
from specdraft.tree import TokenTree

from _budget_driver import observe
from conftest import FAST, VOCAB, OracleSource, PassiveSource, generation_config_override, reference_greedy, tiny_model


class NoiseSource(PassiveSource):
    """Proposes one branch of random tokens using the whole budget: never (or hardly ever) right."""

    def __init__(self, seed: int = 0, name: str = "noise") -> None:
        self.seed = seed
        self.name = name

    def propose(self, context: Context, budget: int) -> Draft:
        rng = np.random.default_rng([self.seed, len(context.tokens)])
        return Draft(branches=[rng.integers(0, VOCAB, size=budget).tolist()] if budget else [])


def _tokens_per_step(sources, prompt, sequence, n: int) -> float:
    model = tiny_model("llama")
    dec = Decoder(model, sources=sources, max_tree_nodes=6, adaptive_budget=False)
    with generation_config_override(model, eos_token_id=None):
        out = dec.generate(prompt, max_new_tokens=n)
    assert out.token_ids == sequence[len(prompt):len(prompt) + n]  # lossless, whatever the merge
    return out.stats.new_tokens / out.stats.steps


def test_mix_with_noise_listed_first_accepts_nearly_as_much_as_the_oracle_alone() -> None:
    model = tiny_model("llama")
    prompt = [5, 17, 33, 8, 41, 12]
    n = 80
    with generation_config_override(model, eos_token_id=None):
        sequence = prompt + reference_greedy(model, prompt, n + 10)
    alone = _tokens_per_step([OracleSource(sequence)], prompt, sequence, n)
    mix = _tokens_per_step([NoiseSource(), OracleSource(sequence)], prompt, sequence, n)
    assert alone > 4.0  # the oracle fills a 6-node tree with right tokens
    assert mix >= 0.8 * alone, (mix, alone)


def _observe_steps(tracker: AcceptanceTracker, request: RequestAcceptance, steps: int) -> None:
    """Source 0 proposes a wrong branch, source 1 the right one, step after step."""
    truth = list(range(10, 10 + 5 * steps + 8))
    committed = [0]
    at = 0
    for _ in range(steps):
        right = truth[at:at + 4]
        wrong = [t + 100 for t in right]
        full = TokenTree.from_drafts(committed[-1], [[wrong], [right]], 6, request.source_rates)
        start = len(committed)
        committed += right + [truth[at + 4]]
        observe(tracker, request, full, committed, start)
        at += 5


def _rate(tracker: AcceptanceTracker, source_index: int, depth: int, request: RequestAcceptance | None = None
          ) -> float:
    """One learned source rate (first sibling): the request's fast one, or the long-run one."""
    values = request.source_rates.values if request is not None else tracker.long_run_sources
    return SourceRates(values)(source_index, depth, 0)


def test_calibration_learns_which_source_is_accepted() -> None:
    tracker = AcceptanceTracker(6, 2)
    assert _rate(tracker, 0, 1) == _rate(tracker, 1, 1)  # no evidence yet: equal
    request = tracker.start()
    _observe_steps(tracker, request, 12)
    for depth in (1, 2, 3, 4):
        assert _rate(tracker, 1, depth, request=request) > 0.9
        assert _rate(tracker, 1, depth) > 0.9  # the long-run average learned it too
    assert _rate(tracker, 0, 1, request=request) < 0.05 and _rate(tracker, 0, 1) < 0.1
    # the rejected source's deeper nodes were never in the running (their parent was rejected):
    # no evidence about them
    assert _rate(tracker, 0, 2) == _rate(AcceptanceTracker(6, 2), 0, 2)
    # a new request starts from the long-run averages, and the merge now puts source 1 first
    tree = TokenTree.from_drafts(0, [[[90, 91, 92]], [[1, 2, 3]]], 3, tracker.start().source_rates)
    assert tree.branches() == [[1, 2, 3]]


def test_calibration_waits_for_the_tokens_below_a_long_walk() -> None:
    # a deep full tree whose walk outlasts the step's tokens: its deeper nodes are recorded when
    # the next steps commit their tokens, not counted as misses
    tracker = AcceptanceTracker(6, 1, source_fast=1.0)
    request = tracker.start()
    full = TokenTree.from_drafts(0, [[[1, 2, 3, 4, 5, 6]]], 6, request.source_rates)
    committed = [0, 1, 2]
    observe(tracker, request, full, committed, 1)  # a step that committed two tokens; the walk is at node "2"
    assert _rate(tracker, 0, 3, request=request) == 0.5  # not known yet
    committed += [3, 4, 9]
    observe(tracker, request, TokenTree(2), committed, 3)
    assert _rate(tracker, 0, 3, request=request) == 1.0 and _rate(tracker, 0, 4, request=request) == 1.0
    assert _rate(tracker, 0, 5, request=request) == 0.0  # "5" was proposed, "9" came


def test_calibration_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="source_fast"):
        AcceptanceTracker(4, 2, source_fast=0.0)
    with pytest.raises(ValueError, match="slow"):
        AcceptanceTracker(4, 2, source_slow=1.5)
    with pytest.raises(ValueError, match="num_sources"):
        AcceptanceTracker(4, -1)


_tok = st.integers(0, 5)
_drafts = st.lists(st.lists(st.lists(_tok, max_size=6), max_size=4), max_size=4)


@settings(FAST, max_examples=200)
@given(drafts=_drafts, budget=st.integers(0, 30), history=st.lists(st.tuples(_drafts, st.lists(_tok, max_size=8)),
                                                                   max_size=4))
def test_calibrated_merge_keeps_the_prefix_property(drafts, budget, history) -> None:
    """Whatever calibration has learned, the tree of budget n is the first n nodes of the full
    tree (nodes, order and attribution), and cutting the full tree gives the same."""
    tracker = AcceptanceTracker(30, len(drafts) or 1)
    request = tracker.start()
    sequence = [0]
    for old, committed in history:  # some learning first, from arbitrary steps
        full = TokenTree.from_drafts(sequence[-1], old[: tracker.num_sources], 30, request.source_rates)
        start = len(sequence)
        sequence += committed
        observe(tracker, request, full, sequence, start)
    rates = request.source_rates
    full = TokenTree.from_drafts(0, drafts, 10_000, rates)
    tree = TokenTree.from_drafts(0, drafts, budget, rates)
    n = len(tree)
    assert n == min(budget, full.num_draft_nodes) + 1
    assert (tree.tokens, tree.parents, tree.depth, tree.sources, tree.proposers) == \
           (full.tokens[:n], full.parents[:n], full.depth[:n], full.sources[:n], full.proposers[:n])
    cut = full.prefix(budget)
    assert (cut.tokens, cut.parents, cut.sources) == (tree.tokens, tree.parents, tree.sources)


def _agreeing_drafts(seed: int) -> list[list[list[int]]]:
    """Several sources' branches that mostly copy one sequence (as sources that agree do), some cut
    short, some changed at a token, some going on past it."""
    rng = np.random.default_rng(seed)
    base = [int(t) for t in rng.integers(0, 5, size=int(rng.integers(0, 25)))]
    drafts = []
    for _ in range(int(rng.integers(1, 6))):
        branches = []
        for _ in range(int(rng.integers(0, 4))):
            branch = base[: int(rng.integers(0, len(base) + 1))]
            if branch and rng.random() < 0.4:
                branch[int(rng.integers(len(branch)))] = int(rng.integers(0, 5))
            branches.append(branch + [int(t) for t in rng.integers(0, 5, size=int(rng.integers(0, 4)))])
        drafts.append(branches)
    return drafts


@pytest.mark.parametrize("seed", range(300))
def test_merge_of_agreeing_branches_is_the_same_whatever_their_sequence_type(seed) -> None:
    # a stretch where every branch through a node goes on with one same token is read by slices
    # when the branches are lists; tuples are grouped depth by depth: both must build one tree
    drafts = _agreeing_drafts(seed)
    rates = {}

    def rate(source, depth, rank):
        return rates.setdefault((source, depth, rank), [0.9, 0.5, 0.2, 1.0, 0.0][(source * 7 + depth * 3 + rank + seed) % 5])

    for budget in (1, 8, 32, 64):
        for rate_fn in (None, rate):
            a = TokenTree.from_drafts(3, drafts, budget, rate_fn)
            b = TokenTree.from_drafts(3, [[tuple(x) for x in branches] for branches in drafts], budget, rate_fn)
            assert (a.tokens, a.parents, a.depth, a.sources, a.proposers) == \
                (b.tokens, b.parents, b.depth, b.sources, b.proposers)
            assert [a.children(i) for i in range(len(a))] == [b.children(i) for i in range(len(b))]
