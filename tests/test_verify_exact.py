"""Exact (noise-free) tests of the verifiers in ``specdraft.verify``.

The sampling verifier is checked by *enumeration*, not by sampling: every random choice it
makes goes through the ``draw`` callback, so a scripted ``draw`` can walk all choice sequences
depth first (one verifier run per complete choice sequence) and multiply the probabilities of
the choices it made. Summing those products per emitted token sequence gives the verifier's
exact output law, which must equal the law of plain sampling *truncated where it leaves the
tree*: plain sampling draws ``x_1, x_2, ...`` from the processed conditionals; the verifier's
step emits ``x_1 .. x_k`` where ``x_k`` is the first token that is not a child of the node
reached so far (inclusive). We compute that reference independently: our own toy "model"
(a hash-seeded logits vector per full prefix), transformers' own processors built here in
``model.generate``'s order, and our own re-derivation of which token paths the merged tree holds.

Numerics (why 1e-9 is the right tolerance, not 1e-6): ``NodeScorer`` casts logits to float32
before processing, exactly as ``model.generate`` does (``outputs.logits[:, -1].to(float32)``),
and the reference does the same, so both sides see bit-identical float32 processed scores and
float32 softmax outputs. Everything after that -- normalising the probability vector the way
``torch.multinomial`` does, multiplying along a path, the rejection arithmetic of the
SpecInfer-style verifier -- is float64, so the remaining disagreement is float64 round-off
(~1e-16 per operation). A verifier that computed its probabilities in a different precision
than plain sampling would disagree at ~1e-7 and fail here, which is intended: that would be a
real (if tiny) departure from ``model.generate``'s distribution. The mutants disagree by > 1e-3.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdraft.sampling import NodeScorer, SamplingSettings
from specdraft.tree import TokenTree
from specdraft.verify import Verdict, verify_greedy, verify_sampling

from _verifier_variants import bonus_from_p_verify, committed_context_verify, specinfer_verify
from conftest import reference_merge

TOL = 1e-9

# ---------------------------------------------------------------------------------------------
# A toy "model": a deterministic logits vector for every full prefix.
# ---------------------------------------------------------------------------------------------


class ToyModel:
    """``logits(prefix)`` is a random vector seeded by the whole prefix, so every conditional
    depends on the full history (which is what makes per-node prefixes matter)."""

    def __init__(self, vocab: int, seed: int, scale: float, zero_rate: float = 0.0) -> None:
        self.vocab, self.seed, self.scale, self.zero_rate = vocab, seed, scale, zero_rate

    def logits(self, prefix: Sequence[int]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(prefix), *map(int, prefix)])
        out = rng.normal(size=self.vocab) * self.scale
        if self.zero_rate:
            # some tokens get a hugely negative logit: probability exactly 0 after softmax in float32
            dead = rng.random(self.vocab) < self.zero_rate
            dead[rng.integers(self.vocab)] = False  # never all dead
            out[dead] = -1e9
        return out

    def tree_logits(self, tree: TokenTree, prefix: Sequence[int]) -> torch.Tensor:
        """Row ``i`` = logits after ``prefix`` + the tokens on the path to node ``i`` (float64)."""
        rows = [self.logits(list(prefix) + [tree.tokens[j] for j in tree.path_to(i)]) for i in range(len(tree))]
        return torch.tensor(np.stack(rows), dtype=torch.float64)


def hf_processors(temperature: float, top_k: int | None, top_p: float, min_p: float | None,
                  repetition_penalty: float) -> LogitsProcessorList:
    """transformers' processors in ``GenerationMixin._get_logits_processor`` order (sampling),
    built here independently of ``specdraft.sampling``."""
    procs = LogitsProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=repetition_penalty))
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        procs.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None:
        procs.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    return procs


def plain_probs(model: ToyModel, procs: LogitsProcessorList, ids: Sequence[int]) -> np.ndarray:
    """What ``model.generate(do_sample=True)`` samples from after ``ids``: float32 processing and
    softmax, then the normalisation ``torch.multinomial`` applies (done in float64)."""
    scores = torch.tensor(model.logits(ids), dtype=torch.float64).to(torch.float32).reshape(1, -1)
    scores = procs(torch.tensor([list(ids)], dtype=torch.long), scores)
    p = torch.softmax(scores, dim=-1)[0].to(torch.float64).numpy()
    return p / p.sum()


# ---------------------------------------------------------------------------------------------
# The tree's node set, re-derived independently of TokenTree.
# ---------------------------------------------------------------------------------------------


def expected_node_paths(branches_per_source: Sequence[Sequence[Sequence[int]]], max_nodes: int) -> set[tuple[int, ...]]:
    """Token paths of the draft nodes ``TokenTree.from_drafts`` must build under its prior rates:
    the ``max_nodes`` proposed nodes of highest value, shared prefixes one node (the brute force
    of :func:`conftest.reference_merge`)."""
    return set(reference_merge(branches_per_source, max_nodes)[1])


def tree_node_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(1, len(tree))}


# ---------------------------------------------------------------------------------------------
# Exact enumeration of a verifier's output law.
# ---------------------------------------------------------------------------------------------


def enumerate_outcomes(run: Callable[[Callable[[torch.Tensor], int]], Verdict],
                       max_runs: int = 200_000) -> tuple[dict[tuple[int, ...], float], int]:
    """Run ``run(draw)`` once per choice sequence, depth first, over every choice with nonzero
    probability; return ``{emitted tokens: probability}`` and the number of runs.

    ``draw`` replays a script of forced choices, then takes the smallest token with nonzero
    probability; after each run we backtrack to the deepest choice that has an untried nonzero
    alternative. Probability vectors are normalised like ``torch.multinomial`` does. The
    verifier must be deterministic given its choices; replayed choices are checked to see the
    very same probability vectors again.
    """
    dist: dict[tuple[int, ...], float] = defaultdict(float)
    script: list[int] = []
    previous: list[tuple[np.ndarray, int]] = []
    runs = 0
    while True:
        log: list[tuple[np.ndarray, int]] = []

        def draw(probs: torch.Tensor) -> int:
            p = probs.detach().to(torch.float64).reshape(-1).numpy().copy()
            assert np.all(p >= 0) and p.sum() > 0, f"draw got an invalid probability vector {p}"
            p = p / p.sum()
            j = len(log)
            if j < len(script):
                token = script[j]
                # the choices before j are the previous run's, so the vector must be the same
                assert np.array_equal(p, previous[j][0]), "verifier is not deterministic given its draws"
            else:
                token = int(np.flatnonzero(p > 0)[0])
            assert p[token] > 0
            log.append((p, token))
            return token

        verdict = run(draw)
        runs += 1
        assert runs <= max_runs, "enumeration blew up"
        assert len(verdict.tokens) == len(verdict.path) + 1
        assert len(log) >= len(script), "the verifier made fewer draws than were replayed"
        prob = 1.0
        for p, token in log:
            prob *= p[token]
        dist[tuple(verdict.tokens)] += prob
        previous = log
        for j in reversed(range(len(log))):
            p, token = log[j]
            alternatives = np.flatnonzero(p > 0)
            alternatives = alternatives[alternatives > token]
            if len(alternatives):
                script = [t for _, t in log[:j]] + [int(alternatives[0])]
                break
        else:
            return dict(dist), runs


def reference_outcomes(model: ToyModel, procs: LogitsProcessorList, prefix: Sequence[int],
                       nodes: set[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
    """Plain sampling, truncated at the first token that leaves the tree (inclusive)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], prob: float) -> None:
        p = plain_probs(model, procs, list(prefix) + list(seq))
        for token in np.flatnonzero(p > 0):
            nxt = seq + (int(token),)
            if nxt in nodes:
                walk(nxt, prob * p[token])
            else:
                out[nxt] = out.get(nxt, 0.0) + prob * p[token]

    walk((), 1.0)
    return out


def max_discrepancy(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


class Case:
    """One verification problem: a toy model, a committed prefix, a merged tree, sampling settings."""

    def __init__(self, vocab, model_seed, scale, zero_rate, prefix, branches_per_source, max_nodes,
                 temperature=1.0, top_k=None, top_p=1.0, min_p=None, repetition_penalty=1.0):
        self.model = ToyModel(vocab, model_seed, scale, zero_rate)
        self.prefix = list(prefix)
        self.branches_per_source = branches_per_source
        self.tree = TokenTree.from_drafts(self.prefix[-1], branches_per_source, max_nodes)
        self.nodes = expected_node_paths(branches_per_source, max_nodes)
        self.settings = SamplingSettings(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                         min_p=min_p, repetition_penalty=repetition_penalty)
        self.procs = hf_processors(temperature, top_k, top_p, min_p, repetition_penalty)
        self.logits = self.model.tree_logits(self.tree, self.prefix)

    def __repr__(self) -> str:
        m = self.model
        return (f"Case(V={m.vocab}, seed={m.seed}, scale={m.scale}, zero_rate={m.zero_rate}, prefix={self.prefix}, "
                f"branches={self.branches_per_source}, tree={self.tree.branches()}, {self.settings})")

    def outcomes(self, verifier=verify_sampling) -> tuple[dict, int]:
        scorer = NodeScorer(self.settings)
        return enumerate_outcomes(lambda draw: verifier(self.tree, self.logits, scorer, self.prefix, draw))

    def reference(self) -> dict:
        return reference_outcomes(self.model, self.procs, self.prefix, self.nodes)


@st.composite
def cases(draw, need_penalty: bool = False) -> Case:
    vocab = draw(st.integers(3, 6))
    token = st.integers(0, vocab - 1)
    branch = st.lists(token, min_size=1, max_size=4)
    branches_per_source = draw(st.lists(st.lists(branch, min_size=0, max_size=4), min_size=1, max_size=3)
                               .filter(lambda b: any(b)))
    model = ToyModel(vocab, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0])),
                     draw(st.sampled_from([0.0, 0.0, 0.3])))
    prefix = draw(st.lists(token, min_size=1, max_size=4))
    if draw(st.booleans()):
        # an "oracle" source: the model's own most likely chain, so deep paths get accepted often
        chain: list[int] = []
        for _ in range(draw(st.integers(1, 4))):
            chain.append(int(np.argmax(model.logits(prefix + chain))))
        branches_per_source.insert(draw(st.integers(0, len(branches_per_source))), [chain])
    top_k = draw(st.one_of(st.none(), st.just(0), st.integers(1, vocab)))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.6, 0.99)))
    min_p = draw(st.one_of(st.none(), st.floats(0.0, 0.2)))
    penalty = st.floats(0.5, 3.0).filter(lambda x: x != 1.0)
    rep = draw(penalty if need_penalty else st.one_of(st.just(1.0), penalty, penalty))
    return Case(
        vocab=vocab, model_seed=model.seed, scale=model.scale, zero_rate=model.zero_rate,
        prefix=prefix,
        branches_per_source=branches_per_source,
        max_nodes=draw(st.one_of(st.integers(4, 14), st.integers(0, 14))),
        temperature=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
        top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
    )


EXACT = settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Sampling verifier: exact law
# ---------------------------------------------------------------------------------------------


@EXACT
@given(cases())
def test_verify_sampling_has_the_exact_law_of_plain_sampling(case: Case) -> None:
    assert tree_node_paths(case.tree) == case.nodes  # our independent reading of the tree agrees
    ref = case.reference()
    got, runs = case.outcomes(verify_sampling)
    assert abs(sum(ref.values()) - 1.0) < TOL and abs(sum(got.values()) - 1.0) < TOL
    # one draw per committed token: every emitted sequence comes from exactly one run
    assert runs == len(got)
    assert set(got) == set(ref), case
    assert max_discrepancy(got, ref) < TOL, case


@settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(need_penalty=True))
def test_verify_sampling_exact_law_with_repetition_penalty(case: Case) -> None:
    """Same check, every case with a repetition penalty (the prefix-dependent processor)."""
    ref = case.reference()
    got, _ = case.outcomes(verify_sampling)
    assert max_discrepancy(got, ref) < TOL, case


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_specinfer_multi_round_rejection_has_the_same_law(case: Case) -> None:
    """The equivalence claimed in verify.py's docstring: accept child c with probability r[c],
    else zero it and renormalise, bonus from the final residual == one draw from p per node."""
    ref = case.reference()
    got, _ = case.outcomes(specinfer_verify)
    assert abs(sum(got.values()) - 1.0) < TOL
    assert max_discrepancy(got, ref) < TOL, case


def test_the_enumeration_reaches_deep_and_zero_probability_branches() -> None:
    """Sanity of the harness itself on a hand-made case: tokens pruned by top-k are never drawn,
    deep paths are reached, and the outcome count is what the tree implies."""
    case = Case(vocab=4, model_seed=7, scale=1.0, zero_rate=0.0, prefix=[0, 1],
                branches_per_source=[[[2, 3, 1], [3]], [[2, 0]]], max_nodes=10, top_k=3)
    got, runs = case.outcomes()
    assert runs == len(got)
    # one pruned token per node under top_k=3 -> no outcome contains it at that position
    for seq in got:
        ids = case.prefix + list(seq[:-1])
        assert plain_probs(case.model, case.procs, ids)[seq[-1]] > 0
    assert max(len(s) for s in got) >= 2
    assert max_discrepancy(got, case.reference()) < TOL


# ---------------------------------------------------------------------------------------------
# Teeth: the same enumeration catches the classic bugs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [
    # two sibling drafts at the root, no processing at all: rejected children come back as bonus
    dict(vocab=4, model_seed=1, scale=1.0, zero_rate=0.0, prefix=[3], branches_per_source=[[[0], [1]]], max_nodes=8),
    # one chain, with the full warper stack
    dict(vocab=5, model_seed=2, scale=1.0, zero_rate=0.0, prefix=[4, 4], branches_per_source=[[[0, 1, 2]], [[1, 0]]],
         max_nodes=8, temperature=0.8, top_k=4, top_p=0.9),
], ids=["siblings", "warped-chain"])
def test_bonus_drawn_from_unreduced_p_is_caught(case: dict) -> None:
    c = Case(**case)
    ref = c.reference()
    good, _ = c.outcomes(specinfer_verify)
    bad, _ = c.outcomes(bonus_from_p_verify)
    assert max_discrepancy(good, ref) < TOL
    assert max_discrepancy(bad, ref) > 1e-3


@pytest.mark.parametrize("case", [
    # the chain repeats a token that is not in the committed prefix: only the node's own path
    # tells the repetition penalty about it
    dict(vocab=4, model_seed=3, scale=1.5, zero_rate=0.0, prefix=[3], branches_per_source=[[[0, 1], [1, 0]]],
         max_nodes=8, repetition_penalty=2.0),
    dict(vocab=6, model_seed=4, scale=1.0, zero_rate=0.0, prefix=[5, 5], branches_per_source=[[[0, 1, 2]], [[2, 2, 2]]],
         max_nodes=10, temperature=0.7, top_k=5, top_p=0.95, repetition_penalty=1.3),
], ids=["penalty-2.0", "penalty-1.3-warped"])
def test_warping_with_committed_context_only_is_caught(case: dict) -> None:
    c = Case(**case)
    ref = c.reference()
    good, _ = c.outcomes(verify_sampling)
    bad, _ = c.outcomes(committed_context_verify)
    assert max_discrepancy(good, ref) < TOL
    assert max_discrepancy(bad, ref) > 1e-3


@pytest.mark.parametrize("mutant, need_penalty", [(bonus_from_p_verify, False), (committed_context_verify, True)],
                         ids=["bonus-from-unreduced-p", "warp-with-committed-context-only"])
def test_the_property_test_generator_finds_each_mutant(mutant, need_penalty: bool) -> None:
    """The hypothesis strategy used above is able to expose each bug on its own (so the
    property tests are not passing merely because their cases are too easy)."""
    found = find(cases(need_penalty=need_penalty),
                 lambda c: max_discrepancy(c.outcomes(mutant)[0], c.reference()) > 1e-3,
                 settings=settings(max_examples=150, derandomize=True, database=None, deadline=None))
    assert max_discrepancy(found.outcomes(mutant)[0], found.reference()) > 1e-3
    assert max_discrepancy(found.outcomes(verify_sampling)[0], found.reference()) < TOL


def test_committed_context_bug_is_invisible_without_a_prefix_dependent_processor() -> None:
    """Documents why the mutant needs repetition_penalty: temperature/top-k/top-p/min-p do not
    read the prefix, so warping with the wrong prefix changes nothing."""
    c = Case(vocab=5, model_seed=5, scale=1.5, zero_rate=0.0, prefix=[4], branches_per_source=[[[0, 1, 2], [1, 0]]],
             max_nodes=10, temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)
    bad, _ = c.outcomes(committed_context_verify)
    assert max_discrepancy(bad, c.reference()) < TOL


# ---------------------------------------------------------------------------------------------
# Greedy verifier
# ---------------------------------------------------------------------------------------------


def _one_hot_logits(tree: TokenTree, vocab: int, best: dict[int, int]) -> torch.Tensor:
    """Logits whose argmax at node ``i`` is ``best[i]`` (a clear margin), noise elsewhere."""
    g = torch.Generator().manual_seed(0)
    logits = torch.rand(len(tree), vocab, generator=g, dtype=torch.float64)
    for node, token in best.items():
        logits[node, token] = 5.0
    return logits


def _node(tree: TokenTree, *tokens: int) -> int:
    node = 0
    for t in tokens:
        node = tree.child(node, t)
        assert node is not None
    return node


def test_verify_greedy_walks_to_the_deepest_agreeing_node_and_adds_the_bonus() -> None:
    tree = TokenTree.from_drafts(9, [[[1, 2, 3], [1, 4]], [[5]]], max_nodes=10)
    a, ab, abc, ad, e = (_node(tree, 1), _node(tree, 1, 2), _node(tree, 1, 2, 3), _node(tree, 1, 4), _node(tree, 5))
    # the model agrees with 1 then 4 (the second child of node 1), then says 7 (the bonus)
    logits = _one_hot_logits(tree, 10, {0: 1, a: 4, ad: 7, ab: 0, abc: 0, e: 0})
    v = verify_greedy(tree, logits)
    assert v.path == [a, ad] and v.tokens == [1, 4, 7]
    # the whole longest branch, then the bonus predicted at the leaf
    logits = _one_hot_logits(tree, 10, {0: 1, a: 2, ab: 3, abc: 8})
    v = verify_greedy(tree, logits)
    assert v.path == [a, ab, abc] and v.tokens == [1, 2, 3, 8]
    # nothing agrees: one token, as plain decoding
    logits = _one_hot_logits(tree, 10, {0: 6})
    v = verify_greedy(tree, logits)
    assert v.path == [] and v.tokens == [6]


def test_verify_greedy_on_a_root_only_tree() -> None:
    tree = TokenTree(3)
    v = verify_greedy(tree, torch.tensor([[0.0, 2.0, 1.0, 0.5]]))
    assert v == Verdict(path=[], tokens=[1])


def test_verify_greedy_rejects_mismatched_logits() -> None:
    tree = TokenTree.from_drafts(0, [[[1, 2]]], max_nodes=4)
    with pytest.raises(ValueError, match="shape"):
        verify_greedy(tree, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="shape"):
        verify_greedy(tree, torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        verify_sampling(tree, torch.zeros(4, 5), NodeScorer(SamplingSettings(do_sample=True)), [0], lambda p: 0)


def test_verify_greedy_scorer_uses_each_nodes_own_path() -> None:
    """Repetition penalty with the node's own prefix: at node [1], token 1 is on the path and
    gets penalised, so the argmax moves to token 2 even though token 1 has the larger raw logit."""
    tree = TokenTree.from_drafts(0, [[[1, 1]], [[1, 2]]], max_nodes=4)
    n1, n12 = _node(tree, 1), _node(tree, 1, 2)
    logits = torch.full((len(tree), 4), -1.0, dtype=torch.float64)
    logits[0, 1] = 3.0        # root: 1 wins (not in the prefix [0])
    logits[n1, 1] = 2.0       # at [1]: raw 1 wins, penalised 2.0 / 1.5 = 1.33 < 1.8 -> 2 wins
    logits[n1, 2] = 1.8
    logits[n12, 3] = 1.0
    scorer = NodeScorer(SamplingSettings(do_sample=False, repetition_penalty=1.5))
    # without the scorer the raw argmax at [1] is 1 (child [1, 1]), then token 0 at [1, 1]
    assert verify_greedy(tree, logits).tokens == [1, 1, 0]
    v = verify_greedy(tree, logits, scorer, prefix=[0])
    assert v.path == [n1, n12] and v.tokens == [1, 2, 3]
    # the scorer sees the committed prefix too: with 1 already committed, the root picks 1 anyway
    # (3.0 / 1.5 = 2 > -1) but at [1] token 1 is still penalised
    v = verify_greedy(tree, logits, scorer, prefix=[1, 0])
    assert v.tokens == [1, 2, 3]


def test_verify_greedy_scorer_identity_matches_vectorised_path() -> None:
    tree = TokenTree.from_drafts(0, [[[1, 2, 3], [2, 2]], [[1, 3]]], max_nodes=10)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        logits = torch.randn(len(tree), 4, generator=g, dtype=torch.float64)
        logits[0, 1] += 1.0
        scorer = NodeScorer(SamplingSettings(do_sample=False))
        assert scorer.is_identity
        assert verify_greedy(tree, logits) == verify_greedy(tree, logits, scorer, prefix=[0])


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(cases(), st.booleans())
def test_verify_greedy_equals_plain_greedy_truncated_at_the_tree(case: Case, with_penalty: bool) -> None:
    """Reference: plain greedy decoding (argmax of the processed conditional, processors built
    here from transformers' classes), stopped at the first token that leaves the tree."""
    penalty = case.settings.repetition_penalty if with_penalty else 1.0
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)]) if penalty != 1.0 else LogitsProcessorList()
    seq: tuple[int, ...] = ()
    while True:
        ids = case.prefix + list(seq)
        scores = torch.tensor(case.model.logits(ids), dtype=torch.float64).to(torch.float32).reshape(1, -1)
        scores = procs(torch.tensor([ids]), scores)
        seq = seq + (int(torch.argmax(scores)),)
        if seq not in case.nodes:
            break
    scorer = NodeScorer(SamplingSettings(do_sample=False, repetition_penalty=penalty))
    # float32 logits, as the runner hands them over (and as model.generate takes its argmax)
    v = verify_greedy(case.tree, case.logits.float(), None if scorer.is_identity else scorer, case.prefix)
    assert tuple(v.tokens) == seq, case
    assert [case.tree.tokens[n] for n in v.path] == list(seq[:-1])
