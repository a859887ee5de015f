"""Frequency trie: Ant Group's *Lookahead* (Zhao et al., KDD 2024), one trie shared by every request.

The trie remembers short windows of tokens from prompts and outputs with how often each prefix
was seen; a draft is the most frequent part of the subtree below the longest context suffix it
knows. Because it outlives requests, what one answer taught it speeds up the next one.

Where each part of the paper lives here:

=====================================  ======================================================
paper                                  this package
=====================================  ======================================================
4.2   hierarchical multi-branch draft  :func:`~specdraft.sources.trie_select.select` takes a
                                       prefix-closed subtree, :meth:`FrequencyTrie.retrieve`
                                       returns its leaf paths (the decoder merges the shared
                                       prefixes back into one tree); ``mode="parallel"`` gives
                                       the paper's *parallel* draft for its ablation
4.3.1 branch inserting                 :meth:`~FrequencyTrie.begin` (prompt, amplified),
                                       :meth:`~FrequencyTrie.observe` and
                                       :meth:`~FrequencyTrie.end` (output), :meth:`~FrequencyTrie.insert`
4.3.1 branch eliminating               a request's prompt is counted in its own overlay only
                                       (see below), so :meth:`~FrequencyTrie.end` removes it by
                                       dropping the overlay
4.3.1 node pruning                     :class:`~specdraft.sources.trie_store.NodeStore`: least
                                       frequent nodes of one first-token tree first, past
                                       ``capacity``; of the whole trie, past ``max_nodes``
4.3.2 multi-stage retrieval            :func:`~specdraft.sources.trie_select.retrieve`: longest
                                       suffix first, shorter until the match offers
                                       ``min_nodes`` nodes, then the ``budget`` most frequent
4.4   Algorithm 1                      lines 5-10 = ``begin``; 12-19 = ``propose``;
                                       24 = ``observe``; 27 = ``end``
5.2.3 Table 5 (ablations)              ``insert_prompt``, ``insert_output``, ``eliminate``,
                                       ``capacity`` and ``max_nodes`` (huge values = no pruning)
5.2.3 Table 6 (capacity)               ``capacity`` (per first-token tree, see below) defaults
                                       to 16 x ``decoding_length``
=====================================  ======================================================

Capacity: what the paper specifies and how we read it. The paper says only that pruning removes
"the least frequent nodes dynamically, when the trie tree exceeds a predetermined capacity"
(Sec. 4.3.1; N_max, the "node capacity of trie tree", in Algorithm 1) and that a capacity of 16 or
32 times the decoding length is best (Table 6). It does not say what the capacity counts. In the
authors' reference implementation (``alipay/PainlessInferenceAcceleration``,
``lookahead/common/lookahead_cache.py``) the "trie" is a forest: one ``Tree`` per first token
(the token a branch follows), each with its own ``max_node``, and the Table 6 sweep
(``lookahead/benchmarks/benchmark.py``, ``perf_check``) sets ``max_node = max_node_rate *
decoding_length`` for every tree; nothing bounds the number of trees. So the paper's 16 x
decoding length is a per-tree limit, and that is how ``capacity`` is read here: the most nodes
of one first-token tree (all the nodes whose key starts with that token, the first-token node
included; the reference counts the nodes below it, one fewer). A global cap of 16 x decoding
length would let one raw prompt (150 tokens x 12 ≈ 1800 nodes) wipe out everything learned
before (the replay that showed it is in the documentation's "How the defaults were chosen").
Two departures from the reference: pruning drops the least frequent nodes as the paper's text
says (the reference instead halves output counts and drops the nodes at count <= 1, in batches),
and, since a per-tree bound alone lets memory grow with the number of distinct tokens (up to
vocabulary x capacity), ``max_nodes`` bounds the whole trie as well, dropping the globally least
frequent nodes first.

Overlays: what a request learns, and when the others see it. Every request counts what it
teaches in an *overlay*, a small trie of its own: its prompt windows at ``begin`` (amplified by
``prompt_weight``) and its output windows as they complete. It drafts from the shared trie and its
overlay read as one (counts added, see :mod:`~specdraft.sources.trie_select`), so its own prompt
and output help its own drafts at once. The shared trie changes only when a request ends: ``end``
counts the request's output windows there and drops the overlay, which takes the prompt's
amplified counts with it (the paper's branch eliminating). A failed request (``abort``) just drops
its overlay, so it leaves the shared trie exactly as it was, by construction, whatever other
requests did meanwhile. Requests running at the same time see each other's outputs once they
end, not while they run, and never each other's prompts.

Windows. A window is ``branch_length + 1`` tokens: the token a branch follows plus the branch,
as in the authors' implementation (``token_ids[i + 1 : i + branch_length + 1]`` filed under
``token_ids[i]``), so matching one context token still yields branches of ``branch_length``.
Output windows are counted in the overlay as in the paper's "incrementally put branches of O"
(Algorithm 1, line 24): each window once, when its last token is committed. At ``end`` every
output window goes into the shared trie, those that would run past the end of the output
shortened. A window counts as output if it contains at least one generated token, so the last
``branch_length`` prompt tokens (a chat template's "assistant" header, say) stay linked to what
was generated after them.

Data layout. The shared trie and each overlay are a
:class:`~specdraft.sources.trie_store.NodeStore`: nodes are indexes into flat lists of ints and
dicts of ints, none of which Python's cyclic garbage collector tracks, so a full trie of
``max_nodes`` nodes adds nothing to a full collection, and pruned or dropped nodes make no garbage
for it to find. :attr:`FrequencyTrie.trie` shows the shared nodes as a :class:`pygtrie.Trie` (token
tuple -> :class:`TrieNode`, a copy of the node's counts), built on demand for reading.

Thread safety. One re-entrant lock (``threading.RLock``) guards the shared trie and the table of
overlays; an overlay is written only by its own request's calls. ``begin`` indexes the prompt into
the new overlay without the lock, so a long prompt does not hold up the other requests' steps;
``propose`` holds it while it reads (at most ``budget`` nodes and their siblings), ``observe``
while it counts the one to few windows a step completes, and ``end`` while it counts the request's
output into the shared trie. Pruning is amortised: a tree is pruned when it passes ``capacity``
and then goes down to ``prune_to * capacity``; the whole trie when it passes ``max_nodes``, down
to ``prune_to * max_nodes``.

Cost: well under 1% of a small model's CPU step per decoding step, all included. The
measurements (``benchmarks/trie_overhead.py``, ``benchmarks/gc_pauses.py``) are in the
documentation's "How the defaults were chosen" and in ``docs/reliability.md``.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import Sequence

import pygtrie

from .base import Context, Draft, Feedback
from .trie_select import branches as _branches
from .trie_select import retrieve as _retrieve
from .trie_store import NodeStore

__all__ = ["FrequencyTrie", "TrieNode"]

HIERARCHICAL = "hierarchical"
PARALLEL = "parallel"
DEFAULT_MAX_NODES = 131_072

#: Where an overlay's clock starts: past any stamp the shared trie will reach, so that among nodes
#: of equal frequency the ones a request touched itself count as the most recent for its drafts.
OVERLAY_STAMPS = 1 << 48


@dataclass(frozen=True)
class TrieNode:
    """A copy of one node of the shared trie, as :attr:`FrequencyTrie.trie` shows it: ``out`` counts
    output windows through the node, ``prompt`` prompt windows (only ever non-zero with
    ``eliminate=False``), ``stamp`` the clock of the last window that touched it."""

    token: int
    depth: int
    out: int
    prompt: int
    stamp: int


class _Overlay:
    """One running request's own counts (see the module docstring) and where its output stands."""

    __slots__ = ("store", "prompt_length", "next_start")

    def __init__(self, store: NodeStore, prompt_length: int, next_start: int) -> None:
        self.store = store
        self.prompt_length = prompt_length
        self.next_start = next_start  # start of the first output window not counted yet


class FrequencyTrie:
    """Draft source: a frequency trie over prompt and output windows, shared across requests.

    Parameters (defaults follow the paper and, where its text gives no number, the authors'
    reference implementation):

    ``decoding_length``
        L_d, the most draft nodes one proposal holds (the decoder's budget caps it further).
        The paper sweeps 16-128 (Fig. 4); its reference implementation defaults to 64.
    ``branch_length``
        L_b, the length of an inserted branch (a window is the token it follows plus the branch).
        Reference implementation default: 12.
    ``capacity``
        Node pruning threshold of one first-token tree (Sec. 4.3.1, N_max; per tree as in the
        authors' implementation, see the module docstring). ``None`` = 16 x ``decoding_length``,
        the best value of Table 6. After every public call no tree (the nodes whose key starts with
        a given token, that token's node included) holds more than ``capacity`` nodes, in the shared
        trie and in each overlay; a tree that passes it loses its least frequent nodes down to
        ``prune_to * capacity``, and the other trees are not touched.
    ``max_nodes``
        Bound on the whole trie (not in the paper, whose trie grows with the number of distinct
        first tokens): after every public call the shared trie holds at most ``max_nodes`` nodes,
        and so does each running request's overlay; past it the globally least frequent nodes go,
        down to ``prune_to * max_nodes``.
    ``prompt_weight``
        The "significant factor" prompt frequencies are amplified by (Sec. 4.3.2) so prompt
        branches win over output branches; 10 000 as in the reference implementation (its
        ``output_weight=1e-4``).
    ``min_nodes``
        N_m of Algorithm 1: a retrieval stage whose match offers fewer nodes retries with a
        shorter suffix. ``None`` = ``branch_length`` (the reference implementation's "token count
        is enough" rule), capped at the budget.
    ``mode``
        ``"hierarchical"`` (Sec. 4.2, the default): the ``budget`` most frequent nodes, shared
        prefixes counted once. ``"parallel"``: whole root-to-leaf branches whose lengths add up to
        the budget, as if shared prefixes were repeated (the paper's *parallel multi-branch draft*,
        for the Table 4 ablation; the decoder still merges what it gets, so only the choice of
        drafts changes, not the forward's size).
    ``prune_to``
        The low watermark: a prune goes down to ``prune_to * capacity`` nodes in the tree (or
        ``prune_to * max_nodes`` in the trie), so pruning runs once per many insertions instead of
        at every one.
    ``insert_prompt``, ``insert_output``, ``eliminate``
        Turn off one updating procedure each, for the Table 5 ablations (without ``eliminate``, a
        finished request's prompt windows join the shared trie, as prompt counts, and stay).
    """

    def __init__(self, decoding_length: int = 64, branch_length: int = 12, capacity: int | None = None,
                 prompt_weight: float = 10_000, min_nodes: int | None = None, mode: str = HIERARCHICAL,
                 prune_to: float = 0.9, insert_prompt: bool = True, insert_output: bool = True,
                 eliminate: bool = True, name: str = "trie", max_nodes: int = DEFAULT_MAX_NODES) -> None:
        if not isinstance(decoding_length, int) or decoding_length < 1:
            raise ValueError(f"decoding_length must be an int >= 1, got {decoding_length!r}")
        if not isinstance(branch_length, int) or branch_length < 1:
            raise ValueError(f"branch_length must be an int >= 1, got {branch_length!r}")
        if capacity is None:
            capacity = 16 * decoding_length
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (or None for 16 x decoding_length), got {capacity!r}")
        if not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
        if (isinstance(prompt_weight, bool) or not isinstance(prompt_weight, numbers.Real)
                or not (prompt_weight >= 1 and math.isfinite(prompt_weight))):
            raise ValueError(f"prompt_weight must be a finite number >= 1, got {prompt_weight!r}")
        if min_nodes is None:
            min_nodes = branch_length
        if not isinstance(min_nodes, int) or min_nodes < 1:
            raise ValueError(f"min_nodes must be an int >= 1, got {min_nodes!r}")
        if mode not in (HIERARCHICAL, PARALLEL):
            raise ValueError(f"mode must be {HIERARCHICAL!r} or {PARALLEL!r}, got {mode!r}")
        if isinstance(prune_to, bool) or not isinstance(prune_to, numbers.Real) or not 0.0 <= prune_to <= 1.0:
            raise ValueError(f"prune_to must be in [0, 1], got {prune_to!r}")
        self.decoding_length = decoding_length
        self.branch_length = branch_length
        self.capacity = capacity
        self.max_nodes = max_nodes
        self.prompt_weight = prompt_weight
        self.min_nodes = min_nodes
        self.mode = mode
        self.prune_to = prune_to
        self.insert_prompt = insert_prompt
        self.insert_output = insert_output
        self.eliminate = eliminate
        self.name = name
        self._lock = threading.RLock()
        self._view: pygtrie.Trie | None = None  # the pygtrie view of :attr:`trie`, made on demand
        self._view_version = -1
        self._shared = self._store()
        self._requests: dict[int, _Overlay] = {}

    def _store(self, stamp_base: int = 0) -> NodeStore:
        return NodeStore(self.capacity, self.max_nodes, self.prompt_weight, self.prune_to, stamp_base)

    # -- the DraftSource protocol -----------------------------------------------------------

    def begin(self, context: Context) -> None:
        """Branch inserting, prompt part (Sec. 4.3.1; Algorithm 1, lines 5-10): every window of the
        prompt, counted as prompt (amplified) in the request's new overlay. A request id begun again
        without ``end`` drops its earlier overlay, as ``abort`` would."""
        prompt = [int(t) for t in context.tokens[: context.prompt_length]]
        overlay = self._overlay(len(prompt))
        if self.insert_prompt:
            overlay.store.insert_all(prompt, 0, self.branch_length + 1, as_prompt=True)
            overlay.store.prune_if_needed()
        with self._lock:
            self._requests[context.request_id] = overlay

    def propose(self, context: Context, budget: int) -> Draft:
        """Trie retrieving (Sec. 4.3.2; Algorithm 1, lines 12-19) from the shared trie and the
        request's overlay read as one: see :meth:`retrieve`."""
        return Draft(branches=self.retrieve(context.tokens, budget, context.request_id))

    def observe(self, feedback: Feedback) -> None:
        """Branch inserting, output part (Algorithm 1, line 24): count the windows the committed
        tokens complete in the request's overlay, each once."""
        context = feedback.context
        with self._lock:
            overlay = self._requests.get(context.request_id)
            if overlay is None:  # observe without begin: track the output anyway, count no prompt
                overlay = self._requests[context.request_id] = self._overlay(context.prompt_length)
            if not self.insert_output:
                return
            tokens = context.tokens
            width = self.branch_length + 1
            start = overlay.next_start
            store = overlay.store
            while start + width <= len(tokens):
                store.insert(tokens, start, start + width)
                start += 1
            overlay.next_start = start
            store.prune_if_needed()

    def end(self, context: Context) -> None:
        """The request is over: count every output window in the shared trie (those running past the
        end of the output shortened), and drop the overlay, its prompt counts with it (branch
        eliminating, Sec. 4.3.1; Algorithm 1, line 27). Unknown request ids are ignored."""
        with self._lock:
            overlay = self._requests.pop(context.request_id, None)
            if overlay is None:
                return
            tokens = [int(t) for t in context.tokens]
            width = self.branch_length + 1
            shared = self._shared
            if self.insert_output and len(tokens) > overlay.prompt_length:
                shared.insert_all(tokens, self._first_output_window(overlay.prompt_length), width)
            if not self.eliminate and self.insert_prompt:  # the ablation: the prompt stays
                shared.insert_all(tokens[: overlay.prompt_length], 0, width, as_prompt=True)
            shared.prune_if_needed()

    def abort(self, context: Context) -> None:
        """The request failed (see :class:`~specdraft.sources.base.DraftSource`): drop its overlay.
        The shared trie never held anything of it, so it is exactly as it was before the request
        began, whatever other requests did meanwhile. Unknown request ids are ignored."""
        with self._lock:
            self._requests.pop(context.request_id, None)

    # -- public helpers ------------------------------------------------------------------------

    def retrieve(self, tokens: Sequence[int], budget: int, request_id: int | None = None) -> list[list[int]]:
        """Draft branches for the context ``tokens`` using at most ``budget`` draft tokens, from the
        shared trie, read together with the overlay of ``request_id`` when that request is running.

        Multi-stage retrieval (Sec. 4.3.2): match the longest suffix of ``tokens`` (at most
        ``branch_length`` tokens) that is a key of the trie and whose subtree offers at least
        ``min_nodes`` nodes; shorten it until one does (if none does, the stage that offered the
        most nodes wins, the longer suffix on ties). From the matched node take the
        ``min(budget, decoding_length)`` most frequent nodes below it, a prefix-closed subtree
        (Sec. 4.2's hierarchical draft), and return its root-to-leaf paths, the most frequent
        paths (by the frequency of their last node) first.
        """
        k = min(int(budget), self.decoding_length)
        if k <= 0 or len(tokens) == 0:
            return []
        tail = [int(t) for t in tokens[-self.branch_length :]]
        with self._lock:
            overlay = self._requests.get(request_id) if request_id is not None else None
            selected = _retrieve(self._shared, overlay.store if overlay is not None else None, tail, k,
                                 self.branch_length, self.min_nodes)
        return _branches(selected, k, self.mode == PARALLEL) if selected else []

    def insert(self, tokens: Sequence[int]) -> None:
        """Insert every window of ``tokens`` as an output branch (persistent), e.g. to warm the
        trie with past answers, as the paper does with its dev set (Sec. 5.1)."""
        tokens = [int(t) for t in tokens]
        with self._lock:
            self._shared.insert_all(tokens, 0, self.branch_length + 1)
            self._shared.prune_if_needed()

    def prune(self, target: int | None = None, *, first_token: int | None = None) -> int:
        """Node pruning of the shared trie now (normally automatic); returns how many nodes went.

        ``prune(n)``: the globally least frequent nodes until ``n`` remain in the trie.
        ``prune(n, first_token=t)``: the least frequent nodes of ``t``'s tree until ``n`` remain in
        it (default ``prune_to * capacity``). ``prune()``: every tree above ``prune_to *
        capacity`` down to it, then the trie down to ``prune_to * max_nodes`` if above.
        """
        with self._lock:
            shared = self._shared
            if first_token is not None:
                t = int(first_token)
                if t not in shared.tree_size:
                    return 0
                return shared.prune_tree(t, shared.tree_watermark() if target is None else max(0, int(target)))
            if target is not None:
                return shared.prune_global(max(0, int(target)))
            low = shared.tree_watermark()
            removed = 0
            for t in [t for t, n in shared.tree_size.items() if n > low]:
                removed += shared.prune_tree(t, low)
            return removed + shared.prune_global(shared.global_watermark())

    def clear(self) -> None:
        """Forget everything (counts and running requests)."""
        with self._lock:
            self._shared.clear()
            self._requests.clear()

    # -- inspection ----------------------------------------------------------------------------

    def tree_size(self, first_token: int) -> int:
        """Nodes in the shared tree of ``first_token`` (the nodes whose key starts with it); 0 if none."""
        with self._lock:
            return self._shared.tree_size.get(int(first_token), 0)

    def tree_sizes(self) -> dict[int, int]:
        """``first token -> node count`` of every shared tree (a copy)."""
        with self._lock:
            return dict(self._shared.tree_size)

    @property
    def trie(self) -> pygtrie.Trie:
        """Every shared node as a :class:`pygtrie.Trie` (token tuple -> :class:`TrieNode`), for reading
        only. Built from the nodes when first asked for after a change (O(trie size))."""
        with self._lock:
            shared = self._shared
            if self._view is None or self._view_version != (id(shared.token), shared.version, shared.clock):
                view = pygtrie.Trie()
                for key, n in shared.items():
                    view[key] = TrieNode(shared.token[n], shared.depth[n], shared.out[n], shared.prompt[n],
                                         shared.stamp[n])
                self._view, self._view_version = view, (id(shared.token), shared.version, shared.clock)
            return self._view

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method holds (re-entrant)."""
        return self._lock

    def __len__(self) -> int:
        """The number of shared nodes (distinct non-empty prefixes of inserted windows)."""
        return self._shared.size

    @property
    def node_count(self) -> int:
        return self._shared.size

    @property
    def active_requests(self) -> int:
        """Requests begun and not yet ended."""
        with self._lock:
            return len(self._requests)

    @property
    def prunes(self) -> int:
        """How many times pruning ran on the shared trie (per tree or global)."""
        return self._shared.prunes

    @property
    def tree_prunes(self) -> int:
        """Of :attr:`prunes`, the per-tree prunes (a tree past ``capacity``)."""
        return self._shared.tree_prunes

    @property
    def global_prunes(self) -> int:
        """Of :attr:`prunes`, the global prunes (the trie past ``max_nodes``)."""
        return self._shared.global_prunes

    @property
    def pruned_nodes(self) -> int:
        """Shared nodes removed by pruning, in total."""
        return self._shared.pruned_nodes

    def counts(self, key: Sequence[int], request_id: int | None = None) -> tuple[int, int] | None:
        """``(out, prompt)`` counts of ``key`` in the shared trie, or in the shared trie and the
        overlay of ``request_id`` added (what that request drafts from); ``None`` if neither has it."""
        key = [int(t) for t in key]
        if not key:
            return None
        with self._lock:
            found = None
            for store in self._stores(request_id):
                node = store.find(key, 0, len(key))
                if node >= 0:
                    out, prompt = found or (0, 0)
                    found = (out + store.out[node], prompt + store.prompt[node])
            return found

    def snapshot(self, request_id: int | None = None) -> dict[tuple[int, ...], tuple[int, int]]:
        """Every key as ``key -> (out, prompt)``: the shared trie's, or with ``request_id`` what that
        request drafts from (its overlay's counts added). For tests and inspection; O(trie size)."""
        with self._lock:
            out: dict[tuple[int, ...], tuple[int, int]] = {}
            for store in self._stores(request_id):
                for key, n in store.items():
                    o, p = out.get(key, (0, 0))
                    out[key] = (o + store.out[n], p + store.prompt[n])
            return out

    def check_invariants(self) -> None:
        """Assert the structural invariants of the shared trie and of every overlay (O(size); for
        tests): links agree, the key set is prefix-closed, counts are >= 0 and every node has a
        positive frequency, a parent's counts are at least the sum of its children's, the per-tree
        node counts are right and within ``capacity``, and the total is within ``max_nodes``; the
        pygtrie view holds the shared keys."""
        with self._lock:
            keys = self._shared.check()
            assert set(tuple(k) for k in self.trie.keys()) == set(keys), "the pygtrie view is stale"
            for overlay in self._requests.values():
                overlay.store.check()
                assert all(stamp >= OVERLAY_STAMPS for stamp in overlay.store.stamp[1:])

    def __repr__(self) -> str:
        return (f"FrequencyTrie(nodes={self._shared.size}, trees={len(self._shared.tree_size)}, "
                f"capacity={self.capacity}, max_nodes={self.max_nodes}, decoding_length={self.decoding_length}, "
                f"branch_length={self.branch_length}, mode={self.mode!r}, active_requests={len(self._requests)})")

    # -- internals -----------------------------------------------------------------------------

    def _overlay(self, prompt_length: int) -> _Overlay:
        return _Overlay(self._store(OVERLAY_STAMPS), prompt_length, self._first_output_window(prompt_length))

    def _first_output_window(self, prompt_length: int) -> int:
        """The first window holding a generated token starts ``branch_length`` tokens before them."""
        return max(0, prompt_length - self.branch_length)

    def _stores(self, request_id: int | None) -> list[NodeStore]:
        overlay = self._requests.get(request_id) if request_id is not None else None
        return [self._shared] if overlay is None else [self._shared, overlay.store]
