"""Frequency trie: Ant Group's *Lookahead* (Zhao et al., KDD 2024), one trie shared by every request.

The trie remembers short windows of tokens from prompts and outputs with how often each prefix
was seen; a draft is the most frequent part of the subtree below the longest context suffix it
knows. Because it outlives requests, what one answer taught it speeds up the next one.

Where each part of the paper lives here:

=====================================  ======================================================
paper                                  this module
=====================================  ======================================================
4.2   hierarchical multi-branch draft  :meth:`FrequencyTrie.retrieve` returns the leaf paths of
                                       a prefix-closed subtree (the decoder merges the shared
                                       prefixes back into one tree); ``mode="parallel"`` gives
                                       the paper's *parallel* draft for its ablation
4.3.1 branch inserting                 :meth:`~FrequencyTrie.begin` (prompt, amplified),
                                       :meth:`~FrequencyTrie.observe` and
                                       :meth:`~FrequencyTrie.end` (output), :meth:`~FrequencyTrie.insert`
4.3.1 branch eliminating               :meth:`~FrequencyTrie.end` removes exactly the request's
                                       prompt contribution (:meth:`~FrequencyTrie.abort`, for a
                                       failed request, takes back all it taught, outputs too)
4.3.1 node pruning                     ``_prune_tree``: least frequent nodes of one first-token
                                       tree first, past ``capacity``; ``_prune_global``: least
                                       frequent nodes of the whole trie, past ``max_nodes``
4.3.2 multi-stage retrieval            ``_retrieve``: longest suffix first, shorter until the
                                       match offers ``min_nodes`` nodes, then the ``budget``
                                       most frequent nodes
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
Two departures from the reference: pruning drops the least frequent
nodes as the paper's text says (the reference instead halves output counts and drops the nodes
at count <= 1, in batches), and, since a per-tree bound alone lets memory grow with the number
of distinct tokens (up to vocabulary x capacity), ``max_nodes`` bounds the whole trie as well,
dropping the globally least frequent nodes first; its default, 131072 nodes, is about
54 MB (51 MiB) at the measured ~410 bytes per node.

Data layout. Every node (every distinct prefix of an inserted window) is a :class:`TrieNode`
linked to its parent and holding a dict of its children, with two counts: ``out``, the number of output
windows through it (persistent), and ``prompt``, the number of prompt windows of *active* requests
through it (removed when the request ends). Its frequency is ``out + prompt_weight * prompt``.
Because a window through a node passes through all its ancestors, a parent's counts are never
below the sum of its children's: frequencies shrink going down, so "the most frequent nodes" is
always a prefix-closed set, and so is "the least frequent nodes" once ties go deepest-first.
A retrieval touches only the nodes it returns and their siblings, never the whole trie. The
:attr:`FrequencyTrie.trie` property shows the same nodes as a :class:`pygtrie.Trie` (token tuple
-> node), built on demand for reading: keeping a pygtrie up to date on every insertion cost
most of the time of indexing a prompt (about 90 us per prompt token at ``branch_length=12``,
1.5 s for a 16k-token prompt), for a structure retrieval never reads.

Windows. A window is ``branch_length + 1`` tokens: the token a branch follows plus the branch,
as in the authors' implementation (``token_ids[i + 1 : i + branch_length + 1]`` filed under
``token_ids[i]``), so matching one context token still yields branches of ``branch_length``.
Output windows are inserted incrementally as in the paper's "incrementally put branches of O"
(Algorithm 1, line 24) and the authors' ``stream_put``: each window once, when its last token is
committed; windows that would run past the end of the output are inserted, shortened, when the
request ends. A window counts as output if it contains at least one generated token, so the last
``branch_length`` prompt tokens (a chat template's "assistant" header, say) stay linked to what
was generated after them.

Thread safety. One re-entrant lock (``threading.RLock``) guards all state; every method that
reads or changes the trie holds it from start to end, so one trie may serve any number of
requests, ``Decoder`` instances and threads at once. The hot-path sections are short
(``propose`` touches at most ``budget`` nodes and their siblings; ``observe`` inserts the one to
few windows a step completes), so decoders in different threads barely wait for each other.
``begin`` holds the lock while it inserts the whole prompt (tens of milliseconds for 512 tokens
at ``branch_length=12``), and a prune holds it while it ranks the nodes it prunes from. Pruning
is amortised: a tree is pruned when it passes ``capacity`` and then goes down to ``prune_to *
capacity``; the whole trie when it passes ``max_nodes``, down to ``prune_to * max_nodes``. A
tree's prune ranks only that tree's nodes (reached through the child index), O(T log T) for a
tree of T nodes, about 1 ms for a full 1024-node tree; a global prune ranks every node,
O(N log N), but runs only once per ~13000 new nodes at the default ``max_nodes``, and not at all
while the trie stays below it.

Cost: well under 1% of a small model's CPU step per decoding step, all included; about 410 bytes
per node were measured with the pygtrie kept alongside (the node, its child dict, and the pygtrie
node with its child map); without it a node takes less. The measurements
(``benchmarks/trie_overhead.py``) are in the documentation's "How the defaults were chosen".
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Sequence

import pygtrie

from .bulk import collector_paused
from .base import Context, Draft, Feedback

__all__ = ["FrequencyTrie", "TrieNode"]

HIERARCHICAL = "hierarchical"
PARALLEL = "parallel"
DEFAULT_MAX_NODES = 131_072


class TrieNode:
    """One node of the trie: its counts and links.

    ``out`` counts output windows through the node, ``prompt`` the prompt windows of requests
    still running. ``stamp`` is the insertion clock of the last window that touched the node (the
    tie-break of pruning: among equally frequent nodes the stalest goes first). ``children`` maps
    token -> child node (the child index retrieval walks).
    """

    __slots__ = ("token", "parent", "depth", "children", "out", "prompt", "stamp", "alive")

    def __init__(self, token: int, parent: "TrieNode | None", depth: int) -> None:
        self.token = token
        self.parent = parent
        self.depth = depth
        self.children: dict[int, TrieNode] = {}
        self.out = 0
        self.prompt = 0
        self.stamp = 0
        self.alive = True

    def __repr__(self) -> str:
        return f"TrieNode(token={self.token}, depth={self.depth}, out={self.out}, prompt={self.prompt})"


@dataclass
class _Request:
    """Per-request bookkeeping, keyed by ``Context.request_id``; it lives only while the request does.

    ``contributed`` maps every node this request's prompt counted (by identity) to the stamp it had
    before the request first touched it: :meth:`FrequencyTrie._eliminate` takes the counts back,
    :meth:`FrequencyTrie.abort` the stamps too (``prompt_clocks`` are the clocks of the prompt's
    windows, first and last: a node whose stamp is in that range was last touched by one of them).

    ``journal`` is the undo log :meth:`FrequencyTrie.abort` replays backwards, in the order things
    happened: one ``(deepest node, clock, old stamps)`` tuple per output window inserted (the stamps
    the window's pre-existing nodes had before it, top-down; the nodes it made come after them and
    had none), and, while the request is ``exclusive``, the top node of every subtree a prune
    removed during one of the request's calls (the node objects themselves: a removed subtree is
    never touched again, so its counts, stamps and child links are as they were when it went).
    ``base`` is the trie's clock, edit counter and prune counters before the request, ``mark`` the
    clock and edit counter after its latest call: if they differ at its next call, something else
    changed the trie (or another request ended) in between and ``exclusive`` goes (for good, with
    the prune records, which only an exact undo uses).
    """

    prompt: tuple[int, ...]
    prompt_length: int
    next_start: int  # start of the first output window not inserted yet
    base: tuple[int, ...] = ()
    mark: tuple[int, int] = (0, 0)
    exclusive: bool = True
    prompt_clocks: tuple[int, int] = (1, 0)  # an empty range: no prompt window yet
    contributed: dict = field(default_factory=dict)  # node (by identity) -> its stamp before the request
    journal: list = field(default_factory=list)


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
        a given token, that token's node included) holds more than ``capacity`` nodes; a tree that
        passes it loses its least frequent nodes down to ``prune_to * capacity``, and the other
        trees are not touched.
    ``max_nodes``
        Bound on the whole trie (not in the paper, whose trie grows with the number of distinct
        first tokens): after every public call the trie holds at most ``max_nodes`` nodes, the
        running requests' prompt branches included; past it the globally least frequent nodes go,
        down to ``prune_to * max_nodes``. The default 131072 is about 54 MB (~410 bytes per node,
        measured by ``benchmarks/trie_overhead.py``).
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
        Turn off one updating procedure each, for the Table 5 ablations.
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
        self._version = 0  # structural changes (nodes made or removed): when the view is stale
        self._root = TrieNode(-1, None, 0)  # the empty key; never stored, never counted
        self._size = 0
        self._tree_size: dict[int, int] = {}  # first token -> nodes of its tree (its own node included)
        self._grown: set[int] = set()  # first tokens whose tree got new nodes since the last check
        self._clock = 0  # windows inserted so far: a window's clock stamps the nodes it touches
        self._edits = 0  # changes other than insertions (removals, requests ending, ...): with the
        # clock, it tells a request whether anything else happened to the trie between two of its calls
        self._requests: dict[int, _Request] = {}
        self.prunes = 0  #: how many times pruning ran (per tree or global)
        self.tree_prunes = 0  #: of which per-tree prunes (a tree past ``capacity``)
        self.global_prunes = 0  #: of which global prunes (the trie past ``max_nodes``)
        self.pruned_nodes = 0  #: nodes removed by pruning, in total

    # -- the DraftSource protocol -----------------------------------------------------------

    def begin(self, context: Context) -> None:
        """Branch inserting, prompt part (Sec. 4.3.1; Algorithm 1, lines 5-10): every window of the
        prompt, counted as prompt (amplified, and removed again by :meth:`end`)."""
        prompt = tuple(int(t) for t in context.tokens[: context.prompt_length])
        with self._lock, collector_paused():
            old = self._requests.pop(context.request_id, None)
            if old is not None:  # a reused id: the old request ends here, its prompt taken back first
                self._edits += 1
                if self.eliminate:
                    self._eliminate(old)
            req = self._new_request(prompt, len(prompt))
            self._requests[context.request_id] = req
            if self.insert_prompt:
                width = self.branch_length + 1
                first = self._clock + 1
                for start in range(len(prompt) - 1):
                    self._insert(prompt, start, min(start + width, len(prompt)), req.contributed)
                req.prompt_clocks = (first, self._clock)
                self._prune_if_needed(req.journal)
            req.mark = (self._clock, self._edits)

    def propose(self, context: Context, budget: int) -> Draft:
        """Trie retrieving (Sec. 4.3.2; Algorithm 1, lines 12-19): see :meth:`retrieve`."""
        return Draft(branches=self.retrieve(context.tokens, budget))

    def observe(self, feedback: Feedback) -> None:
        """Branch inserting, output part (Algorithm 1, line 24): insert the windows the committed
        tokens complete, each once."""
        context = feedback.context
        with self._lock:
            req = self._requests.get(context.request_id)
            if req is None:  # observe without begin: track the output anyway, insert no prompt
                req = self._new_request((), context.prompt_length)
                self._requests[context.request_id] = req
            elif req.exclusive and req.mark != (self._clock, self._edits):
                self._not_exclusive(req)
            if not self.insert_output:
                return
            tokens = context.tokens
            width = self.branch_length + 1
            start = req.next_start
            journal = req.journal
            while start + width <= len(tokens):
                self._insert(tokens, start, start + width, None, journal)
                start += 1
            req.next_start = start
            self._prune_if_needed(journal if req.exclusive else None)
            req.mark = (self._clock, self._edits)

    def end(self, context: Context) -> None:
        """The request is over: insert its unfinished output windows (shortened at the end of the
        output), then branch eliminating (Sec. 4.3.1; Algorithm 1, line 27): subtract exactly what
        this request's prompt added. Output branches stay. Unknown request ids are ignored."""
        with self._lock:
            req = self._requests.pop(context.request_id, None)
            if req is None:
                return
            self._edits += 1  # even if nothing below changes the trie: see abort
            tokens = context.tokens
            if self.insert_output and len(tokens) > req.prompt_length:
                for start in range(req.next_start, len(tokens) - 1):
                    self._insert(tokens, start, len(tokens), None)
            if self.eliminate and req.contributed:
                self._eliminate(req)
            req.contributed.clear()
            self._prune_if_needed()

    def abort(self, context: Context) -> None:
        """The request failed (see :class:`~specdraft.sources.base.DraftSource`): take back
        everything it taught the trie, then drop it. Unknown request ids are ignored.

        The request's undo journal (see ``_Request``) is replayed backwards: an output window is
        taken back by subtracting its ``out`` count along its path, top-down, removing a node whose
        frequency drops to zero with its subtree, as :meth:`_eliminate` does for prompt counts, and
        by giving each node the stamp it had before the window; a subtree a prune removed is put
        back, the same node objects with their counts, stamps and children. Then the prompt
        contribution goes as in :meth:`end` (whatever ``eliminate`` says: a failed request leaves
        nothing), its nodes get their stamps from before the request back, and the clock, the
        prune counters (``prunes``, ``tree_prunes``, ``global_prunes``, ``pruned_nodes``) go back
        to their values before it. No end-of-output windows are inserted.

        Exact when nothing else changed the trie, and no other request ended, between this request's
        ``begin`` and its abort (reads, and other calls that changed nothing, do not count; nor does
        another request begun and aborted exactly in between two of this one's calls, which left the
        trie as it found it). An ending counts even when it changes nothing that can be seen: the
        ended request's prompt counts may sit in a subtree this request pruned, and putting it back
        would bring them back with nobody left to take them away. Then each undo step meets the trie
        exactly as the step it undoes left it, so the replay walks the states back one by one to the
        one before ``begin``: same keys, counts, stamps, clock, tree sizes and counters (nodes the
        request made come back to zero and go; nodes it pruned come back as they were, under the
        same parents: a prune removes whole subtrees, so the parent of a subtree's top stayed, and
        whatever removed it later is undone first). Only the order of a node's children can differ
        (a subtree put back comes last among its siblings), and no result depends on it: the
        frontier of a retrieval (``_select``) never holds two nodes with the same frequency and
        stamp (the same stamp means the same last window, hence one path, and an ancestor and its
        descendant are never in the frontier together), and pruning orders nodes by frequency, depth
        and stamp, which never tie either. So drafts, prunes and everything after are as if the
        request had never run. Putting the same node objects back (rather than new ones) also keeps
        other running requests' ``contributed`` valid.

        When something else did change the trie meanwhile (other requests running at the same
        time), the abort is best effort and the trie stays consistent (``check_invariants``
        passes): every output window is taken back from the nodes of its path still in the trie (a
        node in the trie since the window was counted holds the window's count; one a prune took,
        or a node made again since, does not, and is skipped with what lies below it), the stamps
        go back where no later window touched the node, the prompt goes as in :meth:`end`; what
        was pruned stays pruned (it may hold prompt counts of requests that ended since, which
        nothing would ever take back), and the clock and counters stay; this ending too counts as
        a change for the other running requests.

        Cost: the journal holds one small tuple per output window (the deepest node, the clock, the
        old stamps of the path's pre-existing nodes) and, while the request has the trie to itself,
        the subtrees its calls pruned (kept from the garbage collector until it ends); it is
        dropped with the request. The abort itself is linear in what the request inserted and
        pruned.
        """
        with self._lock:
            req = self._requests.pop(context.request_id, None)
            if req is None:
                return
            if req.exclusive and req.mark != (self._clock, self._edits):
                self._not_exclusive(req)
            for entry in reversed(req.journal):
                if type(entry) is tuple:
                    self._undo_window(entry)
                else:
                    self._revive(entry)
            req.journal.clear()
            if req.contributed:
                self._eliminate(req)
                lo, hi = req.prompt_clocks
                for node, stamp in req.contributed.items():
                    if node.alive and lo <= node.stamp <= hi:
                        node.stamp = stamp
                req.contributed.clear()
            if req.exclusive:
                (self._clock, self._edits, self.prunes, self.tree_prunes, self.global_prunes,
                 self.pruned_nodes) = req.base
            else:
                self._edits += 1

    # -- public helpers ------------------------------------------------------------------------

    def retrieve(self, tokens: Sequence[int], budget: int) -> list[list[int]]:
        """Draft branches for the context ``tokens`` using at most ``budget`` draft tokens.

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
        with self._lock:
            selected = self._retrieve(tokens, k)
            if not selected:
                return []
            return self._branches(selected, k)

    def insert(self, tokens: Sequence[int]) -> None:
        """Insert every window of ``tokens`` as an output branch (persistent), e.g. to warm the
        trie with past answers, as the paper does with its dev set (Sec. 5.1)."""
        tokens = tuple(int(t) for t in tokens)
        width = self.branch_length + 1
        with self._lock:
            for start in range(len(tokens) - 1):
                self._insert(tokens, start, min(start + width, len(tokens)), None)
            self._prune_if_needed()

    def prune(self, target: int | None = None, *, first_token: int | None = None) -> int:
        """Node pruning now (normally automatic); returns how many nodes went.

        ``prune(n)``: the globally least frequent nodes until ``n`` remain in the trie.
        ``prune(n, first_token=t)``: the least frequent nodes of ``t``'s tree until ``n`` remain in
        it (default ``prune_to * capacity``). ``prune()``: every tree above ``prune_to *
        capacity`` down to it, then the trie down to ``prune_to * max_nodes`` if above.
        """
        with self._lock:
            if first_token is not None:
                t = int(first_token)
                if t not in self._tree_size:
                    return 0
                return self._prune_tree(t, self._tree_watermark() if target is None else max(0, int(target)))
            if target is not None:
                return self._prune_global(max(0, int(target)))
            low = self._tree_watermark()
            removed = 0
            for t in [t for t, n in self._tree_size.items() if n > low]:
                removed += self._prune_tree(t, low)
            return removed + self._prune_global(self._global_watermark())

    def tree_size(self, first_token: int) -> int:
        """Nodes in the tree of ``first_token`` (the nodes whose key starts with it); 0 if none."""
        with self._lock:
            return self._tree_size.get(int(first_token), 0)

    def tree_sizes(self) -> dict[int, int]:
        """``first token -> node count`` of every tree (a copy)."""
        with self._lock:
            return dict(self._tree_size)

    def clear(self) -> None:
        """Forget everything (counts and running requests)."""
        with self._lock:
            for _, node in self._iter_nodes():
                node.alive = False
            self._root = TrieNode(-1, None, 0)
            self._version += 1
            self._size = 0
            self._tree_size.clear()
            self._grown.clear()
            self._requests.clear()
            self._edits += 1

    @property
    def trie(self) -> pygtrie.Trie:
        """Every node as a :class:`pygtrie.Trie` (token tuple -> :class:`TrieNode`), for reading only.
        Built from the nodes when first asked for after a change (O(trie size)); hold :attr:`lock`
        while reading it if other threads may be writing."""
        with self._lock:
            if self._view is None or self._view_version != self._version:
                view = pygtrie.Trie()
                for key, node in self._iter_nodes():
                    view[key] = node
                self._view, self._view_version = view, self._version
            return self._view

    def _iter_nodes(self):
        """``(key, node)`` for every node, parents before children (callers hold the lock)."""
        stack = [((), self._root)]
        while stack:
            key, node = stack.pop()
            for token, child in node.children.items():
                child_key = key + (token,)
                yield child_key, child
                stack.append((child_key, child))

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method holds (re-entrant)."""
        return self._lock

    def __len__(self) -> int:
        """The number of nodes (distinct non-empty prefixes of inserted windows)."""
        return self._size

    @property
    def node_count(self) -> int:
        return self._size

    @property
    def active_requests(self) -> int:
        """Requests begun and not yet ended."""
        with self._lock:
            return len(self._requests)

    def counts(self, key: Sequence[int]) -> tuple[int, int] | None:
        """``(out, prompt)`` counts of the node for ``key``, or ``None`` if there is none."""
        with self._lock:
            node = self._root
            for token in key:
                node = node.children.get(int(token))
                if node is None:
                    return None
            return None if node is self._root else (node.out, node.prompt)

    def snapshot(self) -> dict[tuple[int, ...], tuple[int, int]]:
        """Every node as ``key -> (out, prompt)`` (for tests and inspection; O(trie size))."""
        with self._lock:
            return {key: (node.out, node.prompt) for key, node in self._iter_nodes()}

    def check_invariants(self) -> None:
        """Assert the structural invariants (O(trie size); for tests): the pygtrie view and the
        child index hold the same nodes, the key set is prefix-closed, counts are >= 0 and every node
        has a positive frequency, a parent's counts are at least the sum of its children's, the
        per-tree node counts are right and within ``capacity``, and the total is within
        ``max_nodes``."""
        with self._lock:
            keys = {}
            for key, node in self.trie.iteritems():
                key = tuple(key)
                assert node.alive, f"dead node stored under {key}"
                assert node.depth == len(key) and node.token == key[-1], f"node {node} stored under {key}"
                keys[key] = node
            assert len(keys) == self._size, f"node count {self._size} but {len(keys)} keys"
            seen = 0
            stack = [((), self._root)]
            while stack:
                key, node = stack.pop()
                child_out = child_prompt = 0
                for token, child in node.children.items():
                    child_key = key + (token,)
                    assert keys.get(child_key) is child, f"child index and pygtrie disagree at {child_key}"
                    assert child.parent is node and child.token == token
                    assert child.out >= 0 and child.prompt >= 0, f"negative count at {child_key}: {child}"
                    assert child.out + child.prompt > 0, f"zero-frequency node kept at {child_key}"
                    child_out += child.out
                    child_prompt += child.prompt
                    stack.append((child_key, child))
                    seen += 1
                if node is not self._root:
                    assert node.out >= child_out and node.prompt >= child_prompt, \
                        f"counts grow going down at {key}: {node} vs children {child_out}, {child_prompt}"
            assert seen == self._size, f"child index holds {seen} nodes, node count is {self._size}"
            per_tree: dict[int, int] = {}
            for key in keys:
                assert len(key) == 1 or key[:-1] in keys, f"not prefix-closed: {key} has no parent"
                per_tree[key[0]] = per_tree.get(key[0], 0) + 1
            assert per_tree == self._tree_size, "per-tree node counts are off"
            for t, n in per_tree.items():
                assert n <= self.capacity, f"tree {t} holds {n} nodes, capacity is {self.capacity}"
            assert self._size <= self.max_nodes, f"{self._size} nodes exceed max_nodes {self.max_nodes}"

    def __repr__(self) -> str:
        return (f"FrequencyTrie(nodes={self._size}, trees={len(self._tree_size)}, capacity={self.capacity}, "
                f"max_nodes={self.max_nodes}, decoding_length={self.decoding_length}, "
                f"branch_length={self.branch_length}, mode={self.mode!r}, active_requests={len(self._requests)})")

    # -- internals (callers hold the lock) -----------------------------------------------------

    def _new_request(self, prompt: tuple[int, ...], prompt_length: int) -> _Request:
        req = _Request(prompt, prompt_length, max(0, prompt_length - self.branch_length))
        req.base = (self._clock, self._edits, self.prunes, self.tree_prunes, self.global_prunes, self.pruned_nodes)
        req.mark = (self._clock, self._edits)
        return req

    @staticmethod
    def _not_exclusive(req: _Request) -> None:
        """Something else changed the trie since the request's last call: its abort can no longer
        be exact, so the prune records (used only by an exact undo) go, and no more are kept."""
        req.exclusive = False
        req.journal = [entry for entry in req.journal if type(entry) is tuple]

    def _insert(self, tokens: Sequence[int], start: int, stop: int, contributed: dict | None,
                journal: list | None = None) -> None:
        """Count one window ``tokens[start:stop]``: as prompt (into ``contributed``, each node with
        its stamp from before the request's first touch) or as output; with ``journal``, log it for
        :meth:`abort` as ``(deepest node, clock, old stamps of the nodes that existed)``."""
        self._clock += 1
        clock = self._clock
        olds = [] if journal is not None else None
        node = self._root
        i = start
        while i < stop:
            child = node.children.get(tokens[i])
            if child is None:
                break
            if contributed is None:
                child.out += 1
            else:
                child.prompt += 1
                if child not in contributed:
                    contributed[child] = child.stamp
            if olds is not None:
                olds.append(child.stamp)
            child.stamp = clock
            node = child
            i += 1
        if i < stop:  # below a missing node everything is missing: make the rest, counted once
            for child in self._create(node, tokens, start, i, stop):
                if contributed is None:
                    child.out = 1
                else:
                    child.prompt = 1
                    contributed[child] = 0
                child.stamp = clock
            node = child
        if journal is not None:
            journal.append((node, clock, olds))

    def _create(self, parent: TrieNode, tokens: Sequence[int], start: int, first: int, stop: int) -> list[TrieNode]:
        """Make the nodes for ``tokens[first:stop]`` below ``parent`` (the node of
        ``tokens[start:first]``) in the child index; returns them, top-down, with zero counts."""
        made = []
        node = parent
        for j in range(first, stop):
            child = TrieNode(tokens[j], node, node.depth + 1)
            node.children[tokens[j]] = child
            made.append(child)
            node = child
        self._size += len(made)
        self._version += 1
        tree = tokens[start]
        self._tree_size[tree] = self._tree_size.get(tree, 0) + len(made)
        self._grown.add(tree)
        return made

    def _eliminate(self, req: _Request) -> None:
        """Walk the request's prompt windows again and take back one count per window per node.

        A node this request never counted (it was pruned and then made anew by someone else) stops
        the walk: its subtree was made after the prune too, so it holds nothing of ours. A node
        whose frequency drops to zero goes with its subtree (all zero as well, counts shrink
        going down).
        """
        prompt, mine = req.prompt, req.contributed
        width = self.branch_length + 1
        root = self._root
        for start in range(len(prompt) - 1):
            node = root
            for i in range(start, min(start + width, len(prompt))):
                child = node.children.get(prompt[i])
                if child is None or child not in mine:
                    break
                child.prompt -= 1
                if child.prompt == 0 and child.out == 0:
                    self._remove(child)
                    break
                node = child

    def _remove(self, node: TrieNode) -> int:
        """Remove ``node`` and its subtree from both structures; returns the number of nodes."""
        key = self._key(node)
        del node.parent.children[node.token]
        self._version += 1
        removed = 0
        stack = [node]
        while stack:
            n = stack.pop()
            n.alive = False
            removed += 1
            stack.extend(n.children.values())
        self._size -= removed
        left = self._tree_size[key[0]] - removed
        if left:
            self._tree_size[key[0]] = left
        else:  # the first-token node itself went: the whole tree
            del self._tree_size[key[0]]
        self._edits += 1
        return removed

    def _undo_window(self, entry: tuple[TrieNode, int, list[int]]) -> None:
        """Take back one journaled output window (for :meth:`abort`): one ``out`` count from each
        node of its path, top-down, and the stamps it set where no later window touched the node.

        The path is the deepest node's chain of parents (parent links never change). A node still
        in the trie (``alive``) is the one the window counted, so it holds the window's count;
        a removed node took the count with it, and everything below it went too, so the walk
        stops there. A node whose frequency drops to zero goes with its subtree (all zero as well:
        counts shrink going down), as in :meth:`_eliminate`.
        """
        node, clock, olds = entry
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        existed = len(olds)
        for depth, node in enumerate(path):
            if not node.alive:
                break
            node.out -= 1
            if depth < existed and node.stamp == clock:
                node.stamp = olds[depth]
            if node.out == 0 and node.prompt == 0:
                self._remove(node)
                break
        self._edits += 1

    def _revive(self, top: TrieNode) -> None:
        """Put back a subtree a prune removed (for an exact :meth:`abort`): the same node objects,
        with the counts, stamps and children they had, under the same parent (alive again by then),
        in the child index (last among its siblings: no result depends on the order, see
        :meth:`abort`)."""
        top.parent.children[top.token] = top
        key = self._key(top)
        revived = 0
        stack = [(key, top)]
        while stack:
            key_n, node = stack.pop()
            node.alive = True
            revived += 1
            stack.extend((key_n + (token,), child) for token, child in node.children.items())
        self._size += revived
        self._version += 1
        self._tree_size[key[0]] = self._tree_size.get(key[0], 0) + revived
        self._edits += 1

    @staticmethod
    def _key(node: TrieNode) -> tuple[int, ...]:
        key = []
        while node.parent is not None:
            key.append(node.token)
            node = node.parent
        return tuple(reversed(key))

    def _tree_watermark(self) -> int:
        return min(self.capacity, int(self.capacity * self.prune_to))

    def _global_watermark(self) -> int:
        return min(self.max_nodes, int(self.max_nodes * self.prune_to))

    def _prune_if_needed(self, journal: list | None = None) -> None:
        """After every call that may add nodes: prune each grown tree past ``capacity``, then the
        whole trie if past ``max_nodes``. Only the trees that grew are looked at. The top of every
        subtree removed is appended to ``journal`` if given (for :meth:`abort`)."""
        if self._grown:
            capacity, sizes = self.capacity, self._tree_size
            over = [t for t in self._grown if sizes.get(t, 0) > capacity]
            self._grown.clear()
            if over:
                low = self._tree_watermark()
                for t in over:
                    self._prune_tree(t, low, journal)
        if self._size > self.max_nodes:
            self._prune_global(self._global_watermark(), journal)

    def _prune_tree(self, first_token: int, target: int, journal: list | None = None) -> int:
        """Node pruning (Sec. 4.3.1) in one first-token tree: drop its least frequent nodes until
        ``target`` remain in it. Touches only that tree: O(T log T) for a tree of T nodes."""
        top = self._root.children.get(first_token)
        if top is None or self._tree_size[first_token] <= target:
            return 0
        nodes = []
        stack = [top]
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children.values())
        removed = self._drop(nodes, len(nodes) - target, journal)
        self.tree_prunes += 1
        return removed

    def _prune_global(self, target: int, journal: list | None = None) -> int:
        """Node pruning over the whole trie (the ``max_nodes`` bound): drop the globally least
        frequent nodes until ``target`` remain. O(N log N) for N nodes."""
        if self._size <= target:
            return 0
        nodes = []
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children.values())
        removed = self._drop(nodes, self._size - target, journal)
        self.global_prunes += 1
        return removed

    def _drop(self, nodes: list[TrieNode], excess: int, journal: list | None = None) -> int:
        """Remove the ``excess`` least frequent of ``nodes`` (a set closed under descendants).

        Order: frequency ascending, then deepest first, then stalest first. A node's descendants
        are never more frequent and always deeper, so they come before it: the dropped set is
        closed under descendants and the trie stays prefix-closed.
        """
        if excess <= 0:
            return 0
        w = self.prompt_weight
        key = lambda n: (n.out + w * n.prompt, -n.depth, n.stamp)  # noqa: E731
        if excess >= len(nodes):
            victims = nodes
        elif 4 * excess < len(nodes):
            victims = heapq.nsmallest(excess, nodes, key=key)
        else:
            nodes.sort(key=key)
            victims = nodes[:excess]
        doomed = set(victims)
        removed = 0
        for node in victims:
            if node.parent not in doomed:  # the top of a doomed subtree (the root is never doomed)
                removed += self._remove(node)
                if journal is not None:
                    journal.append(node)
        assert removed == len(victims), "pruned set was not closed under descendants"
        self.prunes += 1
        self.pruned_nodes += removed
        return removed

    def _retrieve(self, tokens: Sequence[int], k: int) -> list[tuple[TrieNode, int]]:
        """Multi-stage retrieval; returns the selection of :meth:`_select` (empty if no match)."""
        n = len(tokens)
        need = min(self.min_nodes, k)
        best: list[tuple[TrieNode, int]] = []
        root = self._root
        for m in range(min(self.branch_length, n), 0, -1):
            node = root
            for i in range(n - m, n):
                node = node.children.get(tokens[i])
                if node is None:
                    break
            if node is None or not node.children:
                continue
            selected = self._select(node, k)
            if len(selected) >= need:
                return selected
            if len(selected) > len(best):
                best = selected
        return best

    def _select(self, start: TrieNode, k: int) -> list[tuple[TrieNode, int]]:
        """The ``k`` most frequent nodes below ``start`` (best first; ties: most recent first),
        as ``(node, index of its parent in the list or -1)``: a prefix-closed subtree, because a
        child is never more frequent than its parent and enters the frontier only after it."""
        w = self.prompt_weight
        tie = itertools.count()
        heap = [(-(c.out + w * c.prompt), -c.stamp, next(tie), c, -1) for c in start.children.values()]
        heapq.heapify(heap)
        selected: list[tuple[TrieNode, int]] = []
        while heap and len(selected) < k:
            _, _, _, node, parent = heapq.heappop(heap)
            index = len(selected)
            selected.append((node, parent))
            for c in node.children.values():
                heapq.heappush(heap, (-(c.out + w * c.prompt), -c.stamp, next(tie), c, index))
        return selected

    def _branches(self, selected: list[tuple[TrieNode, int]], k: int) -> list[list[int]]:
        """Root-to-leaf token paths of the selection, most frequent leaf first (deeper first on
        ties, then selection order). Parallel mode keeps whole paths while their total length
        fits ``k`` (the last one cut to fit), shared prefixes counted once per branch."""
        has_child = [False] * len(selected)
        for _, parent in selected:
            if parent >= 0:
                has_child[parent] = True
        w = self.prompt_weight
        leaves = [i for i in range(len(selected)) if not has_child[i]]
        leaves.sort(key=lambda i: (-(selected[i][0].out + w * selected[i][0].prompt), -selected[i][0].depth, i))
        branches: list[list[int]] = []
        for leaf in leaves:
            path = []
            i = leaf
            while i >= 0:
                node, i = selected[i]
                path.append(node.token)
            path.reverse()
            branches.append(path)
        if self.mode == PARALLEL:
            kept, left = [], k
            for path in branches:
                if left <= 0:
                    break
                kept.append(path[:left])
                left -= len(kept[-1])
            branches = kept
        return branches

