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
sequences): :class:`~specdraft.sources.suffix_trie.SuffixTrie`. A node is made only for a string
that occurs at least twice; an occurrence's tail that occurs once is a *leaf*, a reference
``(sequence, start)`` whose length grows for free as its sequence grows, so all work is O(1) per
occurrence per appended token. Nodes and leaves are indexes into flat lists of ints, with dicts of
ints for the children, none of which Python's cyclic garbage collector tracks: a tree of any size is
a handful of tracked objects.

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

When a response joins. A running request's response is a sequence of the global tree from its
``begin``, growing with every ``observe`` (as in ArcticInference), so every running request drafts
from the others' responses as they are written, and from its own. It joins the cache of finished
responses (and may push the oldest out) when its request ends. A failed request
(:meth:`SuffixTree.abort`) has its response removed, which takes back exactly its suffixes'
counts, and the cache never held it: the global tree's counts, its cached responses and their
order are exactly as if the request had never run, whatever other requests did meanwhile, and the
other requests stop seeing it the moment it aborts. (The trie may keep an explicit node where a
leaf was before; drafts depend on the counts alone.)

Cost (one CPU core; a 3000-token prompt and 500 generated tokens after 100 requests warmed the
global tree): ``propose`` 0.11 ms median (0.18 ms p90), ``observe`` 0.02 ms median; replaying all
164 HumanEval requests (8776 steps) costs 0.6 ms per step all included (Python's garbage
collector ~30% of it), under 0.5% of a ~150 ms forward; ``begin`` indexes the prompt once (11-19 ms
for 3000 tokens).

Thread safety: the global tree and the request cache are guarded by one lock, held for the short
global part of ``propose`` and ``observe`` and while ``begin``, ``end`` and ``abort`` add, close or
remove a response; per-request trees belong to
their request (:class:`~specdraft.sources.base.SourceBase` keeps them by ``request_id``), so one
source object can serve several decoders in several threads.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..checks import check_int, check_number
from .base import Context, Draft, Feedback, SourceBase
from .suffix_trie import SuffixDraft, SuffixTrie

__all__ = ["SuffixDraft", "SuffixTree", "SuffixTrie"]


@dataclass
class _Request:
    """Per-request state: its own trie over prompt + output, and its response's id in the global
    tree (``None`` without a global tree)."""

    local: SuffixTrie
    length: int  # context tokens in ``local``
    prompt_length: int
    response: int | None


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
        check_int("max_depth", max_depth, 2, " (one matched token plus one drafted)")
        check_number("max_spec_factor", max_spec_factor, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)
        check_number("max_spec_offset", max_spec_offset, "a finite number", math.isfinite)
        check_number("min_token_prob", min_token_prob, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        max_spec_tokens = max_depth if max_spec_tokens is None else max_spec_tokens
        check_int("max_spec_tokens", max_spec_tokens, 1, " (or None for max_depth)")
        check_int("max_cached_requests", max_cached_requests, 0, " (0: no global tree)")
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
        #: observe only catches the trees up with the context; a draft catches them up itself
        #: (so on an accelerator a step without a draft learns behind the next forward)
        self.observes_late = True
        self._lock = threading.Lock()
        self._global = SuffixTrie(max_depth)
        self._cached: OrderedDict[int, None] = OrderedDict()  # the finished responses' ids, oldest first
        self._next_id = 0  # the next response's id in the global tree

    # -- lifecycle --------------------------------------------------------------------------------

    def new_state(self, context: Context) -> _Request:
        local = SuffixTrie(self.max_depth)
        tokens = [int(t) for t in context.tokens]
        local.add(0, tokens)
        response = None
        if self.max_cached_requests:
            with self._lock:
                response = self._next_id
                self._next_id += 1
                self._global.add(response, tokens[context.prompt_length :])
        return _Request(local, len(tokens), context.prompt_length, response)

    def propose(self, context: Context, budget: int) -> Draft:
        if budget <= 0:
            return Draft()
        state = self._sync(context)
        cap = min(self.max_spec_tokens, budget)
        tail = context.tokens[-self.max_depth :]  # (read by speculate only where it must locate)
        args = (cap, self.max_spec_factor, self.max_spec_offset, self.min_token_prob, self.tree)
        # both trees hold the context's own end (the request's sequence, its response), so its
        # suffixes are found from where those sequences end rather than each from the root
        best = state.local.speculate(tail, *args, seq_id=0)
        if self.max_cached_requests:
            with self._lock:
                other = self._global.speculate(tail, *args, seq_id=state.response)
            if other.score > best.score:
                best = other
        return Draft(best.branches())

    def observe(self, feedback: Feedback) -> None:
        self._sync(feedback.context)

    def end(self, context: Context) -> None:
        """The request is over: its response (what it generated) stops growing and joins the cache
        of finished responses, the oldest of which goes if the cache is then past
        ``max_cached_requests``; its state is dropped. Unknown ids are ignored."""
        if self.peek_state(context.request_id) is None:
            return
        state = self._sync(context)
        self.pop_state(context.request_id)
        if state.response is None:
            return
        with self._lock:
            self._global.close(state.response)
            self._cached[state.response] = None
            while len(self._cached) > self.max_cached_requests:
                oldest, _ = self._cached.popitem(last=False)
                self._global.remove(oldest)

    def abort(self, context: Context) -> None:
        """The request failed (see :class:`~specdraft.sources.base.DraftSource`): its response leaves
        the global tree (its counts taken back exactly) without ever joining the cache, so the global
        tree is as if the request had never run, whatever other requests did meanwhile; its state is
        dropped. Unknown ids are ignored."""
        state = self.pop_state(context.request_id)
        if state is not None and state.response is not None:
            with self._lock:
                self._global.remove(state.response)

    # -- state ------------------------------------------------------------------------------------

    def _sync(self, context: Context) -> _Request:
        """Bring the request's tree and its response in the global tree up to ``context`` (the first
        token, from the prefill, is only seen here; a context that is not an extension of what was
        seen rebuilds both)."""
        state = self.request_state(context)
        tokens = context.tokens
        n = len(tokens)
        if n == state.length:
            return state
        if n < state.length:
            state.local = SuffixTrie(self.max_depth)
            state.local.add(0, [int(t) for t in tokens])
        else:
            state.local.extend(0, [int(t) for t in tokens[state.length :]])
        if state.response is not None:
            with self._lock:
                if n < state.length:
                    self._global.remove(state.response)
                    self._global.add(state.response, [int(t) for t in tokens[state.prompt_length :]])
                else:
                    new = tokens[max(state.length, state.prompt_length) :]
                    self._global.extend(state.response, [int(t) for t in new])
        state.length = n
        return state

    # -- inspection -------------------------------------------------------------------------------

    @property
    def cached_requests(self) -> int:
        """Responses in the global tree (at most ``max_cached_requests``)."""
        with self._lock:
            return len(self._cached)

    def cached_sequences(self) -> list[list[int]]:
        """The cached responses, oldest first (for tests and inspection)."""
        with self._lock:
            return [self._global.sequence(i) for i in self._cached]

    def __repr__(self) -> str:
        return (f"SuffixTree(max_depth={self.max_depth}, max_spec_factor={self.max_spec_factor}, "
                f"min_token_prob={self.min_token_prob}, max_cached_requests={self.max_cached_requests}, "
                f"cached={len(self._cached)}, active_requests={self.active_requests})")
