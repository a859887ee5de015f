"""A test-scale soak: thousands of short requests through one set of shared sources.

A service keeps its draft sources for days. What must hold after any number of requests: every
source that learns across requests stays within its documented cap (the trie's ``capacity`` per
first-token tree and ``max_nodes`` in all, the shared n-gram's ``max_contexts`` /
``max_followers``), nothing per-request survives its request (trie prompt counts, n-gram states,
Jacobi windows and pools), each request's Jacobi pool stays within ``pool_size`` while it runs,
and greedy output stays exactly ``model.generate``'s however much the sources have learnt.

The caps are set small here so that 2000 requests hit them many times over; the long version,
with RSS recorded, is ``benchmarks/soak.py`` (results in ``docs/reliability.md``).
"""

from __future__ import annotations

import numpy as np
import pytest

from specdraft import Decoder
from specdraft.sources import Context, Draft, Feedback
from specdraft.sources.jacobi import JacobiLookahead
from specdraft.sources.ngram import MultiLevelNGram
from specdraft.sources.prompt_lookup import PromptLookup
from specdraft.sources.trie import FrequencyTrie

from conftest import VOCAB, max_bucket, reference_greedy, tiny_model

N_REQUESTS = 2000
CHECK_EVERY = 100
GREEDY_CHECK_EVERY = 3  # compare every 3rd greedy request with model.generate

TRIE = dict(decoding_length=16, branch_length=4, capacity=48, max_nodes=600)
NGRAM_SHARED = dict(max_contexts=300, max_followers=4)
POOL_SIZE = 24


def live(source) -> int:
    """Requests a source holds state for (``active_requests`` is an int or a list of ids)."""
    value = source.active_requests
    return value if isinstance(value, int) else len(value)


class PoolProbe:
    """A no-draft source listed after Jacobi: at every step it reads the running request's Jacobi
    state and records its pool size, so the per-request bound is checked *during* requests."""

    name = "probe"

    def __init__(self, jacobi: JacobiLookahead) -> None:
        self.jacobi = jacobi
        self.largest_pool = 0
        self.largest_bucket = 0
        self.steps = 0

    def begin(self, context: Context) -> None:
        pass

    def propose(self, context: Context, budget: int) -> Draft:
        state = self.jacobi.peek_state(context.request_id)
        assert state is not None, "Jacobi has no window for a running request"
        self.largest_pool = max(self.largest_pool, len(state.pool))
        self.largest_bucket = max(self.largest_bucket, max_bucket(state.pool))
        self.steps += 1
        return Draft()

    def observe(self, feedback: Feedback) -> None:
        pass

    def end(self, context: Context) -> None:
        pass


def check_bounds(trie: FrequencyTrie, shared: MultiLevelNGram, sources: list) -> None:
    assert len(trie) <= TRIE["max_nodes"]
    assert max(trie.tree_sizes().values(), default=0) <= TRIE["capacity"]
    model = shared.shared_model
    assert model.num_contexts <= NGRAM_SHARED["max_contexts"]
    assert model.num_counters <= NGRAM_SHARED["max_contexts"] * NGRAM_SHARED["max_followers"]
    for source in sources:
        if hasattr(source, "active_requests"):
            assert live(source) == 0, f"{source.name} kept per-request state after its requests ended"
    # no prompt count of a finished request is left in the trie
    assert all(prompt == 0 for _, prompt in trie.snapshot().values())


@pytest.mark.usefixtures("single_thread")
def test_soak_thousands_of_requests_stay_bounded_and_exact() -> None:
    model = tiny_model("llama")
    eos = int(model.generation_config.eos_token_id)
    trie = FrequencyTrie(**TRIE)
    shared = MultiLevelNGram(shared=True, name="ngram-shared", **NGRAM_SHARED)
    jacobi = JacobiLookahead(pool_size=POOL_SIZE)
    probe = PoolProbe(jacobi)
    sources = [PromptLookup(), trie, MultiLevelNGram(), shared, jacobi, probe]
    decoders = [Decoder(model, sources=sources, max_tree_nodes=16),  # the adaptive budget
                Decoder(model, sources=sources, max_tree_nodes=8, adaptive_budget=False)]  # always drafts
    rng = np.random.default_rng(2024)
    small_vocab = np.arange(3, 15)  # a small vocabulary, so windows repeat and the caps are reached
    greedy = sampled = checked = new_tokens = 0
    for i in range(N_REQUESTS):
        prompt = [int(t) for t in rng.choice(small_vocab, size=int(rng.integers(1, 13)))]
        if rng.random() < 0.05:
            prompt[int(rng.integers(0, len(prompt)))] = eos  # an EOS inside the prompt does not stop anything
        n = int(rng.integers(1, 9))
        dec = decoders[i % 2]
        if rng.random() < 0.3:
            out = dec.generate(prompt, max_new_tokens=n, do_sample=True, seed=i)
            sampled += 1
        else:
            out = dec.generate(prompt, max_new_tokens=n)
            if greedy % GREEDY_CHECK_EVERY == 0:
                assert out.token_ids == reference_greedy(model, prompt, n), f"request {i}: {prompt}, {n}"
                checked += 1
            greedy += 1
        tokens = out.token_ids
        assert 1 <= len(tokens) <= n and all(0 <= t < VOCAB for t in tokens)
        assert len(tokens) == n or tokens[-1] == eos
        new_tokens += len(tokens)
        if (i + 1) % CHECK_EVERY == 0:
            check_bounds(trie, shared, sources)
    check_bounds(trie, shared, sources)
    trie.check_invariants()
    # the caps were reached and enforced, not merely never approached
    assert trie.prunes > 0 and trie.pruned_nodes > 0
    assert shared.shared_model.num_contexts == NGRAM_SHARED["max_contexts"]
    assert probe.steps > 0 and 0 < probe.largest_pool <= POOL_SIZE
    assert probe.largest_bucket <= jacobi.max_candidates
    assert greedy > 1000 and sampled > 400 and checked > 300 and new_tokens > 5000
