"""The draft sources by name, and the one default combination.

Everything that picks sources by name reads this module: ``Decoder()`` without ``sources=``, the
``--sources`` flag of ``specdraft generate``, the methods of ``specdraft bench`` and the docs. A
new source is one line in :data:`SOURCES`. Factories import their module only when called, so a
command that does not use a source never pays for importing it (and a source being rewritten
cannot break the others).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Sequence

from ..source_spec import SourceSpecError, parse_source_spec, split_top_level

__all__ = ["DEFAULT_SOURCES", "GPU_DEFAULT_SOURCES", "SOURCES", "default_source_names", "default_sources", "make_sources",
           "parse_source_names"]


def _lazy(module: str, attr: str, **kwargs: Any) -> Callable[..., Any]:
    """A factory that imports ``specdraft.sources.<module>.<attr>`` only when called."""

    def make(**overrides: Any) -> Any:
        return getattr(importlib.import_module(f"specdraft.sources.{module}"), attr)(**{**kwargs, **overrides})

    make.__qualname__ = f"make_{attr}"
    return make


#: Draft sources by name: name -> factory taking the source's keyword arguments.
SOURCES: dict[str, Callable[..., Any]] = {
    "prompt": _lazy("prompt_lookup", "PromptLookup"),
    "trie": _lazy("trie", "FrequencyTrie"),
    "ngram": _lazy("ngram", "MultiLevelNGram"),
    "jacobi": _lazy("jacobi", "JacobiLookahead"),
    "recycle": _lazy("token_recycling", "TokenRecycling"),
    "suffix": _lazy("suffix_tree", "SuffixTree"),
}

#: The default combination, the measured best on a CPU (see docs/defaults.md): prompt lookup, the
#: frequency trie, the multi-level n-gram and the suffix tree (merged by value, so none crowds out
#: the others). Jacobi lookahead is left
#: out because its window costs width every step, which a CPU forward does not have spare; Token
#: Recycling because mixed in it gained 0-1.5% for a top-k read of every tree row.
DEFAULT_SOURCES: tuple[str, ...] = ("prompt", "trie", "ngram", "suffix")

#: The default combination on a CUDA GPU: :data:`DEFAULT_SOURCES` and Token Recycling with the
#: paper's whole 80-node tree template. There a forward of 64 rows costs about what one of 1
#: costs, so wide trees are nearly free: measured on an H100
#: (``benchmarks/results/gpu-h100-2026-11-27-7a7546a``, Qwen2.5-Coder-0.5B in bfloat16), adding
#: Token Recycling raised HumanEval from 1.39x to 1.70x our plain decoding and MT-Bench from 0.91x
#: to 0.94x (medians per prompt). Its template's 16-node prefix, the CPU's choice, leaves tokens
#: out there: with fixed trees on MT-Bench (``benchmarks/results/tree-width-2026-11-27-*``) these
#: sources commit 1.89 tokens per step at 32 nodes with it, 2.00 with the 80-node template, and
#: 2.29 with that template at 64 nodes (a GPU decoder checks up to 63: its widest forward, less
#: the root).
GPU_DEFAULT_SOURCES: tuple[str, ...] = ("prompt", "trie", "ngram", "suffix", "recycle[template=tr80]")


def parse_source_names(text: str) -> list[str]:
    """Split a sources list (``"prompt,trie"``, ``"prompt,jacobi[window=3,ngram=4]"``) and check
    every spec against :data:`SOURCES` (see :mod:`specdraft.source_spec` for the settings syntax).
    Returns the specs in canonical form (spaces removed); raises :class:`SourceSpecError`."""
    specs = [parse_source_spec(part, SOURCES).text for part in split_top_level(text)]
    if not specs:
        raise SourceSpecError(f"at least one draft source is needed; allowed: {', '.join(SOURCES)}")
    dupes = sorted({n for n in specs if specs.count(n) > 1})
    if dupes:
        raise SourceSpecError(f"draft source {dupes[0]!r} is listed twice")
    return specs


def make_sources(specs: Sequence[str], sources: Mapping[str, Callable[..., Any]] | None = None) -> list[Any]:
    """New source instances from specs as returned by :func:`parse_source_names`, built from
    :data:`SOURCES` or another name -> factory mapping (the bench adds its peers to it)."""
    table = SOURCES if sources is None else sources
    return [parse_source_spec(spec, table, check=False).build(table) for spec in specs]


def default_source_names(device: Any = None) -> tuple[str, ...]:
    """The default combination for a model on ``device`` (a ``torch.device``, its name, or
    ``None`` for the CPU): :data:`GPU_DEFAULT_SOURCES` on CUDA, :data:`DEFAULT_SOURCES` elsewhere
    (each measured best where it is the default)."""
    kind = getattr(device, "type", str(device or "cpu").split(":")[0])
    return GPU_DEFAULT_SOURCES if kind == "cuda" else DEFAULT_SOURCES


def default_sources(device: Any = None) -> list[Any]:
    """New instances of the default combination for a model on ``device``
    (:func:`default_source_names`)."""
    return make_sources(list(default_source_names(device)))
