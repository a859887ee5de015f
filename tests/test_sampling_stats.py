"""End-to-end statistical test of sampled decoding on a tiny random Llama (float64, CPU).

With ``max_new_tokens=4`` and a 10-token vocabulary the whole output space (10^4 sequences) can
be enumerated, so the exact plain-sampling law is known: the product of the processed
conditionals, each taken from ``model.generate(..., output_scores=True)`` itself (transformers'
own processors, its own defaults, its own float32 cast). ``Decoder.generate`` samples are then
compared with that law by a chi-square goodness-of-fit test (cells with expected count < 5
pooled), with fixed seeds, so the test is deterministic.

The draft sources make sure the tree path is really exercised: an "oracle" table source that
proposes the model's likely chains (several siblings at the root, depth 2) plus ``PromptLookup``
on a repetitive prompt; the mean accepted tokens per step is checked to be > 1.3.

Teeth: the same harness with a wrong verifier injected into the decoder must be rejected
(p < 1e-4): the bonus token drawn from the unreduced ``p`` instead of the residual, and the
warpers fed only the committed context (visible through the repetition penalty, because the
prompt uses only tokens {1, 2, 3}, so generated tokens outside it are penalised only if the
node's own path is seen).

Finally, a stronger exactness check: fed the same random stream (``torch.manual_seed(s)``, then
``seed=None`` so the decoder uses the global generator), ``Decoder`` reproduces
``model.generate(do_sample=True)`` token for token, because the verifier makes exactly one
``torch.multinomial`` draw on a ``[1, V]`` row per committed token from the very same float32
probabilities, as transformers does.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Sequence

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats
from transformers import AutoModelForCausalLM, LlamaConfig

import specdraft.engine.settle
from specdraft import Decoder, PromptLookup, TokenRecycling
from specdraft.sources import SuffixTree
from specdraft.sources.base import Context, Draft

from conftest import PassiveSource
from _verifier_variants import bonus_from_p_verify, committed_context_verify, specinfer_verify

VOCAB = 10
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive (prompt lookup fires), uses only tokens {1, 2, 3}
NEW = 4
LM_HEAD_SCALE = 25.0  # random init gives near-uniform conditionals; this makes them peaked but not one-hot
P_THRESHOLD = 1e-4

SETTING_A = dict(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.3)
SETTING_DEFAULTS: dict = {}  # do_sample=True alone: transformers' defaults (top_k=50, T=1, ...)

N_CORRECT = 3000
N_DEFAULTS = 2000
N_MUTANT = 1200  # mutants then give p ~ 1e-48 (bonus bug) and impossible sequences (warp bug); see the report


# ---------------------------------------------------------------------------------------------
# Fixtures: the model, the exact law, the sources
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """A 16-wide model is pure overhead; extra intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return law_model()


def law_model(device: str = "cpu"):
    """The tiny peaked float64 Llama the laws are enumerated on (also the CUDA suite's)."""
    torch.manual_seed(20240607)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="sdpa").eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(LM_HEAD_SCALE)
    m.generation_config.pad_token_id = None
    m.generation_config.eos_token_id = None
    return m.to(device)


class ExactLaw:
    """The plain-sampling law of the first ``new`` tokens after ``prompt`` (by default ``NEW``
    after ``PROMPT``), by enumeration.

    Each conditional is what ``model.generate(do_sample=True, **options)`` samples from after
    that prefix: its processed scores (``output_scores``), softmaxed in float32 as transformers
    does, then normalised in float64 as ``torch.multinomial`` does.
    """

    def __init__(self, model, options: dict, prompt: list[int] = PROMPT, new: int = NEW) -> None:
        self.model, self.options, self.prompt, self.new = model, options, list(prompt), new
        self.cond: dict[tuple[int, ...], np.ndarray] = {}
        self.probs: dict[tuple[int, ...], float] = {}
        self._walk((), 1.0)

    def conditional(self, seq: tuple[int, ...]) -> np.ndarray:
        if seq not in self.cond:
            ids = torch.tensor([self.prompt + list(seq)], device=self.model.device)
            out = self.model.generate(ids, max_new_tokens=1, do_sample=True, output_scores=True,
                                      return_dict_in_generate=True, **self.options)
            p = torch.softmax(out.scores[0][0], dim=-1).to(torch.float64).cpu().numpy()
            self.cond[seq] = p / p.sum()
        return self.cond[seq]

    def _walk(self, seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == self.new:
            self.probs[seq] = prob
            return
        p = self.conditional(seq)
        for t in np.flatnonzero(p > 0):
            self._walk(seq + (int(t),), prob * p[t])


class TableSource(PassiveSource):
    """A draft source reading a fixed table: for each context, the ``width`` most likely next
    tokens, each continued greedily for ``depth`` tokens (an "oracle" that makes the tree wide
    and deep and gets accepted often -- exactly the situation the mutants get wrong)."""

    name = "table"

    def __init__(self, law: ExactLaw, width: int = 3, depth: int = 2) -> None:
        self.law, self.width, self.depth = law, width, depth

    def propose(self, context: Context, budget: int) -> Draft:
        seq = tuple(context.tokens[len(PROMPT):])
        if seq not in self.law.cond:
            return Draft()
        branches = []
        for first in np.argsort(-self.law.cond[seq], kind="stable")[: self.width]:
            branch = [int(first)]
            while len(branch) < self.depth and seq + tuple(branch) in self.law.cond:
                branch.append(int(np.argmax(self.law.cond[seq + tuple(branch)])))
            branches.append(branch)
        return Draft(branches=branches)


@pytest.fixture(scope="module")
def law_a(model) -> ExactLaw:
    return ExactLaw(model, SETTING_A)


@pytest.fixture(scope="module")
def law_defaults(model) -> ExactLaw:
    return ExactLaw(model, SETTING_DEFAULTS)


def make_decoder(model, law: ExactLaw) -> Decoder:
    # a fixed budget: every step checks the whole tree, so the tests exercise the verifier on real
    # trees whatever the machine's load (the adaptive budget sizes trees from measured time)
    return Decoder(model, sources=[TableSource(law), PromptLookup(max_ngram=3, min_ngram=1, num_tokens=3)],
                   max_tree_nodes=12, adaptive_budget=False)


# ---------------------------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------------------------


def sample(decoder: Decoder, n: int, options: dict, seed0: int) -> tuple[Counter, float]:
    counts: Counter = Counter()
    steps = tokens = 0
    for i in range(n):
        out = decoder.generate(PROMPT, max_new_tokens=NEW, do_sample=True, seed=seed0 + i, **options)
        counts[tuple(out.token_ids)] += 1
        steps += out.stats.steps
        tokens += out.stats.new_tokens
    return counts, tokens / steps


def chi_square(counts: Counter, law: ExactLaw) -> tuple[float, int, int]:
    """(p-value, degrees of freedom, impossible samples). Cells with expected count < 5 are
    pooled into one cell (itself merged into the smallest big cell if still < 5)."""
    n = sum(counts.values())
    impossible = sum(c for s, c in counts.items() if law.probs.get(s, 0.0) == 0.0)
    if impossible:
        return 0.0, 0, impossible
    big = sorted((s for s, p in law.probs.items() if n * p >= 5), key=lambda s: law.probs[s])
    small = [s for s in law.probs if n * law.probs[s] < 5]
    obs = [counts.get(s, 0) for s in big]
    exp = [n * law.probs[s] for s in big]
    pooled_obs, pooled_exp = sum(counts.get(s, 0) for s in small), n * sum(law.probs[s] for s in small)
    if pooled_exp >= 5:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    elif small:
        obs[0] += pooled_obs
        exp[0] += pooled_exp
    exp = np.asarray(exp) * (n / sum(exp))  # absorb float round-off so both sides sum to n
    result = scipy_stats.chisquare(np.asarray(obs, dtype=float), exp)
    return float(result.pvalue), len(obs) - 1, 0


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_the_tiny_model_is_a_fair_test_bed(law_a: ExactLaw, law_defaults: ExactLaw) -> None:
    """Conditionals neither near-uniform nor near-deterministic; the laws are proper."""
    for law in (law_a, law_defaults):
        assert abs(sum(law.probs.values()) - 1.0) < 1e-9
    top = [p.max() for p in law_defaults.cond.values()]
    assert 0.2 < float(np.mean(top)) < 0.8, np.mean(top)
    assert len([s for s, p in law_a.probs.items() if p > 1e-3]) >= 20


def test_sampled_decoding_matches_plain_sampling_chi_square(model, law_a: ExactLaw) -> None:
    decoder = make_decoder(model, law_a)
    started = time.perf_counter()
    counts, mean_accepted = sample(decoder, N_CORRECT, SETTING_A, seed0=0)
    elapsed = time.perf_counter() - started
    pvalue, dof, impossible = chi_square(counts, law_a)
    print(f"\n[setting A] N={N_CORRECT} p={pvalue:.4g} dof={dof} mean_accepted={mean_accepted:.2f} "
          f"{1e3 * elapsed / N_CORRECT:.1f} ms/generate")
    assert mean_accepted > 1.3, "the drafts are not being accepted: the tree path is not exercised"
    assert impossible == 0
    assert pvalue > P_THRESHOLD


def test_sampled_decoding_with_transformers_defaults_chi_square(model, law_defaults: ExactLaw) -> None:
    """``do_sample=True`` alone: top_k=50 (> vocab), temperature 1, no penalty -- resolved by the
    decoder as transformers resolves it; the reference comes from model.generate itself."""
    decoder = make_decoder(model, law_defaults)
    counts, mean_accepted = sample(decoder, N_DEFAULTS, SETTING_DEFAULTS, seed0=10_000)
    pvalue, dof, impossible = chi_square(counts, law_defaults)
    print(f"\n[defaults] N={N_DEFAULTS} p={pvalue:.4g} dof={dof} mean_accepted={mean_accepted:.2f}")
    assert mean_accepted > 1.3
    assert impossible == 0
    assert pvalue > P_THRESHOLD


def test_specinfer_multi_round_rejection_passes_the_same_harness(model, law_a: ExactLaw, monkeypatch) -> None:
    """The correct SpecInfer-style verifier (accept/reject coin flips, bonus from the residual)
    injected into the decoder passes too (fewer samples: this documents, not duplicates)."""
    monkeypatch.setattr(specdraft.engine.settle, "verify_sampling", specinfer_verify)
    counts, _ = sample(make_decoder(model, law_a), N_MUTANT, SETTING_A, seed0=20_000)
    pvalue, dof, impossible = chi_square(counts, law_a)
    print(f"\n[specinfer] N={N_MUTANT} p={pvalue:.4g} dof={dof}")
    assert impossible == 0 and pvalue > P_THRESHOLD


def recycling_decoder(model, law: ExactLaw, mix: str) -> tuple[Decoder, TokenRecycling]:
    """Token Recycling alone, or with the table and prompt lookup (the merged tree then mixes them);
    a fixed budget, so the recycled drafts are checked whatever the machine's load."""
    recycle = TokenRecycling(k=8, template="tr16")
    sources = [recycle] if mix == "alone" else [TableSource(law), recycle,
                                                PromptLookup(max_ngram=3, min_ngram=1, num_tokens=3)]
    return Decoder(model, sources=sources, max_tree_nodes=12, adaptive_budget=False), recycle


def suffix_decoder(model, law: ExactLaw, mix: str) -> tuple[Decoder, SuffixTree]:
    """SuffixDecoding alone, or with the table, Token Recycling and prompt lookup. Its global tree
    holds every earlier sample, so it drafts the likely continuations with their frequencies. A fixed
    budget: with the adaptive one a loaded machine can shrink the trees until no draft is checked."""
    suffix = SuffixTree(max_depth=8, max_cached_requests=64, min_token_prob=0.05)
    sources = [suffix] if mix == "alone" else [TableSource(law), suffix, TokenRecycling(k=8, template="tr16"),
                                               PromptLookup(max_ngram=3, min_ngram=1, num_tokens=3)]
    return Decoder(model, sources=sources, max_tree_nodes=12, adaptive_budget=False), suffix


#: the sources that learn from what they see (the model's own top-k; every earlier sample), each
#: alone and mixed with others: name -> (decoder factory, seed of its chi-square run)
LEARNING_SOURCES = {"recycle": (recycling_decoder, 40_000), "suffix": (suffix_decoder, 50_000)}


@pytest.mark.parametrize("mix", ["alone", "mixed"])
@pytest.mark.parametrize("kind", list(LEARNING_SOURCES))
def test_learning_source_keeps_the_sampling_law(model, law_a: ExactLaw, kind: str, mix: str) -> None:
    """Token Recycling drafts from the model's own top-k and the suffix tree from every earlier
    sample, which is what the sampler likes best: the law must still be the plain one (fewer
    samples than setting A's main test), and the drafts must really be accepted."""
    make, seed0 = LEARNING_SOURCES[kind]
    decoder, source = make(model, law_a, mix)
    counts, mean_accepted = sample(decoder, N_MUTANT, SETTING_A, seed0=seed0)
    pvalue, dof, impossible = chi_square(counts, law_a)
    print(f"\n[{kind} {mix}] N={N_MUTANT} p={pvalue:.4g} dof={dof} mean_accepted={mean_accepted:.2f}")
    assert impossible == 0 and pvalue > P_THRESHOLD
    accepted = sum(decoder.generate(PROMPT, max_new_tokens=NEW, do_sample=True, seed=s, **SETTING_A)
                   .stats.per_source[source.name].accepted for s in range(30))
    assert accepted > 0, f"the {kind} drafts are never accepted: the test does not exercise them"


@pytest.mark.parametrize("mix", ["alone", "mixed"])
@pytest.mark.parametrize("kind", list(LEARNING_SOURCES))
def test_learning_source_same_random_stream_as_model_generate(model, law_a: ExactLaw, kind: str, mix: str) -> None:
    decoder, _ = LEARNING_SOURCES[kind][0](model, law_a, mix)
    prompt = torch.tensor([PROMPT])
    for s in range(40):
        new = 3 if s % 2 else 12
        torch.manual_seed(s)
        ref = model.generate(prompt, max_new_tokens=new, do_sample=True, **SETTING_A)[0, len(PROMPT):].tolist()
        torch.manual_seed(s)
        out = decoder.generate(PROMPT, max_new_tokens=new, do_sample=True, seed=None, **SETTING_A)
        assert out.token_ids == ref, (s, ref, out.token_ids)


@pytest.mark.parametrize("mutant", [bonus_from_p_verify, committed_context_verify],
                         ids=["bonus-from-unreduced-p", "warp-with-committed-context-only"])
def test_chi_square_rejects_a_wrong_verifier(model, law_a: ExactLaw, monkeypatch, mutant) -> None:
    monkeypatch.setattr(specdraft.engine.settle, "verify_sampling", mutant)
    counts, mean_accepted = sample(make_decoder(model, law_a), N_MUTANT, SETTING_A, seed0=30_000)
    pvalue, dof, impossible = chi_square(counts, law_a)
    print(f"\n[{mutant.__name__}] N={N_MUTANT} p={pvalue:.4g} dof={dof} impossible={impossible} "
          f"mean_accepted={mean_accepted:.2f}")
    assert pvalue < P_THRESHOLD


@pytest.mark.parametrize("options, gen_config", [
    (SETTING_A, {}),
    (SETTING_DEFAULTS, {}),
    (dict(temperature=1.3, top_p=0.8, min_p=0.05), {}),
    (SETTING_A, {"eos_token_id": "likely"}),
    # defaults taken from the model's own generation_config (do_sample=True is all the caller says)
    (SETTING_DEFAULTS, {"top_k": 3, "temperature": 0.7, "repetition_penalty": 1.2}),
], ids=["setting-A", "defaults", "min-p", "setting-A-with-eos", "model-generation-config"])
def test_same_random_stream_gives_the_very_same_tokens_as_model_generate(model, law_a: ExactLaw, options, gen_config,
                                                                         monkeypatch) -> None:
    """torch.manual_seed(s) then model.generate == torch.manual_seed(s) then Decoder.generate
    (seed=None uses the global generator): one multinomial draw per committed token, from the
    same float32 probabilities, in the same order, whatever the drafts were. With an EOS id
    (the most likely first token, so it is hit often, also in the middle of accepted paths)
    both must stop at the same place."""
    eos = None
    for key, value in gen_config.items():
        if key == "eos_token_id":
            eos = value = int(np.argmax(law_a.cond[()]))
            monkeypatch.setattr(model.generation_config, "pad_token_id", eos)
        monkeypatch.setattr(model.generation_config, key, value)
    decoder = make_decoder(model, law_a)
    prompt = torch.tensor([PROMPT])
    mismatches, accepted, stopped_early = [], [], 0
    for s in range(100):
        new = 3 if s % 2 else 12  # longer runs: later steps start from a compacted cache
        torch.manual_seed(s)
        ref = model.generate(prompt, max_new_tokens=new, do_sample=True, **options)[0, len(PROMPT):].tolist()
        torch.manual_seed(s)
        out = decoder.generate(PROMPT, max_new_tokens=new, do_sample=True, seed=None, **options)
        tree_steps = out.stats.accept_lengths[1:]  # the first token comes from the prefill, never a draft
        accepted.append(np.mean(tree_steps) if tree_steps else 1.0)
        stopped_early += len(out.token_ids) < new
        if out.token_ids != ref:
            mismatches.append((s, ref, out.token_ids))
    assert not mismatches, mismatches[:5]
    if eos is None:
        assert np.mean(accepted) > 1.3
    else:  # generations often end after a token or two here, so acceptance is not the point
        assert stopped_early >= 10 and max(accepted) > 1.0


def test_seed_reproducibility_and_isolation(model, law_a: ExactLaw) -> None:
    decoder = make_decoder(model, law_a)
    run = lambda seed: decoder.generate(PROMPT, max_new_tokens=12, do_sample=True, seed=seed, **SETTING_A).token_ids
    first = [run(s) for s in range(10)]
    global_state = torch.get_rng_state()
    again = [run(s) for s in range(10)]
    assert first == again
    assert len({tuple(x) for x in first}) > 1, "different seeds should give different samples"
    assert torch.equal(global_state, torch.get_rng_state()), "seed= must not touch the global RNG"
    # a fresh decoder (fresh cache, sources) gives the same thing for the same seed
    assert make_decoder(model, law_a).generate(PROMPT, max_new_tokens=12, do_sample=True, seed=3,
                                               **SETTING_A).token_ids == first[3]


# ---------------------------------------------------------------------------------------------
# Every row's choice at once (the accelerator path): the same law
# ---------------------------------------------------------------------------------------------


def test_batched_row_choices_keep_the_plain_sampling_law(model, law_a: ExactLaw) -> None:
    """On an accelerator each step draws one token for *every* tree row on the device (one read per
    step) and then walks the tree over those draws. Forced here on the CPU: setting A (with its
    repetition penalty, applied per row through each node's own path mask) keeps the exact law."""
    decoder = make_decoder(model, law_a)
    decoder.row_choices = "batched"
    counts, mean_accepted = sample(decoder, N_CORRECT, SETTING_A, seed0=60_000)
    pvalue, dof, impossible = chi_square(counts, law_a)
    print(f"\n[batched rows] N={N_CORRECT} p={pvalue:.4g} dof={dof} mean_accepted={mean_accepted:.2f}")
    assert mean_accepted > 1.3
    assert impossible == 0 and pvalue > P_THRESHOLD


def test_chi_square_rejects_batched_rows_that_ignore_each_nodes_path(model, law_a: ExactLaw, monkeypatch) -> None:
    """Teeth for the batched path: penalising every row with the committed tokens only (not the
    tokens on the node's own path) must fail, as the node-by-node mutant does."""
    import specdraft.engine.step

    monkeypatch.setattr(specdraft.engine.step, "_node_masks",
                        lambda step, request, n: None if request.penalty is None else request.penalty.seen.expand(n, -1))
    assert_batched_mutant_is_rejected(model, law_a, 70_000, "committed-only penalty")


def assert_batched_mutant_is_rejected(model, law: ExactLaw, seed0: int, label: str) -> None:
    """Sample through the batched rows (with whatever mutant is patched in) and require the
    chi-square test to reject the law."""
    decoder = make_decoder(model, law)
    decoder.row_choices = "batched"
    counts, _ = sample(decoder, N_MUTANT, SETTING_A, seed0=seed0)
    pvalue, dof, impossible = chi_square(counts, law)
    print(f"\n[batched rows, {label}] N={N_MUTANT} p={pvalue:.4g} impossible={impossible}")
    assert pvalue < P_THRESHOLD


def test_batched_rows_give_one_output_per_seed_whatever_the_drafts(model, law_a: ExactLaw) -> None:
    """On the device path a row's draw is keyed by the position it samples (``RowDraws``), so a
    seed fixes the output: the same with a reused decoder (whose sources learned from earlier
    requests), with fresh sources, and with no drafts at all. Drawn in row order from one stream,
    the output changed with the tree (seen on an H200 with a reused decoder)."""
    reused = make_decoder(model, law_a)
    fresh = lambda: make_decoder(model, law_a)  # noqa: E731
    plain = Decoder(model, sources=[], max_tree_nodes=0)
    for d in (reused, plain):
        d.row_choices = "batched"
    run = lambda dec, s: dec.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=s, **SETTING_A).token_ids  # noqa: E731
    first = [run(reused, s) for s in range(12)]
    assert [run(reused, s) for s in range(12)] == first
    assert [run(plain, s) for s in range(12)] == first
    for s in (0, 5):
        other = fresh()
        other.row_choices = "batched"
        assert run(other, s) == first[s]
    assert len({tuple(x) for x in first}) > 1, "different seeds should give different samples"


def test_chi_square_rejects_batched_rows_that_share_noise_across_positions(model, law_a: ExactLaw,
                                                                          monkeypatch) -> None:
    """Teeth for the positional draws: one noise vector for every position of a step correlates
    consecutive tokens, and the law test must see it."""
    from specdraft.engine.row_draws import RowDraws

    choose = RowDraws.choose
    monkeypatch.setattr(RowDraws, "choose", lambda self, probs, depths, position0: choose(
        self, probs, [0] * len(depths), position0))
    assert_batched_mutant_is_rejected(model, law_a, 80_000, "one noise per step")
