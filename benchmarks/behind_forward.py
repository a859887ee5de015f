"""Host work that hides behind the forward on an accelerator: how much of a step's host time moves.

On a GPU the step runs the sources' late learning (``observes_late``) and their prompt indexing
between a forward's launch and its read (:meth:`specdraft.engine.step.Step.behind_forward`). On
a CPU the forward runs in the calling thread, so nothing overlaps; this script forces the GPU
order there (``Decoder.hide_host_work = True``) to measure what moved: the time inside
``behind_forward`` per step, beside the host time between forwards, with and without the move
(alternated, median of ``--repeats``), and the steps a 256-token answer took (the drafts miss one
step of learning). The model is ``host_overhead.py``'s near-free one, greedy, a fixed tree.

    python benchmarks/behind_forward.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from host_overhead import ForwardTimer, near_free_model, repetitive_context
from specdraft import Decoder
from specdraft.engine import step as step_module
from specdraft.sources.registry import make_sources
from specdraft.stats import GenerationStats

MIXES = {"default": ["prompt", "trie", "ngram", "suffix"], "default+recycle": ["prompt", "trie", "ngram", "suffix", "recycle"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    behind = [0.0]
    original = step_module.Step.behind_forward

    def timed(self, members) -> None:
        started = time.perf_counter()
        original(self, members)
        behind[0] += time.perf_counter() - started

    step_module.Step.behind_forward = timed
    model = near_free_model()
    timer = ForwardTimer(model)
    runs: dict[tuple[str, int, bool], list[dict[str, float]]] = {}
    for mix, sources in MIXES.items():
        for context in [int(c) for c in args.contexts.split(",")]:
            prompt = repetitive_context(context)
            for _ in range(args.repeats):
                for hide in (False, True):
                    dec = Decoder(model, None, sources=make_sources(sources), max_tree_nodes=args.nodes,
                                  adaptive_budget=False, cpu_kernels="stock")
                    dec.hide_host_work = hide
                    stats, behind[0] = GenerationStats(), 0.0
                    timer.reset()
                    list(dec.stream(prompt, max_new_tokens=args.new_tokens, stats=stats))
                    runs.setdefault((mix, context, hide), []).append(
                        {"host_ms": statistics.median(timer.gaps()[2:]) * 1e3,
                         "behind_ms": behind[0] / stats.steps * 1e3, "steps": stats.steps})
    rows = []
    for (mix, context, hide), found in runs.items():
        rows.append({"sources": mix, "context": context, "behind_forward": hide,
                     "host_ms_per_step": round(statistics.median(r["host_ms"] for r in found), 3),
                     "behind_ms_per_step": round(statistics.median(r["behind_ms"] for r in found), 3),
                     "steps": [r["steps"] for r in found]})
    lines = ["| sources | context | order | host ms / step | of it behind the forward | steps |", "|---|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['sources']} | {r['context']:,} | {'GPU (behind)' if r['behind_forward'] else 'CPU'} | "
                     f"{r['host_ms_per_step']:.2f} | {r['behind_ms_per_step']:.2f} | {', '.join(map(str, r['steps']))} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
