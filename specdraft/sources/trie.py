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
4.3.1 branch eliminating               a request's prompt is counted in the running part only
                                       (see below), so :meth:`~FrequencyTrie.end` takes it
                                       back exactly
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

Shared and running parts: what a request learns, and when. Every node's counts are the sum of a
*shared* part, what finished requests and :meth:`~FrequencyTrie.insert` taught, and a *running*
part, what the requests still running taught so far: their prompt windows at ``begin`` (amplified by
``prompt_weight``) and their output windows as they complete (see
:mod:`~specdraft.sources.trie_store`). Every request drafts from the sums, so it sees its own prompt
and output at once, and what the other running requests are learning too (read only), as if all
wrote to one trie. The shared part changes only when a request ends: ``end`` takes the request's
running counts back (its prompt's amplified counts with them: the paper's branch eliminating) and
counts its output windows in the shared part. A failed request (``abort``) only has its running
counts taken back; nothing it did ever reached the shared part, whose counts, stamps, clock and
prunes are kept apart from the running ones, so the shared trie is exactly as it was, by
construction, whatever other requests did meanwhile, and the other requests stop seeing what it
taught the moment it aborts. (What it may leave behind, until they end, is in what the other
running requests draft from: a tie-break stamp on nodes they counted too, and, since the running
part of all requests shares one bound, the nodes of theirs a prune of the running part took while
it ran.)

Windows. A window is ``branch_length + 1`` tokens: the token a branch follows plus the branch,
as in the authors' implementation (``token_ids[i + 1 : i + branch_length + 1]`` filed under
``token_ids[i]``), so matching one context token still yields branches of ``branch_length``.
Output windows are counted in the running part as in the paper's "incrementally put branches of O"
(Algorithm 1, line 24): each window once, when its last token is committed. At ``end`` every
output window goes into the shared trie, those that would run past the end of the output
shortened. A window counts as output if it contains at least one generated token, so the last
``branch_length`` prompt tokens (a chat template's "assistant" header, say) stay linked to what
was generated after them.

Data layout. The whole trie, both parts, is one
:class:`~specdraft.sources.trie_store.NodeStore`: nodes are indexes into flat lists of ints and
dicts of ints, none of which Python's cyclic garbage collector tracks, so a full trie of
``max_nodes`` nodes adds nothing to a full collection, and pruned or dropped nodes make no garbage
for it to find. :attr:`FrequencyTrie.trie` shows the shared nodes as a :class:`pygtrie.Trie` (token
tuple -> :class:`TrieNode`, a copy of the node's shared counts), built on demand for reading.

Thread safety. One re-entrant lock (``threading.RLock``) guards the store and the table of running
requests; every method holds it from start to end. The hot-path sections are short (``propose``
reads at most ``budget`` nodes and their siblings; ``observe`` counts the one to few windows a step
completes); ``begin`` holds it while it counts the prompt's windows, ``end`` and ``abort`` while
they take a request's counts back (a few tens of milliseconds for a prompt of some thousand tokens).
Pruning is amortised: a tree is pruned when it passes ``capacity`` and then goes down to ``prune_to
* capacity``; the whole trie when it passes ``max_nodes``, down to ``prune_to * max_nodes``.

Cost: well under 1% of a small model's CPU step per decoding step, all included. The
measurements (``benchmarks/trie_overhead.py``, ``benchmarks/gc_pauses.py``) are in the
documentation's "How the defaults were chosen" and in ``docs/reliability.md``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Sequence

import pygtrie

from ..checks import check_int, check_number
from .base import Context, Draft, Feedback
from .trie_select import branches as _branches
from .trie_select import retrieve as _retrieve
from .trie_store import ROOT, NodeStore

__all__ = ["FrequencyTrie", "TrieNode"]

HIERARCHICAL = "hierarchical"
PARALLEL = "parallel"
DEFAULT_MAX_NODES = 131_072

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


class _Request:
    """One running request: what it counted in the running part, so that it can be taken back.

    ``tokens`` are the prompt and the output counted so far; the prompt's windows were counted with
    consecutive running clocks from ``prompt_tick`` (0: none counted), the output windows, which
    start at ``first`` and go on one token at a time, with the clocks in ``ticks``."""

    __slots__ = ("tokens", "prompt_length", "prompt_tick", "first", "ticks")

    def __init__(self, context: Context, branch_length: int) -> None:
        self.tokens = [int(t) for t in context.tokens[: context.prompt_length]]
        self.prompt_length = len(self.tokens)
        self.prompt_tick = 0
        # the first window holding a generated token starts ``branch_length`` tokens before them
        self.first = max(0, self.prompt_length - branch_length)
        self.ticks: list[int] = []  # the running clock of each output window counted, in order


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
        a given token, that token's node included) holds more than ``capacity`` nodes in the shared
        trie, nor more than ``capacity`` nodes that only the running requests taught; a tree that
        passes it loses its least frequent nodes down to ``prune_to * capacity``, and the other
        trees are not touched.
    ``max_nodes``
        Bound on the whole trie (not in the paper, whose trie grows with the number of distinct
        first tokens): after every public call the shared trie holds at most ``max_nodes`` nodes,
        and the nodes only the running requests taught are at most as many; past it the globally
        least frequent nodes go, down to ``prune_to * max_nodes``.
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
        check_int("decoding_length", decoding_length, 1)
        check_int("branch_length", branch_length, 1)
        capacity = 16 * decoding_length if capacity is None else capacity
        check_int("capacity", capacity, 1, " (or None for 16 x decoding_length)")
        check_int("max_nodes", max_nodes, 1)
        check_number("prompt_weight", prompt_weight, "a finite number >= 1", lambda v: v >= 1 and math.isfinite(v))
        min_nodes = branch_length if min_nodes is None else min_nodes
        check_int("min_nodes", min_nodes, 1)
        if mode not in (HIERARCHICAL, PARALLEL):
            raise ValueError(f"mode must be {HIERARCHICAL!r} or {PARALLEL!r}, got {mode!r}")
        check_number("prune_to", prune_to, "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
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
        #: observe only counts windows; a draft reads its context and the counts as they stand
        self.observes_late = True
        self._lock = threading.RLock()
        self._view: pygtrie.Trie | None = None  # the pygtrie view of :attr:`trie`, made on demand
        self._view_version = -1
        self._store = NodeStore(capacity, max_nodes, prompt_weight, prune_to)
        self._requests: dict[int, _Request] = {}

    # -- the DraftSource protocol -----------------------------------------------------------

    def begin(self, context: Context) -> None:
        """Branch inserting, prompt part (Sec. 4.3.1; Algorithm 1, lines 5-10): every window of the
        prompt, counted as prompt (amplified) in the running part. A request id begun again without
        ``end`` has its earlier counts taken back first, as ``abort`` would."""
        request = _Request(context, self.branch_length)
        with self._lock:
            self._take_back(self._requests.pop(context.request_id, None))
            if self.insert_prompt and request.prompt_length > 1:
                request.prompt_tick = self._store.add_all(request.tokens, 0, self.branch_length + 1, True, shared=False)
                self._store.prune_if_needed()
            self._requests[context.request_id] = request

    def propose(self, context: Context, budget: int) -> Draft:
        """Trie retrieving (Sec. 4.3.2; Algorithm 1, lines 12-19): see :meth:`retrieve`."""
        return Draft(branches=self.retrieve(context.tokens, budget))

    def observe(self, feedback: Feedback) -> None:
        """Branch inserting, output part (Algorithm 1, line 24): count the windows the committed
        tokens complete in the running part, each once."""
        context = feedback.context
        with self._lock:
            request = self._requests.get(context.request_id)
            if request is None:  # observe without begin: track the output anyway, count no prompt
                request = self._requests[context.request_id] = _Request(context, self.branch_length)
            tokens = request.tokens
            tokens.extend(map(int, context.tokens[len(tokens) :]))
            if not self.insert_output:
                return
            store, ticks, width = self._store, request.ticks, self.branch_length + 1
            for start in range(request.first + len(ticks), len(tokens) - width + 1):  # (not counted yet)
                ticks.append(store.add_running(tokens, start, start + width))
            store.prune_if_needed()

    def end(self, context: Context) -> None:
        """The request is over: take its running counts back (its prompt's with them: branch
        eliminating, Sec. 4.3.1; Algorithm 1, line 27) and count every output window in the shared
        part (those running past the end of the output shortened). Unknown request ids are ignored."""
        with self._lock:
            request = self._requests.pop(context.request_id, None)
            if request is None:
                return
            self._take_back(request)
            tokens = [int(t) for t in context.tokens]
            store, width = self._store, self.branch_length + 1
            if self.insert_output and len(tokens) > request.prompt_length:
                store.add_all(tokens, request.first, width)
            if not self.eliminate and self.insert_prompt:  # the ablation: the prompt stays
                store.add_all(tokens[: request.prompt_length], 0, width, as_prompt=True)
            store.prune_if_needed()

    def abort(self, context: Context) -> None:
        """The request failed (see :class:`~specdraft.sources.base.DraftSource`): take its running
        counts back. The shared part never held anything of it, so the shared trie is exactly as it
        was before the request began, whatever other requests did meanwhile. Unknown request ids
        are ignored."""
        with self._lock:
            self._take_back(self._requests.pop(context.request_id, None))

    # -- beyond the protocol -------------------------------------------------------------------

    def retrieve(self, tokens: Sequence[int], budget: int) -> list[list[int]]:
        """Draft branches for the context ``tokens`` using at most ``budget`` draft tokens, from the
        shared trie and what the running requests taught so far, read as one (what ``propose``
        drafts from; with no request running, the shared trie alone).

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
            selected = _retrieve(self._store, tail, k, self.branch_length, self.min_nodes)
        return _branches(selected, k, self.mode == PARALLEL) if selected else []

    def insert(self, tokens: Sequence[int]) -> None:
        """Insert every window of ``tokens`` as an output branch in the shared trie (persistent),
        e.g. to warm the trie with past answers, as the paper does with its dev set (Sec. 5.1)."""
        tokens = [int(t) for t in tokens]
        with self._lock:
            self._store.add_all(tokens, 0, self.branch_length + 1)
            self._store.prune_if_needed()

    def prune(self, target: int | None = None, *, first_token: int | None = None) -> int:
        """Node pruning of the shared trie now (normally automatic); returns how many nodes went.

        ``prune(n)``: the globally least frequent nodes until ``n`` remain in the trie.
        ``prune(n, first_token=t)``: the least frequent nodes of ``t``'s tree until ``n`` remain in
        it (default ``prune_to * capacity``). ``prune()``: every tree above ``prune_to *
        capacity`` down to it, then the trie down to ``prune_to * max_nodes`` if above. What the
        running requests taught stays.
        """
        with self._lock:
            store = self._store
            if first_token is not None:
                removed = store.prune(store.tree_watermark if target is None else max(0, int(target)), int(first_token))
            elif target is not None:
                removed = store.prune(max(0, int(target)))
            else:
                low = store.tree_watermark
                removed = sum(store.prune(low, t) for t in [t for t, n in store.tree_size.items() if n > low])
                removed += store.prune(store.global_watermark)
            store.bound(shared=False)  # (a node the running requests count in stays, running only)
            return removed

    def clear(self) -> None:
        """Forget everything (counts and running requests)."""
        with self._lock:
            self._store.clear()
            self._requests.clear()

    # -- inspection ----------------------------------------------------------------------------

    def tree_size(self, first_token: int) -> int:
        """Nodes in the shared tree of ``first_token`` (the nodes whose key starts with it); 0 if none."""
        with self._lock:
            return self._store.tree_size.get(int(first_token), 0)

    def tree_sizes(self) -> dict[int, int]:
        """``first token -> node count`` of every shared tree (a copy)."""
        with self._lock:
            return dict(self._store.tree_size)

    @property
    def trie(self) -> pygtrie.Trie:
        """Every shared node as a :class:`pygtrie.Trie` (token tuple -> :class:`TrieNode`, its shared
        counts), for reading only. Built from the nodes when first asked for after a change (O(trie
        size))."""
        with self._lock:
            store = self._store
            version = (store.version, store.clock)
            if self._view is None or self._view_version != version:
                view = pygtrie.Trie()
                for key, n in store.items(shared_only=True):
                    view[key] = TrieNode(store.token[n], store.depth[n], store.shared_out[n], store.shared_prompt[n],
                                         store.shared_stamp[n])
                self._view, self._view_version = view, version
            return self._view

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method holds (re-entrant)."""
        return self._lock

    @property
    def clock(self) -> int:
        """The shared clock: output windows counted in the shared trie so far."""
        return self._store.clock

    @property
    def prunes(self) -> int:
        """How many times pruning ran on the shared trie (per tree or global)."""
        return self._store.prunes

    @property
    def tree_prunes(self) -> int:
        """Of :attr:`prunes`, the per-tree prunes (a tree past ``capacity``)."""
        return self._store.tree_prunes

    @property
    def global_prunes(self) -> int:
        """Of :attr:`prunes`, the global prunes (the trie past ``max_nodes``)."""
        return self._store.global_prunes

    @property
    def pruned_nodes(self) -> int:
        """Shared nodes removed by pruning, in total."""
        return self._store.pruned_nodes

    @property
    def running_prunes(self) -> int:
        """How many times the nodes only running requests taught were pruned."""
        return self._store.running_prunes

    def __len__(self) -> int:
        """The number of shared nodes (distinct non-empty prefixes of inserted windows)."""
        return self._store.size

    @property
    def active_requests(self) -> int:
        """Requests begun and not yet ended."""
        with self._lock:
            return len(self._requests)

    def counts(self, key: Sequence[int], running: bool = False) -> tuple[int, int] | None:
        """``(out, prompt)`` counts of ``key`` in the shared trie, or with ``running`` in what the
        running requests draft from (the running counts added); ``None`` if it has none there."""
        key = [int(t) for t in key]
        with self._lock:
            store = self._store
            node = store.find(key, 0, len(key))
            if node in (-1, ROOT) or not (running or store.is_shared(node)):  # (the root: the empty key)
                return None
            if running:
                return store.out[node], store.prompt[node]
            return store.shared_out[node], store.shared_prompt[node]

    def snapshot(self, running: bool = False) -> dict[tuple[int, ...], tuple[int, int]]:
        """Every key as ``key -> (out, prompt)``: the shared trie's, or with ``running`` what the
        running requests draft from (the running counts added). For tests and inspection; O(trie
        size)."""
        with self._lock:
            store = self._store
            if running:
                return {key: (store.out[n], store.prompt[n]) for key, n in store.items()}
            return {key: (store.shared_out[n], store.shared_prompt[n]) for key, n in store.items(shared_only=True)}

    def check_invariants(self) -> None:
        """Assert the structural invariants (O(size); for tests): links agree, the key sets are
        prefix-closed, both parts are >= 0 and every node holds a count, a parent's counts are at
        least the sum of its children's, the per-tree node counts are right and within
        ``capacity``, and the totals within ``max_nodes``; the pygtrie view holds the shared keys;
        with no request running, no running count is left."""
        with self._lock:
            keys = self._store.check()
            assert set(tuple(k) for k in self.trie.keys()) == set(keys), "the pygtrie view is stale"
            if not self._requests:  # then what requests draft from is the shared trie alone
                left = self.snapshot(running=True).items() - self.snapshot().items()
                assert not left, f"running counts outlived their request at {sorted(left)[:3]}"

    def __repr__(self) -> str:
        return (f"FrequencyTrie(nodes={self._store.size}, trees={len(self._store.tree_size)}, "
                f"capacity={self.capacity}, max_nodes={self.max_nodes}, decoding_length={self.decoding_length}, "
                f"branch_length={self.branch_length}, mode={self.mode!r}, active_requests={len(self._requests)})")

    # -- internals (callers hold the lock) ------------------------------------------------------

    def _take_back(self, request: _Request | None) -> None:
        """Take every running count of ``request`` back: its prompt windows and its output windows
        (nothing for ``None``, a request id not running)."""
        if request is None:
            return
        store, width, tokens = self._store, self.branch_length + 1, request.tokens
        if request.prompt_tick:
            n = request.prompt_length
            for start in range(n - 1):
                store.take_back(tokens, start, min(start + width, n), True, request.prompt_tick + start)
        for start, tick in enumerate(request.ticks, request.first):
            store.take_back(tokens, start, start + width, False, tick)
        store.sort_free()  # (outside any step: the next steps' new nodes take runs of what went)
