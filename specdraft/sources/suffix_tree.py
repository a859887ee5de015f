"""SuffixDecoding: drafts from suffix trees over the request and over earlier responses.

Oliaro, Jia, Campos and Qiao, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications" (NeurIPS 2025, arXiv 2411.04975; the official implementation ships in Snowflake's
ArcticInference and is what vLLM calls). Agentic and structured workloads (text-to-SQL, tool calls,
self-refinement loops) repeat long token runs, both inside a request and across requests; a suffix
tree finds the longest run the context ends with and proposes what followed it, with a length that
grows with the match.

Where each part of the paper lives here (section titles of the arXiv v3 / NeurIPS version):

==========================================  ====================================================
paper                                       this module
==========================================  ====================================================
Sec. 3, suffix tree construction: a global  :class:`SuffixTrie` (one per request, over prompt +
tree over previous outputs and a            output; one shared, over the responses of the last
per-request tree over the prompt and the    ``max_cached_requests`` finished requests, each
tokens generated so far, depth-limited      added when its request ends)
Sec. 3, pattern matching: the last ``p``    :meth:`SuffixTrie.speculate` walks every context
tokens located in each tree                 suffix that occurs, ``p`` = 1 .. longest (<= depth)
Sec. 3, speculation tree expansion:         ``SuffixTrie._expand``: best-first by
greedily add the leaf of highest            D(N) = prod C(child)/C(parent) along the path
D(N) = C(N)/C(parent) x D(parent), nodes    from the matched node, nodes with D < τ
below a threshold dropped                   (``min_token_prob``) never enter
Sec. 3, adaptive speculation length:        at most ``floor(max_spec_factor * p +
MAX_SPEC = α·p                              max_spec_offset)`` nodes, capped by
                                            ``max_spec_tokens`` and the decoder's budget
Sec. 3, speculation tree scoring: SCORE     each ``p`` in each tree gives one candidate tree;
= Σ D(N), the best candidate is verified    the highest score wins (ties: longer match, then
                                            the per-request tree), as ArcticInference does
Sec. 4 / appendix, the knobs' defaults      ``max_depth=24``, ``max_spec_factor=1``,
                                            ``min_token_prob=0.1`` (vLLM's and ArcticInference's
                                            defaults); ``max_cached_requests=1000`` (ours, see
                                            Memory below)
==========================================  ====================================================

What the tree counts. ``C(s)`` is the number of positions where the token string ``s`` (at most
``max_depth`` tokens) occurs in the live sequences: every suffix of every sequence, cut at
``max_depth`` tokens, is one root-to-node path, and each node counts the paths through it. A
matched context of ``p`` tokens leaves ``max_depth - p`` tokens of depth to draft, which is why
shorter matches are candidates too (a shorter match has room for a longer draft).

Data layout (ours; the official C++ compresses chains of nodes into edges referencing the
sequences). A node is made only for a string that occurs at least twice; an occurrence's tail that
occurs once is a *leaf*: a reference ``(sequence, start)`` whose tokens are read from the sequence
and whose length grows for free as its sequence grows. When a second occurrence walks into a leaf
it is split one node at a time, so all work is O(1) per occurrence per appended token and the tree
holds, per live token, one leaf plus the nodes of its *repeated* substrings. Appending a token
steps each of the sequence's at most ``max_depth`` unfinished suffixes one level down (leaves
grow without being touched); removing a sequence walks its suffixes once and takes their counts
back, dropping nodes whose count reaches zero.

Memory (``tracemalloc``, word-level tokens of the 164 HumanEval prompts + solutions, max_depth
24; setup and table in ``docs/sources/suffix-tree.md``): about 370 bytes per cached token when the
responses do not repeat each other (one leaf and ~one node per token), about 2.5 KB per token when
every response occurs twice (then every substring up to ``max_depth`` repeats: ~19 nodes per
token), and 1.2 KB per token at four copies (copies past the second add almost nothing: nodes are
per *distinct* repeated string). The global tree forgets the oldest request's response first
(FIFO, as ArcticInference's ``max_cached_requests``), taking back exactly its suffixes' counts, so
it never holds more than ``max_cached_requests`` responses. The default, 1000 responses (vLLM's
is 10000, for a C++ tree of ~10x less memory per token), bounds 300-token responses to ~0.1 GB
when they do not repeat and ~0.75 GB in the worst case.

When a response joins. A response enters the global tree when its request ends (ArcticInference
extends it token by token while the request runs); until then the request drafts from its own
tree, which holds its response too. So requests running at the same time see each other's
responses once they end, and a failed request (:meth:`SuffixTree.abort`) only drops its own tree:
the global tree never held anything of it.

Cost (one CPU core; a 3000-token prompt and 500 generated tokens after 100 requests warmed the
global tree): ``propose`` 0.11 ms median (0.18 ms p90), ``observe`` 0.02 ms median; replaying all
164 HumanEval requests (8776 steps) costs 0.6 ms per step all included (Python's garbage
collector ~30% of it), under 0.5% of a ~150 ms forward; ``begin`` indexes the prompt once (11-19 ms
for 3000 tokens). One cost is lumpy: once the trees hold a few 100 000 nodes, a full collection of
Python's garbage collector (rare; it is amortised in the 0.6 ms) can pause one step for ~0.5 s.

Thread safety: the global tree and the request cache are guarded by one lock, held for the short
global part of ``propose`` and while ``end`` adds a response; per-request trees belong to
their request (:class:`~specdraft.sources.base.SourceBase` keeps them by ``request_id``), so one
source object can serve several decoders in several threads.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from .base import Context, Draft, Feedback, SourceBase

__all__ = ["SuffixDraft", "SuffixTree", "SuffixTrie"]


class _Node:
    """A string that occurs at least twice (or did: counts drop when sequences are removed).

    ``count`` is C(s), the occurrences of the node's string in the live sequences; ``children``
    maps the next token to a :class:`_Node` or a :class:`_Leaf`.
    """

    __slots__ = ("count", "children")

    def __init__(self, count: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Leaf] = {}


class _Leaf:
    """The single-occurrence tail of one suffix: nodes of count 1, read from the sequence.

    The occurrence starts at ``seq[start]``; the leaf hangs below a node at depth ``depth`` and
    stands for the strings ``seq[start : start + q]`` for ``depth < q <= min(max_depth,
    len(seq) - start)`` (so it grows with its sequence). ``node`` is set when another occurrence
    split the leaf exactly at its end: the occurrence then ends at that explicit node, and its next
    token must be stepped from there.
    """

    __slots__ = ("seq", "start", "depth", "node")

    def __init__(self, seq: list[int], start: int, depth: int) -> None:
        self.seq = seq
        self.start = start
        self.depth = depth
        self.node: _Node | None = None


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


_Position = tuple[Any, int]  # (node, -1) at an explicit node, or (leaf, depth) inside a leaf


class SuffixTrie:
    """A depth-limited suffix trie with occurrence counts over several growing token sequences.

    ``add``/``extend`` a sequence by id, ``remove`` it (its suffixes' counts are taken back), and
    :meth:`speculate` from a context. Not thread-safe on its own: :class:`SuffixTree` locks the
    shared one.
    """

    def __init__(self, max_depth: int) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        self.max_depth = max_depth
        self._root = _Node(0)
        self._seqs: dict[int, list[int]] = {}
        # seq id -> states of its suffixes still shorter than max_depth, shallowest (newest) first:
        # a _Node (the suffix ends there) or a _Leaf (it ends inside that leaf, or at leaf.node)
        self._open: dict[int, list[Any]] = {}

    # -- sequences --------------------------------------------------------------------------------

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self._seqs.values())

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of a sequence (a copy)."""
        return list(self._seqs[seq_id])

    def is_open(self, seq_id: int) -> bool:
        """Whether a sequence in the tree can still grow (added and not :meth:`close` d)."""
        return seq_id in self._open

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
            states = self._append(seq, states, int(token))
        self._open[seq_id] = states

    def close(self, seq_id: int) -> None:
        """The sequence will not grow any more: forget its open suffixes (it stays counted)."""
        self._open.pop(seq_id, None)

    def remove(self, seq_id: int) -> None:
        """Take back every count the sequence's suffixes added; nodes left at zero go."""
        seq = self._seqs.pop(seq_id)
        self._open.pop(seq_id, None)
        depth, n, root = self.max_depth, len(seq), self._root
        for i in range(n):
            node = root
            for j in range(i, min(n, i + depth)):
                token = seq[j]
                child = node.children[token]
                if child.__class__ is _Leaf:
                    del node.children[token]  # our own tail (a leaf on our path has count 1: us)
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[token]  # nobody else below: the whole subtree was ours
                    break
                node = child

    def _append(self, seq: list[int], states: list[Any], token: int) -> list[Any]:
        """Count the one-token-longer suffixes of ``seq + [token]``; returns the new open states.

        Suffixes are stepped shallowest first. A step can split another occurrence's leaf; if that
        occurrence is one of this sequence's and ended exactly there, it is deeper than the
        stepping one and so is stepped (from the split node) later in this same pass, never twice.
        """
        n = len(seq)
        depth = self.max_depth
        step = self._step
        first = step(self._root, token, seq, n, 0)
        out = [first] if depth > 1 else []
        limit = depth - 2  # state k (depth k + 1) stays open if its new depth k + 2 < max_depth
        for k, state in enumerate(states):
            if state.__class__ is _Leaf:
                node = state.node
                new = state if node is None else step(node, token, seq, n - 1 - k, k + 1)
            else:
                new = step(state, token, seq, n - 1 - k, k + 1)
            if k < limit:
                out.append(new)
        seq.append(token)
        return out

    def _step(self, node: _Node, token: int, seq: list[int], start: int, depth: int) -> Any:
        """Move the occurrence starting at ``seq[start]`` from ``node`` (at ``depth``) by ``token``."""
        children = node.children
        child = children.get(token)
        if child is None:
            leaf = _Leaf(seq, start, depth)
            children[token] = leaf
            return leaf
        if child.__class__ is _Node:
            child.count += 1
            return child
        # another occurrence's tail: its first token becomes a node counting both of us
        split = _Node(2)
        children[token] = split
        other_seq, other_start, below = child.seq, child.start, depth + 1
        if below < self.max_depth and len(other_seq) - other_start > below:
            child.depth = below
            split.children[other_seq[other_start + below]] = child
        else:
            child.node = split
        return split

    # -- matching and drafting --------------------------------------------------------------------

    def _locate(self, ctx: list[int], lo: int) -> _Position | None:
        """Where ``ctx[lo:]`` ends in the tree, or None if it does not occur."""
        node = self._root
        hi = len(ctx)
        for j in range(lo, hi):
            child = node.children.get(ctx[j])
            if child is None:
                return None
            if child.__class__ is _Leaf:
                seq, start, base = child.seq, child.start, child.depth
                end = base + hi - j  # depth reached if the rest matches the leaf
                if end > min(self.max_depth, len(seq) - start):
                    return None
                if seq[start + base + 1 : start + end] != ctx[j + 1 : hi]:
                    return None
                return child, end
            node = child
        return node, -1

    def longest_match(self, context: Sequence[int]) -> int:
        """The length of the longest suffix of ``context`` (at most ``max_depth`` tokens) that
        occurs in the tree's sequences."""
        ctx = [int(t) for t in context[-self.max_depth :]]
        best = 0
        for m in range(1, len(ctx) + 1):
            if self._locate(ctx, len(ctx) - m) is None:
                break
            best = m
        return best

    def count(self, key: Sequence[int]) -> int:
        """C(key): occurrences of the string in the live sequences (0 if absent or too long)."""
        key = [int(t) for t in key]
        if not key or len(key) > self.max_depth:
            return 0
        pos = self._locate(key, 0)
        if pos is None:
            return 0
        return 1 if pos[1] >= 0 else pos[0].count

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, tree: bool = True) -> SuffixDraft:
        """The best-scoring draft over every context suffix that occurs (Sec. 3 of the paper).

        For each match length ``p`` a draft of at most ``min(max_spec_tokens, floor(max_spec_factor
        * p + max_spec_offset))`` tokens is grown; the highest score wins, ties to the longer
        match. Lengths are tried longest first and the search stops once no shorter match could
        win (a draft of ``k`` tokens scores at most ``k``), which gives the same answer as trying
        them all. ``tree=False`` follows only the most frequent child (a single path, the mode
        vLLM uses).
        """
        ctx = [int(t) for t in context[-(self.max_depth - 1) :]] if self.max_depth > 1 else []
        positions: list[_Position] = []
        for m in range(1, len(ctx) + 1):
            pos = self._locate(ctx, len(ctx) - m)
            if pos is None:
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

    def _children(self, pos: _Position, prob: float, min_token_prob: float,
                  tree: bool) -> Iterator[tuple[float, int, _Position]]:
        """The continuations of a position worth drafting: (D, token, position)."""
        obj, depth = pos
        if depth >= 0:  # inside a leaf: one continuation, count 1 of 1
            seq, start = obj.seq, obj.start
            if depth < min(self.max_depth, len(seq) - start):
                yield prob, seq[start + depth], (obj, depth + 1)
            return
        if not obj.children:
            return
        scale = prob / obj.count
        need = min_token_prob / scale  # a child needs at least this count
        best: tuple[float, int, _Position] | None = None
        best_count = 0
        for token, child in obj.children.items():
            if child.__class__ is _Node:
                count, where = child.count, (child, -1)
            else:
                count, where = 1, (child, child.depth + 1)
            if count < need:
                continue
            if tree:
                yield count * scale, token, where
            elif count > best_count or (count == best_count and token < best[1]):  # type: ignore[index]
                best, best_count = (count * scale, token, where), count
        if best is not None:
            yield best

    def _expand(self, pos: _Position, limit: int, min_token_prob: float, tree: bool) -> SuffixDraft:
        """Grow a draft of at most ``limit`` tokens from ``pos``, best D(N) first; equal D(N): the
        child of the node chosen first, then the smaller token id. (Siblings are distinct tokens, so
        that order is total, and it depends on the counts alone, not on the order the children
        were made in: a tree whose sequences were removed and added again drafts the same.)"""
        draft = SuffixDraft()
        heap = [(-p, -1, t, where) for p, t, where in self._children(pos, 1.0, min_token_prob, tree)]
        heapq.heapify(heap)
        tokens, parents, probs = draft.tokens, draft.parents, draft.probs
        while heap and len(tokens) < limit:
            neg, parent, token, where = heapq.heappop(heap)
            index = len(tokens)
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg)
            for p, t, below in self._children(where, -neg, min_token_prob, tree):
                heapq.heappush(heap, (-p, index, t, below))
        draft.score = math.fsum(probs)
        return draft

    # -- inspection (tests) -----------------------------------------------------------------------

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every string in the tree with its count (O(size); for tests)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self._root)]
        while stack:
            key, node = stack.pop()
            for token, child in node.children.items():
                k = key + (token,)
                if child.__class__ is _Node:
                    out[k] = child.count
                    stack.append((k, child))
                else:
                    seq, start = child.seq, child.start
                    end = min(self.max_depth, len(seq) - start)
                    for q in range(child.depth + 1, end + 1):
                        out[key + tuple(seq[start + child.depth : start + q])] = 1
        return out

    def num_nodes(self) -> tuple[int, int]:
        """(explicit nodes, leaves) in the tree."""
        nodes = leaves = 0
        stack = [self._root]
        while stack:
            for child in stack.pop().children.values():
                if child.__class__ is _Node:
                    nodes += 1
                    stack.append(child)
                else:
                    leaves += 1
        return nodes, leaves

    def check_invariants(self) -> None:
        """Assert the structure (O(size); for tests): positive counts, a parent's count at least
        its children's sum, leaves reading live sequences and matching their key."""
        live = {id(s) for s in self._seqs.values()}
        stack: list[tuple[_Node, int]] = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            total = 0
            for token, child in node.children.items():
                if child.__class__ is _Node:
                    assert child.count > 0, "node with count 0 kept"
                    assert depth + 1 <= self.max_depth
                    total += child.count
                    stack.append((child, depth + 1))
                else:
                    assert id(child.seq) in live, "leaf of a removed sequence"
                    assert child.depth == depth and child.node is None, "leaf at the wrong depth"
                    assert child.seq[child.start + depth] == token, "leaf filed under the wrong token"
                    assert depth < min(self.max_depth, len(child.seq) - child.start)
                    total += 1
            if node is not self._root:
                assert total <= node.count, f"children count {total} > node count {node.count}"


@dataclass
class _Request:
    """Per-request state: its own trie over prompt + output."""

    local: SuffixTrie
    length: int  # context tokens in ``local``
    prompt_length: int


class SuffixTree(SourceBase[_Request]):
    """Draft source: SuffixDecoding (Oliaro et al., NeurIPS 2025), see the module docstring.

    ``max_depth``
        Depth of both suffix trees (paper / vLLM default 24): the longest matched context plus
        draft. Larger finds longer repeats, costs memory and time linearly.
    ``max_spec_factor``, ``max_spec_offset``
        α of the paper's adaptive length: a match of ``p`` tokens may propose at most
        ``floor(max_spec_factor * p + max_spec_offset)`` tokens (defaults 1 and 0, as vLLM).
    ``min_token_prob``
        τ: a draft token whose estimated probability D(N) (product of count ratios from the
        matched node) is below it is never proposed (default 0.1).
    ``max_spec_tokens``
        Hard cap on one draft (default ``max_depth``); the decoder's ``budget`` caps it further.
    ``max_cached_requests``
        Responses the global tree keeps, oldest forgotten first (default 1000; vLLM's 10000 is for a
        C++ tree of ~10x less memory per token, see the module docstring); 0 turns the global tree
        off (per-request trees only).
    ``tree``
        True (default): a draft tree, the paper's method. False: a single path of most frequent
        children (vLLM's mode).
    """

    name = "suffix"

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_spec_tokens: int | None = None, max_cached_requests: int = 1000,
                 max_spec_offset: float = 0.0, tree: bool = True, name: str = "suffix") -> None:
        super().__init__()
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an int >= 2 (one matched token plus one drafted), got {max_depth!r}")
        if not (isinstance(max_spec_factor, (int, float)) and math.isfinite(max_spec_factor) and max_spec_factor > 0):
            raise ValueError(f"max_spec_factor must be a finite number > 0, got {max_spec_factor!r}")
        if not (isinstance(max_spec_offset, (int, float)) and math.isfinite(max_spec_offset)):
            raise ValueError(f"max_spec_offset must be a finite number, got {max_spec_offset!r}")
        if not (isinstance(min_token_prob, (int, float)) and 0.0 <= min_token_prob <= 1.0):
            raise ValueError(f"min_token_prob must be a number in [0, 1], got {min_token_prob!r}")
        if max_spec_tokens is None:
            max_spec_tokens = max_depth
        if isinstance(max_spec_tokens, bool) or not isinstance(max_spec_tokens, int) or max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be an int >= 1 (or None for max_depth), got {max_spec_tokens!r}")
        if isinstance(max_cached_requests, bool) or not isinstance(max_cached_requests, int) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be an int >= 0 (0: no global tree), got {max_cached_requests!r}")
        if not isinstance(tree, bool):
            raise ValueError(f"tree must be True (draft trees) or False (single paths), got {tree!r}")
        self.max_depth = max_depth
        self.max_spec_factor = float(max_spec_factor)
        self.max_spec_offset = float(max_spec_offset)
        self.min_token_prob = float(min_token_prob)
        self.max_spec_tokens = max_spec_tokens
        self.max_cached_requests = max_cached_requests
        self.tree = tree
        self.name = name
        self._lock = threading.Lock()
        self._global = SuffixTrie(max_depth)
        self._cached: OrderedDict[int, None] = OrderedDict()  # cache ids, oldest first (= ascending)
        self._next_id = 0

    # -- lifecycle --------------------------------------------------------------------------------

    def new_state(self, context: Context) -> _Request:
        local = SuffixTrie(self.max_depth)
        tokens = [int(t) for t in context.tokens]
        local.add(0, tokens)
        return _Request(local, len(tokens), context.prompt_length)

    def propose(self, context: Context, budget: int) -> Draft:
        if budget <= 0:
            return Draft()
        state = self._sync(context)
        cap = min(self.max_spec_tokens, budget)
        tail = [int(t) for t in context.tokens[-self.max_depth :]]
        args = (cap, self.max_spec_factor, self.max_spec_offset, self.min_token_prob, self.tree)
        best = state.local.speculate(tail, *args)
        if self.max_cached_requests:
            with self._lock:
                other = self._global.speculate(tail, *args)
            if other.score > best.score:
                best = other
        return Draft(best.branches())

    def observe(self, feedback: Feedback) -> None:
        self._sync(feedback.context)

    def end(self, context: Context) -> None:
        """The request is over: its response (what it generated) joins the global tree, the oldest
        cached response goes if the cache is then past ``max_cached_requests``, and its state is
        dropped."""
        with self._states_lock:
            known = context.request_id in self._states
        if known and self.max_cached_requests:
            response = [int(t) for t in context.tokens[context.prompt_length :]]
            with self._lock:
                cache_id = self._next_id
                self._next_id += 1
                self._global.add(cache_id, response)
                self._global.close(cache_id)
                self._cached[cache_id] = None
                while len(self._cached) > self.max_cached_requests:
                    oldest, _ = self._cached.popitem(last=False)
                    self._global.remove(oldest)
        super().end(context)

    def abort(self, context: Context) -> None:
        """The request failed (see :class:`~specdraft.sources.base.DraftSource`): drop its state. Its
        response would join the global tree only at ``end``, so the global tree is exactly as it was
        before the request began, whatever other requests did meanwhile. Unknown ids are ignored."""
        super().end(context)

    # -- state ------------------------------------------------------------------------------------

    def _sync(self, context: Context) -> _Request:
        """Bring the request's tree up to ``context`` (the first token, from the prefill, is only
        seen here; a context that is not an extension of what was seen rebuilds the local tree)."""
        state = self.request_state(context)
        tokens = context.tokens
        n = len(tokens)
        if n < state.length:
            state.local = SuffixTrie(self.max_depth)
            state.local.add(0, [int(t) for t in tokens])
            state.length = n
        elif n > state.length:
            state.local.extend(0, [int(t) for t in tokens[state.length :]])
            state.length = n
        return state

    # -- inspection -------------------------------------------------------------------------------

    @property
    def cached_requests(self) -> int:
        """Responses in the global tree (at most ``max_cached_requests``)."""
        with self._lock:
            return len(self._cached)

    def global_counts(self) -> dict[tuple[int, ...], int]:
        """The global tree's strings and counts (O(size); for tests)."""
        with self._lock:
            return self._global.counts()

    def cached_sequences(self) -> list[list[int]]:
        """The cached responses, oldest first (for tests and inspection)."""
        with self._lock:
            return [self._global.sequence(i) for i in self._cached]

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._cached) <= max(self.max_cached_requests, 0)
            assert list(self._cached) == [i for i in self._cached if i in self._global]
            assert self._global.num_sequences == len(self._cached)
            assert not any(self._global.is_open(i) for i in self._cached), "a cached response is still open"
            self._global.check_invariants()

    def __repr__(self) -> str:
        return (f"SuffixTree(max_depth={self.max_depth}, max_spec_factor={self.max_spec_factor}, "
                f"min_token_prob={self.min_token_prob}, max_cached_requests={self.max_cached_requests}, "
                f"cached={len(self._cached)}, active_requests={self.active_requests})")
