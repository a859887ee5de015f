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

    *Running requests* (shared mode): the shared model changes only at ``end``, which counts the
    request's stream into it; so a failed request (``abort``) leaves it exactly as it was, by
    construction. Until then a request counts its stream in one view shared by every running
    request (:class:`~specdraft.sources.ngram_running.RunningCounts`, an overlay of the shared
    model: a context one of them updates is first copied from the shared model, then counted), and
    drafts read the view first, then the shared model: every running request sees the shared counts,
    its own and the other running requests' at once, as if all counted in one table. ``end`` and
    ``abort`` take the request's counts back from the view exactly (it keeps how many each context's
    followers were counted by running requests), so a failed request's counts stop being seen the
    moment it aborts. The view holds at most the ``(N - 1) * L`` contexts per running request of
    ``L`` tokens a per-request model would, and is empty when no request runs. Counting at ``end``
    gives the shared model exactly what counting step by step did when requests run one at a time
    (same counts, tie-break stamps, clock and LRU order: one clock tick per position either way).

    *Layout*: a context's statistics are one dict of ints (``token -> count << 40 | last seen``,
    with the current prediction under two negative keys, :data:`_BEST` and :data:`_BEST_KEY`), and
    the table maps context tuples to them. Dicts of ints, and tuples of ints once a collection has
    seen them, are not tracked by Python's cyclic garbage collector, so a model of any size is a
    single tracked object: a full collection does not scan its contexts.

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

import heapq
import itertools
import threading
from collections import OrderedDict
from typing import Sequence

from ..checks import check_int
from .bulk import collector_paused
from .base import Context, Draft, Feedback
from .ngram_running import RunningCounts

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

#: A context's statistics (``Followers``, a dict of ints) keep its current prediction -- the most
#: frequent next token, ties: the most recently seen -- under two keys no token id takes: the token
#: under ``_BEST`` and its packed statistics under ``_BEST_KEY`` (-1 and -1 while it has none).
#: Not -1: CPython hashes -1 as -2, and two keys of one hash make every lookup of them probe twice
#: (counting a prompt took about 70% longer with -1 and -2).
_BEST = -2
_BEST_KEY = -3
_RESERVED = 2  # entries of a statistics dict that are not followers
Followers = dict  # dict[int, int]: token -> count << _SHIFT | last_seen, plus _BEST and _BEST_KEY


def ranked(stats: Followers, b: int) -> list[int]:
    """The ``b`` best next tokens: highest count first, ties most recent first."""
    if b == 1 or len(stats) == _RESERVED + 1:  # (most contexts have one follower)
        return [stats[_BEST]]
    return heapq.nlargest(b, [t for t in stats if t >= 0], key=stats.__getitem__)


def evict_one(stats: Followers) -> None:
    """Forget the weakest follower (lowest count, ties: least recently seen)."""
    victim = min((t for t in stats if t >= 0), key=stats.__getitem__)
    del stats[victim]
    if victim == stats[_BEST]:
        set_best(stats)


def set_best(stats: Followers) -> None:
    """Store the prediction of a context's followers under :data:`_BEST` (``-1`` and ``-1`` for none)."""
    best = max((t for t in stats if t >= 0), key=stats.__getitem__, default=-1)
    stats[_BEST], stats[_BEST_KEY] = best, stats.get(best, -1)


class NGramModel:
    """Counts of next tokens after every context of ``1 .. max_ngram - 1`` tokens.

    One table keyed by the context tuple holds every level (a context's length says its level:
    ``n = len(context) + 1``). ``add`` counts a token stream incrementally; ``candidates``
    and ``draft`` query it with back-off. A model made by another's :meth:`overlay` is an *overlay*
    of that base model: a context is copied from the base at its first update here (copy on
    write), and queries read the overlay first, then the base; the base is never written. An
    overlay neither evicts contexts nor caps followers (it holds what the running requests count,
    which their lengths bound). Not thread-safe by itself (:class:`MultiLevelNGram` locks).
    """

    __slots__ = ("max_ngram", "max_contexts", "max_followers", "_table", "clock", "_base")

    def __init__(self, max_ngram: int = 5, max_contexts: int | None = None,
                 max_followers: int | None = None) -> None:
        check_int("max_ngram", max_ngram, 2, numpy_ok=True)  # (a context of at least one token)
        check_int("max_contexts", max_contexts, 1, none_ok=True, numpy_ok=True)
        check_int("max_followers", max_followers, 1, none_ok=True, numpy_ok=True)
        self.max_ngram = max_ngram
        self.max_contexts = max_contexts
        self.max_followers = max_followers
        self._base: NGramModel | None = None  # the model this one is an overlay of
        # An OrderedDict only when it must evict (LRU); a plain dict is faster.
        self._table: dict[tuple[int, ...], Followers] = OrderedDict() if max_contexts is not None else {}
        #: Positions counted so far, one tick each: the stamp of the most recent update, the "most
        #: recent" of the tie-break.
        self.clock = 0

    def overlay(self) -> "NGramModel":
        """A new, empty overlay of this model (see the class docstring). It goes on from this
        model's clock, so what it counts is newer than anything it copies."""
        view = NGramModel(self.max_ngram)
        view._base = self
        view.clock = self.clock
        return view

    def recount(self, ctx: tuple[int, ...], counted: dict[int, int] | None) -> None:
        """An overlay: set its statistics of ``ctx`` to its base's plus ``counted`` (``token ->
        count``), each follower keeping the later of its last-seen stamps here and in the base; with
        ``counted`` ``None``, drop ``ctx`` (reads fall back to the base). For
        :class:`~specdraft.sources.ngram_running.RunningCounts`, which takes counts back."""
        table = self._table
        if counted is None:
            table.pop(ctx, None)
            return
        old = table.get(ctx) or {}
        base = self._base._table.get(ctx) if self._base is not None else None
        stats = dict(base) if base is not None else {_BEST: -1, _BEST_KEY: -1}
        for token, count in counted.items():
            packed = stats.get(token, 0)
            seen = max(packed & _CLOCK_MASK, old.get(token, 0) & _CLOCK_MASK)
            stats[token] = ((packed >> _SHIFT) + count) << _SHIFT | seen
        set_best(stats)
        table[ctx] = stats

    def _lookup(self):
        """``get(context)`` over this model and its base (the overlay first)."""
        get = self._table.get
        if self._base is None:
            return get
        base_get = self._base._table.get
        return lambda ctx: get(ctx) or base_get(ctx)  # (a statistics dict is never empty)

    # -- updates ------------------------------------------------------------------------------

    def add(self, tokens: Sequence[int], start: int = 0) -> None:
        """Count ``tokens[i]`` after each of its ``1 .. N-1`` preceding contexts, for ``i >= start``.

        ``tokens[:start]`` must already have been counted (or be history only); they serve as the
        left context of the first new positions. Cost: ``N - 1`` dict updates per new token (an
        overlay: plus a copy of each context at its first update).
        """
        top = self.max_ngram - 1
        lo = max(start - top, 0)
        window = tuple(int(t) for t in tokens[lo:])
        table = self._table
        get = table.get
        base_get = self._base._table.get if self._base is not None else None
        lru = self.max_contexts is not None
        max_contexts = self.max_contexts or 0
        cap = (self.max_followers or 0) + _RESERVED if self.max_followers is not None else None
        one, shift = _ONE, _SHIFT
        clock = self.clock
        for i in range(max(start - lo, 1), len(window)):
            clock += 1
            nxt = window[i]
            for m in range(1, min(top, i) + 1):
                ctx = window[i - m : i]
                f = get(ctx)
                if f is None:
                    if lru and len(table) >= max_contexts:
                        table.popitem(last=False)  # type: ignore[call-arg]
                    copied = base_get(ctx) if base_get is not None else None
                    f = table[ctx] = {_BEST: -1, _BEST_KEY: -1} if copied is None else dict(copied)
                elif lru:
                    table.move_to_end(ctx)  # type: ignore[attr-defined]
                key = f.get(nxt)
                if key is None:
                    if cap is not None and len(f) >= cap:
                        evict_one(f)
                    key = one | clock
                else:
                    key = ((key >> shift) + 1) << shift | clock
                f[nxt] = key
                if key > f[_BEST_KEY]:  # more frequent, or as frequent and (being this one) newer
                    f[_BEST] = nxt
                    f[_BEST_KEY] = key
        self.clock = clock

    # -- queries ------------------------------------------------------------------------------

    def candidates(self, tail: Sequence[int], b: int) -> list[int]:
        """Up to ``b`` distinct next tokens after ``tail``, best first: the longest matching
        context's followers by count (ties: most recent), topped up from shorter contexts."""
        tail = tuple(tail)
        get = self._lookup()
        out: list[int] = []
        for m in range(min(len(tail), self.max_ngram - 1), 0, -1):
            f = get(tail[len(tail) - m :])
            if f is None:
                continue
            for t in ranked(f, b):  # b suffice: at most len(out) of them are duplicates
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
        get = self._lookup()
        out: list[int] = []
        for _ in range(length):
            for m in range(len(ctx), 0, -1):
                f = get(ctx[len(ctx) - m :])
                if f is not None:
                    break
            else:
                return out
            t = f[_BEST]
            out.append(t)
            ctx = (ctx + (t,))[-top:]
        return out

    # -- inspection ---------------------------------------------------------------------------

    def counts(self, n: int) -> dict[tuple[int, ...], dict[int, int]]:
        """The level-``n`` table: context of ``n - 1`` tokens -> {next token: count} (a copy); for an
        overlay, what it drafts from (its base's contexts, its own where it has them)."""
        if not 2 <= n <= self.max_ngram:
            raise ValueError(f"n must be in [2, {self.max_ngram}], got {n}")
        out = self._base.counts(n) if self._base is not None else {}
        out.update({ctx: {t: key >> _SHIFT for t, key in f.items() if t >= 0}
                    for ctx, f in self._table.items() if len(ctx) == n - 1})
        return out

    @property
    def num_contexts(self) -> int:
        return len(self._table)

    @property
    def num_counters(self) -> int:
        """(context, next token) pairs held: the model's size in counters."""
        return sum(len(f) - _RESERVED for f in self._table.values())

    def __repr__(self) -> str:
        return f"NGramModel(max_ngram={self.max_ngram}, contexts={self.num_contexts})"


class _Request:
    """A running request: the model it counts in (its own, or in shared mode the running requests'
    view), how many of its tokens were counted, and where its counting started; in shared mode also
    its tokens, so that its counts can be taken back."""

    __slots__ = ("model", "seen", "start", "tokens")

    def __init__(self, model: NGramModel, seen: int, tokens: list[int] | None = None) -> None:
        self.model = model
        self.seen = seen  # tokens of this request's stream already counted
        self.start = seen  # its first counted position (its stream joins the shared model from here)
        self.tokens = tokens


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
        for label, value, low in (("max_ngram", max_ngram, 2), ("num_tokens", num_tokens, 1), ("top_b", top_b, 1),
                                  ("branch_depth", branch_depth, 0), ("max_requests", max_requests, 1)):
            check_int(label, value, low, numpy_ok=True)
        check_int("max_contexts", max_contexts, 1, none_ok=True, numpy_ok=True)
        check_int("max_followers", max_followers, 1, none_ok=True, numpy_ok=True)
        if shared:
            max_contexts = DEFAULT_SHARED_MAX_CONTEXTS if max_contexts is None else max_contexts
            max_followers = DEFAULT_SHARED_MAX_FOLLOWERS if max_followers is None else max_followers
        self.max_ngram = max_ngram
        self.num_tokens = num_tokens
        self.top_b = top_b
        self.branch_depth = branch_depth
        self.shared = shared
        self.max_contexts = max_contexts
        self.max_followers = max_followers
        self.max_requests = max_requests
        self.name = name
        #: observe only catches the counts up with the context; a draft catches them up itself
        #: (so on an accelerator a step without a draft learns behind the next forward)
        self.observes_late = True
        self._lock = threading.Lock()
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        #: in shared mode, the model every request learns into (``None`` per request)
        self.shared_model = self._new_model() if shared else None
        self._running = RunningCounts(self.shared_model) if shared else None
        # rank vectors of the branching positions, best first (see the module docstring)
        depth = min(branch_depth, num_tokens) if top_b > 1 else 0
        self._rank_vectors = sorted(itertools.product(range(top_b), repeat=depth),
                                    key=lambda r: (sum(r), r))

    def _new_model(self) -> NGramModel:
        return NGramModel(self.max_ngram, self.max_contexts, self.max_followers)

    # -- the DraftSource protocol --------------------------------------------------------------

    def begin(self, context: Context) -> None:
        with self._lock, collector_paused():
            self._drop(self._requests.pop(context.request_id, None))
            self._state(context, begin=True)

    def observe(self, feedback: Feedback) -> None:
        with self._lock:
            self._state(feedback.context)

    def end(self, context: Context) -> None:
        """The request is over: drop its state; in shared mode, first count what it counted (its
        stream, from where its counting started) into the shared model, and take its counts back
        from the running requests' view."""
        with self._lock:
            self._drop(self._requests.pop(context.request_id, None), ended=True)

    def abort(self, context: Context) -> None:
        """The request failed: take its counts back from the running requests' view and drop its
        state (see :class:`~specdraft.sources.base.DraftSource`). The shared model never held
        anything of it, so it is exactly as it was before the request began, whatever other requests
        did meanwhile. An unknown request id is ignored."""
        with self._lock:
            self._drop(self._requests.pop(context.request_id, None))

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
        from here: the shared model may already hold those tokens and cannot tell. (A shared-mode
        state dropped past ``max_requests`` takes what it counted with it.)
        """
        tokens = context.tokens
        state = self._requests.get(context.request_id)
        running = self._running
        if state is None:
            if running is None:
                state = _Request(self._new_model(), 0)
            else:
                state = _Request(running.view, 0 if begin else len(tokens), [])
            self._requests[context.request_id] = state
            while len(self._requests) > self.max_requests:
                self._drop(self._requests.popitem(last=False)[1])
        elif len(tokens) < state.seen:  # the stream was rewound: never happens with Decoder
            if running is None:
                state.model = self._new_model()
            else:
                self._drop(state)
                state.tokens = []
            state.seen = state.start = 0
        if len(tokens) > state.seen:
            if running is None:
                state.model.add(tokens, state.seen)
            else:
                state.tokens.extend(int(t) for t in tokens[len(state.tokens) :])  # type: ignore[union-attr]
                running.add(state.tokens, state.seen)  # type: ignore[arg-type]
            state.seen = len(tokens)
        return state

    def _drop(self, state: _Request | None, ended: bool = False) -> None:
        """Take a dropped shared-mode state's counts back from the running requests' view; if its
        request ``ended``, first count what it counted into the shared model."""
        if state is not None and state.tokens is not None and self._running is not None and state.seen > state.start:
            if ended:
                self.shared_model.add(state.tokens[: state.seen], state.start)  # type: ignore[union-attr]
            self._running.take_back(state.tokens, state.start, state.seen)

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
            node, shared = trie, 0
            while shared < len(path) and path[shared] in node:
                node = node[path[shared]]
                shared += 1
            if shared == len(path):  # nothing new (or no path at all)
                continue
            del path[shared + left :]  # what does not fit the budget
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
