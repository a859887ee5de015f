"""Token Recycling: the adjacency-matrix update, BFS drafting along a template, sharing, copies, errors."""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest

from specdraft.bench.checkpoint import dumps_with_locks
from specdraft.source_spec import SourceSpecError
from specdraft.sources import Context, Feedback, TokenRecycling
from specdraft.sources.registry import SOURCES, make_sources, parse_source_names
from specdraft.sources.token_recycling import PAPER_TREE_PATHS, TEMPLATES, TreeTemplate


def ctx(*tokens: int, request_id: int = 0) -> Context:
    return Context(tokens=list(tokens), prompt_length=1, request_id=request_id)


def feed(source: TokenRecycling, row_tokens, top_ids) -> None:
    source.observe(Feedback(committed=[], context=ctx(0), top_ids=np.asarray(top_ids, dtype=np.int64),
                            row_tokens=np.asarray(row_tokens, dtype=np.int64)))


def rank_paths(template: TreeTemplate) -> list[tuple[int, ...]]:
    """Each node's rank path from the root, as the authors write templates."""
    out: list[tuple[int, ...]] = []
    for parent, rank in zip(template.parents, template.ranks):
        out.append((out[parent] if parent >= 0 else ()) + (rank,))
    return out


# A small template: root -> a (rank 0), b (rank 1); a -> c (rank 0); b -> d (rank 0); c -> e (rank 1).
SMALL = [(-1, 0), (-1, 1), (0, 0), (1, 0), (2, 1)]


# -- the update ---------------------------------------------------------------------------------------


def test_update_writes_each_rows_top_k():
    src = TokenRecycling(k=2, template=[(-1, 0)], vocab_size=20)
    feed(src, [3, 5], [[7, 8, 9], [1, 2, 0]])  # k' = 3 >= k: the first k columns count
    m = src.matrix
    assert m.dtype == np.int32 and m.shape == (20, 2)
    assert m[3].tolist() == [7, 8] and m[5].tolist() == [1, 2]
    assert (m[[0, 1, 2, 4] + list(range(6, 20))] == -1).all()
    feed(src, [3], [[4, 6, 0]])  # the latest candidates replace the old ones
    assert src.matrix[3].tolist() == [4, 6] and src.matrix[5].tolist() == [1, 2]


def test_duplicate_rows_last_wins_like_sequential_updates():
    rows = [4, 2, 4, 9, 2, 4]
    top = [[1, 2], [3, 4], [5, 6], [7, 8], [10, 11], [12, 13]]
    src = TokenRecycling(k=2, template=[(-1, 0)])
    feed(src, rows, top)
    seq = TokenRecycling(k=2, template=[(-1, 0)])
    for r, t in zip(rows, top):
        feed(seq, [r], [t])
    rows_needed = 14
    assert np.array_equal(src.matrix[:rows_needed], seq.matrix[:rows_needed])
    assert src.matrix[4].tolist() == [12, 13] and src.matrix[2].tolist() == [10, 11]


def test_lazy_matrix_grows_to_the_largest_token_and_keeps_what_it_had():
    src = TokenRecycling(k=2, template=[(-1, 0)])
    assert src.matrix.shape == (0, 2) and src.matrix.nbytes == 0
    assert src.propose(ctx(5), 8).branches == []  # nothing seen: no draft, no error
    feed(src, [5], [[3000, 1]])  # a candidate larger than any input row
    assert src.matrix.shape[0] >= 3001 and src.matrix.shape[0] % 1024 == 0
    feed(src, [5000], [[5, 6]])
    m = src.matrix
    assert m.shape[0] >= 5001 and m[5].tolist() == [3000, 1] and m[5000].tolist() == [5, 6]
    assert m.nbytes == m.shape[0] * 2 * 4


def test_fewer_columns_than_k_fill_the_rest_with_empty():
    src = TokenRecycling(k=4, template=[(-1, 0), (-1, 3)])
    feed(src, [1], [[2, 3, 4, 5]])
    feed(src, [1], [[6, 0]])  # top-2 only (a vocabulary below k): the stale ranks 2-3 go
    assert src.matrix[1].tolist() == [6, 0, -1, -1]
    assert src.propose(ctx(1), 8).branches == [[6]]


def test_no_top_ids_is_a_no_op():
    src = TokenRecycling(k=2, template=[(-1, 0)])
    src.observe(Feedback(committed=[1], context=ctx(0, 1)))
    assert src.matrix.shape[0] == 0


def test_bad_feedback_and_tokens_outside_the_vocabulary_are_refused():
    src = TokenRecycling(k=2, template=[(-1, 0)], vocab_size=10)
    with pytest.raises(ValueError, match=r"token id 10, outside the vocabulary of 10 tokens.*0\.\.9"):
        feed(src, [10], [[1, 2]])
    with pytest.raises(ValueError, match=r"token id 12, outside the vocabulary"):
        feed(src, [1], [[12, 2]])
    with pytest.raises(ValueError, match=r"token id -1.*>= 0"):
        feed(src, [-1], [[1, 2]])
    with pytest.raises(ValueError, match=r"root.*token id 10"):
        src.propose(ctx(10), 4)
    with pytest.raises(ValueError, match=r"shapes \(2, 2\) and \(3,\)"):
        feed(src, [1, 2, 3], [[1, 2], [3, 4]])
    assert (src.matrix == -1).all()  # nothing half-applied


# -- drafting -----------------------------------------------------------------------------------------


def small_source(**kwargs) -> TokenRecycling:
    src = TokenRecycling(k=2, template=SMALL, vocab_size=100, **kwargs)
    # root 10 -> [11, 12]; 11 -> [13, 14]; 12 -> [15, 16]; 13 -> [17, 18]
    feed(src, [10, 11, 12, 13], [[11, 12], [13, 14], [15, 16], [17, 18]])
    return src


def test_draft_follows_the_template_in_its_order():
    src = small_source()
    assert src.propose(ctx(1, 10), 100).branches == [[11], [12], [11, 13], [12, 15], [11, 13, 18]]


def test_budget_keeps_the_first_nodes():
    src = small_source()
    for budget in range(0, 7):
        draft = src.propose(ctx(10), budget).branches
        assert draft == [[11], [12], [11, 13], [12, 15], [11, 13, 18]][:budget]
        assert len(draft) <= budget


def test_empty_entries_are_skipped_with_their_subtree():
    src = TokenRecycling(k=2, template=SMALL, vocab_size=100)
    feed(src, [10, 12, 13], [[11, 12], [15, 16], [17, 18]])  # 11 never seen: its subtree (c, e) is empty
    assert src.propose(ctx(10), 100).branches == [[11], [12], [12, 15]]
    assert src.propose(ctx(10), 2).branches == [[11], [12]]
    assert src.propose(ctx(15), 100).branches == []  # the root itself has an empty row
    src.reset()
    assert src.propose(ctx(10), 100).branches == []


def test_empty_entries_are_skipped_after_the_lazy_matrix_grows():
    """Empty parents read an always-empty sentinel row past the last one; growth must keep it empty."""
    src = TokenRecycling(k=2, template=SMALL)
    feed(src, [10], [[11, 12]])
    feed(src, [12, 4000], [[15, 16], [1, 2]])  # grows past 4000; 11 still unseen
    assert src.propose(ctx(10), 100).branches == [[11], [12], [12, 15]]
    assert src.propose(ctx(99_999), 100).branches == []  # a root beyond the matrix: never seen


def test_the_paths_are_a_tree_listed_parents_first():
    rng = np.random.default_rng(0)
    src = TokenRecycling(k=8, template="tr80", vocab_size=50)
    rows = rng.integers(0, 50, size=400)
    top = np.stack([rng.permutation(50)[:8] for _ in rows])
    feed(src, rows, top)
    branches = src.propose(ctx(int(rows[0])), 80).branches
    assert len(branches) == 80  # every row seen: every node exists
    seen = set()
    for path in branches:
        assert len(path) == 1 or tuple(path[:-1]) in seen
        seen.add(tuple(path))
    assert len(seen) == 80
    m = src.matrix
    for path, ranks in zip(branches, rank_paths(TEMPLATES["tr80"])):  # every node = M[parent][rank]
        parent = int(rows[0])
        for token, rank in zip(path, ranks):
            assert token == m[parent, rank]
            parent = token


# -- templates ----------------------------------------------------------------------------------------


def test_named_templates_are_best_first_prefixes_of_the_papers_tree():
    tr80 = TEMPLATES["tr80"]
    assert len(tr80) == 80 and sorted(rank_paths(tr80)) == sorted(PAPER_TREE_PATHS)
    assert rank_paths(tr80)[:8] == [(0,), (1,), (0, 0), (2,), (3,), (0, 1), (1, 0), (0, 0, 0)]
    for name, size in (("tr8", 8), ("tr16", 16), ("tr32", 32)):
        assert rank_paths(TEMPLATES[name]) == rank_paths(tr80)[:size]
    for t in TEMPLATES.values():
        assert all(p < i for i, p in enumerate(t.parents))


def test_from_paths_keeps_the_list_order_parents_first():
    t = TreeTemplate.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    assert list(zip(t.parents, t.ranks)) == [(-1, 0), (-1, 1), (0, 0), (1, 0), (2, 0)]
    with pytest.raises(ValueError, match=r"path \[1, 0\] has no parent \[1\]"):
        TreeTemplate.from_paths([[0], [1, 0]])


# -- sharing and copies -------------------------------------------------------------------------------


def test_threads_updating_and_drafting_see_whole_rows():
    """Each write puts a row v, v+1, ..., v+k-1 under a token; a torn row (half one write, half
    another) or an inconsistent snapshot would break the +1 steps between siblings."""
    k, vocab, tokens = 4, 2000, 40
    src = TokenRecycling(k=k, template=[(-1, 0), (-1, 1), (-1, 2), (-1, 3), (0, 0), (0, 1)], vocab_size=vocab)
    errors: list[str] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            rows = rng.integers(0, tokens, size=16)
            base = rng.integers(0, tokens - k, size=16)  # candidates stay below `tokens`: deep drafts exist
            feed(src, rows, base[:, None] + np.arange(k))

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            draft = src.propose(ctx(int(rng.integers(0, tokens))), 6).branches
            firsts = [b[0] for b in draft if len(b) == 1]
            if firsts and firsts != list(range(firsts[0], firsts[0] + len(firsts))):
                errors.append(f"torn root row {firsts}")
            seconds = [b[1] for b in draft if len(b) == 2]
            if len(seconds) == 2 and seconds[1] != seconds[0] + 1:
                errors.append(f"torn child row {seconds}")

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in range(3, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    m = src.matrix
    written = m[:tokens]
    assert ((written - written[:, :1]) == np.arange(k)).all()  # every row is one whole write
    assert (m[tokens:] == -1).all()


def test_pickle_deepcopy_and_the_bench_copy_keep_the_matrix_and_a_working_lock():
    src = small_source()
    for clone in (pickle.loads(pickle.dumps(src)), copy.deepcopy(src), pickle.loads(dumps_with_locks(src))):
        assert np.array_equal(clone.matrix, src.matrix)
        assert clone.propose(ctx(10), 100).branches == src.propose(ctx(10), 100).branches
        feed(clone, [10], [[50, 51]])  # the copy learns on its own (and its lock works)
        assert clone.propose(ctx(10), 1).branches == [[50]]
        assert src.propose(ctx(10), 1).branches == [[11]]


def test_protocol_attributes_and_memory():
    src = TokenRecycling(k=8, vocab_size=151936)
    assert src.top_k == 8 and src.name == "recycle" and len(src.template) == 16  # the default template, tr16
    assert src.matrix.nbytes == 151936 * 8 * 4  # 4.9 MB for Qwen2.5's vocabulary
    from specdraft.sources.base import DraftSource, source_option
    assert isinstance(src, DraftSource) and source_option(src, "top_k") == 8


# -- bad arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), r"k must be an int >= 1 \(candidates kept per token\), got 0"),
    (dict(k=-3), r"must be an int >= 1 .*, got -3"),
    (dict(k=2.5), r"must be an int >= 1 .*, got 2.5"),
    (dict(k=True), r"must be an int >= 1 .*, got True"),
    (dict(template="tr99"), r"unknown tree template 'tr99'; allowed: tr8, tr16, tr32, tr80"),
    (dict(k=4, template="tr80"), r"'tr80' uses ranks up to 7, so it needs k >= 8, got k=4; .*fit k=4: tr8"),
    (dict(template=[]), r"non-empty list of \(parent_index, rank\) pairs"),
    (dict(template=[(0, 0)]), r"node 0 is \(0, 0\): its parent_index must be -1 \(the root\) or an earlier node"),
    (dict(template=[(-1, 0), (3, 0)]), r"node 1 is \(3, 0\).*0\.\.0"),
    (dict(template=[(-1, -1)]), r"rank must be >= 0"),
    (dict(template=[(-1, 0), (-1, 0)]), r"node 1 is \(-1, 0\), which an earlier node already is"),
    (dict(template=[(-1, 0, 1)]), r"node 0 is \(-1, 0, 1\); each node must be a pair of ints"),
    (dict(template=3), r"template must be a name .* got 3"),
    (dict(vocab_size=0), r"vocab_size must be an int >= 1 or None .* got 0"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenRecycling(**kwargs)


def test_registry_spec_parses_and_builds():
    assert "recycle" in SOURCES
    specs = parse_source_names("prompt,recycle[k=4,template=tr8]")
    assert specs == ["prompt", "recycle[k=4,template=tr8]"]
    _, src = make_sources(specs)
    assert isinstance(src, TokenRecycling) and src.k == 4 and src.template.name == "tr8"
    with pytest.raises(SourceSpecError, match=r"recycle\[k=4,template=tr32\].*needs k >= 8"):
        parse_source_names("recycle[k=4,template=tr32]")
    with pytest.raises(SourceSpecError, match=r"unknown tree template 'nope'"):
        parse_source_names("recycle[template=nope]")
