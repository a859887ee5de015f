"""Structural checks and read-outs of the suffix tree's tries, for tests (O(size) each).

They read the internals of :class:`~specdraft.sources.suffix_trie.SuffixTrie` and
:class:`~specdraft.sources.suffix_tree.SuffixTree` on purpose: drafting needs none of this, and the
tests compare what they read against brute-force recounts.
"""

from __future__ import annotations

from typing import Iterator

from specdraft.sources.suffix_tree import SuffixTree, SuffixTrie

_ATTACHED = -1  # ``leaf_node`` of a leaf still in the trie (suffix_trie._ATTACHED)


def walk(trie: SuffixTrie) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """``(string, reference, depth of its parent)`` for every node and leaf in the trie."""
    stack: list[tuple[tuple[int, ...], int]] = [((), 0)]
    while stack:
        key, node = stack.pop()
        for token, child in (trie._children[node] or {}).items():
            yield key + (token,), child, len(key)
            if child > 0:
                stack.append((key + (token,), child))


def count(trie: SuffixTrie, key: list[int]) -> int:
    """C(key): occurrences of the string in the live sequences (0 if absent or too long)."""
    if not key or len(key) > trie.max_depth:
        return 0
    pos = trie._locate(key, 0)
    if pos is None:
        return 0
    return 1 if pos[1] >= 0 else trie._count[pos[0]]


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every string in the trie with its count."""
    out: dict[tuple[int, ...], int] = {}
    for key, ref, _ in walk(trie):
        if ref > 0:
            out[key] = trie._count[ref]
            continue
        seq, start, depth = trie._leaf_seq[~ref], trie._leaf_start[~ref], trie._leaf_depth[~ref]
        for q in range(depth + 1, min(trie.max_depth, len(seq) - start) + 1):
            out[key[:-1] + tuple(seq[start + depth : start + q])] = 1
    return out


def check_trie(trie: SuffixTrie) -> None:
    """Assert the structure: positive counts, a parent's count at least its children's sum, leaves
    reading live sequences and matching their key, and every index in use or free (a leaf out of
    the trie only while an open suffix refers to it)."""
    live = {id(s) for s in trie._seqs.values()}
    nodes, leaves = set(), set()
    for key, ref, depth in walk(trie):
        if ref > 0:
            assert trie._count[ref] > 0 and depth + 1 <= trie.max_depth, f"node {key}"
            total = sum(trie._count[c] if c > 0 else 1 for c in (trie._children[ref] or {}).values())
            assert total <= trie._count[ref], f"children count {total} > node count at {key}"
            assert trie._children[ref] is None or trie._children[ref], f"empty child dict kept at {key}"
            nodes.add(ref)
            continue
        leaf = ~ref
        seq, start = trie._leaf_seq[leaf], trie._leaf_start[leaf]
        assert id(seq) in live, "leaf of a removed sequence"
        attached = trie._leaf_node[leaf] == _ATTACHED
        assert trie._leaf_depth[leaf] == depth and attached, "leaf at the wrong depth"
        assert seq[start + depth] == key[-1], "leaf filed under the wrong token"
        assert depth < min(trie.max_depth, len(seq) - start)
        leaves.add(leaf)
    detached = {~r for states in trie._open.values() for r in states
                if r < 0 and trie._leaf_node[~r] != _ATTACHED}
    assert len(nodes) + len(trie._free_nodes) + 1 == len(trie._count), "a node index is neither used nor free"
    assert len(leaves) + len(detached) + len(trie._free_leaves) == len(trie._leaf_seq), "a leaf index leaks"


def global_counts(src: SuffixTree) -> dict[tuple[int, ...], int]:
    """The global tree's strings and counts: the cached responses and the running requests'
    responses so far."""
    with src._lock:
        return trie_counts(src._global)


def _live_responses(src: SuffixTree) -> set[int]:
    return {s.response for s in src.running_states() if s.response is not None}


def running_sequences(src: SuffixTree) -> list[list[int]]:
    """The running requests' responses so far, in the order they began."""
    with src._lock:
        return [src._global.sequence(i) for i in sorted(_live_responses(src))]


def check_source(src: SuffixTree) -> None:
    """Assert the source's invariants: the cache within its bound, every cached response closed and
    every running one open, no response outliving its request, and the global trie's structure."""
    with src._lock:
        live, seqs, opened = _live_responses(src), src._global._seqs, src._global._open
        assert len(src._cached) <= max(src.max_cached_requests, 0)
        assert all(i in seqs for i in src._cached)
        assert len(seqs) == len(src._cached) + len(live), "a response outlived its request"
        assert not any(i in opened for i in src._cached), "a cached response is still open"
        assert all(i in opened for i in live), "a running response is closed"
        check_trie(src._global)
