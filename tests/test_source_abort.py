"""``abort`` takes back everything a failed request taught a source's cross-request state.

Three sources learn across requests: the shared n-gram table (``MultiLevelNGram(shared=True)``),
the Token Recycling matrix and the suffix tree's global cache. Each test warms a source over
several requests (so there is learnt state to lose), takes a deep snapshot of everything
observable -- for the n-gram also the tie-break stamps, the clock and the LRU order, for Token
Recycling the matrix and its size, for the suffix tree the counts, the cache order and which
responses are still open -- runs one more request (begin, several observes) and aborts it, and
asserts the snapshot and the drafts are what they were. The n-gram table and the suffix tree keep
what running requests taught apart from what finished requests taught (the n-gram's running view,
the suffix tree's open responses), so for them the tests also check that the shared part does not
change while a request runs, and that interleaved requests with one aborted end exactly as a run
without it; Token Recycling writes its shared matrix in place and keeps an undo log, so its caps
are small enough that the aborted request really overwrites and grows it (the tests assert that
it did). The decoder's side (``abort`` called when a request fails) is tested in
``test_failed_request.py``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdraft.sources import Context, Feedback
from specdraft.sources.ngram import _BEST, _BEST_KEY, _CLOCK_MASK, MultiLevelNGram, NGramModel
from specdraft.sources.suffix_tree import SuffixTree
from specdraft.sources.token_recycling import TokenRecycling

from _suffix_checks import check_source, global_counts
from conftest import FAST, ngram_model_for

SEEDS = range(8)


def ctx(tokens, prompt_length: int, rid: int) -> Context:
    return Context(tuple(int(t) for t in tokens), prompt_length, rid)


def stream(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Tokens with repeats (copied runs of earlier tokens), so contexts recur."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.4:
            at = rng.randrange(len(out))
            out += out[at : at + rng.randint(2, 6)]
        else:
            out.append(rng.randrange(vocab))
    return out[:length]


# -- the shared n-gram table -----------------------------------------------------------------------


def ngram_snapshot(src: MultiLevelNGram) -> dict[str, Any]:
    model = src.shared_model
    assert model is not None
    return dict(
        counts={n: model.counts(n) for n in range(2, src.max_ngram + 1)},
        order=list(model._table),
        stats={c: dict(f) for c, f in model._table.items()},  # stamps and the prediction included
        clock=model.clock,
        contexts=model.num_contexts,
        live=src.active_requests,
    )


def ngram_drafts(src: MultiLevelNGram, tails: list[list[int]]) -> list[list[list[int]]]:
    out = []
    for i, tail in enumerate(tails):
        context = ctx(tail, len(tail), 10_000 + i)
        out.append(src.propose(context, 16).branches)
        src.end(context)  # (a state made by propose counts nothing in shared mode)
    return out


def assert_lru_invariant(model: NGramModel) -> None:
    """The table's order is the order of (last update clock, context length), all distinct."""
    # a context's last update stamped the follower it counted with the clock, and evictions never drop that one
    keys = [(max(key & _CLOCK_MASK for t, key in f.items() if t >= 0), len(c)) for c, f in model._table.items()]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert all(key[0] <= model.clock for key in keys)
    if model.max_contexts is not None:
        assert model.num_contexts <= model.max_contexts
    for _, f in model._table.items():
        followers = {t: key for t, key in f.items() if t >= 0}  # (the prediction keys left out)
        assert followers and (model.max_followers is None or len(followers) <= model.max_followers)
        assert f[_BEST_KEY] == max(followers.values()) and followers[f[_BEST]] == f[_BEST_KEY]


def ngram_request(src: MultiLevelNGram, tokens: list[int], prompt: int, rid: int, step: int = 3) -> None:
    """begin + observes (no end)."""
    src.begin(ctx(tokens[:prompt], prompt, rid))
    for i in range(prompt, len(tokens), step):
        src.observe(Feedback(committed=tokens[i : i + step], context=ctx(tokens[: i + step], prompt, rid)))


def warmed_ngram(seed: int, **kwargs: Any) -> tuple[MultiLevelNGram, random.Random]:
    rng = random.Random(seed)
    options = dict(max_ngram=4, shared=True, max_contexts=60, max_followers=2)
    options.update(kwargs)
    src = MultiLevelNGram(**options)
    for rid in range(1, 7):
        tokens = stream(rng, 12, rng.randint(15, 40))
        ngram_request(src, tokens, rng.randint(1, 10), rid)
        src.end(ctx(tokens, 0, rid))
    return src, rng


@pytest.mark.parametrize("seed", SEEDS)
def test_lru_order_is_the_order_of_last_update_and_length(seed: int) -> None:
    """The order of the table is the order of last update (which the bounded table evicts by):
    checked after every update of random streams, with ``add(start=...)`` (history-only first
    positions), tiny caps and one-follower contexts."""
    rng = random.Random(seed)
    for _ in range(60):
        model = NGramModel(rng.randint(2, 6), max_contexts=rng.randint(1, 40),
                           max_followers=rng.choice([1, 2, 3, None]))
        for _ in range(rng.randint(1, 6)):
            tokens = stream(rng, rng.randint(1, 6), rng.randint(0, 30))
            model.add(tokens, rng.randint(0, len(tokens)))
            assert_lru_invariant(model)


@pytest.mark.parametrize("seed", SEEDS)
def test_ngram_abort_restores_the_shared_table_exactly(seed: int) -> None:
    src, rng = warmed_ngram(seed)
    model = src.shared_model
    tails = [stream(rng, 12, 4) for _ in range(6)]
    before, drafts = ngram_snapshot(src), ngram_drafts(src, tails)
    tokens = stream(rng, 14, 45)  # two new tokens: new contexts for sure
    ngram_request(src, tokens, 8, 99)
    during = ngram_snapshot(src)
    assert {**during, "live": []} == before, "a running request changed the shared table"
    view = ngram_model_for(src, 99)  # what it drafts from: the running requests' view over the shared table
    assert any(view.counts(n) != before["counts"][n] for n in before["counts"]), "the request counted nothing"
    src.abort(ctx(tokens, 8, 99))
    assert ngram_snapshot(src) == before
    assert ngram_drafts(src, tails) == drafts
    assert_lru_invariant(model)
    # and it goes on as if the request never was: the same next request leaves the same table
    twin, _ = warmed_ngram(seed)
    for s in (src, twin):
        ngram_request(s, tails[0] * 3, 2, 5)
        s.end(ctx(tails[0] * 3, 2, 5))
    assert ngram_snapshot(src) == ngram_snapshot(twin)


@given(seed=st.integers(0, 10**6), max_ngram=st.integers(2, 6), max_contexts=st.integers(1, 50),
       max_followers=st.sampled_from([1, 2, 3, 8]), vocab=st.integers(2, 20), steps=st.integers(1, 6))
@FAST
def test_ngram_abort_is_exact_for_any_caps(seed, max_ngram, max_contexts, max_followers, vocab, steps) -> None:
    src, rng = warmed_ngram(seed, max_ngram=max_ngram, max_contexts=max_contexts, max_followers=max_followers)
    before = ngram_snapshot(src)
    tokens = stream(rng, vocab, rng.randint(1, 40))
    ngram_request(src, tokens, rng.randint(1, len(tokens)), 99, step=steps)
    src.abort(ctx(tokens, 0, 99))
    assert ngram_snapshot(src) == before


def test_ngram_abort_of_an_unknown_request_and_per_request_mode() -> None:
    src, _ = warmed_ngram(0)
    before = ngram_snapshot(src)
    src.abort(ctx([1, 2, 3], 3, 12345))  # never begun
    assert ngram_snapshot(src) == before
    ngram_request(src, [1, 2, 3, 4, 5, 6], 3, 7)
    src.end(ctx([1, 2, 3, 4, 5, 6], 3, 7))
    after = ngram_snapshot(src)
    assert after != before
    src.abort(ctx([1, 2, 3, 4, 5, 6], 3, 7))  # already ended: nothing to take back
    assert ngram_snapshot(src) == after
    own = MultiLevelNGram()  # per request: abort drops the request's model, like end
    ngram_request(own, [1, 2, 3, 1, 2, 3], 3, 1)
    assert own.active_requests == [1]
    own.abort(ctx([1, 2, 3, 1, 2, 3], 3, 1))
    assert own.active_requests == [] and own.shared_model is None


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_ngram_end_then_abort_of_another_leaves_the_state_after_the_first(seed: int) -> None:
    src, rng = warmed_ngram(seed)
    first, second = stream(rng, 12, 30), stream(rng, 14, 30)
    ngram_request(src, first, 6, 1)
    src.end(ctx(first, 6, 1))
    after_first = ngram_snapshot(src)
    ngram_request(src, second, 6, 2)
    src.abort(ctx(second, 6, 2))
    assert ngram_snapshot(src) == after_first


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_ngram_abort_is_exact_beside_a_request_that_is_live_but_idle(seed: int) -> None:
    """Another request is running (it taught its prompt) but updates nothing while the aborted one
    runs: the table is exactly as it was after that prompt, and the other request goes on."""
    src, rng = warmed_ngram(seed)
    first, second = stream(rng, 12, 30), stream(rng, 14, 30)
    src.begin(ctx(first[:10], 10, 1))
    after_prompt = ngram_snapshot(src)
    ngram_request(src, second, 6, 2)
    src.abort(ctx(second, 6, 2))
    assert ngram_snapshot(src) == after_prompt
    twin, _ = warmed_ngram(seed)
    twin.begin(ctx(first[:10], 10, 1))
    for s in (src, twin):
        for i in range(10, 30, 4):
            s.observe(Feedback(committed=first[i : i + 4], context=ctx(first[: i + 4], 10, 1)))
        s.end(ctx(first, 10, 1))
    assert ngram_snapshot(src) == ngram_snapshot(twin)


@pytest.mark.parametrize("seed", SEEDS)
def test_ngram_abort_among_concurrent_requests_is_as_if_it_never_ran(seed: int) -> None:
    """Interleaved requests, one aborted mid-way and one at the end: the shared table ends exactly as
    a twin's that ran only the requests that ended, and keeps its invariants and bounds."""
    src, rng = warmed_ngram(seed)
    twin, _ = warmed_ngram(seed)
    streams = {rid: stream(rng, 12, 40) for rid in (1, 2, 3)}
    seen = {rid: 5 for rid in streams}
    for rid, tokens in streams.items():
        src.begin(ctx(tokens[:5], 5, rid))
    while any(seen[r] < len(streams[r]) for r in streams):
        rid = rng.choice([r for r in streams if seen[r] < len(streams[r])])
        seen[rid] += rng.randint(1, 4)
        src.observe(Feedback(committed=[], context=ctx(streams[rid][: seen[rid]], 5, rid)))
        if rid == 2 and seen[rid] > 20:
            before = ngram_snapshot(src)
            src.abort(ctx(streams[2][: seen[2]], 5, 2))
            assert ngram_snapshot(src) == {**before, "live": [r for r in before["live"] if r != 2]}
            seen[2] = len(streams[2])
            assert 2 not in src.active_requests
            assert_lru_invariant(src.shared_model)
    src.end(ctx(streams[1], 5, 1))
    src.abort(ctx(streams[3], 5, 3))
    assert src.active_requests == []
    assert_lru_invariant(src.shared_model)
    twin.begin(ctx(streams[1][:5], 5, 1))
    twin.observe(Feedback(committed=[], context=ctx(streams[1], 5, 1)))
    twin.end(ctx(streams[1], 5, 1))
    assert ngram_snapshot(src) == ngram_snapshot(twin)


# -- Token Recycling ---------------------------------------------------------------------------------


def tr_feedback(rng: random.Random, context: Context, vocab: int, k: int, rows: int) -> Feedback:
    """A step's feedback: the root and ``rows - 1`` tree nodes, each with k distinct top ids."""
    row_tokens = np.asarray([context.root] + [rng.randrange(vocab) for _ in range(rows - 1)], dtype=np.int64)
    top = np.asarray([rng.sample(range(vocab), k) for _ in range(rows)], dtype=np.int64)
    return Feedback(committed=[int(context.root)], context=context, top_ids=top, row_tokens=row_tokens)


def tr_request(src: TokenRecycling, rng: random.Random, rid: int, vocab: int, steps: int, end: bool = True,
               high: int | None = None) -> Context:
    tokens = [rng.randrange(vocab) for _ in range(4)]
    context = ctx(tokens, 4, rid)
    src.begin(context)
    for step in range(steps):
        tokens.append(rng.randrange(vocab) if high is None or step != steps // 2 else high)
        context = ctx(tokens, 4, rid)
        src.observe(tr_feedback(rng, context, vocab, src.k, rng.randint(1, 9)))
    if end:
        src.end(context)
    return context


def tr_snapshot(src: TokenRecycling) -> dict[str, Any]:
    return dict(matrix=src._matrix.copy(), shape=src._matrix.shape, live=src.active_requests)


def tr_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["shape"] == b["shape"] and a["live"] == b["live"] and np.array_equal(a["matrix"], b["matrix"])


def tr_drafts(src: TokenRecycling, roots: list[int]) -> list[list[list[int]]]:
    return [src.propose(ctx([5, r], 1, 10_000), 8).branches for r in roots]


def warmed_tr(seed: int, vocab: int = 60, **kwargs: Any) -> tuple[TokenRecycling, random.Random]:
    rng = random.Random(seed)
    src = TokenRecycling(k=4, template="tr8", **kwargs)
    for rid in range(1, 6):
        tr_request(src, rng, rid, vocab, rng.randint(3, 10))
    return src, rng


@pytest.mark.parametrize("seed", SEEDS)
def test_token_recycling_abort_restores_rows_and_size(seed: int) -> None:
    src, rng = warmed_tr(seed)
    before, drafts = tr_snapshot(src), tr_drafts(src, list(range(60)))
    assert before["shape"] == (1024 + 1, 4)
    # a token past the matrix makes it grow mid-request
    context = tr_request(src, rng, 99, 60, 12, end=False, high=1500)
    during = tr_snapshot(src)
    assert during["shape"][0] > before["shape"][0], "the request did not grow the matrix"
    assert not np.array_equal(during["matrix"][:1024], before["matrix"][:1024]), "no row overwritten"
    src.abort(context)
    assert tr_equal(tr_snapshot(src), before)
    assert tr_drafts(src, list(range(60))) == drafts
    assert src.active_requests == 0


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_token_recycling_abort_with_a_fixed_vocabulary_and_a_long_request(seed: int) -> None:
    """A long request that rewrites the same rows logs each row once, and puts them all back."""
    src, rng = warmed_tr(seed, vocab=40, vocab_size=40)
    before = tr_snapshot(src)
    context = tr_request(src, rng, 99, 40, 3000, end=False)
    undo = src.peek_state(99)
    assert undo is not None and undo.logged <= 40
    src.abort(context)
    assert tr_equal(tr_snapshot(src), before)


def test_token_recycling_abort_of_an_unknown_request_and_after_end() -> None:
    src, rng = warmed_tr(1)
    before = tr_snapshot(src)
    src.abort(ctx([1, 2], 1, 12345))
    assert tr_equal(tr_snapshot(src), before)
    context = tr_request(src, rng, 7, 60, 5)  # ended
    after_first = tr_snapshot(src)
    src.abort(context)  # too late: nothing to take back
    assert tr_equal(tr_snapshot(src), after_first)
    context = tr_request(src, rng, 8, 60, 5, end=False)  # end, then abort of another
    src.abort(context)
    assert tr_equal(tr_snapshot(src), after_first)


@pytest.mark.parametrize("seed", SEEDS)
def test_token_recycling_abort_among_requests_that_end_keeps_their_rows(seed: int) -> None:
    """Interleaved requests sharing a few rows, one aborted: every row ends up as the others alone
    would have left it -- their last write, or what was there before -- found by replaying only
    their writes on a copy."""
    rng = random.Random(seed)
    src = TokenRecycling(k=4, template="tr8", vocab_size=12)
    reference = TokenRecycling(k=4, template="tr8", vocab_size=12)
    contexts = {rid: ctx([rid, rid], 1, rid) for rid in (1, 2, 3)}
    for rid, context in contexts.items():
        src.begin(context)
    for _ in range(3000):
        rid = rng.choice([1, 2, 3])
        feedback = tr_feedback(rng, contexts[rid], 12, 4, rng.randint(1, 6))
        src.observe(feedback)
        if rid != 2:
            reference.observe(feedback)
        if rng.random() < 0.01:
            src.peek_state(2).compact()
    assert src.peek_state(2).compacted > 0  # rows overwritten by the others are logged again
    src.end(contexts[1])
    src.abort(contexts[2])
    src.end(contexts[3])
    assert np.array_equal(src.matrix, reference.matrix)


# -- the suffix tree ---------------------------------------------------------------------------------


def suffix_snapshot(src: SuffixTree) -> dict[str, Any]:
    with src._lock:
        ids = list(src._cached)
        opened = [i in src._global._open for i in ids]
    return dict(counts=global_counts(src), sequences=src.cached_sequences(), ids=ids, open=opened,
                cached=src.cached_requests, live=src.active_requests)


def suffix_drafts(src: SuffixTree, tails: list[list[int]]) -> list[list[list[int]]]:
    """What the global tree drafts (``propose`` of a new request would admit it and evict)."""
    out = []
    with src._lock:
        for tail in tails:
            for tree in (True, False):
                draft = src._global.speculate(tail, src.max_spec_tokens, src.max_spec_factor, src.max_spec_offset,
                                              src.min_token_prob, tree)
                out.append(draft.branches())
    return out


def suffix_request(src: SuffixTree, tokens: list[int], prompt: int, rid: int, step: int = 2) -> Context:
    src.begin(ctx(tokens[:prompt], prompt, rid))
    for i in range(prompt, len(tokens), step):
        context = ctx(tokens[:i], prompt, rid)
        src.propose(context, 8)
        src.observe(Feedback(committed=tokens[i : i + step], context=ctx(tokens[: i + step], prompt, rid)))
    return ctx(tokens, prompt, rid)


def warmed_suffix(seed: int, cache: int = 3, requests: int = 5) -> tuple[SuffixTree, random.Random]:
    rng = random.Random(seed)
    src = SuffixTree(max_depth=6, max_cached_requests=cache, min_token_prob=0.05)
    for rid in range(1, requests + 1):
        tokens = stream(rng, 6, rng.randint(10, 30))
        src.end(suffix_request(src, tokens, rng.randint(1, 8), rid))
    return src, rng


@pytest.mark.parametrize("seed", SEEDS)
def test_suffix_abort_restores_the_global_tree(seed: int) -> None:
    src, rng = warmed_suffix(seed)
    tails = [stream(rng, 6, 5) for _ in range(8)]
    before, drafts = suffix_snapshot(src), suffix_drafts(src, tails)
    assert before["cached"] == 3
    tokens = stream(rng, 6, 30)
    context = suffix_request(src, tokens, 6, 99)
    during = suffix_snapshot(src)
    shared = ("sequences", "ids", "open", "cached")
    assert {k: during[k] for k in shared} == {k: before[k] for k in shared}  # it joins the cache at end
    assert during["counts"] != before["counts"]  # but the running requests read it as it grows
    src.abort(context)
    assert suffix_snapshot(src) == before
    assert suffix_drafts(src, tails) == drafts
    check_source(src)
    # had it ended, its response would have joined and the oldest gone
    context = suffix_request(src, tokens, 6, 100)
    src.end(context)
    after = suffix_snapshot(src)
    assert after["ids"][0] != before["ids"][0] and after["sequences"][-1] == tokens[6:]


def test_suffix_abort_among_running_requests_is_as_if_it_never_ran() -> None:
    """Requests interleaved, one of them aborted: the global tree ends as in a run without it."""
    runs = {}
    for with_abort in (False, True):
        rng = random.Random(5)
        src = SuffixTree(max_depth=6, max_cached_requests=2, min_token_prob=0.05)
        src.end(suffix_request(src, stream(rng, 6, 20), 4, 1))
        running = stream(rng, 6, 30)
        src.begin(ctx(running[:4], 4, 2))
        src.observe(Feedback(committed=running[4:10], context=ctx(running[:10], 4, 2)))
        doomed = stream(rng, 6, 20)
        if with_abort:
            context = suffix_request(src, doomed, 4, 3)
        src.observe(Feedback(committed=running[10:20], context=ctx(running[:20], 4, 2)))
        if with_abort:
            src.abort(context)
        src.observe(Feedback(committed=running[20:], context=ctx(running, 4, 2)))
        src.end(ctx(running, 4, 2))
        check_source(src)
        runs[with_abort] = suffix_snapshot(src)
    assert runs[True] == runs[False]
    assert runs[True]["sequences"][-1] == running[4:] and runs[True]["open"] == [False, False]


def test_suffix_abort_of_an_unknown_request_and_end_then_abort_of_another() -> None:
    src, rng = warmed_suffix(2)
    before = suffix_snapshot(src)
    src.abort(ctx([1, 2], 1, 12345))
    assert suffix_snapshot(src) == before
    src.end(suffix_request(src, stream(rng, 6, 20), 5, 50))
    after_first = suffix_snapshot(src)
    assert after_first != before
    context = suffix_request(src, stream(rng, 6, 20), 5, 51)
    src.abort(context)
    assert suffix_snapshot(src) == after_first
    src.abort(context)  # twice: a no-op
    assert suffix_snapshot(src) == after_first


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_suffix_concurrent_requests_join_the_cache_as_they_end(seed: int) -> None:
    src, rng = warmed_suffix(seed, cache=2)
    streams = {rid: stream(rng, 6, 24) for rid in (10, 11, 12)}
    for rid, tokens in streams.items():
        src.begin(ctx(tokens[:4], 4, rid))
    for i in range(4, 24, 4):
        for rid, tokens in streams.items():
            src.observe(Feedback(committed=tokens[i : i + 4], context=ctx(tokens[: i + 4], 4, rid)))
    src.abort(ctx(streams[11], 4, 11))
    src.end(ctx(streams[12], 4, 12))
    src.end(ctx(streams[10], 4, 10))
    check_source(src)
    snap = suffix_snapshot(src)
    assert snap["sequences"] == [streams[12][4:], streams[10][4:]]  # in the order they ended
    assert snap["open"] == [False, False] and snap["live"] == 0


def test_token_recycling_two_failures_undone_last_first_are_exact() -> None:
    """P writes rows, Q overwrites some of them; Q fails, then P fails: the matrix of before both."""
    rng = random.Random(3)
    src, _ = warmed_tr(3, vocab=12, vocab_size=12)
    before = tr_snapshot(src)
    p, q = ctx([1, 1], 1, 1), ctx([2, 2], 1, 2)
    src.begin(p)
    src.begin(q)
    for _ in range(30):
        src.observe(tr_feedback(rng, p, 12, 4, 5))
    for _ in range(30):
        src.observe(tr_feedback(rng, q, 12, 4, 5))
    src.abort(q)
    src.abort(p)
    assert tr_equal(tr_snapshot(src), before)


def test_token_recycling_reset_and_copies_during_a_request() -> None:
    """A reset forgets the request's rows too (abort brings nothing back); a copy taken mid-request
    aborts on its own, like the original."""
    import copy
    import pickle

    rng = random.Random(4)
    src, _ = warmed_tr(4)
    before = tr_snapshot(src)
    context = tr_request(src, rng, 9, 60, 6, end=False)
    twins = [copy.deepcopy(src), pickle.loads(pickle.dumps(src))]
    for twin in twins:
        twin.abort(context)
        assert tr_equal(tr_snapshot(twin), before)
    src.reset()
    src.abort(context)
    assert (src.matrix == -1).all() and src.active_requests == 0
