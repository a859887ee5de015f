"""The official SuffixDecoding (Snowflake's ArcticInference) as a draft source, for benchmarks only.

:class:`ArcticSuffix` wraps ``arctic_inference.suffix_decoding.SuffixDecodingCache`` (the C++
suffix trees vLLM calls) behind the :class:`~specdraft.sources.base.DraftSource` protocol, with the
same knobs and defaults as our :class:`~specdraft.sources.suffix_tree.SuffixTree`, so the two can
be compared on the same prompts: drafts, acceptance and drafting cost. It is not a dependency of
the library and is not in the source registry: the bench offers it as ``arctic-suffix``
(:data:`specdraft.bench.methods.BENCH_ONLY_SOURCES`).

Installing it. ``arctic-inference`` 0.3.0's wheel needs CUDA and torch >= 2.10 to build, but its
suffix-decoding extension is plain C++20 with nanobind, and builds alone on a CPU machine
(``docs/sources/suffix-tree.md`` has the exact commands): build ``csrc/suffix_decoding`` from the
sdist with CMake, then put ``arctic_inference/__init__.py``, ``arctic_inference/suffix_decoding/
{__init__,cache}.py`` and the built ``_C`` module in a directory on ``PYTHONPATH``.

Differences from ours that a comparison should keep in mind: its probabilities are float32, it
tries match lengths ``1 .. len(context) - 1`` of the context it is given (we pass it the last
``max_depth`` tokens, so both try up to ``max_depth - 1``), and among equally likely candidates it
may choose in another order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sources.base import Context, Draft, Feedback, SourceBase

__all__ = ["ArcticSuffix", "ArcticNotInstalled"]

INSTALL_HINT = ("build the suffix-decoding extension of arctic-inference==0.3.0 from its sdist and put it on "
                "PYTHONPATH, as docs/sources/suffix-tree.md describes ('The official implementation as a peer')")


class ArcticNotInstalled(ImportError):
    """``arctic_inference.suffix_decoding`` cannot be imported; the message says how to get it."""


def _cache_class() -> Any:
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as exc:
        raise ArcticNotInstalled(f"the 'arctic-suffix' bench source needs arctic_inference.suffix_decoding, which "
                                 f"does not import ({exc}); {INSTALL_HINT}") from None
    return SuffixDecodingCache


@dataclass
class _Request:
    length: int  # context tokens handed to the cache (prompt at start_request, then responses)


class ArcticSuffix(SourceBase[_Request]):
    """Draft source over ArcticInference's ``SuffixDecodingCache`` (benchmark peer, see module doc).

    Same knobs as :class:`~specdraft.sources.suffix_tree.SuffixTree`; ``max_cached_requests=0``
    turns its global tree off. One lock guards the cache (the C++ cache is not thread-safe).
    Pickling (the bench's ``--repeats`` copies sources that way) keeps the cached responses and
    rebuilds the cache from them; running requests are not carried over.
    """

    name = "arctic-suffix"

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_spec_tokens: int | None = None, max_cached_requests: int = 1000,
                 max_spec_offset: float = 0.0, tree: bool = True, name: str = "arctic-suffix") -> None:
        super().__init__()
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0 (0: no global tree), got {max_cached_requests!r}")
        self.max_depth = int(max_depth)
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.max_spec_tokens = int(max_depth if max_spec_tokens is None else max_spec_tokens)
        self.max_cached_requests = int(max_cached_requests)
        self.max_spec_offset = float(max_spec_offset)
        self.tree = bool(tree)
        self.name = name
        self._lock = threading.Lock()
        self._responses: dict[Any, list[int]] = {}  # cached responses, oldest first (for pickling)
        self._cache = _cache_class()(max_tree_depth=self.max_depth, max_cached_requests=self.max_cached_requests)

    def new_state(self, context: Context) -> _Request:
        tokens = np.asarray(context.tokens[: context.prompt_length], dtype=np.int32)
        with self._lock:
            self._cache.start_request(context.request_id, tokens)
            if self.max_cached_requests:  # start_request may have evicted (only it does)
                self._responses.pop(context.request_id, None)
                self._responses[context.request_id] = []
                kept = self._cache.cached_requests
                self._responses = {rid: tokens for rid, tokens in self._responses.items() if rid in kept}
        state = _Request(context.prompt_length)
        self._sync(state, context)
        return state

    def propose(self, context: Context, budget: int) -> Draft:
        if budget <= 0:
            return Draft()
        state = self.request_state(context)
        self._sync(state, context)
        tail = np.asarray(context.tokens[-self.max_depth :], dtype=np.int32)
        with self._lock:
            draft = self._cache.speculate(context.request_id, tail, max_spec_tokens=min(self.max_spec_tokens, budget),
                                          max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
                                          min_token_prob=self.min_token_prob, use_tree_spec=self.tree)
        paths: list[list[int]] = []
        for token, parent in zip(draft.token_ids, draft.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [int(token)])
        return Draft(paths)

    def observe(self, feedback: Feedback) -> None:
        self._sync(self.request_state(feedback.context), feedback.context)

    def end(self, context: Context) -> None:
        if self.peek_state(context.request_id) is not None:
            with self._lock:
                self._cache.stop_request(context.request_id)
        super().end(context)

    def _sync(self, state: _Request, context: Context) -> None:
        tokens = context.tokens
        if len(tokens) <= state.length:
            return
        new = [int(t) for t in tokens[state.length :]]
        with self._lock:
            self._cache.add_active_response(context.request_id, np.asarray(new, dtype=np.int32))
            if context.request_id in self._responses:
                self._responses[context.request_id].extend(new)
        state.length = len(tokens)

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            state = super().__getstate__()
            state.pop("_cache", None)
            state["_states"] = {}
            state["_responses"] = {rid: list(toks) for rid, toks in self._responses.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._cache = _cache_class()(max_tree_depth=self.max_depth, max_cached_requests=self.max_cached_requests)
        for rid, tokens in self._responses.items():  # replay, oldest first: the same FIFO order
            self._cache.start_request(rid, np.zeros(0, dtype=np.int32))
            self._cache.add_active_response(rid, np.asarray(tokens, dtype=np.int32))
            self._cache.stop_request(rid)

