"""ANPD's multi-level n-gram (Ou et al., 2024): an adaptive n-gram model of the request itself.

The model counts, for every ``n`` in ``2..N``, which token followed every context of ``n - 1``
tokens (the paper's "n-gram" is the context *plus* the predicted token, so ``n = 2`` is a
one-token context). It is

* **initialised from the prompt** (Algorithm 1, line 4): every position of the prompt is counted
  once at every level;
* **updated with every committed token** (the paper's runtime update, appendix A.8), never with
  unverified drafts; an update touches ``N - 1`` counters, whatever the context length;
* **queried from the longest context down** (multi-level back-off, section 3.2 / Algorithm 2): the
  last ``N - 1`` tokens are looked up first, then the last ``N - 2``, ... down to the last one;
  the first level that has seen its context answers. (Algorithm 2 as printed lacks the ``break``
  and would let ``n = 2`` win; the text -- "stopping when a successful match is found" -- is what
  we implement.) The answer is that context's most frequent next token; **ties go to the token
  seen most recently after that context**, so the prediction is a deterministic function of the
  token stream;
* **chained K times** to draft ``K`` tokens (Algorithm 1, lines 12-16): after predicting ``t1`` the
  query context becomes the last ``N - 1`` tokens of ``(..., root, t1)``, and so on. (The printed
  slice ``tmp_token_ids[-N+k:]`` shrinks the context as ``k`` grows, which is evidently a typo;
  we always use the last ``N - 1`` tokens, drafts included.) A chain ends early when no level has
  seen the current context (the paper's ``QUERY`` returns ``NULL``).

Beyond the paper, because our verifier takes trees: with ``top_b > 1`` the first
``branch_depth`` draft positions ("levels" of the tree, depth 1 = the root's children) each offer
the ``top_b`` best next tokens instead of one, and every path is then continued greedily to depth
``K``. The ``top_b`` candidates of a position are the followers of the longest matching context
in count order (ties: most recent first), topped up from the shorter contexts (skipping tokens
already taken) when the longest one has fewer than ``top_b`` distinct followers. Paths are
proposed best first: the all-greedy chain (exactly the ``top_b = 1`` draft) first, then the
others in order of the sum of their candidate ranks (ties: the path that leaves the greedy chain
deeper first, since it shares more nodes). Nodes shared between paths are counted once against
the budget, which is spent in that order; a path that does not fit is cut. ``top_b = 1`` (the
default) reproduces the paper: one chain of ``K`` tokens.

State and memory
    *Per request* (the default, as in the paper): each request has its own model, built in
    ``begin`` from the prompt and dropped in ``end``. Exact counts; for a request of ``L`` tokens
    (prompt + output) it holds at most ``(N - 1) * L`` contexts and ``(N - 1) * L`` (context,
    next token) counters. Measured (CPython 3.11, ``tracemalloc``): 0.4-0.5 KB per context plus
    ~0.1 KB per extra follower, so at most ~4 MB for a 2k-token request at ``N = 5``; a
    1536-token Python prompt (Qwen2.5 tokenizer) takes 4 056 contexts, 1.6 MiB. At most
    ``max_requests`` request states are kept (the oldest is dropped past that, e.g. when a caller
    forgets ``end``); a dropped state is rebuilt from the context if its request comes back, and
    since the counts are a function of the token stream, nothing changes but the time it takes.

    *Shared* (``shared=True``): one model learns from every request served by this source (prompts
    in ``begin``, committed tokens in ``observe``) and keeps what it learnt after ``end``. It is
    bounded: at most ``max_contexts`` contexts (default 65 536, i.e. the last ~16k+ tokens of
    text at ``N = 5``; the least recently *updated* context is evicted first) with at most
    ``max_followers`` next tokens each (default 8; when a new one arrives at a full context, the
    one with the lowest count goes, ties: the least recently seen). So it never holds more than
    ``max_contexts`` contexts and ``max_contexts * max_followers`` counters: at most ~80 MB at the
    defaults, typically ~35 MB (most contexts have one or two followers). Counts past those
    bounds are approximate; that only changes the drafts, never the output (the verifier
    decides). The same two bounds can be set in per-request mode too.

    *A failed request* (the decoder calls ``abort`` instead of ``end``) leaves the shared model as
    it was: while it runs, each request journals the contexts it changes or evicts (a copy of
    each before its first change, ``None`` for a new one), and ``abort`` puts them back and
    rebuilds the LRU order (:meth:`NGramModel.undo`; exact when no other request updated the model
    meanwhile). A journal costs at most what a per-request model of the same request would (one
    entry per context touched), and is dropped at ``end``. Per-request mode needs none.

Cost
    A step's query is at most ``K * (N - 1)`` dict lookups of short tuples (plus, with ``top_b >
    1``, a partial sort of one context's followers per branching position and one chain per
    path, so up to ``top_b ** branch_depth`` chains); an update is ``N - 1`` dict lookups per
    committed token. Nothing rescans the context. ``benchmarks/ngram_overhead.py`` measures it on
    real code tokens: ~12 us per step (propose + observe, ``N = 5, K = 7``), under 0.05% of a
    145 ms Qwen2.5-0.5B fp32 step even with ``top_b = 3, branch_depth = 2``; counting a
    1.5k-token prompt in ``begin`` takes 3-8 ms, once per request.

Thread safety: every method takes the source's lock, so one instance may serve several decoders
in several threads (per-request states are keyed by ``Context.request_id``).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import numbers
import threading
from collections import OrderedDict
from typing import Iterator, Sequence

from .bulk import collector_paused
from .base import Context, Draft, Feedback

__all__ = ["MultiLevelNGram", "NGramModel"]

#: Shared-mode defaults (see the module docstring for the memory they imply).
DEFAULT_SHARED_MAX_CONTEXTS = 65_536
DEFAULT_SHARED_MAX_FOLLOWERS = 8


#: A follower's statistics packed into one int: ``count << _SHIFT | last_seen``. Comparing two
#: packed values compares (count, last seen) -- exactly the prediction order -- and an int costs
#: less memory than a pair. ``last_seen`` is a position counter, far below 2**40 in practice.
_SHIFT = 40
_ONE = 1 << _SHIFT
_CLOCK_MASK = _ONE - 1

#: What :meth:`NGramModel.add` records, when asked, to take an update back: each context's content
#: before its first change (``None``: the context did not exist), evicted contexts included.
Journal = dict  # dict[tuple[int, ...], _Followers | None]


class _Followers:
    """Next-token statistics of one context: ``stats[token] = count << _SHIFT | last_seen`` and
    the current prediction (max count, ties: most recently seen), maintained in O(1) per update."""

    __slots__ = ("stats", "best", "best_key")

    def __init__(self) -> None:
        self.stats: dict[int, int] = {}
        self.best = -1
        self.best_key = -1

    def ranked(self, b: int) -> list[int]:
        """The ``b`` best next tokens: highest count first, ties most recent first."""
        if b == 1:
            return [self.best]
        return heapq.nlargest(b, self.stats, key=self.stats.__getitem__)

    def copy(self) -> "_Followers":
        twin = _Followers()
        twin.stats = dict(self.stats)
        twin.best, twin.best_key = self.best, self.best_key
        return twin

    def last_update(self) -> int:
        """The clock of the context's last update: every update stamps the follower it counts with
        the current clock, and a follower eviction (only when a new one arrives) never drops it."""
        return max(key & _CLOCK_MASK for key in self.stats.values())

    def evict_one(self) -> None:
        """Forget the weakest follower (lowest count, ties: least recently seen)."""
        stats = self.stats
        victim = min(stats, key=stats.__getitem__)
        del stats[victim]
        if victim == self.best:
            if stats:
                self.best = max(stats, key=stats.__getitem__)
                self.best_key = stats[self.best]
            else:
                self.best, self.best_key = -1, -1


class NGramModel:
    """Counts of next tokens after every context of ``1 .. max_ngram - 1`` tokens.

    One table keyed by the context tuple holds every level (a context's length says its level:
    ``n = len(context) + 1``). ``add`` counts a token stream incrementally; ``predict`` and
    ``draft`` query it with back-off. Not thread-safe by itself (:class:`MultiLevelNGram` locks).
    """

    __slots__ = ("max_ngram", "max_contexts", "max_followers", "_table", "_clock")

    def __init__(self, max_ngram: int = 5, max_contexts: int | None = None, max_followers: int | None = None) -> None:
        if max_ngram < 2:
            raise ValueError(f"max_ngram must be >= 2 (a context of at least one token), got {max_ngram}")
        if max_contexts is not None and max_contexts < 1:
            raise ValueError(f"max_contexts must be >= 1 or None, got {max_contexts}")
        if max_followers is not None and max_followers < 1:
            raise ValueError(f"max_followers must be >= 1 or None, got {max_followers}")
        self.max_ngram = max_ngram
        self.max_contexts = max_contexts
        self.max_followers = max_followers
        # An OrderedDict only when it must evict (LRU); a plain dict is faster.
        self._table: dict[tuple[int, ...], _Followers] = OrderedDict() if max_contexts is not None else {}
        self._clock = 0  # one tick per counted position: the "most recent" of the tie-break

    # -- updates ------------------------------------------------------------------------------

    def add(self, tokens: Sequence[int], start: int = 0, journal: Journal | None = None) -> None:
        """Count ``tokens[i]`` after each of its ``1 .. N-1`` preceding contexts, for ``i >= start``.

        ``tokens[:start]`` must already have been counted (or be history only); they serve as the
        left context of the first new positions. Cost: ``N - 1`` dict updates per new token.

        With a ``journal`` (a dict, kept by the caller across calls), every context this call
        changes or evicts that the journal does not hold yet is recorded there first: a copy of its
        followers, or ``None`` if it did not exist. :meth:`undo` takes the changes back. (One more
        dict lookup per update, plus a copy at a context's first change; without a journal
        nothing is recorded.)
        """
        top = self.max_ngram - 1
        lo = max(start - top, 0)
        window = tuple(int(t) for t in tokens[lo:])
        table = self._table
        get = table.get
        lru = self.max_contexts is not None
        max_contexts = self.max_contexts or 0
        cap = self.max_followers
        one, shift = _ONE, _SHIFT
        clock = self._clock
        journaled = journal is not None
        for i in range(max(start - lo, 1), len(window)):
            clock += 1
            nxt = window[i]
            for m in range(1, min(top, i) + 1):
                ctx = window[i - m : i]
                f = get(ctx)
                if f is None:
                    if journaled and ctx not in journal:
                        journal[ctx] = None
                    if lru and len(table) >= max_contexts:
                        gone, followers = table.popitem(last=False)  # type: ignore[call-arg]
                        if journaled and gone not in journal:  # untouched so far: its content before
                            journal[gone] = followers
                    f = table[ctx] = _Followers()
                else:
                    if journaled and ctx not in journal:
                        journal[ctx] = f.copy()
                    if lru:
                        table.move_to_end(ctx)  # type: ignore[attr-defined]
                stats = f.stats
                key = stats.get(nxt)
                if key is None:
                    if cap is not None and len(stats) >= cap:
                        f.evict_one()
                    key = one | clock
                else:
                    key = ((key >> shift) + 1) << shift | clock
                stats[nxt] = key
                if key > f.best_key:  # more frequent, or as frequent and (being this one) newer
                    f.best = nxt
                    f.best_key = key
        self._clock = clock

    def undo(self, journal: Journal, clock: int | None = None) -> None:
        """Take back the updates recorded in ``journal`` (see :meth:`add`): every context it names
        gets its recorded content back (or goes, if it did not exist), and the LRU order is rebuilt.

        With ``clock`` (the model's clock when the journal started) and no other update since the
        journal started, the model is then exactly as it was: same counts, same tie-break stamps,
        same clock and same LRU order. That rests on an invariant of the table: its order is the
        order of (the context's last update clock, its length). Every update stamps the follower it
        counts with the current clock, so a context's last update is its followers' newest stamp
        (a follower eviction happens only when a new follower arrives, and never drops it); one
        clock tick is one position, whose contexts are updated in increasing length. Contexts the
        journal does not name kept their relative order, so the restored ones are merged in at
        their place.

        Without ``clock`` (other updates came in meanwhile) the named contexts still get their
        recorded content back -- later updates to those same contexts, from other streams, are
        lost with it -- the clock stays (never going back below a stamp in the table), the table is
        trimmed to ``max_contexts`` (least recently updated first) and the order rebuilt by the same
        invariant: a consistent model, though not the one it would have been without the undone
        updates.

        Cost: one pass over the table plus ``O(j log n)`` for ``j`` journaled contexts among ``n``
        (0.1-0.2 s for a request of 500 tokens after a 1000-token prompt on a full default table
        of 65 536 contexts, on a busy CPU core); only ever paid when a request fails.
        """
        table = self._table
        if clock is not None:
            self._clock = clock
        if self.max_contexts is None:  # a plain dict (no eviction): insertion order; put back in place
            for ctx, followers in journal.items():
                if followers is None:
                    table.pop(ctx, None)
                else:
                    table[ctx] = followers
            return
        # The contexts the journal does not name are still in order: merge the restored ones in, by
        # (last update, length) packed in one int, finding each one's place by galloping from the
        # last (O(j log(n / j)) keys computed for j restored contexts among n) -- and no tuple made
        # per context, so no garbage-collector passes over a big table either.
        mask_and = _CLOCK_MASK.__and__
        shift = self.max_ngram.bit_length()

        def key_of(ctx: tuple[int, ...]) -> int:
            return max(map(mask_and, table[ctx].stats.values())) << shift | len(ctx)

        restored = sorted((max(map(mask_and, f.stats.values())) << shift | len(ctx), ctx, f)
                          for ctx, f in journal.items() if f is not None)  # keys are distinct
        kept = [ctx for ctx in table if ctx not in journal]
        n = len(kept)
        merged: OrderedDict[tuple[int, ...], _Followers] = OrderedDict()
        lo = 0
        for key, ctx, followers in restored:
            below, probe, step = lo, lo, 1  # kept[:below] all sort before this one
            while probe < n and key_of(kept[probe]) < key:  # gallop: lo, lo + 1, lo + 3, lo + 7, ...
                below = probe + 1
                probe = below + step
                step <<= 1
            at = bisect.bisect_left(kept, key, below, min(probe, n), key=key_of)
            for c in kept[lo:at]:
                merged[c] = table[c]
            merged[ctx] = followers
            lo = at
        for c in kept[lo:]:
            merged[c] = table[c]
        while len(merged) > self.max_contexts:  # only when other updates came in meanwhile
            merged.popitem(last=False)  # least recently updated first
        self._table = merged

    # -- queries ------------------------------------------------------------------------------

    def predict(self, tail: Sequence[int]) -> tuple[int, int] | None:
        """``(token, n)``: the prediction after ``tail`` and the level ``n`` that gave it, trying
        the last ``N-1`` tokens of ``tail`` first, then fewer; ``None`` if no level has seen them."""
        tail = tuple(tail)
        table = self._table
        for m in range(min(len(tail), self.max_ngram - 1), 0, -1):
            f = table.get(tail[len(tail) - m :])
            if f is not None:
                return f.best, m + 1
        return None

    def candidates(self, tail: Sequence[int], b: int) -> list[int]:
        """Up to ``b`` distinct next tokens after ``tail``, best first: the longest matching
        context's followers by count (ties: most recent), topped up from shorter contexts."""
        tail = tuple(tail)
        table = self._table
        out: list[int] = []
        for m in range(min(len(tail), self.max_ngram - 1), 0, -1):
            f = table.get(tail[len(tail) - m :])
            if f is None:
                continue
            for t in f.ranked(b):  # b suffice: at most len(out) of them are duplicates
                if t not in out:
                    out.append(t)
                    if len(out) == b:
                        return out
        return out

    def draft(self, tail: Sequence[int], length: int) -> list[int]:
        """Chain ``length`` predictions after ``tail`` (each one joins the next query's context);
        stops early when no level matches."""
        top = self.max_ngram - 1
        ctx = tuple(tail)[-top:]
        table = self._table
        out: list[int] = []
        for _ in range(length):
            for m in range(len(ctx), 0, -1):
                f = table.get(ctx[len(ctx) - m :])
                if f is not None:
                    break
            else:
                return out
            t = f.best
            out.append(t)
            ctx = (ctx + (t,))[-top:]
        return out

    # -- inspection ---------------------------------------------------------------------------

    def counts(self, n: int) -> dict[tuple[int, ...], dict[int, int]]:
        """The level-``n`` table: context of ``n - 1`` tokens -> {next token: count} (a copy)."""
        if not 2 <= n <= self.max_ngram:
            raise ValueError(f"n must be in [2, {self.max_ngram}], got {n}")
        return {ctx: {t: key >> _SHIFT for t, key in f.stats.items()}
                for ctx, f in self._table.items() if len(ctx) == n - 1}

    def contexts(self) -> Iterator[tuple[int, ...]]:
        return iter(self._table)

    @property
    def clock(self) -> int:
        """Positions counted so far (the stamp of the most recent update)."""
        return self._clock

    @property
    def num_contexts(self) -> int:
        return len(self._table)

    @property
    def num_counters(self) -> int:
        """(context, next token) pairs held: the model's size in counters."""
        return sum(len(f.stats) for f in self._table.values())

    def __repr__(self) -> str:
        return f"NGramModel(max_ngram={self.max_ngram}, contexts={self.num_contexts})"


class _Request:
    __slots__ = ("model", "seen", "journal", "clock", "writes", "own_writes")

    def __init__(self, model: NGramModel, seen: int, writes: int | None = None) -> None:
        self.model = model
        self.seen = seen  # tokens of this request's stream already counted
        # shared mode: what this request changed in the shared model, to take it back at abort
        self.journal: Journal | None = None if writes is None else {}
        self.clock = model.clock  # the shared model's clock when the journal started
        self.writes = writes  # the source's write count then
        self.own_writes = 0  # updates this request made since


class MultiLevelNGram:
    """ANPD's multi-level n-gram as a :class:`~specdraft.sources.base.DraftSource`.

    ``max_ngram`` is the paper's ``N`` (contexts of ``1 .. N-1`` tokens), ``num_tokens`` its ``K``
    (draft length); ``top_b`` candidates are offered at each of the first ``branch_depth`` draft
    positions (``top_b = 1``: the paper's single chain). Defaults N=5, K=7 are the paper's; ``top_b=2``
    was the best of N in {2,3,5} x K in {4,7} x b in {1,2} on 20 HumanEval prompts with
    Qwen2.5-Coder-0.5B (mean accepted tokens per step 1.518 vs 1.468 for b=1, replayed exactly
    with ``benchmarks/acceptance_replay.py``, 128 new tokens, 32-node budget). ``shared=True`` keeps one bounded model
    across requests instead of one per request; ``max_contexts`` / ``max_followers`` bound a
    model (defaults: unbounded per request -- the request's length bounds it --, 65 536 / 8 when
    shared); ``max_requests`` bounds the live per-request states. See the module docstring.
    """

    def __init__(self, max_ngram: int = 5, num_tokens: int = 7, top_b: int = 2, branch_depth: int = 1,
                 shared: bool = False, max_contexts: int | None = None, max_followers: int | None = None,
                 max_requests: int = 64, name: str = "ngram") -> None:
        # types first, so a wrong one (say a string from the command line) is named, not a failed comparison
        for label, value, low, optional in (("max_ngram", max_ngram, 2, False), ("num_tokens", num_tokens, 1, False),
                                            ("top_b", top_b, 1, False), ("branch_depth", branch_depth, 0, False),
                                            ("max_contexts", max_contexts, 1, True),
                                            ("max_followers", max_followers, 1, True),
                                            ("max_requests", max_requests, 1, False)):
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{label} must be an int >= {low}{' or None' if optional else ''}, got {value!r}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if top_b < 1:
            raise ValueError(f"top_b must be >= 1, got {top_b}")
        if branch_depth < 0:
            raise ValueError(f"branch_depth must be >= 0, got {branch_depth}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if shared:
            max_contexts = DEFAULT_SHARED_MAX_CONTEXTS if max_contexts is None else max_contexts
            max_followers = DEFAULT_SHARED_MAX_FOLLOWERS if max_followers is None else max_followers
        # NGramModel checks max_ngram / max_contexts / max_followers; build one now (an empty table,
        # free) so bad values fail here rather than at the first request
        NGramModel(max_ngram, max_contexts, max_followers)
        self.max_ngram = max_ngram
        self.num_tokens = num_tokens
        self.top_b = top_b
        self.branch_depth = branch_depth
        self.shared = shared
        self.max_contexts = max_contexts
        self.max_followers = max_followers
        self.max_requests = max_requests
        self.name = name
        self._lock = threading.Lock()
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self._shared_model = self._new_model() if shared else None
        self._writes = 0  # updates of the shared model (and aborts): tells an abort it was alone
        # rank vectors of the branching positions, best first (see the module docstring)
        depth = min(branch_depth, num_tokens) if top_b > 1 else 0
        self._rank_vectors = sorted(itertools.product(range(top_b), repeat=depth),
                                    key=lambda r: (sum(r), r))

    def _new_model(self) -> NGramModel:
        return NGramModel(self.max_ngram, self.max_contexts, self.max_followers)

    # -- the DraftSource protocol --------------------------------------------------------------

    def begin(self, context: Context) -> None:
        with self._lock, collector_paused():
            self._requests.pop(context.request_id, None)
            self._state(context, begin=True)

    def observe(self, feedback: Feedback) -> None:
        with self._lock:
            self._state(feedback.context)

    def end(self, context: Context) -> None:
        with self._lock:
            self._requests.pop(context.request_id, None)

    def abort(self, context: Context) -> None:
        """The request failed: take back what it taught the shared model, then drop its state (see
        :class:`~specdraft.sources.base.DraftSource`). Per-request mode: the same as :meth:`end`.

        Shared mode: the request's journal (see :meth:`NGramModel.add`) holds every context it
        changed or evicted, as it was before. If no other request updated the shared model (or
        aborted) while it ran, the model comes back exactly: counts, tie-break stamps, clock and LRU
        order. Otherwise the contexts it touched get their old content back (other requests' later
        updates to those contexts go with it), the clock stays and the order is rebuilt: a
        consistent model, not an exact one. Only what was taught since the request's state was
        made is taken back (a state dropped past ``max_requests`` is made again, with an empty
        journal). An unknown request id is ignored.
        """
        with self._lock:
            state = self._requests.pop(context.request_id, None)
            if state is None or state.journal is None:
                return
            model = self._shared_model
            assert model is not None and state.writes is not None
            if state.journal:  # (empty: it counted nothing, so there is nothing to take back)
                alone = self._writes - state.writes == state.own_writes
                model.undo(state.journal, state.clock if alone else None)
                self._writes += 1

    def propose(self, context: Context, budget: int) -> Draft:
        if budget <= 0 or not len(context.tokens):
            return Draft()
        with self._lock:
            model = self._state(context).model
            tail = tuple(int(t) for t in context.tokens[-(self.max_ngram - 1):])
            if len(self._rank_vectors) <= 1:
                chain = model.draft(tail, min(self.num_tokens, budget))
                return Draft(branches=[chain] if chain else [])
            return Draft(branches=self._tree(model, tail, budget))

    # -- inspection ----------------------------------------------------------------------------

    def model_for(self, request_id: int) -> NGramModel | None:
        """The model a request drafts from (the shared one in shared mode), or ``None``."""
        with self._lock:
            state = self._requests.get(request_id)
            if state is not None:
                return state.model
            return self._shared_model

    @property
    def shared_model(self) -> NGramModel | None:
        return self._shared_model

    @property
    def active_requests(self) -> list[int]:
        with self._lock:
            return list(self._requests)

    # -- internals -----------------------------------------------------------------------------

    def _state(self, context: Context, begin: bool = False) -> _Request:
        """The request's state, created if missing, and caught up with any tokens of ``context``
        not counted yet. Caller holds the lock.

        A state created outside ``begin`` (its request was evicted past ``max_requests``, or the
        caller skipped ``begin``) is rebuilt from the whole context in per-request mode -- exact,
        since the counts are a function of the stream -- but in shared mode starts counting only
        from here: the shared model may already hold those tokens and cannot tell.
        """
        tokens = context.tokens
        state = self._requests.get(context.request_id)
        if state is None:
            shared = self._shared_model
            if shared is None:
                state = _Request(self._new_model(), 0)
            else:
                state = _Request(shared, 0 if begin else len(tokens), self._writes)
            self._requests[context.request_id] = state
            while len(self._requests) > self.max_requests:
                self._requests.popitem(last=False)
        elif len(tokens) < state.seen:  # the stream was rewound: never happens with Decoder
            if self._shared_model is None:
                state.model = self._new_model()
                state.seen = 0
            else:
                state.seen = len(tokens)  # a shared model cannot un-count; just follow along
        if len(tokens) > state.seen:
            if state.journal is None:
                state.model.add(tokens, state.seen)
            else:
                state.model.add(tokens, state.seen, state.journal)
                self._writes += 1
                state.own_writes += 1
            state.seen = len(tokens)
        return state

    def _tree(self, model: NGramModel, tail: tuple[int, ...], budget: int) -> list[list[int]]:
        """Top-b alternatives at the first ``branch_depth`` positions, each continued greedily."""
        length = self.num_tokens
        top = self.max_ngram - 1
        memo: dict[tuple[int, ...], list[int]] = {}
        trie: dict[int, dict] = {}
        branches: list[list[int]] = []
        left = budget
        for ranks in self._rank_vectors:
            path: list[int] = []
            ok = True
            for rank in ranks:
                key = tuple(path)
                cands = memo.get(key)
                if cands is None:
                    cands = memo[key] = model.candidates((tail + key)[-top:], self.top_b)
                if rank >= len(cands):
                    ok = rank == 0  # no candidate at all: the path just ends here
                    break
                path.append(cands[rank])
            if not ok:
                continue
            if len(path) == len(ranks):
                path += model.draft((tail + tuple(path))[-top:], length - len(path))
            if not path:
                continue
            node, shared = trie, 0
            while shared < len(path) and path[shared] in node:
                node = node[path[shared]]
                shared += 1
            new = len(path) - shared
            if new == 0:
                continue
            if new > left:
                path = path[: shared + left]
            for t in path[shared:]:
                node = node.setdefault(t, {})
            branches.append(path)
            left -= len(path) - shared
            if left <= 0:
                break
        return branches

    def __repr__(self) -> str:
        mode = "shared" if self.shared else "per-request"
        return (f"MultiLevelNGram(max_ngram={self.max_ngram}, num_tokens={self.num_tokens}, top_b={self.top_b}, "
                f"branch_depth={self.branch_depth}, {mode})")
