"""The merge by expected value: a mix of sources does about as well as its best member, whatever
the order they are listed in, because each source's acceptance is learned online
(:mod:`specdraft.calibration`) and the tree is filled best first (:meth:`TokenTree.from_drafts`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft import Decoder
from specdraft.calibration import AcceptanceCalibration
from specdraft.sources.base import Context, Draft
from specdraft.tree import TokenTree

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


def _observe_steps(calibration: AcceptanceCalibration, request_id: int, steps: int) -> None:
    """Source 0 proposes a wrong branch, source 1 the right one, step after step."""
    truth = list(range(10, 10 + 5 * steps + 8))
    at = 0
    for _ in range(steps):
        right = truth[at:at + 4]
        wrong = [t + 100 for t in right]
        tree = TokenTree.from_drafts(truth[at - 1] if at else 0, [[wrong], [right]], 6,
                                     calibration.rates(request_id))
        cut = tree.prefix(6)
        committed = right + [truth[at + 4]]
        calibration.observe(request_id, cut, committed)
        at += 5


def test_calibration_learns_which_source_is_accepted() -> None:
    cal = AcceptanceCalibration(2)
    assert cal.rate(0, 1) == cal.rate(1, 1)  # no evidence yet: equal
    cal.start_request(1)
    _observe_steps(cal, 1, 12)
    for depth in (1, 2, 3, 4):
        assert cal.rate(1, depth, request_id=1) > 0.9
        assert cal.rate(1, depth) > 0.9  # the long-run average learned it too
    assert cal.rate(0, 1, request_id=1) < 0.05 and cal.rate(0, 1) < 0.1
    # the rejected source's deeper nodes were never in the running (their parent was rejected):
    # no evidence about them
    assert cal.rate(0, 2) == AcceptanceCalibration(2).rate(0, 2)
    # a new request starts from the long-run averages, and the merge now puts source 1 first
    cal.start_request(2)
    tree = TokenTree.from_drafts(0, [[[90, 91, 92]], [[1, 2, 3]]], 3, cal.rates(2))
    assert tree.branches() == [[1, 2, 3]]


def test_calibration_waits_for_the_tokens_below_a_long_walk() -> None:
    # a deep full tree whose walk outlasts the step's tokens: its deeper nodes are recorded when
    # the next steps commit their tokens, not counted as misses
    cal = AcceptanceCalibration(1, fast=1.0)
    cal.start_request(7)
    tree = TokenTree.from_drafts(0, [[[1, 2, 3, 4, 5, 6]]], 6, cal.rates(7))
    cal.observe(7, tree.prefix(1), [1, 2])  # a one-node check; the walk is at node "2"
    assert cal.rate(0, 3, request_id=7) == 0.5  # not known yet
    cal.observe(7, TokenTree(2), [3, 4, 9])
    assert cal.rate(0, 3, request_id=7) == 1.0 and cal.rate(0, 4, request_id=7) == 1.0
    assert cal.rate(0, 5, request_id=7) == 0.0  # "5" was proposed, "9" came


def test_calibration_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="fast"):
        AcceptanceCalibration(2, fast=0.0)
    with pytest.raises(ValueError, match="slow"):
        AcceptanceCalibration(2, slow=1.5)
    with pytest.raises(ValueError, match="num_sources"):
        AcceptanceCalibration(-1)
    with pytest.raises(ValueError, match="source_index"):
        AcceptanceCalibration(2).rate(2, 1)


_tok = st.integers(0, 5)
_drafts = st.lists(st.lists(st.lists(_tok, max_size=6), max_size=4), max_size=4)


@settings(FAST, max_examples=200)
@given(drafts=_drafts, budget=st.integers(0, 30), history=st.lists(st.tuples(_drafts, st.lists(_tok, max_size=8)),
                                                                   max_size=4))
def test_calibrated_merge_keeps_the_prefix_property(drafts, budget, history) -> None:
    """Whatever calibration has learned, the tree of budget n is the first n nodes of the full
    tree (nodes, order and attribution), and cutting the full tree gives the same."""
    cal = AcceptanceCalibration(len(drafts) or 1)
    cal.start_request(1)
    for old, committed in history:  # some learning first, from arbitrary steps
        cal.observe(1, TokenTree.from_drafts(0, old[: cal.num_sources], 30, cal.rates(1)), committed)
    rates = cal.rates(1)
    full = TokenTree.from_drafts(0, drafts, 10_000, rates)
    tree = TokenTree.from_drafts(0, drafts, budget, rates)
    n = len(tree)
    assert n == min(budget, full.num_draft_nodes) + 1
    assert (tree.tokens, tree.parents, tree.depth, tree.sources, tree.proposers) == \
           (full.tokens[:n], full.parents[:n], full.depth[:n], full.sources[:n], full.proposers[:n])
    cut = full.prefix(budget)
    assert (cut.tokens, cut.parents, cut.sources) == (tree.tokens, tree.parents, tree.sources)
