"""Pauses of Python's cyclic garbage collector in a server-like run of the draft sources.

A server keeps its draft sources for its whole life: the frequency trie and the suffix tree's
global cache grow to their bounds, and every request builds per-request indexes of its prompt.
Every object the collector tracks is scanned by each full collection, and full collections fire
on their own every few requests; when the sources hold millions of tracked objects, one of them
stalls a step for half a second, in the middle of someone's answer. This script drives the
sources through such a run without a model and records every collection.

What runs: ``--requests`` requests one after another, each a prompt of ``--prompt-tokens``
followed by ``--output-tokens`` "generated" tokens, both cut from this repository's own text
(Python sources, docs and tests, split into words, punctuation and whitespace runs and numbered
by first appearance: a real, repetitive token stream of ~15k distinct tokens). Each request makes
the calls the decoder makes: ``begin`` on every source, then per step every source's ``propose``,
the decoder's own merge (:meth:`specdraft.tree.TokenTree.from_drafts`), the greedy walk along the
true continuation (the accepted path plus the model's own next token), ``observe`` on every
source, and ``end``. The forward itself is free, so a step's time is the sources' own work.

What is recorded:

* every collection, through :data:`gc.callbacks`: its generation and its duration, and whether it
  ran inside a step (a step's time includes it) or between requests;
* the host time of each step (``propose`` + merge + ``observe`` of every source): median and p99,
  and per source;
* after the run, the tracked objects (``len(gc.get_objects())`` plus the frozen ones) and the time of one full
  ``gc.collect()``; with ``--per-source``, the tracked objects each source holds.

``--settle`` calls :func:`specdraft.sources.bulk.settle_long_lived` between requests (where the
engine would: no request in flight), as a server does once it is set up. ``--bare`` leaves the
engine (transformers) unimported; by default it is imported, because a server process holds it,
and its objects are part of every full collection.

    python benchmarks/gc_pauses.py                          # 40 requests of 8k tokens
    python benchmarks/gc_pauses.py --settle --json out.json
    python benchmarks/gc_pauses.py --requests 12 --per-source
    python benchmarks/gc_pauses.py --package ../older-checkout --text-from HEAD   # another commit's sources
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
CLOCK = time.perf_counter


def repository_tokens(text_from: str | None = None) -> list[int]:
    """This repository's Python and Markdown files as one token stream (words, single punctuation
    marks, newlines and space runs, numbered in order of first appearance). ``text_from``: a git
    revision whose files to read instead of the working tree, so that runs of two commits see the
    same stream."""
    patterns = ("specdraft/**/*.py", "tests/*.py", "docs/**/*.md", "benchmarks/*.py")
    with tempfile.TemporaryDirectory() as where:
        root = ROOT
        if text_from is not None:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", text_from, "specdraft", "tests", "docs",
                                      "benchmarks"], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
            root = Path(where)
        files = sorted(p for pattern in patterns for p in root.glob(pattern))
        text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    ids: dict[str, int] = {}
    return [ids.setdefault(w, len(ids) + 3) for w in re.findall(r"\w+|[^\w\s]|\n| +", text)]


def make_requests(stream: list[int], count: int, prompt_tokens: int, output_tokens: int,
                  seed: int) -> list[tuple[list[int], list[int]]]:
    """``count`` (prompt, output) pairs cut at random places of ``stream`` (seeded): a prompt and the
    text that follows it, as a model that reproduced the text would answer."""
    span = prompt_tokens + output_tokens
    if len(stream) < span:
        raise ValueError(f"the token stream has {len(stream)} tokens, fewer than one request's {span}")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        at = rng.randrange(len(stream) - span + 1)
        out.append((stream[at : at + prompt_tokens], stream[at + prompt_tokens : at + span]))
    return out


class Collections:
    """Every collection of the cyclic garbage collector: (generation, start, seconds), and the CPU
    seconds of each (``cpu``), which a machine shared with other work does not stretch: a
    collection the scheduler interrupted is long in wall time only."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float, float]] = []
        self.cpu: list[float] = []
        self._start = 0.0
        self._start_cpu = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start, self._start_cpu = CLOCK(), time.thread_time()
        else:
            self.events.append((info["generation"], self._start, CLOCK() - self._start))
            self.cpu.append(time.thread_time() - self._start_cpu)

    def __enter__(self) -> "Collections":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def walk(tree: Any, root: int, full: Sequence[int], done: int) -> list[int]:
    """What greedy verification commits at ``done``: the longest tree path along ``full``, plus the
    model's own next token (never past the end)."""
    node, step = 0, []
    while done + len(step) < len(full):
        token = full[done + len(step)]
        step.append(token)
        child = tree.child(node, token)
        if child is None:
            break
        node = child
    return step


def run(sources: list[Any], requests: list[tuple[list[int], list[int]]], budget: int,
        settle: Any) -> dict[str, Any]:
    """Drive the sources through the requests as the decoder would; returns the steps' start and
    end times, their host seconds, each source's seconds per step and the accepted lengths."""
    from specdraft.sources import Context, Feedback
    from specdraft.tree import TokenTree

    steps: list[tuple[float, float]] = []
    per_source: dict[str, list[float]] = {s.name: [] for s in sources}
    lengths: list[int] = []
    for rid, (prompt, output) in enumerate(requests, 1):
        full = prompt + output
        tokens = list(prompt)
        context = Context(tuple(tokens), len(prompt), rid)
        for source in sources:
            source.begin(context)
        while len(tokens) < len(full):
            start = CLOCK()
            drafts = []
            for source in sources:
                t = CLOCK()
                drafts.append(source.propose(context, budget).branches)
                per_source[source.name].append(CLOCK() - t)
            depth = len(full) - len(tokens) - 1
            drafts = [[b[:depth] for b in d if b] if depth > 0 else [] for d in drafts]
            tree = TokenTree.from_drafts(context.root, drafts, budget)
            committed = walk(tree, context.root, full, len(tokens))
            tokens.extend(committed)
            context = Context(tuple(tokens), len(prompt), rid)
            feedback = Feedback(committed=committed, context=context)
            for i, source in enumerate(sources):
                t = CLOCK()
                source.observe(feedback)
                per_source[source.name][-1] += CLOCK() - t
            steps.append((start, CLOCK()))
            lengths.append(len(committed))
        for source in sources:
            source.end(context)
        if settle is not None:
            settle()
    return dict(steps=steps, per_source=per_source, lengths=lengths)


def source_objects(source: Any) -> int:
    """Tracked objects reachable from ``source`` (modules, classes and functions excluded)."""
    seen = {id(source)}
    stack = [source]
    count = 0
    skip = (type(sys), type, type(run))
    while stack:
        obj = stack.pop()
        count += 1
        for ref in gc.get_referents(obj):
            if gc.is_tracked(ref) and id(ref) not in seen and not isinstance(ref, skip):
                seen.add(id(ref))
                stack.append(ref)
    return count


def commit(root: Path = ROOT) -> str:
    """The commit checked out at ``root`` (``SPECDRAFT_COMMIT`` names it for a copy outside git)."""
    import os

    if os.environ.get("SPECDRAFT_COMMIT"):
        return os.environ["SPECDRAFT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=6144)
    ap.add_argument("--output-tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=32, help="node budget per step (the decoder's max_tree_nodes)")
    ap.add_argument("--sources", default=None, help="comma list of source specs (default: the default sources)")
    ap.add_argument("--settle", action="store_true", help="call settle_long_lived() between requests")
    ap.add_argument("--bare", action="store_true", help="do not import the engine (transformers)")
    ap.add_argument("--per-source", action="store_true", help="count the tracked objects each source holds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-from", default=None,
                    help="a git revision whose files make the token stream (default: the working tree)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--package", type=Path, default=ROOT,
                    help="a checkout whose specdraft to run (default: this one), to compare two commits")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.package.resolve()))

    import torch

    torch.set_num_threads(1)
    if not args.bare:
        import specdraft.decoder  # noqa: F401  (what a server process holds)
    from specdraft.sources import registry

    settle = None
    if args.settle:
        from specdraft.sources.bulk import settle_long_lived as settle
    specs = registry.parse_source_names(args.sources) if args.sources else list(registry.DEFAULT_SOURCES)
    sources = registry.make_sources(specs)
    requests = make_requests(repository_tokens(args.text_from), args.requests, args.prompt_tokens, args.output_tokens, args.seed)
    gc.collect()
    if settle is not None:
        settle()  # once set up, before the first request, as a server would
    baseline_objects = len(gc.get_objects()) + gc.get_freeze_count()
    with Collections() as collections:
        started = CLOCK()
        result = run(sources, requests, args.budget, settle)
        wall = CLOCK() - started
    steps = result["steps"]
    seconds = [b - a for a, b in steps]
    # a collection inside a step lengthens that step; one between steps (begin, end, settle) does not
    starts = [a for a, _ in steps]
    inside = []
    import bisect

    for generation, at, took in collections.events:
        i = bisect.bisect_right(starts, at) - 1
        inside.append(i >= 0 and at < steps[i][1])
    tracked = len(gc.get_objects()) + gc.get_freeze_count()
    objects = {s.name: source_objects(s) for s in sources} if args.per_source else {}
    t = CLOCK()
    gc.collect()
    full_ms = 1000 * (CLOCK() - t)
    ms = lambda xs: [1000 * x for x in xs]  # noqa: E731
    in_step = [took for (g, _, took), ok in zip(collections.events, inside) if ok]
    report = {
        "commit": commit(args.package), "date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0],
        "sources": specs, "text_from": args.text_from, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "budget": args.budget, "settle": args.settle, "bare": args.bare,
        "steps": len(steps), "mean_accepted": sum(result["lengths"]) / len(result["lengths"]),
        "wall_s": wall, "objects_before_run": baseline_objects, "tracked_objects_after": tracked,
        "frozen_after": gc.get_freeze_count(),
        "full_collection_after_ms": full_ms,
        "collections": {g: sum(1 for e in collections.events if e[0] == g) for g in range(3)},
        "longest_pause_ms": max(ms(e[2] for e in collections.events), default=0.0),
        "longest_pause_in_step_ms": max(ms(in_step), default=0.0),
        "pauses_in_steps_over_20ms": sum(1 for x in in_step if x > 0.020),
        "longest_pause_in_step_cpu_ms": max((1000 * c for c, ok in zip(collections.cpu, inside) if ok), default=0.0),
        "generations_of_pauses_in_steps_over_20ms": sorted(g for (g, _, took), ok in zip(collections.events, inside)
                                                           if ok and took > 0.020),
        "gc_total_ms": sum(ms(e[2] for e in collections.events)),
        "step_ms_median": statistics.median(ms(seconds)),
        "step_ms_p99": statistics.quantiles(ms(seconds), n=100)[98],
        "step_ms_max": max(ms(seconds)),
        "source_us_median": {name: 1e6 * statistics.median(v) for name, v in result["per_source"].items()},
        "source_objects": objects,
    }
    for key, value in report.items():
        print(f"{key:28s} {value:.3f}" if isinstance(value, float) else f"{key:28s} {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
