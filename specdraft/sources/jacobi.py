"""Lookahead decoding (Fu et al., 2024): Jacobi iteration in the spare width of the forward pass.

Autoregressive decoding solves ``y_t = argmax P(y_t | y_<t)`` one position at a time; Jacobi
iteration updates guesses for *all* future positions at once from the previous guesses. Its
trajectory rarely lands a whole run in the right place, but every column of it is a chain of
model predictions, i.e. an n-gram the model is likely to produce somewhere later. Lookahead
decoding keeps the last ``N - 1`` iterations of a ``W``-position window (the *lookahead branch*),
caches every completed ``N``-gram it produces in a pool keyed by its first token, and each step
offers up to ``G`` pool n-grams that start with the newest committed token as drafts (the
*verification branch*). Both run in one forward pass.

In specdraft the window is this source's :class:`~specdraft.sources.base.SideBlock`: it rides in
the same forward as the merged token tree, sees the committed prefix and the root, never the tree
(and the tree never sees it), and its cache entries are dropped by the decoder's compaction. The
verification branch is ordinary draft branches, so pool n-grams share prefixes with other
sources' drafts in the merged tree. The verifier only ever checks the tree, so output is exactly
plain decoding's whatever the window holds.

Window layout (the reference implementation's, which is Figure 2b of the paper). Positions are
offsets after the root (root = 0); ``f = N - 2`` levels above level 0 once the window is full:

* level 0 (the oldest): ``W - 1`` tokens at offsets ``1 .. W-1``; token ``k`` sees the root and
  level-0 tokens ``0 .. k`` (a causal run, like plain Jacobi decoding);
* level ``l`` (``1 <= l <= N-2``): ``W`` tokens, column ``i`` at offset ``i + l``; it sees the
  root, level-0 tokens ``0 .. i-1`` and column ``i`` of levels ``1 .. l`` (its own trajectory).

So every window token sees a contiguous run of positions ``1 .. offset`` and its logits are those
of "committed + that run" -- exactly what the tests check. After the pass, the argmax of each
column of the newest level is the new level. Column ``i``'s completed n-gram is its first token
(the root for column 0, level-0 token ``i - 1`` otherwise: the token at offset ``i``) followed by
its trajectory on levels ``1 .. N-2`` and the new token. Then the window moves one step along
the time axis (Algorithm 1, L16 and L29): level 0 becomes level 1 without its first column,
level ``l`` becomes level ``l + 1`` and the new tokens become the newest level.

The initial fill (Algorithm 1, L4) takes ``W + N - 3`` random tokens of the prompt as level 0 and
grows one level per step, each step dropping one column, for ``N - 2`` steps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..checks import check_int
from .base import Context, Draft, Feedback, SideBlock, SourceBase, within_budget

__all__ = ["JacobiLookahead", "NGramPool", "LookaheadWindow", "window_side_block"]

_ADVANCE = ("one", "committed")


class NGramPool:
    """The n-gram pool ``C`` of Algorithm 1: n-grams keyed by their first token, bounded.

    An entry is ``key -> continuation`` (the ``N - 1`` tokens after the key). Bounded twice, by
    recency (LRU): at most ``per_key`` continuations per key (the reference implementation's
    ``GUESS_SET_SIZE``; lookups only ever return the ``per_key`` most recent anyway, so a larger
    per-key store would never be read) and at most ``capacity`` entries in total, the least
    recently *added* entry going first. Re-adding an entry makes it the most recent; reading does
    not. Every operation is O(1) (two ordered dicts).
    """

    def __init__(self, capacity: int, per_key: int) -> None:
        self.capacity = capacity
        self.per_key = per_key
        self._by_key: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self._order: OrderedDict[tuple[int, tuple[int, ...]], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, key: int, continuation: Sequence[int]) -> None:
        key = int(key)
        cont = tuple(int(t) for t in continuation)
        entry = (key, cont)
        bucket = self._by_key.setdefault(key, OrderedDict())
        bucket[cont] = None  # new, or re-added: then it only moves, and no bound can be passed
        bucket.move_to_end(cont)
        self._order[entry] = None
        self._order.move_to_end(entry)
        if len(bucket) > self.per_key:
            self._remove((key, next(iter(bucket))))
        while len(self._order) > self.capacity:
            self._remove(next(iter(self._order)))

    def _remove(self, entry: tuple[int, tuple[int, ...]]) -> None:
        key, cont = entry
        del self._order[entry]
        bucket = self._by_key[key]
        del bucket[cont]
        if not bucket:
            del self._by_key[key]

    def get(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """Continuations of ``key``, most recently added first, at most ``limit``."""
        return list(reversed(self._by_key.get(int(key), {})))[:limit]


def window_side_block(levels: Sequence[Sequence[int]]) -> SideBlock:
    """The side block of a (possibly still filling) lookahead window.

    ``levels[0]`` holds ``s`` tokens at offsets ``1 .. s``, causal among themselves; every later
    level holds ``s + 1`` columns, column ``i`` of level ``l`` at offset ``i + l``, seeing level-0
    tokens ``0 .. i-1`` and column ``i`` of levels ``1 .. l``. Tokens are laid out level by level.
    """
    s = len(levels[0])
    cols = s + 1
    f = len(levels) - 1
    for l in range(1, f + 1):
        if len(levels[l]) != cols:
            raise ValueError(f"level {l} has {len(levels[l])} tokens, expected {cols} (level 0 has {s})")
    n = s + f * cols
    tokens = [int(t) for level in levels for t in level]
    positions = list(range(1, s + 1)) + [i + l for l in range(1, f + 1) for i in range(cols)]
    mask = np.zeros((n, n), dtype=bool)
    mask[:s, :s] = np.tri(s, dtype=bool)  # level 0: a causal run
    for l in range(1, f + 1):
        for i in range(cols):
            row = s + (l - 1) * cols + i
            mask[row, :i] = True
            mask[row, s + i : row + 1 : cols] = True  # column i of levels 1 .. l
    return SideBlock(tokens=tokens, positions=positions, mask=mask, sees_root=True)


@dataclass
class LookaheadWindow:
    """One request's lookahead state: the window levels, which cells the model generated, the pool.

    ``levels[0]`` is the oldest level, ``levels[-1]`` the newest; ``filled`` levels above level
    0 exist (``N - 2`` once full). ``generated[l][i]`` is False for cells of levels ``>= 1`` that
    were refilled with random tokens rather than produced by the model; a column's n-gram enters
    the pool only when its whole trajectory was generated.
    """

    levels: list[list[int]]
    generated: list[list[bool]]
    pool: NGramPool
    rng: np.random.Generator
    steps: int = 0
    pending: dict | None = field(default=None, repr=False)

    @property
    def filled(self) -> int:
        return len(self.levels) - 1


class JacobiLookahead(SourceBase[LookaheadWindow]):
    """Lookahead decoding as a draft source: a Jacobi window in the side block, an n-gram pool,
    and up to ``max_candidates`` pool n-grams starting with the newest token as tree branches.

    Parameters
    ----------
    window:
        ``W``, the number of future positions the window iterates (columns).
    ngram:
        ``N``, the n-gram size; the window keeps ``N - 1`` levels of the trajectory and each draft
        branch is ``N - 1`` tokens. At least 3 (with ``N = 2`` every draft is one token; the
        reference implementation does not support it either).
    max_candidates:
        ``G``, how many pool n-grams (most recently generated first) become branches each step;
        also the pool's per-key bound.
    pool_size:
        bound on the total number of n-grams in the pool of one request (LRU: the least recently
        generated goes first). The pool lives for one request, as in the paper; a new request
        starts from an empty (or prompt-seeded) pool.
    prompt_as_reference:
        seed the pool with every ``N``-gram of the prompt (the paper's "prompt as reference",
        Table 3 rows 8 vs 9), and keep adding the n-grams of the committed output.
    advance:
        how the window moves after a step that committed ``c`` tokens. ``"one"`` (the reference
        implementation's default, ``ALWAYS_FWD_ONE``): one step along the time axis whatever
        ``c`` is; the window's positions then trail the sequence by ``c - 1``, which costs little
        because pool n-grams are keyed by their first token, not by where they were found.
        ``"committed"``: additionally drop ``c - 1`` columns (their positions are now committed)
        and refill the tail with random context tokens; a refilled column's n-grams enter the pool
        only once its whole trajectory is the model's again (``N - 2`` steps later). The initial
        fill always advances one column per step. ``"committed"`` was not in the real-model grid
        (its time budget); on the tiny test models neither mode accepts consistently more.
    seed:
        seed of the random initial fill and refills (per request, mixed with the prompt).

    Defaults: ``W=5, N=3, G=2``, chosen by measurement on a CPU rather than copied from the
    paper's A100 table (W=15, N=5, G=15: about (W + G)(N - 1) = 120 tokens per forward, width a
    CPU does not have to spare). On Qwen2.5-Coder-0.5B-Instruct (``benchmarks/jacobi_grid.py`` and
    a ``specdraft bench`` grid; ``benchmarks/README.md``, "Jacobi lookahead grid"), (5, 3, 2)
    accepted the most tokens per step of the windows tried at two thirds of the widest windows'
    side tokens. Where a forward of many tokens costs more than a one-token one (stock float32
    kernels on a CPU), lookahead alone is a slowdown whatever the window; it pays where spare
    width is real (GPUs, or the packed CPU kernels of :mod:`specdraft.cpu_kernels`) and mixes
    with the other sources in one tree. Every float32 output was identical to plain decoding.
    """

    def __init__(self, window: int = 5, ngram: int = 3, max_candidates: int = 2, pool_size: int = 4096,
                 prompt_as_reference: bool = True, advance: str = "one", seed: int = 0,
                 name: str = "jacobi") -> None:
        for label, value, low in (("window", window, 1), ("ngram", ngram, 3), ("max_candidates", max_candidates, 1),
                                  ("pool_size", pool_size, 1)):
            check_int(label, value, low, numpy_ok=True)
        if advance not in _ADVANCE:
            raise ValueError(f"advance must be one of {_ADVANCE}, got {advance!r}")
        super().__init__()
        self.window = int(window)
        self.ngram = int(ngram)
        self.max_candidates = int(max_candidates)
        self.pool_size = int(pool_size)
        self.prompt_as_reference = bool(prompt_as_reference)
        self.advance = advance
        self.seed = int(seed)
        self.name = name
        # steps before the window is full and its pool starts to pay (read by the adaptive budget,
        # which should not judge this source while it is still filling)
        self.warmup_steps = self.ngram - 1

    def __repr__(self) -> str:
        return (f"JacobiLookahead(window={self.window}, ngram={self.ngram}, max_candidates={self.max_candidates}, "
                f"pool_size={self.pool_size}, prompt_as_reference={self.prompt_as_reference}, "
                f"advance={self.advance!r})")

    @property
    def side_tokens(self) -> int:
        """Tokens the full window adds to every forward: ``(W - 1) + W (N - 2)``."""
        return self.window - 1 + self.window * (self.ngram - 2)

    # -- request lifecycle -------------------------------------------------------------------

    # per-request windows live in SourceBase (begin/end, under a lock); ``active_requests`` times
    # one window and one pool of at most ``pool_size`` n-grams bounds the source's memory

    def new_state(self, context: Context) -> LookaheadWindow:
        tokens = [int(t) for t in context.tokens]
        rng = np.random.default_rng([self.seed, len(tokens), *tokens[-32:]])
        pool = NGramPool(self.pool_size, self.max_candidates)
        if self.prompt_as_reference:
            self._learn(pool, tokens, 0)
        level0 = self._random_tokens(rng, tokens, self.window + self.ngram - 3)
        return LookaheadWindow(levels=[level0], generated=[[True] * len(level0)], pool=pool, rng=rng)

    @staticmethod
    def _random_tokens(rng: np.random.Generator, tokens: Sequence[int], n: int) -> list[int]:
        """``n`` tokens drawn from the context (Algorithm 1, L4; the reference draws from the prompt)."""
        if n <= 0:
            return []
        return [int(tokens[i]) for i in rng.integers(0, len(tokens), size=n)]

    def _learn(self, pool: NGramPool, tokens: Sequence[int], start: int) -> None:
        """Add every ``N``-gram of ``tokens`` that starts at or after ``start`` (older first)."""
        n = self.ngram
        for s in range(max(start, 0), len(tokens) - n + 1):
            pool.add(tokens[s], tokens[s + 1 : s + n])

    # -- one step ------------------------------------------------------------------------------

    def propose(self, context: Context, budget: int) -> Draft:
        st = self.request_state(context)  # made here if begin() was skipped: start from this context
        if budget <= 0:
            # plain decoding was asked for: the window's n-grams could not be checked, so it
            # would only cost time. It resumes when there is a budget again.
            st.pending = None
            return Draft()
        root = int(context.root)
        branches = within_budget(st.pool.get(root, self.max_candidates), budget)
        side = window_side_block(st.levels)
        st.pending = dict(root=root, filled=st.filled, level0=len(st.levels[0]))
        return Draft(branches=branches, side_block=side)

    def observe(self, feedback: Feedback) -> None:
        st = self.peek_state(feedback.context.request_id)
        if st is None:
            return
        pending, st.pending = st.pending, None
        tokens = feedback.context.tokens
        if self.prompt_as_reference and feedback.committed:
            # n-grams of the committed output that became complete this step
            self._learn(st.pool, tokens, len(tokens) - len(feedback.committed) - self.ngram + 1)
        if pending is None or feedback.side_logits is None:
            return  # no window this step (budget 0): it stays as it was
        s, f = pending["level0"], pending["filled"]
        best = feedback.side_argmax  # read with the step's one device read (None: a caller made its own Feedback)
        if best is None:
            best = torch.argmax(feedback.side_logits, dim=-1).tolist()
        new = [int(t) for t in (best[: s] if f == 0 else best[s + (f - 1) * (s + 1):])]
        st.steps += 1
        self._update(st, pending["root"], new, len(feedback.committed), list(tokens))

    def _update(self, st: LookaheadWindow, root: int, new: list[int], committed: int, context: list[int]) -> None:
        """Algorithm 1 L16 (new level), L25-27 (pool) and L29 (drop the oldest level)."""
        levels, gen = st.levels, st.generated
        top = self.ngram - 2
        if st.filled < top:  # still filling: grow one level, drop one column everywhere
            cut = min(st.filled, 1)  # (a level grown from level 0 alone is as wide as it must be)
            levels[:] = [lv[1:] for lv in levels] + [new[cut:]]
            gen[:] = [g[1:] for g in gen] + [[True] * (len(new) - cut)]
            return
        # full window: every column completes an n-gram
        for i in range(self.window):
            if all(gen[l][i] for l in range(1, top + 1)):
                key = root if i == 0 else levels[0][i - 1]
                st.pool.add(key, [levels[l][i] for l in range(1, top + 1)] + [new[i]])
        drop = 0 if self.advance == "one" else min(max(committed - 1, 0), self.window)
        new_levels = [levels[1][1 + drop:], *(level[drop:] for level in levels[2:]), new[drop:]]
        # level-0 cells are keys and prefix only
        new_gen = [[True] * len(new_levels[0]), *(g[drop:] for g in gen[2:]), [True] * (len(new) - drop)]
        if drop:
            for l, level in enumerate(new_levels):
                want = self.window - 1 if l == 0 else self.window
                missing = want - len(level)
                level.extend(self._random_tokens(st.rng, context, missing))
                new_gen[l].extend([l == 0] * missing)
        st.levels, st.generated = new_levels, new_gen
