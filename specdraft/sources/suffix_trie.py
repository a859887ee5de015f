"""A depth-limited suffix trie with occurrence counts over growing token sequences, in flat lists.

The data structure behind :class:`~specdraft.sources.suffix_tree.SuffixTree` (SuffixDecoding,
Oliaro et al.): ``C(s)``, the number of positions where the token string ``s`` (at most
``max_depth`` tokens) occurs in the live sequences, for every such ``s``; every suffix of every
sequence, cut at ``max_depth`` tokens, is one root-to-node path, and each node counts the paths
through it.

Nodes and leaves. A node is made only for a string that occurs at least twice; an occurrence's
tail that occurs once is a *leaf*: a reference ``(sequence, start)`` whose tokens are read from the
sequence and whose length grows for free as its sequence grows. When a second occurrence walks
into a leaf it is split one node at a time, so all work is O(1) per occurrence per appended token
and the trie holds, per live token, one leaf plus the nodes of its *repeated* substrings.
Appending a token steps each of the sequence's at most ``max_depth`` unfinished suffixes one level
down (leaves grow without being touched); removing a sequence walks its suffixes once and takes
their counts back, dropping nodes whose count reaches zero.

Layout. A node is an int, an index into the lists ``_count`` and ``_children`` (node 0 is the
root, the empty string); ``_children[n]`` maps the next token to a *reference*: a node's index
(> 0), or ``~leaf`` (< 0) for a leaf, itself an index into the ``_leaf_*`` lists (its sequence, the
sequence's id, ``start``, ``depth`` and ``node``, below). Dicts of ints are not tracked by Python's
cyclic garbage collector and the lists are a handful of objects, so a trie of any size costs a full
collection almost nothing, where a node object with a dict of children would be two tracked objects
per repeated string (a few hundred thousand for a busy cache, and as many per long request). Removed
nodes and leaves go to free lists and their indexes are reused.

A leaf stands for the strings ``seq[start : start + q]`` for ``depth < q <= min(max_depth,
len(seq) - start)``, hanging below a node at depth ``depth``. When another occurrence splits a leaf
exactly at its end, the leaf leaves the trie and its ``node`` records the node its occurrence now
ends at; only its sequence's open suffixes still refer to it, and it is freed when the next token
is stepped from that node (or the sequence closes). A position inside the trie is ``(node, -1)`` at
an explicit node or ``(leaf, depth)`` inside a leaf.

Drafting (:meth:`SuffixTrie.speculate`): for each context suffix that occurs, the speculation
tree grows best-first by ``D(N) = prod C(child) / C(parent)`` along the path from the matched
position, nodes below ``min_token_prob`` never entering; the best-scoring tree (``SCORE = sum
D(N)``) wins. It depends on the counts alone, so a trie whose sequences were removed and added
again drafts the same. Not thread-safe on its own.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from ..checks import check_int

__all__ = ["SuffixDraft", "SuffixTrie"]

_ROOT = 0
#: ``leaf_node`` of a leaf still in the trie.
_ATTACHED = -1

Position = tuple[int, int]  # (node, -1) at an explicit node, or (leaf, depth) inside a leaf


@dataclass
class SuffixDraft:
    """One speculation: tokens in the order they were chosen (best first, parents first),
    ``parents[i]`` the index of token ``i``'s parent (-1: a child of the root), ``probs[i]`` its
    D(N), ``score`` their sum and ``match_length`` the context suffix it continues."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_length: int = 0

    def branches(self) -> list[list[int]]:
        """One root-to-node path per token, in choice order (so a budget that keeps the first N
        created nodes keeps the N most likely)."""
        paths: list[list[int]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        return paths


class SuffixTrie:
    """A depth-limited suffix trie with occurrence counts over several growing token sequences.

    ``add``/``extend`` a sequence by id, ``remove`` it (its suffixes' counts are taken back), and
    :meth:`speculate` from a context. See the module docstring.
    """

    def __init__(self, max_depth: int) -> None:
        check_int("max_depth", max_depth, 1)
        self.max_depth = max_depth
        self._count: list[int] = [0]
        self._children: list[dict[int, int] | None] = [None]
        self._free_nodes: list[int] = []
        self._leaf_seq: list[list[int]] = []
        self._leaf_id: list[int] = []
        self._leaf_start: list[int] = []
        self._leaf_depth: list[int] = []
        self._leaf_node: list[int] = []
        self._free_leaves: list[int] = []
        self._seqs: dict[int, list[int]] = {}
        # seq id -> references of its suffixes still shorter than max_depth, shallowest (newest)
        # first: a node (the suffix ends there) or ~leaf (it ends inside that leaf, or at leaf_node)
        self._open: dict[int, list[int]] = {}

    # -- sequences --------------------------------------------------------------------------------

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of a sequence (a copy)."""
        return list(self._seqs[seq_id])

    def add(self, seq_id: int, tokens: Sequence[int] = ()) -> None:
        """Start a new sequence, ``tokens`` its first tokens."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the tree")
        self._seqs[seq_id] = []
        self._open[seq_id] = []
        self.extend(seq_id, tokens)

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence that is still open (added and not :meth:`close` d)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not in the tree")
        states = self._open.get(seq_id)
        if states is None:
            raise ValueError(f"sequence {seq_id!r} is closed and cannot grow")
        for token in tokens:
            states = self._append(seq, seq_id, states, int(token))
        self._open[seq_id] = states

    def close(self, seq_id: int) -> None:
        """The sequence will not grow any more: forget its open suffixes (it stays counted)."""
        self._forget_states(self._open.pop(seq_id, ()))

    def remove(self, seq_id: int) -> None:
        """Take back every count the sequence's suffixes added; nodes left at zero go."""
        seq = self._seqs.pop(seq_id)
        self._forget_states(self._open.pop(seq_id, ()))
        depth, n = self.max_depth, len(seq)
        count, children = self._count, self._children
        for i in range(n):
            node = _ROOT
            for j in range(i, min(n, i + depth)):
                token = seq[j]
                kids = children[node]
                child = kids[token]  # type: ignore[index]
                if child < 0 or count[child] == 1:  # our own tail (a leaf on our path is us), or
                    del kids[token]  # type: ignore[union-attr]  # nobody else below: all ours
                    if not kids:
                        children[node] = None
                    self._free(child)
                    break
                count[child] -= 1
                node = child

    def _forget_states(self, states: Sequence[int]) -> None:
        """Free the leaves among a sequence's open suffixes that no longer are in the trie."""
        leaf_node = self._leaf_node
        for ref in states:
            if ref < 0 and leaf_node[~ref] != _ATTACHED:
                self._free_leaf(~ref)

    # -- growing ----------------------------------------------------------------------------------

    def _append(self, seq: list[int], seq_id: int, states: list[int], token: int) -> list[int]:
        """Count the one-token-longer suffixes of ``seq + [token]``; returns the new open states.

        Suffixes are stepped shallowest first. A step can split another occurrence's leaf; if that
        occurrence is one of this sequence's and ended exactly there, it is deeper than the
        stepping one and so is stepped (from the split node) later in this same pass, never twice.
        """
        n = len(seq)
        step = self._step
        leaf_node = self._leaf_node
        first = step(_ROOT, token, seq, seq_id, n, 0)
        out = [first] if self.max_depth > 1 else []
        limit = self.max_depth - 2  # state k (depth k + 1) stays open if its new depth k + 2 < max_depth
        for k, state in enumerate(states):
            if state >= 0:
                new = step(state, token, seq, seq_id, n - 1 - k, k + 1)
            elif leaf_node[~state] == _ATTACHED:
                new = state  # inside its leaf: grows with the sequence
            else:  # its leaf was split at its end: step from that node; nothing refers to the leaf now
                new = step(leaf_node[~state], token, seq, seq_id, n - 1 - k, k + 1)
                self._free_leaf(~state)
            if k < limit:
                out.append(new)
        seq.append(token)
        return out

    def _step(self, node: int, token: int, seq: list[int], seq_id: int, start: int, depth: int) -> int:
        """Move the occurrence starting at ``seq[start]`` from ``node`` (at ``depth``) by ``token``;
        returns the reference it ends at."""
        kids = self._children[node]
        child = kids.get(token) if kids is not None else None
        if child is None:
            leaf = ~self._new_leaf(seq, seq_id, start, depth)
            if kids is None:
                self._children[node] = {token: leaf}
            else:
                kids[token] = leaf
            return leaf
        if child > 0:
            self._count[child] += 1
            return child
        # another occurrence's tail: its first token becomes a node counting both of us
        split = self._new_node(2)
        kids[token] = split  # type: ignore[index]
        leaf = ~child
        other_seq, other_start, below = self._leaf_seq[leaf], self._leaf_start[leaf], depth + 1
        if below < self.max_depth and len(other_seq) - other_start > below:
            self._leaf_depth[leaf] = below
            self._children[split] = {other_seq[other_start + below]: child}
        elif below < self.max_depth and self._leaf_id[leaf] in self._open:
            self._leaf_node[leaf] = split  # it ends here and can still grow: its next step starts here
        else:
            self._free_leaf(leaf)  # it ends here for good: only the node's count remembers it
        return split

    def _new_node(self, count: int) -> int:
        if self._free_nodes:
            node = self._free_nodes.pop()
            self._count[node] = count
            return node
        self._count.append(count)
        self._children.append(None)
        return len(self._count) - 1

    def _new_leaf(self, seq: list[int], seq_id: int, start: int, depth: int) -> int:
        if self._free_leaves:
            leaf = self._free_leaves.pop()
            self._leaf_seq[leaf], self._leaf_id[leaf], self._leaf_start[leaf] = seq, seq_id, start
            self._leaf_depth[leaf], self._leaf_node[leaf] = depth, _ATTACHED
            return leaf
        self._leaf_seq.append(seq)
        self._leaf_id.append(seq_id)
        self._leaf_start.append(start)
        self._leaf_depth.append(depth)
        self._leaf_node.append(_ATTACHED)
        return len(self._leaf_seq) - 1

    def _free_leaf(self, leaf: int) -> None:
        self._leaf_seq[leaf] = _NO_SEQUENCE  # (so a freed leaf keeps no sequence alive)
        self._free_leaves.append(leaf)

    def _free(self, ref: int) -> None:
        """Free a reference taken out of the trie, with everything below it."""
        stack = [ref]
        children = self._children
        while stack:
            ref = stack.pop()
            if ref < 0:
                self._free_leaf(~ref)
                continue
            kids = children[ref]
            if kids:
                stack.extend(kids.values())
            children[ref] = None
            self._count[ref] = 0
            self._free_nodes.append(ref)

    # -- matching and drafting --------------------------------------------------------------------

    def _locate(self, ctx: list[int], lo: int) -> Position | None:
        """Where ``ctx[lo:]`` ends in the trie, or None if it does not occur."""
        node = _ROOT
        hi = len(ctx)
        children = self._children
        for j in range(lo, hi):
            kids = children[node]
            child = kids.get(ctx[j]) if kids is not None else None
            if child is None:
                return None
            if child < 0:
                leaf = ~child
                seq, start, base = self._leaf_seq[leaf], self._leaf_start[leaf], self._leaf_depth[leaf]
                end = base + hi - j  # depth reached if the rest matches the leaf
                if end > min(self.max_depth, len(seq) - start):
                    return None
                if seq[start + base + 1 : start + end] != ctx[j + 1 : hi]:
                    return None
                return leaf, end
            node = child
        return node, -1

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, tree: bool = True,
                  seq_id: int | None = None) -> SuffixDraft:
        """The best-scoring draft over every context suffix that occurs (Sec. 3 of the paper).

        For each match length ``p`` a draft of at most ``min(max_spec_tokens, floor(max_spec_factor
        * p + max_spec_offset))`` tokens is grown; the highest score wins, ties to the longer
        match. Lengths are tried longest first and the search stops once no shorter match could
        win (a draft of ``k`` tokens scores at most ``k``), which gives the same answer as trying
        them all. ``tree=False`` follows only the most frequent child (a single path, the mode
        vLLM uses).

        ``seq_id``: an open sequence of the trie that ``context`` ends with (its tokens are the
        context's last ones). Its suffixes' positions are then read from its open states, which
        :meth:`extend` keeps, instead of each being located from the root; the draft is the same.
        """
        states = self._open.get(seq_id, ()) if seq_id is not None else ()
        known = len(states)  # suffixes of 1 .. known tokens: where the sequence's own ones end
        longest = min(len(context), self.max_depth - 1)
        # the context's tokens are read only to locate suffixes longer than the sequence's own
        ctx = [int(t) for t in context[len(context) - longest :]] if longest > known else []
        leaf_node = self._leaf_node
        positions: list[Position] = []
        for m in range(1, longest + 1):
            if m <= known:
                ref = states[m - 1]
                if ref >= 0:
                    pos = (ref, -1)
                elif leaf_node[~ref] == _ATTACHED:
                    pos = (~ref, m)
                else:
                    pos = (leaf_node[~ref], -1)
            else:
                pos = self._locate(ctx, len(ctx) - m)
            if pos is None or self._ends_here(pos):
                # No longer suffix can draft either: each of its occurrences ends where one of
                # this suffix's does, none of which goes on (the context's own occurrence, at the
                # end of its live sequence, is the usual one). Its draft would score 0, which never
                # wins, so the search stops here rather than locate and expand the rest.
                break
            positions.append(pos)
        best = SuffixDraft()
        for m in range(len(positions), 0, -1):
            limit = min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))
            if limit <= best.score or limit <= 0:
                break  # no shorter match can score more
            draft = self._expand(positions[m - 1], limit, min_token_prob, tree)
            if draft.score > best.score:
                draft.match_length = m
                best = draft
        return best

    def _ends_here(self, pos: Position) -> bool:
        """Whether nothing continues the position: a leaf at the end of its sequence or at the
        trie's depth, or a node without children (what :meth:`_continuations` would find no
        continuation of, whatever the threshold)."""
        ref, depth = pos
        if depth >= 0:
            return depth >= min(self.max_depth, len(self._leaf_seq[ref]) - self._leaf_start[ref])
        return not self._children[ref]

    def _continuations(self, pos: Position, prob: float, min_token_prob: float,
                  tree: bool) -> Iterator[tuple[float, int, Position]]:
        """The continuations of a position worth drafting: (D, token, position)."""
        ref, depth = pos
        if depth >= 0:  # inside a leaf: one continuation, count 1 of 1
            seq, start = self._leaf_seq[ref], self._leaf_start[ref]
            if depth < min(self.max_depth, len(seq) - start):
                yield prob, seq[start + depth], (ref, depth + 1)
            return
        kids = self._children[ref]
        if not kids:
            return
        count, leaf_depth = self._count, self._leaf_depth
        scale = prob / count[ref]
        need = min_token_prob / scale  # a child needs at least this count
        best: tuple[float, int, Position] | None = None
        best_count = 0
        for token, child in kids.items():
            if child > 0:
                c, where = count[child], (child, -1)
            else:
                c, where = 1, (~child, leaf_depth[~child] + 1)
            if c < need:
                continue
            if tree:
                yield c * scale, token, where
            elif c > best_count or (c == best_count and token < best[1]):  # type: ignore[index]
                best, best_count = (c * scale, token, where), c
        if best is not None:
            yield best

    def _expand(self, pos: Position, limit: int, min_token_prob: float, tree: bool) -> SuffixDraft:
        """Grow a draft of at most ``limit`` tokens from ``pos``, best D(N) first; equal D(N): the
        child of the node chosen first, then the smaller token id. (Siblings are distinct tokens, so
        that order is total, and it depends on the counts alone, not on the order the children
        were made in: a trie whose sequences were removed and added again drafts the same.)"""
        draft = SuffixDraft()
        heap = [(-p, -1, t, where) for p, t, where in self._continuations(pos, 1.0, min_token_prob, tree)]
        heapq.heapify(heap)
        tokens, parents, probs = draft.tokens, draft.parents, draft.probs
        while heap and len(tokens) < limit:
            neg, parent, token, where = heapq.heappop(heap)
            index = len(tokens)
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg)
            for p, t, below in self._continuations(where, -neg, min_token_prob, tree):
                heapq.heappush(heap, (-p, index, t, below))
        draft.score = math.fsum(probs)
        return draft


#: What a freed leaf refers to instead of its sequence.
_NO_SEQUENCE: list[int] = []
