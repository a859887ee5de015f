"""TokenTree: prefix merging, node budget, round-robin merging of sources, masks, positions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.tree import TokenTree

from conftest import FAST


def brute_force_mask(tree: TokenTree) -> np.ndarray:
    """mask[i, j] iff j is on the root path of i (i included), by walking parent pointers."""
    n = len(tree)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = tree.parents[j]
    return mask


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
    assert tree.add_branch([1, 2, 3]) == 3
    assert tree.add_branch([1, 2, 4]) == 1  # shares [1, 2]
    assert tree.add_branch([1, 2]) == 0  # a prefix of an existing branch adds nothing
    assert tree.add_branch([5]) == 1
    assert tree.add_branch([1, 2, 3]) == 0  # a duplicate adds nothing
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
    tree.add_branch([3, 3, 3])  # the root's own token repeated: three distinct nodes
    tree.add_branch([4, 3])
    assert tree.tokens == [3, 3, 3, 3, 4, 3]
    assert tree.depth == [0, 1, 2, 3, 1, 2]
    check_invariants(tree)


def test_path_to() -> None:
    tree = TokenTree(0)
    tree.add_branch([1, 2, 3])
    tree.add_branch([1, 9])
    tree.add_branch([8, 7])
    assert tree.path_to(0) == []
    assert tree.path_to(3) == [1, 2, 3]
    assert tree.path_to(4) == [1, 4]
    assert tree.path_to(6) == [5, 6]
    assert [tree.tokens[j] for j in tree.path_to(6)] == [8, 7]


def test_ancestor_mask_example() -> None:
    tree = TokenTree(0)
    tree.add_branch([1, 2])
    tree.add_branch([3])
    tree.add_branch([1, 4])
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


def test_max_new_nodes_cut_keeps_prefix_closed() -> None:
    tree = TokenTree(0)
    assert tree.add_branch([1, 2, 3, 4, 5], max_new_nodes=2) == 2
    assert tree.branches() == [[1, 2]]
    # shared nodes cost nothing: [1, 2] exists, so 2 new nodes buy [3, 6]
    assert tree.add_branch([1, 2, 3, 6, 7], max_new_nodes=2) == 2
    assert tree.branches() == [[1, 2, 3, 6]]
    assert tree.add_branch([9], max_new_nodes=0) == 0
    assert len(tree) == 5
    check_invariants(tree)


def test_add_branch_rejects_bad_source_index() -> None:
    tree = TokenTree(0)
    with pytest.raises(ValueError, match="source_index"):
        tree.add_branch([1], source_index=62)
    with pytest.raises(ValueError, match="source_index"):
        tree.add_branch([1], source_index=-1)


def test_source_bits() -> None:
    tree = TokenTree(0)
    tree.add_branch([1, 2, 3], source_index=0)
    tree.add_branch([1, 2, 4], source_index=2)
    tree.add_branch([1], source_index=5)
    assert tree.sources[0] == 0  # the root is nobody's draft
    assert tree.sources[1] == (1 << 0) | (1 << 2) | (1 << 5)
    assert tree.sources[2] == (1 << 0) | (1 << 2)
    assert tree.sources[3] == 1 << 0
    assert tree.sources[4] == 1 << 2
    tree.add_branch([1, 2, 3], source_index=61)
    assert tree.sources[3] == (1 << 0) | (1 << 61)


def test_shared_prefix_attributed_even_when_budget_cuts() -> None:
    tree = TokenTree(0)
    tree.add_branch([1, 2], source_index=0)
    assert tree.add_branch([1, 2, 3], source_index=1, max_new_nodes=0) == 0
    assert tree.sources[1] == tree.sources[2] == 0b11


def test_from_drafts_round_robin() -> None:
    a = [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    b = [[4, 4, 4], [5, 5, 5]]
    c = [[6, 6, 6]]
    tree = TokenTree.from_drafts(0, [a, b, c], max_nodes=100)
    # branch 0 of every source, then branch 1 of every source, ...
    firsts = [tree.tokens[k] for k in tree.children(0)]
    assert firsts == [1, 4, 6, 2, 5, 3]
    # a budget of 9 nodes is exactly the first round: every source gets its best branch
    tree = TokenTree.from_drafts(0, [a, b, c], max_nodes=9)
    assert sorted(tree.branches()) == [[1, 1, 1], [4, 4, 4], [6, 6, 6]]
    # with 7 nodes the third source still gets its first token before anyone's second branch
    tree = TokenTree.from_drafts(0, [a, b, c], max_nodes=7)
    assert tree.branches() == [[1, 1, 1], [4, 4, 4], [6]]
    for i in range(1, len(tree)):
        owner = {1: 0, 4: 1, 6: 2}[tree.tokens[tree.path_to(i)[0]]]
        assert tree.sources[i] == 1 << owner


def test_from_drafts_one_greedy_source_cannot_crowd_out_others() -> None:
    # fairness is per branch: the hog's long first branch cannot push out the other source's first
    # branch, nor (after one more round) its second
    hog = [[10 + i] * 8 for i in range(10)]
    small = [[3], [4]]
    tree = TokenTree.from_drafts(0, [hog, small], max_nodes=12)
    assert tree.num_draft_nodes == 12
    assert tree.branches() == [[10] * 8, [3], [11] * 3]
    tree = TokenTree.from_drafts(0, [hog, small], max_nodes=18)
    assert [3] in tree.branches() and [4] in tree.branches()


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


def _reference_merge(root: int, sources: list[list[list[int]]], budget: int):
    """Brute force: node sequences (as tuples) that from_drafts must create, and their source sets,
    simulating the round-robin order and the budget one token at a time."""
    nodes: dict[tuple[int, ...], set[int]] = {(): set()}
    created = 0
    rounds = max((len(s) for s in sources), default=0)
    for r in range(rounds):
        for si, branches in enumerate(sources):
            if r >= len(branches):
                continue
            branch = branches[r]
            for k in range(1, len(branch) + 1):
                prefix = tuple(branch[:k])
                if prefix not in nodes:
                    if created >= budget:
                        break
                    nodes[prefix] = set()
                    created += 1
                nodes[prefix].add(si)  # shared nodes are credited even once the budget is full
    return nodes


@settings(FAST, max_examples=300)
@given(root=_tok, sources=st.lists(_source, min_size=0, max_size=4), budget=st.integers(0, 30))
def test_from_drafts_matches_brute_force(root, sources, budget) -> None:
    tree = TokenTree.from_drafts(root, sources, budget)
    check_invariants(tree)
    assert tree.tokens[0] == root
    assert tree.num_draft_nodes <= budget
    seqs = node_sequences(tree)
    expected = _reference_merge(root, sources, budget)
    assert set(seqs) == set(expected)
    for seq, node in seqs.items():
        bits = {i for i in range(62) if tree.sources[node] >> i & 1}
        assert bits == expected[seq], seq
    # prefix-closed: every node's parent path is itself a node
    for seq in seqs:
        assert seq[:-1] in seqs
    # with an unlimited budget every inserted branch is present in full
    full = TokenTree.from_drafts(root, sources, 10_000)
    full_seqs = node_sequences(full)
    for branches in sources:
        for b in branches:
            assert tuple(b) in full_seqs
    # a smaller budget gives a prefix of the same construction (same nodes, same order)
    n = len(tree)
    assert full.tokens[:n] == tree.tokens and full.parents[:n] == tree.parents


@settings(FAST, max_examples=300)
@given(root=_tok, branches=st.lists(_branch, max_size=8), budget=st.integers(0, 40))
def test_single_source_budget_keeps_prefixes(root, branches, budget) -> None:
    tree = TokenTree.from_drafts(root, [branches], budget)
    check_invariants(tree)
    seqs = node_sequences(tree)
    # each branch is present up to some cut, and once a branch is cut no later branch adds a node
    exhausted = False
    for b in branches:
        present = 0
        while present < len(b) and tuple(b[: present + 1]) in seqs:
            present += 1
        if present < len(b):
            # a missing node can only be due to the budget
            assert tree.num_draft_nodes == budget or exhausted
            exhausted = True
    assert len(seqs) - 1 == tree.num_draft_nodes
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        path = set(tree.path_to(i)) | {0}
        assert set(np.flatnonzero(mask[i]).tolist()) == path
        assert tree.position_offsets()[i] == len(tree.path_to(i))
    # leaves are exactly the branches
    assert sorted(map(tuple, tree.branches())) == sorted(
        s for s, i in seqs.items() if s and not tree.children(i))
