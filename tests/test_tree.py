"""TokenTree: prefix merging, node budget, best-first merging of sources by value, masks, positions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.tree import TokenTree, prior_rate

from conftest import FAST, add_branch, ancestor_block, reference_merge


def brute_force_mask(tree: TokenTree) -> np.ndarray:
    """mask[i, j] iff j is on the root path of i (i included), by walking parent pointers."""
    return ancestor_block(tree.parents)


def node_sequences(tree: TokenTree) -> dict[tuple[int, ...], int]:
    """Every node's token path from the root (root excluded) -> node index."""
    return {tuple(tree.tokens[j] for j in tree.path_to(i)): i for i in range(len(tree))}


def check_invariants(tree: TokenTree) -> None:
    n = len(tree)
    assert tree.parents[0] == -1 and tree.depth[0] == 0
    for i in range(1, n):
        p = tree.parents[i]
        assert 0 <= p < i, "insertion order must be topological"
        assert tree.depth[i] == tree.depth[p] + 1
        assert tree.child(p, tree.tokens[i]) == i
    # no two siblings carry the same token (prefixes are merged)
    for i in range(n):
        kids = tree.children(i)
        assert len({tree.tokens[c] for c in kids}) == len(kids)
        assert all(tree.parents[c] == i for c in kids)
    assert sum(len(tree.children(i)) for i in range(n)) == n - 1
    np.testing.assert_array_equal(tree.ancestor_mask(), brute_force_mask(tree))
    np.testing.assert_array_equal(tree.position_offsets(), np.asarray(tree.depth))
    assert tree.position_offsets().dtype == np.int64
    assert tree.num_draft_nodes == n - 1


# -- examples --------------------------------------------------------------------------------------


def test_root_only() -> None:
    tree = TokenTree(7)
    assert len(tree) == 1 and tree.num_draft_nodes == 0
    assert tree.tokens == [7] and tree.branches() == []
    assert tree.path_to(0) == []
    np.testing.assert_array_equal(tree.ancestor_mask(), [[True]])
    np.testing.assert_array_equal(tree.position_offsets(), [0])
    check_invariants(tree)


def test_prefix_merging() -> None:
    tree = TokenTree(0)
    assert add_branch(tree, [1, 2, 3]) == 3
    assert add_branch(tree, [1, 2, 4]) == 1  # shares [1, 2]
    assert add_branch(tree, [1, 2]) == 0  # a prefix of an existing branch adds nothing
    assert add_branch(tree, [5]) == 1
    assert add_branch(tree, [1, 2, 3]) == 0  # a duplicate adds nothing
    assert len(tree) == 6
    assert tree.tokens == [0, 1, 2, 3, 4, 5]
    assert tree.parents == [-1, 0, 1, 2, 2, 0]
    assert tree.depth == [0, 1, 2, 3, 3, 1]
    assert sorted(tree.branches()) == [[1, 2, 3], [1, 2, 4], [5]]
    assert tree.children(2) == [3, 4]  # insertion order
    assert tree.child(0, 1) == 1 and tree.child(0, 9) is None
    check_invariants(tree)


def test_same_token_at_different_depths_is_not_merged() -> None:
    tree = TokenTree(3)
    add_branch(tree, [3, 3, 3])  # the root's own token repeated: three distinct nodes
    add_branch(tree, [4, 3])
    assert tree.tokens == [3, 3, 3, 3, 4, 3]
    assert tree.depth == [0, 1, 2, 3, 1, 2]
    check_invariants(tree)


def test_path_to() -> None:
    tree = TokenTree(0)
    add_branch(tree, [1, 2, 3])
    add_branch(tree, [1, 9])
    add_branch(tree, [8, 7])
    assert tree.path_to(0) == []
    assert tree.path_to(3) == [1, 2, 3]
    assert tree.path_to(4) == [1, 4]
    assert tree.path_to(6) == [5, 6]
    assert [tree.tokens[j] for j in tree.path_to(6)] == [8, 7]


def test_ancestor_mask_example() -> None:
    tree = TokenTree(0)
    add_branch(tree, [1, 2])
    add_branch(tree, [3])
    add_branch(tree, [1, 4])
    # nodes: 0 root, 1:(1) 2:(1,2) 3:(3) 4:(1,4)
    expected = np.array([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ], dtype=bool)
    np.testing.assert_array_equal(tree.ancestor_mask(), expected)
    np.testing.assert_array_equal(tree.position_offsets(), [0, 1, 2, 1, 2])


def test_from_drafts_equal_sources_share_in_turns() -> None:
    a = [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    b = [[4, 4, 4], [5, 5, 5]]
    c = [[6, 6, 6]]
    # under the prior every source is worth the same: equal values go in turns (first branch of
    # every source, then the second, ...), and a source's later siblings are worth less
    tree = TokenTree.from_drafts(0, [a, b, c], max_nodes=100)
    assert [tree.tokens[k] for k in tree.children(0)] == [1, 4, 6, 2, 5, 3]
    tree = TokenTree.from_drafts(0, [a, b, c], max_nodes=3)
    assert tree.branches() == [[1], [4], [6]]
    for i in range(1, len(tree)):
        assert tree.sources[i] == 1 << {1: 0, 4: 1, 6: 2}[tree.tokens[i]]
        assert tree.proposers[i] == ((i - 1, 0),)


def _rates(table: dict[int, float]):
    """A rate function: a fixed rate per source, whatever the depth and rank."""
    return lambda source, depth, rank: table[source]


def test_from_drafts_good_source_listed_last_fills_the_budget() -> None:
    junk = [[90 + i, 91, 92, 93] for i in range(4)]
    good = [[1, 2, 3, 4, 5, 6, 7, 8]]
    tree = TokenTree.from_drafts(0, [junk, good], max_nodes=6, rate=_rates({0: 0.05, 1: 0.9}))
    assert tree.branches() == [[1, 2, 3, 4, 5, 6]]
    assert all(s == 0b10 for s in tree.sources[1:])
    # once the good chain's value drops below the junk's first node, the junk comes in
    tree = TokenTree.from_drafts(0, [junk, good], max_nodes=40, rate=_rates({0: 0.05, 1: 0.9}))
    assert tree.tokens[1:9] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_from_drafts_agreement_is_evidence() -> None:
    # the node both sources propose combines their rates (noisy-or) and outranks either alone
    tree = TokenTree.from_drafts(0, [[[5], [7]], [[6], [7]]], max_nodes=1, rate=_rates({0: 0.3, 1: 0.3}))
    assert tree.tokens == [0, 7] and tree.sources[1] == 0b11
    assert tree.proposers[1] == ((0, 1), (1, 1))


def test_prefix_is_the_smaller_budget_and_knows_its_full_tree() -> None:
    drafts = [[[1, 2, 3], [1, 4]], [[5, 6], [1, 2, 9]]]
    full = TokenTree.from_drafts(0, drafts, max_nodes=100)
    for n in range(0, 9):
        cut = full.prefix(n)
        ref = TokenTree.from_drafts(0, drafts, max_nodes=n)
        assert (cut.tokens, cut.parents, cut.depth, cut.sources, cut.proposers) == \
               (ref.tokens, ref.parents, ref.depth, ref.sources, ref.proposers)
        assert cut.full is full
        check_invariants(cut)
    assert full.prefix(3).prefix(1).full is full
    with pytest.raises(ValueError, match="max_nodes"):
        full.prefix(-1)


def test_from_drafts_budget_zero_and_empty() -> None:
    tree = TokenTree.from_drafts(5, [[[1, 2]], [[3]]], max_nodes=0)
    assert len(tree) == 1 and tree.tokens == [5]
    tree = TokenTree.from_drafts(5, [], max_nodes=10)
    assert len(tree) == 1
    tree = TokenTree.from_drafts(5, [[], [[]], [[1]]], max_nodes=10)
    assert tree.branches() == [[1]]
    assert tree.sources[1] == 1 << 2
    with pytest.raises(ValueError, match="max_nodes"):
        TokenTree.from_drafts(5, [[[1]]], max_nodes=-1)


def test_from_drafts_names_too_many_sources() -> None:
    with pytest.raises(ValueError, match="at most 62 sources.*got 63"):
        TokenTree.from_drafts(0, [[]] * 62 + [[[1]]], max_nodes=5)
    # silent sources past the 62nd cost nothing and break nothing
    assert TokenTree.from_drafts(0, [[[1]]] + [[]] * 70, max_nodes=5).tokens == [0, 1]


def test_from_drafts_merges_across_sources() -> None:
    tree = TokenTree.from_drafts(0, [[[1, 2, 3]], [[1, 2, 4]], [[1, 2, 3]]], max_nodes=10)
    assert len(tree) == 5
    assert tree.sources[1] == tree.sources[2] == 0b111
    assert tree.sources[3] == 0b101
    assert tree.sources[4] == 0b010


# -- properties ------------------------------------------------------------------------------------

_tok = st.integers(0, 7)  # a small alphabet, so branches collide and share prefixes often
_branch = st.lists(_tok, min_size=0, max_size=6)
_source = st.lists(_branch, min_size=0, max_size=5)


_rate_table = st.lists(st.sampled_from([0.0, 0.05, 0.2, 0.5, 0.9, 1.0]), min_size=4 * 3 * 2, max_size=4 * 3 * 2)


def _table_rate(table: list[float]):
    return lambda source, depth, rank: table[(source * 3 + min(depth, 3) - 1) * 2 + min(rank, 1)]


@settings(FAST, max_examples=300)
@given(root=_tok, sources=st.lists(_source, min_size=0, max_size=4), budget=st.integers(0, 30),
       table=st.one_of(st.none(), _rate_table))
def test_from_drafts_matches_brute_force(root, sources, budget, table) -> None:
    rate = prior_rate if table is None else _table_rate(table)
    tree = TokenTree.from_drafts(root, sources, budget, rate if table is not None else None)
    check_invariants(tree)
    assert tree.tokens[0] == root
    assert tree.num_draft_nodes <= budget
    seqs = node_sequences(tree)
    expected, order = reference_merge(sources, budget, rate)
    assert set(seqs) - {()} == set(expected)
    for seq, node in seqs.items():
        if seq:
            bits = {i for i in range(62) if tree.sources[node] >> i & 1}
            assert bits == expected[seq], seq
    # prefix-closed: every node's parent path is itself a node
    for seq in seqs:
        assert seq[:-1] in seqs
    # with an unlimited budget every inserted branch is present in full
    full = TokenTree.from_drafts(root, sources, 10_000, rate if table is not None else None)
    full_seqs = node_sequences(full)
    for branches in sources:
        for b in branches:
            assert tuple(b) in full_seqs
    # a smaller budget gives a prefix of the same construction (same nodes, same order, same
    # attribution), and so does cutting the full tree
    n = len(tree)
    assert (full.tokens[:n], full.parents[:n], full.sources[:n], full.proposers[:n]) == \
           (tree.tokens, tree.parents, tree.sources, tree.proposers)
    cut = full.prefix(budget)
    assert (cut.tokens, cut.parents, cut.sources) == (tree.tokens, tree.parents, tree.sources)


@settings(FAST, max_examples=300)
@given(root=_tok, branches=st.lists(_branch, max_size=8), budget=st.integers(0, 40))
def test_single_source_budget_keeps_prefixes(root, branches, budget) -> None:
    tree = TokenTree.from_drafts(root, [branches], budget)
    check_invariants(tree)
    seqs = node_sequences(tree)
    # a missing node can only be due to the budget
    if any(tuple(b) not in seqs for b in branches):
        assert tree.num_draft_nodes == budget
    assert len(seqs) - 1 == tree.num_draft_nodes
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        path = set(tree.path_to(i)) | {0}
        assert set(np.flatnonzero(mask[i]).tolist()) == path
        assert tree.position_offsets()[i] == len(tree.path_to(i))
    # leaves are exactly the branches
    assert sorted(map(tuple, tree.branches())) == sorted(
        s for s, i in seqs.items() if s and not tree.children(i))


def test_pickle_keeps_the_full_tree() -> None:
    import pickle

    full = TokenTree.from_drafts(0, [[[1, 2]], [[1, 3]]], 5)
    cut = pickle.loads(pickle.dumps(full.prefix(1)))
    assert cut.tokens == [0, 1] and cut.proposers[1] == ((0, 0), (1, 0))
    assert cut.full.tokens == full.tokens and cut.full.full is None
