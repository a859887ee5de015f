"""What the running requests counted, over a shared n-gram model: one view they all draft from.

In shared mode (:class:`~specdraft.sources.ngram.MultiLevelNGram` with ``shared=True``) the shared
model changes only when a request ends, so a failed request leaves it exactly as it was. Until it
ends, what a request counts goes to :class:`RunningCounts`, which keeps two things:

* ``view``, an overlay of the shared model (see :class:`~specdraft.sources.ngram.NGramModel`): for
  every context a running request counted, the shared statistics plus what every running request
  counted there. Drafts read it before the shared model, so every running request sees its own
  counts and the others' as they are made, as if all counted in one table, at the cost of one more
  dict lookup per query.
* ``pending``: for each of those contexts, how many times each running request's next token was
  counted there, summed over the running requests (``context -> {token: count}``), so that a
  request's counts can be taken back exactly when it ends or fails: its stream is walked again,
  its counts subtracted from ``pending``, and each context it touched is rebuilt from the shared
  model and what is still pending there (or dropped from the view when nothing is).

With no request running both are empty, and drafts read the shared model alone. A rebuilt
context keeps the tie-break stamps its followers had in the view (so a request that took its
counts back may leave, until the others end, which of two equally counted followers they predict
first). The view holds no more contexts and followers than the running requests counted (no
eviction: their lengths bound it) and keeps no follower cap. Statistics dicts and the tables are
dicts of ints and tuples of ints: the garbage collector does not track them.
"""

from __future__ import annotations

from typing import Sequence

# (no import of .ngram, which builds on this module: ``NGramModel`` below is an annotation only)

__all__ = ["RunningCounts"]


class RunningCounts:
    """What the running requests counted over ``shared`` (see the module docstring)."""

    __slots__ = ("shared", "view", "pending")

    def __init__(self, shared: "NGramModel") -> None:  # noqa: F821
        self.shared = shared
        self.view = shared.overlay()
        self.pending: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: Sequence[int], start: int) -> None:
        """Count ``tokens[i]`` after its contexts for every ``i >= start`` (as
        :meth:`NGramModel.add`), in the view and in ``pending``."""
        view = self.view
        view.clock = max(view.clock, self.shared.clock)  # newer than anything the shared model holds
        view.add(tokens, start)
        pending = self.pending
        for ctx, token in _positions(tokens, start, view.max_ngram - 1):
            counted = pending.get(ctx)
            if counted is None:
                pending[ctx] = {token: 1}
            else:
                counted[token] = counted.get(token, 0) + 1

    def take_back(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Take back what :meth:`add` counted for the positions ``start <= i < stop`` of ``tokens``,
        and rebuild every context they touched."""
        pending = self.pending
        touched = set()
        for ctx, token in _positions(tokens[:stop], start, self.view.max_ngram - 1):
            counted = pending[ctx]
            left = counted[token] - 1
            if left:
                counted[token] = left
            else:
                del counted[token]
                if not counted:
                    del pending[ctx]
            touched.add(ctx)
        for ctx in touched:  # the shared statistics plus what is still pending there (none if nothing is)
            self.view.recount(ctx, pending.get(ctx))


def _positions(tokens: Sequence[int], start: int, top: int):
    """``(context, next token)`` for every position ``i >= max(start, 1)`` of ``tokens`` and every
    context of ``1 .. top`` tokens before it, as :meth:`NGramModel.add` counts them."""
    lo = max(start - top, 0)
    window = tuple(int(t) for t in tokens[lo:])
    for i in range(max(start - lo, 1), len(window)):
        token = window[i]
        for m in range(1, min(top, i) + 1):
            yield window[i - m : i], token
