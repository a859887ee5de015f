"""MultiLevelNGram (ANPD's multi-level n-gram): counts, back-off, chaining, top-b trees, memory, identity.

The references here are deliberately naive: counts, predictions and candidate lists are recomputed
by scanning the whole token stream at every query, so they share no code or data structure with
the incremental implementation.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdraft import Decoder, MultiLevelNGram, PromptLookup
from specdraft.sources import Context, Draft, DraftSource, Feedback
from specdraft.sources.ngram import _BEST, NGramModel
from specdraft.tree import TokenTree

from conftest import VOCAB, RandomGuess, ngram_model_for, reference_greedy, tiny_model

SETTINGS = settings(deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- brute-force references ------------------------------------------------------------------------------


def brute_counts(streams, n):
    """Level-n table {context of n-1 tokens: {next: count}} by counting every window of every stream."""
    pairs = Counter((tuple(s[i - n + 1 : i]), s[i]) for s in streams for i in range(n - 1, len(s)))
    table: dict = {}
    for (ctx, nxt), c in pairs.items():
        table.setdefault(ctx, {})[nxt] = c
    return table


def _followers(streams, ctx):
    """{next token: (count, time of its latest occurrence after ctx)}, time = global position."""
    out: dict = {}
    clock = 0
    m = len(ctx)
    for s in streams:
        for i in range(1, len(s)):
            clock += 1
            if i >= m and tuple(s[i - m : i]) == ctx:
                count, _ = out.get(s[i], (0, 0))
                out[s[i]] = (count + 1, clock)
    return out


def predict(model: NGramModel, tail) -> tuple[int, int] | None:
    """``(token, n)``: the model's prediction after ``tail`` and the level ``n`` that gave it, the
    last ``N-1`` tokens of ``tail`` tried first, then fewer; ``None`` if no level has seen them."""
    tail = tuple(tail)
    get = model._lookup()
    for m in range(min(len(tail), model.max_ngram - 1), 0, -1):
        f = get(tail[len(tail) - m :])
        if f is not None:
            return f[_BEST], m + 1
    return None


def brute_predict(streams, tail, N):
    """(token, n): longest seen context of the last N-1 tokens of tail; most frequent, ties most recent."""
    tail = tuple(tail)
    for m in range(min(len(tail), N - 1), 0, -1):
        f = _followers(streams, tail[len(tail) - m :])
        if f:
            return max(f, key=lambda t: f[t]), m + 1
    return None


def brute_candidates(streams, tail, N, b):
    tail = tuple(tail)
    out: list = []
    for m in range(min(len(tail), N - 1), 0, -1):
        f = _followers(streams, tail[len(tail) - m :])
        for t in sorted(f, key=lambda t: f[t], reverse=True):
            if t not in out and len(out) < b:
                out.append(t)
    return out


def brute_chain(streams, seq, N, K):
    seq, out = list(seq), []
    for _ in range(K):
        p = brute_predict(streams, seq, N)
        if p is None:
            break
        out.append(p[0])
        seq.append(p[0])
    return out


def brute_tree(streams, seq, N, K, b, d):
    """Every path: top-b candidates at depths < d, then the greedy chain, to depth K."""
    paths = set()

    def grow(path):
        if len(path) >= min(d, K):
            paths.add(tuple(path + brute_chain(streams, list(seq) + path, N, K - len(path))))
            return
        cands = brute_candidates(streams, list(seq) + path, N, b)
        if not cands:
            if path:
                paths.add(tuple(path))
            return
        for c in cands:
            grow(path + [c])

    grow([])
    paths.discard(())
    return paths


def run_request(source, prompt, chunks, request_id=1, end=True):
    """Drive a source like the decoder does: begin, observe each committed chunk, end."""
    tokens = list(prompt)
    source.begin(Context(tuple(tokens), len(prompt), request_id))
    for chunk in chunks:
        tokens += chunk
        source.observe(Feedback(committed=list(chunk), context=Context(tuple(tokens), len(prompt), request_id)))
    ctx = Context(tuple(tokens), len(prompt), request_id)
    if end:
        source.end(ctx)
    return ctx


def unique_nodes(branches):
    return TokenTree.from_drafts(0, [branches], 10**9).num_draft_nodes


# -- strategies ------------------------------------------------------------------------------------------


small_tokens = st.integers(3, 8)  # a small alphabet: many repeated contexts and ties
streams = st.lists(small_tokens, min_size=1, max_size=40)
chunk_lists = st.lists(st.lists(small_tokens, min_size=1, max_size=5), max_size=8)


# -- counts ----------------------------------------------------------------------------------------------


@given(prompt=streams, chunks=chunk_lists, N=st.integers(2, 6))
@settings(SETTINGS, max_examples=150)
def test_counts_equal_brute_force_recount(prompt, chunks, N) -> None:
    source = MultiLevelNGram(max_ngram=N)
    ctx = run_request(source, prompt, chunks, end=False)
    stream = list(ctx.tokens)
    model = ngram_model_for(source, 1)
    for n in range(2, N + 1):
        assert model.counts(n) == brute_counts([stream], n), n
    assert model.num_contexts == sum(len(brute_counts([stream], n)) for n in range(2, N + 1))
    # predictions (back-off + tie-break) agree with a scan of the stream, for the real tail and others
    tails = [stream, stream[:-1], stream[-1:], [stream[-1], 3, 4], [8, 8, 8, 8, 8, 8]]
    for tail in tails:
        assert predict(model, tail) == brute_predict([stream], tail, N), tail
    # the state is a pure function of the stream: a fresh source built lazily from the context agrees
    fresh = MultiLevelNGram(max_ngram=N)
    assert fresh.propose(ctx, 32).branches == source.propose(ctx, 32).branches


@given(requests=st.lists(st.tuples(streams, chunk_lists), min_size=1, max_size=4), N=st.integers(2, 5))
@settings(SETTINGS, max_examples=60)
def test_shared_counts_are_the_sum_over_requests_while_within_bounds(requests, N) -> None:
    source = MultiLevelNGram(max_ngram=N, shared=True, max_contexts=10**6, max_followers=10**6)
    full = []
    for rid, (prompt, chunks) in enumerate(requests, start=1):
        full.append(list(run_request(source, prompt, chunks, request_id=rid).tokens))
    model = source.shared_model
    assert source.active_requests == []  # per-request bookkeeping gone, the shared model kept
    for n in range(2, N + 1):
        assert model.counts(n) == brute_counts(full, n)
    for tail in (full[-1], full[0], [3, 3]):
        assert predict(model, tail) == brute_predict(full, tail, N)


def test_counts_small_example() -> None:
    model = NGramModel(max_ngram=3)
    model.add([1, 2, 3, 1, 2, 4])
    assert model.counts(2) == {(1,): {2: 2}, (2,): {3: 1, 4: 1}, (3,): {1: 1}}
    assert model.counts(3) == {(1, 2): {3: 1, 4: 1}, (2, 3): {1: 1}, (3, 1): {2: 1}}
    model.add([1, 2, 3, 1, 2, 4, 1, 2, 3], start=6)  # incremental: only positions 6.. are new
    assert model.counts(3)[(1, 2)] == {3: 2, 4: 1}
    assert model.counts(3)[(2, 4)] == {1: 1}
    with pytest.raises(ValueError):
        model.counts(4)


# -- back-off order, tie-break, chaining -----------------------------------------------------------------


def test_back_off_longest_seen_context_wins() -> None:
    # (1,2,3) -> 9 once; (3,) -> 7 twice. The 4-gram beats the more frequent 2-gram.
    model = NGramModel(max_ngram=4)
    model.add([1, 2, 3, 9, 5, 3, 7, 6, 3, 7])
    assert predict(model, [1, 2, 3]) == (9, 4)
    assert predict(model, [8, 2, 3]) == (9, 3)   # (8,2,3) unseen -> (2,3) seen
    assert predict(model, [8, 8, 3]) == (7, 2)   # only (3,) seen: its most frequent follower
    assert predict(model, [8, 8, 8]) is None      # nothing seen at any level
    assert predict(model, [0, 1, 2, 3]) == (9, 4)  # only the last N-1 tokens matter
    assert predict(model, [3]) == (7, 2)
    # the same through the source: the first drafted token follows the back-off
    # (the source also counts the tail itself: in (.., 8, 8, 8) the pair (8, 8) -> 8 has been seen)
    source = MultiLevelNGram(max_ngram=4, num_tokens=1, top_b=1)
    stream = (1, 2, 3, 9, 5, 3, 7, 6, 3, 7)
    for tail, expected in [((1, 2, 3), 9), ((8, 2, 3), 9), ((8, 8, 3), 7), ((8, 8, 8), 8), ((8,), None)]:
        ctx = Context(stream + tail, len(stream), 1)
        source.begin(Context(stream, len(stream), 1))
        branches = source.propose(ctx, 8).branches
        assert branches == ([[expected]] if expected is not None else []), tail
        source.end(ctx)


def test_ties_go_to_the_most_recent_follower() -> None:
    model = NGramModel(max_ngram=2)
    model.add([5, 1, 5, 2])
    assert predict(model, [5]) == (2, 2)  # 1 and 2 seen once each: 2 is newer
    model.add([5, 1, 5, 2, 5, 1], start=4)
    assert predict(model, [5]) == (1, 2)  # 1 now seen twice
    model.add([5, 1, 5, 2, 5, 1, 5, 2], start=6)
    assert predict(model, [5]) == (2, 2)  # tied again at 2-2: 2 is newer
    assert model.candidates([5], 3) == [2, 1]


def test_chaining_feeds_each_drafted_token_back_into_the_context() -> None:
    # With N=3: after root 4 the 2-token context (3,4) says 5, then (4,5) says 6 ... a 1-token
    # context alone would say 4 -> 9 (more frequent), so the chain must use the drafted tokens.
    prompt = [3, 4, 5, 6, 7, 0, 4, 9, 0, 4, 9, 0, 3, 4]
    source = MultiLevelNGram(max_ngram=3, num_tokens=7, top_b=1)
    ctx = Context(tuple(prompt), len(prompt), 1)
    source.begin(ctx)
    assert source.propose(ctx, 32).branches == [[5, 6, 7, 0, 4, 9, 0]]
    assert source.propose(ctx, 3).branches == [[5, 6, 7]]  # the budget caps K
    assert MultiLevelNGram(max_ngram=2, num_tokens=3, top_b=1).propose(ctx, 32).branches == [[9, 0, 4]]
    # a chain stops where no level matches: 8 was never followed by anything
    model = NGramModel(max_ngram=3)
    model.add([1, 2, 3, 8])
    assert model.draft([1], 7) == [2, 3, 8]
    assert MultiLevelNGram(max_ngram=3).propose(Context((1, 2, 3, 8), 4, 2), 32).branches == []


@given(prompt=streams, chunks=chunk_lists, N=st.integers(2, 5), K=st.integers(1, 9))
@settings(SETTINGS, max_examples=100)
def test_chain_equals_iterated_brute_force_prediction(prompt, chunks, N, K) -> None:
    source = MultiLevelNGram(max_ngram=N, num_tokens=K, top_b=1)
    ctx = run_request(source, prompt, chunks, end=False)
    stream = list(ctx.tokens)
    chain = brute_chain([stream], stream, N, K)
    assert source.propose(ctx, 100).branches == ([chain] if chain else [])


# -- top-b trees -----------------------------------------------------------------------------------------


def test_top_b_tree_shape() -> None:
    # root 1, N=3: (9, 1) unseen, so the 1-token context decides: after 1 came 2 (x3), 5 (x2), 6 (x1).
    # (3, 1) -> {2, 5} once each: 5 is more recent; (7, 1) -> {5, 6}: 6 is more recent.
    prompt = [1, 2, 3, 1, 2, 3, 1, 5, 7, 1, 5, 7, 1, 6, 8, 1, 2, 3, 9, 1]
    ctx = Context(tuple(prompt), len(prompt), 1)
    paper = MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=1).propose(ctx, 32).branches
    assert paper == [[2, 3, 1, 5]]
    two = MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=2).propose(ctx, 32).branches
    assert two == [[2, 3, 1, 5], [5, 7, 1, 6]]
    three = MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=3).propose(ctx, 32).branches
    assert three == [[2, 3, 1, 5], [5, 7, 1, 6], [6, 8, 1, 2]]
    # the budget: the paths share no node here, so 4 + 4 + 2 = 10 cuts the last one to 2 tokens
    assert MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=3).propose(ctx, 10).branches == \
        [[2, 3, 1, 5], [5, 7, 1, 6], [6, 8]]
    assert MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=3).propose(ctx, 3).branches == [[2, 3, 1]]
    # branch_depth=0 is the paper's chain whatever top_b is
    assert MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=3, branch_depth=0).propose(ctx, 32).branches == paper
    # depth 2: after (1, 2) only 3 was ever seen (and after (2,) too), after (1, 5) only 7: nothing to add
    assert MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=2, branch_depth=2).propose(ctx, 32).branches == two
    # depth 3 adds (2, 3) -> 9 (1 is more frequent); depth 4 adds (3, 1) -> 2 and (7, 1) -> 5. Paths
    # come in order of their rank sum (ties: leaving the chain deeper first); shared nodes count once.
    d3 = MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=2, branch_depth=3).propose(ctx, 32).branches
    assert d3 == [[2, 3, 1, 5], [2, 3, 9, 1], [5, 7, 1, 6]]
    d4 = MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=2, branch_depth=4).propose(ctx, 32).branches
    assert d4 == [[2, 3, 1, 5], [2, 3, 1, 2], [2, 3, 9, 1], [5, 7, 1, 6], [5, 7, 1, 5]]
    assert unique_nodes(d4) == 4 + 1 + 2 + 4 + 1
    assert MultiLevelNGram(max_ngram=3, num_tokens=4, top_b=2, branch_depth=4).propose(ctx, 9).branches == \
        [[2, 3, 1, 5], [2, 3, 1, 2], [2, 3, 9, 1], [5, 7]]


@given(prompt=streams, chunks=chunk_lists, N=st.integers(2, 5), K=st.integers(1, 8), b=st.integers(1, 3),
       d=st.integers(0, 3), budget=st.integers(1, 40))
@settings(SETTINGS, max_examples=150)
def test_tree_matches_brute_force_and_respects_the_budget(prompt, chunks, N, K, b, d, budget) -> None:
    source = MultiLevelNGram(max_ngram=N, num_tokens=K, top_b=b, branch_depth=d)
    ctx = run_request(source, prompt, chunks, end=False)
    stream = list(ctx.tokens)
    branches = source.propose(ctx, budget).branches
    assert unique_nodes(branches) <= budget
    assert all(1 <= len(br) <= K for br in branches)
    # no branch is a prefix of another (so none is wasted)
    tuples = [tuple(br) for br in branches]
    assert not any(i != j and s[: len(t)] == t for i, s in enumerate(tuples) for j, t in enumerate(tuples))
    # the first branch is the paper's chain (cut by the budget)
    chain = brute_chain([stream], stream, N, min(K, budget))
    assert (branches[0] if branches else []) == chain
    # with an ample budget every path of the brute-force tree is there, and nothing else
    full = source.propose(ctx, 10**6).branches
    assert {tuple(br) for br in full} == brute_tree([stream], stream, N, K, b if d else 1, d)
    assert len(full) <= (b ** min(d, K) if b > 1 else 1)
    # a budget cut keeps the order: each proposed branch is a prefix of the ample-budget branch at its place
    for br, whole in zip(branches, full):
        assert tuple(whole[: len(br)]) == tuple(br)
    if d == 0 or b == 1:
        assert branches == MultiLevelNGram(max_ngram=N, num_tokens=K, top_b=1).propose(ctx, budget).branches


def test_budget_zero_and_empty_context() -> None:
    source = MultiLevelNGram()
    ctx = Context((1, 2, 1, 2), 4, 1)
    source.begin(ctx)
    assert source.propose(ctx, 0).branches == []
    assert source.propose(ctx, 1).branches == [[1]]
    assert isinstance(source, DraftSource)
    with pytest.raises(ValueError):
        MultiLevelNGram(max_ngram=1)
    with pytest.raises(ValueError):
        MultiLevelNGram(num_tokens=0)
    with pytest.raises(ValueError):
        MultiLevelNGram(top_b=0)


# -- state and memory ------------------------------------------------------------------------------------


def test_per_request_state_is_dropped_at_end() -> None:
    source = MultiLevelNGram()
    a = Context((1, 2, 3, 1, 2), 5, 10)
    b = Context((7, 8, 7), 3, 11)
    source.begin(a)
    source.begin(b)
    assert sorted(source.active_requests) == [10, 11]
    assert ngram_model_for(source, 10) is not ngram_model_for(source, 11)
    assert source.propose(a, 3).branches == [[3, 1, 2]]
    assert source.propose(b, 3).branches == [[8, 7, 8]]  # request 10's tokens are not visible
    source.end(a)
    assert source.active_requests == [11] and ngram_model_for(source, 10) is None
    source.end(b)
    assert source.active_requests == []
    source.end(b)  # ending twice is harmless


def test_decoder_drops_the_state_even_when_a_request_fails() -> None:
    model = tiny_model("llama")
    source = MultiLevelNGram()
    Decoder(model, sources=[source], max_tree_nodes=8).generate([5, 6, 5, 6, 5], max_new_tokens=10)
    assert source.active_requests == []

    class Boom(RandomGuess):
        def propose(self, context, budget):
            if len(context.tokens) > 7:
                raise RuntimeError("boom")
            return Draft()

    with pytest.raises(RuntimeError, match="boom"):
        Decoder(model, sources=[source, Boom(name="boom")]).generate([5, 6, 5, 6, 5], max_new_tokens=10)
    assert source.active_requests == []


def test_live_request_states_are_bounded_without_end() -> None:
    source = MultiLevelNGram(max_requests=3)
    for rid in range(10):
        source.begin(Context((rid, rid + 1, rid), 3, rid))
    assert source.active_requests == [7, 8, 9]
    # an evicted request is rebuilt from its context: same draft as if never evicted
    ctx = Context((0, 1, 0, 1, 0), 3, 0)
    assert source.propose(ctx, 8).branches == MultiLevelNGram().propose(ctx, 8).branches


def test_shared_model_memory_is_bounded_after_many_requests() -> None:
    import random

    rng = random.Random(0)
    source = MultiLevelNGram(shared=True, max_contexts=500, max_followers=3)
    for rid in range(300):
        prompt = [rng.randrange(200) for _ in range(rng.randrange(1, 60))]
        chunks = [[rng.randrange(200) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(0, 10))]
        ctx = run_request(source, prompt, chunks, request_id=rid, end=False)
        source.propose(ctx, 16)
        source.end(ctx)
    model = source.shared_model
    assert model.num_contexts <= 500
    assert all(len(f) <= 3 for n in range(2, 6) for f in model.counts(n).values())
    assert model.num_counters <= 500 * 3
    assert source.active_requests == []
    # what it learnt recently is still there and still drafts
    ctx = run_request(source, [11, 12, 13, 14, 11, 12, 13], [], request_id=999)
    assert source.propose(ctx, 8).branches[0][:3] == [14, 11, 12]
    # the defaults are bounded too
    default = MultiLevelNGram(shared=True)
    assert default.max_contexts and default.max_followers


def test_follower_cap_evicts_the_weakest_and_keeps_the_prediction_exact() -> None:
    model = NGramModel(max_ngram=2, max_followers=2)
    model.add([9, 1, 9, 1, 9, 2, 9, 3])  # 9 -> 1 (x2), then 2, then 3 evicts 2 (lowest count, oldest)
    assert model.counts(2)[(9,)] == {1: 2, 3: 1}
    assert predict(model, [9]) == (1, 2)
    one = NGramModel(max_ngram=2, max_followers=1)
    one.add([9, 1, 9, 1, 9, 2])
    assert one.counts(2)[(9,)] == {2: 1} and predict(one, [9]) == (2, 2)


def test_context_lru_evicts_the_least_recently_updated() -> None:
    model = NGramModel(max_ngram=2, max_contexts=2)
    model.add([1, 2, 1, 3])  # contexts (1,), (2,) ; then (1,) updated again at the end
    assert set(model._table) == {(1,), (2,)}
    model.add([1, 2, 1, 3, 4], start=4)  # new context (3,) evicts (2,), the least recently updated
    assert set(model._table) == {(1,), (3,)}


# -- greedy identity through the Decoder --------------------------------------------------------------------


@st.composite
def prompts(draw, max_len: int = 30):
    length = draw(st.integers(1, max_len))
    kind = draw(st.sampled_from(["random", "repeat", "small_alphabet"]))
    if kind == "random":
        return draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
    if kind == "small_alphabet":
        alphabet = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4, unique=True))
        return draw(st.lists(st.sampled_from(alphabet), min_size=length, max_size=length))
    pattern = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6))
    return (pattern * (length // len(pattern) + 1))[:length]


ngram_configs = st.builds(dict, max_ngram=st.integers(2, 6), num_tokens=st.integers(1, 9), top_b=st.integers(1, 3),
                          branch_depth=st.integers(0, 2), shared=st.booleans())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi", "gpt2", "gemma3"])
@given(prompt=prompts(), n=st.integers(1, 24), budget=st.integers(0, 24), cfg=ngram_configs,
       mix=st.sampled_from(["alone", "alone", "prompt", "prompt+random"]))
@settings(SETTINGS, max_examples=5)
def test_greedy_identity(arch, prompt, n, budget, cfg, mix) -> None:
    model = tiny_model(arch)
    source = MultiLevelNGram(**cfg)
    sources = [source]
    if mix != "alone":
        sources.append(PromptLookup())
    if mix == "prompt+random":
        sources.insert(0, RandomGuess(seed=len(prompt)))
    decoder = Decoder(model, sources=sources, max_tree_nodes=budget)
    out = decoder.generate(prompt, max_new_tokens=n)
    assert out.token_ids == reference_greedy(model, prompt, n)
    assert source.active_requests == []
    if cfg["shared"]:  # a second request drafts from what the first one taught the shared model
        again = decoder.generate(prompt[::-1], max_new_tokens=n)
        assert again.token_ids == reference_greedy(model, prompt[::-1], n)


def test_greedy_identity_with_the_frequency_trie() -> None:
    trie = pytest.importorskip("specdraft.sources.trie")
    model = tiny_model("qwen2")
    cases = [([5, 6, 7, 5, 6, 7, 5, 6], dict()), ([9, 10, 11, 12, 13, 9, 10], dict(top_b=2, branch_depth=2)),
             ([4] * 12, dict(shared=True, max_ngram=3))]
    for prompt, cfg in cases:
        sources = [MultiLevelNGram(**cfg), trie.FrequencyTrie(), PromptLookup()]
        out = Decoder(model, sources=sources, max_tree_nodes=20).generate(prompt, max_new_tokens=24)
        assert out.token_ids == reference_greedy(model, prompt, 24)


def test_ngram_drafts_are_accepted_when_the_output_repeats() -> None:
    """Not only lossless but useful: tiny random models fall into loops, which the n-gram learns at
    runtime (appendix A.8) and then drafts correctly."""
    model = tiny_model("phi")
    prompt = [17, 23, 5, 41, 17, 23, 5]
    ref = reference_greedy(model, prompt, 60)
    source = MultiLevelNGram()
    out = Decoder(model, sources=[source], max_tree_nodes=16, adaptive_budget=False).generate(prompt, max_new_tokens=60)
    assert out.token_ids == ref
    stats = out.stats.per_source["ngram"]
    assert stats.accepted > 0 and out.stats.steps < len(ref)
