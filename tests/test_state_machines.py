"""Stateful fuzzing of the data structures that outlive a step: the frequency trie, the multi-level
n-gram model, the Jacobi window and n-gram pool, and the token tree.

Each :class:`hypothesis.stateful.RuleBasedStateMachine` drives one structure through random
interleavings of its public operations (requests begun, observed and ended in any order, direct
insertions, retrievals, prunes) and checks after *every* operation what a service operator relies
on: counts equal a brute-force recount kept next to it, the documented memory bounds hold, nothing
of a finished request is left behind, and every proposed token came from the structure itself.
The brute-force models below share no code with the implementations; where a structure forgets on
purpose (pruning, LRU eviction) the model follows what was forgotten and checks that only the
least frequent / least recent things went.

Runtime is kept modest (a few seconds in all) through ``max_examples`` and
``stateful_step_count``; the structures are small, so a few dozen steps reach their bounds.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specdraft.sources import Context, Feedback
from specdraft.sources.jacobi import JacobiLookahead, NGramPool
from specdraft.sources.ngram import MultiLevelNGram
from specdraft.sources.trie import FrequencyTrie
from specdraft.tree import TokenTree

from conftest import ancestor_block, max_bucket, ngram_model_for

MACHINE = settings(max_examples=100, stateful_step_count=40, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])

#: A small alphabet, so windows and contexts repeat and the structures fill up.
SMALL_VOCAB = 6
tokens_st = st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=0, max_size=12)


def merged_size(branches: list[list[int]]) -> int:
    """Distinct nodes of the prefix tree the branches form (what a budget counts)."""
    return len({tuple(b[: i + 1]) for b in branches for i in range(len(b))})


# ==================================================================================================
# the frequency trie
# ==================================================================================================


class TrieMachine(RuleBasedStateMachine):
    """FrequencyTrie's shared trie against a brute-force dict ``key -> [out, prompt]`` of every window
    counted there.

    The model counts exactly as the paper says (every prefix of every window). A request teaches the
    shared trie only when it ends (its output windows; its prompt is counted in the running part,
    from which ``end`` takes it back), and nothing when it is aborted; drafts read the running part
    too. After an operation that pruned, the model drops what the
    trie dropped -- checking that the survivors' counts are untouched, that within every first-token
    tree nothing dropped was more frequent than anything kept, and that every tree is within
    ``capacity`` and the trie within ``max_nodes``.
    """

    @initialize(branch_length=st.integers(1, 4), decoding_length=st.integers(1, 8), capacity=st.integers(2, 24),
                max_nodes=st.integers(3, 60), prompt_weight=st.sampled_from([1, 10_000]),
                mode=st.sampled_from(["hierarchical", "parallel"]), prune_to=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    def setup(self, branch_length, decoding_length, capacity, max_nodes, prompt_weight, mode, prune_to) -> None:
        self.trie = FrequencyTrie(decoding_length=decoding_length, branch_length=branch_length, capacity=capacity,
                                  max_nodes=max_nodes, prompt_weight=prompt_weight, mode=mode, prune_to=prune_to)
        self.width = branch_length + 1
        self.model: dict[tuple[int, ...], list[int]] = {}
        # per request: [tokens, prompt_length]
        self.requests: dict[int, list] = {}
        self.ids = itertools.count(1)
        self.prunes_before = 0

    # -- the brute-force model --------------------------------------------------------------------

    def _count(self, window) -> None:
        for i in range(1, len(window) + 1):
            self.model.setdefault(tuple(window[:i]), [0, 0])[0] += 1

    def _freq(self, counts) -> float:
        return counts[0] + self.trie.prompt_weight * counts[1]

    def _sync(self) -> None:
        """Compare with the trie; if it pruned, check what went and forget it in the model."""
        snap = self.trie.snapshot()
        new_keys = set(snap) - set(self.model)
        assert not new_keys, f"the trie holds keys nobody inserted: {sorted(new_keys)[:5]}"
        gone = set(self.model) - set(snap)
        pruned = self.trie.prunes > self.prunes_before
        self.prunes_before = self.trie.prunes
        assert pruned or not gone, f"keys vanished without a prune: {sorted(gone)[:5]}"
        for key, counts in snap.items():
            assert counts == tuple(self.model[key]), f"counts of {key}: trie {counts}, recount {self.model[key]}"
        if gone:
            for tree in {k[0] for k in gone}:
                dropped = [self._freq(self.model[k]) for k in gone if k[0] == tree]
                kept = [self._freq(self.model[k]) for k in snap if k[0] == tree]
                assert not kept or max(dropped) <= min(kept), \
                    f"tree {tree}: pruned a node of frequency {max(dropped)} but kept one of {min(kept)}"
            for key in gone:
                self.model.pop(key, None)

    # -- operations ---------------------------------------------------------------------------------

    @rule(prompt=st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=10))
    def begin(self, prompt) -> None:
        rid = next(self.ids)
        self.trie.begin(Context(tuple(prompt), len(prompt), rid))
        self.requests[rid] = [list(prompt), len(prompt)]
        self._sync()

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new=st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=5))
    def observe(self, data, new) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[rid]
        req[0] += new
        self.trie.observe(Feedback(committed=list(new), context=Context(tuple(req[0]), req[1], rid)))
        self._sync()

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), fail=st.booleans())
    def end(self, data, fail) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        tokens, prompt_length = self.requests.pop(rid)
        context = Context(tuple(tokens), prompt_length, rid)
        if fail:
            self.trie.abort(context)
        else:
            self.trie.end(context)
            if len(tokens) > prompt_length:
                for start in range(max(0, prompt_length - self.trie.branch_length), len(tokens) - 1):
                    self._count(tokens[start : start + self.width])
        self._sync()

    @rule(tokens=tokens_st)
    def insert(self, tokens) -> None:
        self.trie.insert(tokens)
        for start in range(len(tokens) - 1):
            self._count(tokens[start:start + self.width])
        self._sync()

    @rule()
    def prune(self) -> None:
        self.trie.prune()
        self._sync()

    @rule(tokens=st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=8), budget=st.integers(0, 10))
    def retrieve(self, tokens, budget) -> None:
        branches = self.trie.propose(Context(tuple(tokens), len(tokens), 0), budget).branches
        k = min(budget, self.trie.decoding_length)
        if self.trie.mode == "hierarchical":
            assert merged_size(branches) <= k
        else:
            assert sum(len(b) for b in branches) <= k
        assert all(branches), "an empty branch was proposed"
        keys = set(self.trie.snapshot(running=True))  # (what the running requests taught is read too)
        assert set(self.model) <= keys
        # every branch continues one matched suffix of the context, inside the trie
        matches = [m for m in range(1, min(self.trie.branch_length, len(tokens)) + 1)
                   if all(tuple(tokens[-m:]) + tuple(b) in keys for b in branches)]
        assert not branches or matches, f"branches {branches} do not continue any suffix of {tokens} in the trie"
        # and something that could be proposed is proposed
        offer = any(tuple(tokens[-m:]) in keys and any(key[:m] == tuple(tokens[-m:]) and len(key) > m for key in keys)
                    for m in range(1, min(self.trie.branch_length, len(tokens)) + 1))
        assert bool(branches) == (offer and k > 0), (tokens, budget, branches)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def structure(self) -> None:
        self.trie.check_invariants()
        sizes = Counter(k[0] for k in self.trie.snapshot())
        assert all(n <= self.trie.capacity for n in sizes.values())
        assert len(self.trie) <= self.trie.max_nodes
        assert self.trie.active_requests == len(self.requests)

    @invariant()
    def no_prompt_count_is_shared(self) -> None:
        assert all(prompt == 0 for _, prompt in self.trie.snapshot().values())


TestTrieMachine = TrieMachine.TestCase
TestTrieMachine.settings = MACHINE


# ==================================================================================================
# the multi-level n-gram model
# ==================================================================================================


def recount(stream, N) -> dict[tuple[int, ...], dict[int, int]]:
    """{context: {next: count}} over every context of 1..N-1 tokens of one stream."""
    table: dict = {}
    for i in range(1, len(stream)):
        for m in range(1, min(N - 1, i) + 1):
            f = table.setdefault(tuple(stream[i - m:i]), {})
            f[stream[i]] = f.get(stream[i], 0) + 1
    return table


def model_table(model) -> dict[tuple[int, ...], dict[int, int]]:
    table: dict = {}
    for n in range(2, model.max_ngram + 1):
        table.update(model.counts(n))
    return table


def brute_chain(stream, tail, N, length) -> list[int]:
    """Chained predictions by rescanning the stream: longest seen context, most frequent, ties to
    the follower seen last."""
    out: list[int] = []
    ctx = list(tail)[-(N - 1):]
    for _ in range(length):
        best = None
        for m in range(min(len(ctx), N - 1), 0, -1):
            want = tuple(ctx[len(ctx) - m:])
            stats: dict[int, list[int]] = {}
            for i in range(m, len(stream)):
                if tuple(stream[i - m:i]) == want:
                    s = stats.setdefault(stream[i], [0, 0])
                    s[0] += 1
                    s[1] = i
            if stats:
                best = max(stats, key=lambda t: tuple(stats[t]))
                break
        if best is None:
            break
        out.append(best)
        ctx = (ctx + [best])[-(N - 1):]
    return out


class NGramMachine(RuleBasedStateMachine):
    """MultiLevelNGram (per request or shared) against recounts of the token streams it was fed."""

    @initialize(N=st.integers(2, 4), K=st.integers(1, 5), top_b=st.integers(1, 3), depth=st.integers(0, 2),
                shared=st.booleans(), bounded=st.booleans(), max_requests=st.integers(1, 4))
    def setup(self, N, K, top_b, depth, shared, bounded, max_requests) -> None:
        kwargs = dict(max_contexts=5, max_followers=2) if bounded else {}
        if shared and not bounded:
            kwargs = dict(max_contexts=10**6, max_followers=10**6)  # never reached: counts stay exact
        self.src = MultiLevelNGram(max_ngram=N, num_tokens=K, top_b=top_b, branch_depth=depth, shared=shared,
                                   max_requests=max_requests, **kwargs)
        self.N, self.bounded, self.shared = N, bounded, shared
        self.streams: dict[int, list[int]] = {}  # live requests
        self.fed: list[list[int]] = []  # every stream the shared model has counted (those of ended requests)
        self.ids = itertools.count(1)

    @rule(prompt=st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=8))
    def begin(self, prompt) -> None:
        rid = next(self.ids)
        self.src.begin(Context(tuple(prompt), len(prompt), rid))
        self.streams[rid] = list(prompt)

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), new=st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=4))
    def observe(self, data, new) -> None:
        rid = data.draw(st.sampled_from(sorted(self.streams)))
        if self.shared and rid not in self.src.active_requests:
            return  # evicted past max_requests: a shared model counts only from here on (documented)
        self.streams[rid] += new
        self.src.observe(Feedback(committed=list(new), context=Context(tuple(self.streams[rid]), 1, rid)))

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), fail=st.booleans())
    def end(self, data, fail) -> None:
        """A shared model learns a request's stream when it ends, nothing of one that fails (nor of
        one whose state was dropped past ``max_requests``)."""
        rid = data.draw(st.sampled_from(sorted(self.streams)))
        stream = self.streams.pop(rid)
        if self.shared and not fail and rid in self.src.active_requests:
            self.fed.append(stream)
        (self.src.abort if fail else self.src.end)(Context(tuple(stream), 1, rid))
        assert rid not in self.src.active_requests

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), budget=st.integers(0, 12))
    def propose(self, data, budget) -> None:
        rid = data.draw(st.sampled_from(sorted(self.streams)))
        if self.shared and rid not in self.src.active_requests:
            return  # see observe
        stream = self.streams[rid]
        branches = self.src.propose(Context(tuple(stream), 1, rid), budget).branches
        assert merged_size(branches) <= budget
        assert all(branches)
        if budget == 0:
            assert branches == []
            return
        model = ngram_model_for(self.src, rid)
        table = model_table(model)
        # every drafted token follows some suffix (of 1..N-1 tokens) of what precedes it in the model
        for branch in branches:
            seq = list(stream) + list(branch)
            for j in range(len(stream), len(seq)):
                assert any(seq[j] in table.get(tuple(seq[j - m:j]), {}) for m in range(1, min(self.N - 1, j) + 1)), \
                    f"drafted token {seq[j]} never followed any suffix of {seq[:j]}"
            assert len(branch) <= self.src.num_tokens
        if not self.bounded and not self.shared and self.src.top_b == 1 and budget > 0:
            expect = brute_chain(stream, stream, self.N, min(self.src.num_tokens, budget))
            assert branches == ([expect] if expect else []), (stream, branches, expect)
        if not self.bounded and not self.shared and budget > 0 and branches:
            # the first branch is always the greedy chain (exactly the top_b = 1 draft)
            expect = brute_chain(stream, stream, self.N, min(self.src.num_tokens, budget))
            assert branches[0] == expect[: len(branches[0])]

    @invariant()
    def counts_and_bounds(self) -> None:
        if not hasattr(self, "src"):
            return
        live = self.src.active_requests
        assert len(live) <= self.src.max_requests
        assert set(live) <= set(self.streams), "a state outlived its request"
        models = [self.src.shared_model] if self.shared else [ngram_model_for(self.src, r) for r in live]
        running: dict = {}  # what the running requests counted (shared mode: their view holds it)
        for rid in live:
            for ctx, f in recount(self.streams[rid], self.N).items():
                for t, c in f.items():
                    running.setdefault(ctx, {})[t] = running.get(ctx, {}).get(t, 0) + c
        if self.shared:
            for rid in live:  # the view holds what the running requests counted, not bounded by the shared caps
                assert set(ngram_model_for(self.src, rid)._table) <= set(running)
        for model in models:
            if self.bounded:
                assert model.num_contexts <= 5
                assert all(len(f) <= 2 for f in model_table(model).values())
        if self.bounded:
            return
        if self.shared:
            expect: dict = {}
            for stream in self.fed:
                for ctx, f in recount(stream, self.N).items():
                    for t, c in f.items():
                        expect.setdefault(ctx, {})[t] = expect.get(ctx, {}).get(t, 0) + c
            assert model_table(self.src.shared_model) == expect
            for rid in live:  # a running request drafts from the shared counts and every running request's
                combined = {ctx: dict(f) for ctx, f in expect.items()}
                for ctx, f in running.items():
                    for t, c in f.items():
                        combined.setdefault(ctx, {})[t] = combined.get(ctx, {}).get(t, 0) + c
                assert model_table(ngram_model_for(self.src, rid)) == combined
        else:
            for rid in live:
                assert model_table(ngram_model_for(self.src, rid)) == recount(self.streams[rid], self.N)


TestNGramMachine = NGramMachine.TestCase
TestNGramMachine.settings = MACHINE


# ==================================================================================================
# the Jacobi n-gram pool and window
# ==================================================================================================


class PoolMachine(RuleBasedStateMachine):
    """NGramPool against a list of entries in recency order (a brute-force LRU)."""

    @initialize(capacity=st.integers(1, 8), per_key=st.integers(1, 3))
    def setup(self, capacity, per_key) -> None:
        self.pool = NGramPool(capacity, per_key)
        self.entries: list[tuple[int, tuple[int, ...]]] = []  # oldest first

    @rule(key=st.integers(0, 3), cont=st.lists(st.integers(0, 3), min_size=1, max_size=2))
    def add(self, key, cont) -> None:
        self.pool.add(key, cont)
        entry = (key, tuple(cont))
        if entry in self.entries:
            self.entries.remove(entry)
            self.entries.append(entry)
            return
        self.entries.append(entry)
        same = [e for e in self.entries if e[0] == key]
        if len(same) > self.pool.per_key:
            self.entries.remove(same[0])
        while len(self.entries) > self.pool.capacity:
            self.entries.pop(0)

    @rule(key=st.integers(0, 3), limit=st.one_of(st.none(), st.integers(0, 4)))
    def get(self, key, limit) -> None:
        expect = [c for k, c in reversed(self.entries) if k == key]
        assert self.pool.get(key, limit) == (expect if limit is None else expect[:limit])

    @invariant()
    def bounded_and_equal(self) -> None:
        if not hasattr(self, "pool"):
            return
        assert len(self.pool) == len(self.entries) <= self.pool.capacity
        assert max_bucket(self.pool) <= self.pool.per_key
        for entry in self.entries:
            assert entry[1] in self.pool.get(entry[0])


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = MACHINE


class JacobiMachine(RuleBasedStateMachine):
    """JacobiLookahead's per-request windows under random steps, with random "model" logits.

    Checks the window's bookkeeping (level shapes while filling and when full, the side block's
    positions and mask: each window token sees exactly one token at each offset 1..its own), the
    pool bounds, that drafts are pool entries under the root within the budget, that every pool
    token came from the context or from the model's (here: the random logits') argmaxes, and that
    nothing is left of a request after ``end``.
    """

    V = 8

    @initialize(window=st.integers(1, 4), ngram=st.integers(3, 5), G=st.integers(1, 3), pool_size=st.integers(1, 12),
                advance=st.sampled_from(["one", "committed"]), reference=st.booleans())
    def setup(self, window, ngram, G, pool_size, advance, reference) -> None:
        self.src = JacobiLookahead(window=window, ngram=ngram, max_candidates=G, pool_size=pool_size, advance=advance,
                                   prompt_as_reference=reference)
        self.requests: dict[int, dict] = {}
        self.ids = itertools.count(1)
        self.rng = np.random.default_rng(0)

    @rule(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=10))
    def begin(self, prompt) -> None:
        rid = next(self.ids)
        self.src.begin(Context(tuple(prompt), len(prompt), rid))
        self.requests[rid] = dict(tokens=list(prompt), plen=len(prompt), seen=set(prompt), pending=None)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), budget=st.integers(0, 8), committed=st.integers(1, 4), blind=st.booleans())
    def step(self, data, budget, committed, blind) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[rid]
        ctx = Context(tuple(req["tokens"]), req["plen"], rid)
        draft = self.src.propose(ctx, budget)
        st_ = self.src.peek_state(rid)
        pool_entries = {(k, c) for k in range(self.V) for c in st_.pool.get(k)}
        assert sum(len(b) for b in draft.branches) <= budget
        assert len(draft.branches) <= self.src.max_candidates
        for b in draft.branches:
            assert any(c[: len(b)] == tuple(b) for k, c in pool_entries if k == ctx.root), \
                f"branch {b} is no pool n-gram of root {ctx.root}"
        side = draft.side_block
        if budget == 0:
            assert side is None and not draft.branches
        else:
            self._check_side_block(side, st_)
        new = [int(t) for t in self.rng.integers(0, self.V, size=committed)]
        logits = None
        if side is not None and not blind:
            logits = torch.from_numpy(self.rng.standard_normal((len(side.tokens), self.V))).float()
            req["seen"].update(int(t) for t in logits.argmax(-1).tolist())
        req["tokens"] += new
        req["seen"].update(new)
        self.src.observe(Feedback(committed=new, context=Context(tuple(req["tokens"]), req["plen"], rid),
                                  side_logits=logits))

    def _check_side_block(self, side, state) -> None:
        W, N = self.src.window, self.src.ngram
        levels = state.levels
        assert 1 <= len(levels) <= N - 1
        if state.filled == N - 2:  # full
            assert len(levels[0]) == W - 1 and all(len(lv) == W for lv in levels[1:])
            assert len(side.tokens) == self.src.side_tokens
        assert side.tokens == [t for lv in levels for t in lv]
        mask = np.asarray(side.mask)
        for i, pos in enumerate(side.positions):
            seen = sorted(side.positions[j] for j in range(len(side.tokens)) if mask[i, j])
            assert seen == list(range(1, pos + 1)), f"side token {i} at offset {pos} sees offsets {seen}"

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def end(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests.pop(rid)
        self.src.end(Context(tuple(req["tokens"]), req["plen"], rid))
        assert self.src.peek_state(rid) is None

    @invariant()
    def pools(self) -> None:
        if not hasattr(self, "src"):
            return
        assert self.src.active_requests == len(self.requests), "a window outlived its request"
        assert all(self.src.peek_state(rid) is not None for rid in self.requests)
        for rid, req in self.requests.items():
            pool = self.src.peek_state(rid).pool
            assert len(pool) <= self.src.pool_size
            assert max_bucket(pool) <= self.src.max_candidates
            for k in range(self.V):
                for cont in pool.get(k):
                    assert len(cont) == self.src.ngram - 1
                    assert {k, *cont} <= req["seen"], "a pool token came from nowhere"


TestJacobiMachine = JacobiMachine.TestCase
TestJacobiMachine.settings = MACHINE


# ==================================================================================================
# the token tree
# ==================================================================================================


def _check_tree(tree: TokenTree) -> None:
    """Structural invariants of any token tree."""
    n = len(tree)
    assert tree.parents[0] == -1 and tree.depth[0] == 0
    seen: set = set()
    for i in range(1, n):
        p = tree.parents[i]
        assert 0 <= p < i, "not topologically ordered"
        assert tree.depth[i] == tree.depth[p] + 1
        assert tree.child(p, tree.tokens[i]) == i
        assert (p, tree.tokens[i]) not in seen, "two siblings carry the same token"
        seen.add((p, tree.tokens[i]))
    assert np.array_equal(tree.ancestor_mask(), ancestor_block(tree.parents))
    assert np.array_equal(tree.position_offsets(), np.asarray(tree.depth))
    for i in range(1, n):
        assert sorted(tree.children(i)) == [j for j in range(n) if tree.parents[j] == i]


@settings(MACHINE)
@given(root=st.integers(0, 4),
       drafts=st.lists(st.lists(st.lists(st.integers(0, 4), max_size=5), max_size=4), max_size=4),
       budget=st.integers(0, 12))
def test_from_drafts_is_the_full_merge_cut_to_its_budget(root, drafts, budget) -> None:
    """TokenTree.from_drafts against an unbudgeted merge cut to its first ``budget`` nodes; every
    node's bits name exactly the sources whose branches pass through it."""
    tree = TokenTree.from_drafts(root, drafts, budget)
    full = TokenTree.from_drafts(root, drafts, 10**6)
    assert tree.num_draft_nodes == min(budget, full.num_draft_nodes)
    n = len(tree)
    assert (tree.tokens, tree.parents, tree.depth, tree.sources) == \
           (full.tokens[:n], full.parents[:n], full.depth[:n], full.sources[:n])
    _check_tree(tree)
    _check_tree(full)
    for i in range(1, len(full)):
        path = tuple(full.tokens[j] for j in full.path_to(i))
        bits = sum(1 << s for s, branches in enumerate(drafts)
                   if any(tuple(b[: len(path)]) == path for b in branches))
        assert full.sources[i] == bits
