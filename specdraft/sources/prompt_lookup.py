"""Prompt lookup (LLMA / "prompt as reference"): copy what followed earlier occurrences of the tail.

When the output repeats the prompt (code edits, summaries, RAG answers quoting their sources),
the tokens that followed an earlier occurrence of the last few tokens are an excellent guess for
what follows now. We match the last ``n`` tokens for ``n`` from ``max_ngram`` down to
``min_ngram`` over the prompt and everything generated so far; the longest ``n`` with any match
wins, and up to ``max_branches`` distinct continuations (most recent match first) become
branches of the tree, so several candidate copies are checked in the same forward pass.
"""

from __future__ import annotations

from array import array
from typing import Iterable, Sequence

from ..checks import check_int
from .base import Context, Draft, SourceBase


class _TailIndex:
    """Where every n-gram (``min_ngram <= n <= max_ngram``) of one request's sequence starts, grown
    as tokens commit: a lookup costs O(matches), not a scan of the whole context.

    An n-gram seen once maps to its start (an int), one seen more often to an ``array('q')`` of its
    starts: neither is tracked by Python's cyclic garbage collector (a list per n-gram would be,
    tens of thousands of them for a long prompt, scanned by every full collection while the
    request runs), and most n-grams of a long context occur once."""

    __slots__ = ("starts", "indexed")

    def __init__(self) -> None:
        self.starts: dict[tuple[int, ...], int | array] = {}
        self.indexed = 0  # windows ending before this index are in ``starts``

    def extend(self, tokens: Sequence[int], end: int, min_ngram: int, max_ngram: int) -> None:
        """Index every window ``tokens[i : i + n]`` with ``i + n <= end`` not indexed yet."""
        if end <= self.indexed:
            return
        offset = max(0, self.indexed - max_ngram + 1)
        fresh = list(map(int, tokens[offset:end]))
        starts = self.starts
        for stop in range(self.indexed + 1, end + 1):  # windows ending at ``stop`` (exclusive)
            for n in range(min_ngram, max_ngram + 1):
                first = stop - n
                if first < 0:
                    break
                key = tuple(fresh[first - offset : stop - offset])
                found = starts.get(key)
                if found is None:
                    starts[key] = first
                elif found.__class__ is int:
                    starts[key] = array("q", (found, first))
                else:
                    found.append(first)
        self.indexed = end


class PromptLookup(SourceBase[_TailIndex]):
    """Draft source that proposes continuations of earlier matches of the context's tail.

    Defaults: the longest tail matched is 3 tokens, branches are up to 20 tokens, 2 branches,
    most recent match first (a recent copy is the likeliest to go on). Long branches cost width
    only when the adaptive budget judges they pay. How the defaults were measured is in the
    documentation's "How the defaults were chosen" page.

    Each request keeps an index of where every n-gram of its sequence starts, built while the
    prefill runs (``begin``) and grown by the tokens each step commits, so a step's lookup does
    not rescan the context (a scan of a 16k-token context costs about a millisecond a step, the
    whole of a compiled GPU step's budget). Nothing outlives a request, so one instance is safe
    to share between decoders and threads.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 20, max_branches: int = 2,
                 name: str = "prompt") -> None:
        for label, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("num_tokens", num_tokens),
                             ("max_branches", max_branches)):
            check_int(label, value, 1, numpy_ok=True)
        if max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        super().__init__()
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_tokens = num_tokens
        self.max_branches = max_branches
        self.name = name

    def new_state(self, context: Context) -> _TailIndex:
        index = _TailIndex()
        index.extend(context.tokens, len(context.tokens) - 1, self.min_ngram, self.max_ngram)
        return index

    def propose(self, context: Context, budget: int) -> Draft:
        if budget <= 0:  # no draft wanted: the index catches up at the next draft
            return Draft()
        tokens = context.tokens
        length = len(tokens)
        index = self.request_state(context)
        # a match must end before the root (the tail matching itself says nothing)
        index.extend(tokens, length - 1, self.min_ngram, self.max_ngram)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            starts = index.starts.get(tuple(map(int, tokens[length - n :])))
            if starts is None:
                continue
            found = (starts,) if starts.__class__ is int else reversed(starts)
            return Draft(branches=self._continuations(tokens, found, n, budget))
        return Draft()

    def _continuations(self, tokens: Sequence[int], starts: Iterable[int], n: int, budget: int) -> list[list[int]]:
        """What followed each match (most recent first), distinct and none a prefix of an earlier one."""
        branches: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for start in starts:
            if len(branches) >= self.max_branches or budget <= 0:
                break
            begin = start + n
            cont = tuple(map(int, tokens[begin : begin + min(self.num_tokens, budget)]))
            if cont and cont not in seen and not any(s[: len(cont)] == cont for s in seen):
                seen.add(cont)
                branches.append(list(cont))
                budget -= len(cont)
        return branches
