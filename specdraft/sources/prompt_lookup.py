"""Prompt lookup (LLMA / "prompt as reference"): copy what followed earlier occurrences of the tail.

When the output repeats the prompt (code edits, summaries, RAG answers quoting their sources),
the tokens that followed an earlier occurrence of the last few tokens are an excellent guess for
what follows now. We match the last ``n`` tokens for ``n`` from ``max_ngram`` down to
``min_ngram`` over the prompt and everything generated so far; the longest ``n`` with any match
wins, and up to ``max_branches`` distinct continuations (most recent match first) become
branches of the tree, so several candidate copies are checked in the same forward pass.
"""

from __future__ import annotations

import numbers

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .base import Context, Draft, SourceBase


class PromptLookup(SourceBase[None]):
    """Draft source that proposes continuations of earlier matches of the context's tail.

    Defaults: the longest tail matched is 3 tokens, branches are up to 20 tokens, 2 branches,
    most recent match first (a recent copy is the likeliest to go on). Long branches cost width
    only when the adaptive budget judges they pay. How the defaults were measured is in the
    documentation's "How the defaults were chosen" page.

    Stateless across steps and requests (it rescans the context, which costs microseconds next
    to a forward pass), so one instance is safe to share between decoders and threads.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 20, max_branches: int = 2,
                 name: str = "prompt") -> None:
        for label, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("num_tokens", num_tokens),
                             ("max_branches", max_branches)):
            # a wrong type (a string from the command line, say) is named here, not a failed comparison
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{label} must be an int >= 1, got {value!r}")
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {max_branches}")
        super().__init__()
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_tokens = num_tokens
        self.max_branches = max_branches
        self.name = name

    def propose(self, context: Context, budget: int) -> Draft:
        tokens = np.asarray(context.tokens, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # window i covers tokens[i : i + n]
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(starts) == 0:
                continue
            return Draft(branches=self._continuations(tokens, starts[::-1] + n, budget))
        return Draft()

    def _continuations(self, tokens: np.ndarray, begins: np.ndarray, budget: int) -> list[list[int]]:
        branches: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for begin in begins:
            if len(branches) >= self.max_branches or budget <= 0:
                break
            cont = tuple(tokens[begin : begin + min(self.num_tokens, budget)].tolist())
            if cont and cont not in seen and not any(s[: len(cont)] == cont for s in seen):
                seen.add(cont)
                branches.append(list(cont))
                budget -= len(cont)
        return branches
