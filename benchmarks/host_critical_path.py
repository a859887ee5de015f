"""Where a tree step's host time goes on the critical path of an accelerator, phase by phase.

On a GPU the host and the device overlap except between the step's one read of step ``t`` and the
launch of step ``t + 1``: settling (verify, commit, keep the accepted path, the sources' early
learning), drafting, planning, laying out the rows, packing the one upload. That stretch is
what the device waits for, so it is what makes a tree step dearer than a plain one. This script
runs the accelerator's order on the CPU and times each phase of :class:`specdraft.engine.step.Step`
by wrapping its methods (exclusive times, nested calls subtracted), with a near-free model
(``host_overhead.py``'s) so the forward hides nothing:

* ``hide_host_work = True`` (the learning the read does not need runs in ``behind_forward``),
  ``row_choices = "batched"`` (every row's choice is made at once and read in one read), and the
  GPU's fixed-width static forwards (:mod:`specdraft.model.static`, run eagerly here: no graphs);
* **critical path** = settle + account + the loop between steps + draft + plan + lay out + the
  host part of the forward (the plan of rows and the packing of the upload);
* **device** parts are timed apart: the static forward itself (cache moves, mask, model; one
  graph replay on a GPU), and the read, whose time on a CPU is mostly the rows' argmax (kernels
  launched behind the forward on a GPU); ``behind`` is the work run behind the forward.

Each figure is the median over a run's steps (the first two left out) of ms per step, then the
median over ``--repeats`` runs; the critical-path total is the median of each step's sum.

    python benchmarks/host_critical_path.py --out DIR          # contexts 1k, 4k; trees of 8 and 32
    python benchmarks/host_critical_path.py --profile 1024,32  # cProfile of one cell's steps
    python benchmarks/host_critical_path.py --device cuda      # on a GPU: its own static widths and graphs
    python benchmarks/host_critical_path.py --merge B1,B2,B3 A1,A2,A3 --out DIR  # before/after

Before and after are measured by running this script from one checkout against two trees of the
library (``PYTHONPATH`` pointing at the other one), alternately, each run with ``--out``; the
merge takes each figure's median over the runs of each side.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import hashlib
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import machine, near_free_model, repetitive_context  # noqa: E402

from specdraft import Decoder  # noqa: E402
from specdraft.engine import step as step_module  # noqa: E402
from specdraft.model import runner as runner_module  # noqa: E402
from specdraft.model import static as static_module  # noqa: E402
from specdraft.model.static import Buckets  # noqa: E402
from specdraft.sources.registry import DEFAULT_SOURCES, GPU_DEFAULT_SOURCES, make_sources  # noqa: E402
from specdraft.stats import GenerationStats  # noqa: E402

#: phases on the critical path of an accelerator (between the read and the next launch)
CRITICAL = ("settle", "account", "loop", "draft", "plan", "lay_out", "forward_host")
#: phases that overlap the device or are device work on an accelerator
OTHER = ("device_forward", "read", "behind")
PHASES = CRITICAL + OTHER


class PhaseClock:
    """Exclusive time per phase for each step: a wrapped call's time less its wrapped callees'."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._stack: list[list[Any]] = []
        self._step_end: float | None = None

    def wrap(self, owner: Any, attribute: str, phase: str) -> Callable[[], None]:
        """Time ``owner.attribute`` as ``phase``; returns what undoes it."""
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            frame = [phase, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[1]
                if self.steps:
                    current = self.steps[-1]
                    current[phase] = current.get(phase, 0.0) + spent - frame[2]
                if self._stack:
                    self._stack[-1][2] += spent

        setattr(owner, attribute, timed)
        return lambda: setattr(owner, attribute, original)

    def wrap_step(self) -> Callable[[], None]:
        """Open a record at each ``Step.run``; the time since the last one ended is the loop's."""
        original = step_module.Step.run

        @functools.wraps(original)
        def run(step_self):
            started = time.perf_counter()
            record = {"loop": started - self._step_end} if self._step_end is not None else {}
            self.steps.append(record)
            try:
                return original(step_self)
            finally:
                self._step_end = time.perf_counter()

        step_module.Step.run = run
        return lambda: setattr(step_module.Step, "run", original)

    def reset(self) -> None:
        self.steps, self._stack, self._step_end = [], [], None


def install(clock: PhaseClock) -> list[Callable[[], None]]:
    """Time the step's phases with ``clock``; returns what undoes each wrapping."""
    Step = step_module.Step
    undo = [clock.wrap_step()]
    for name, phase in (("draft", "draft"), ("plan", "plan"), ("lay_out", "lay_out"), ("forward", "forward_host"),
                        ("behind_forward", "behind"), ("read_back", "read"), ("settle", "settle"),
                        ("account", "account")):
        undo.append(clock.wrap(Step, name, phase))
    undo.append(clock.wrap(runner_module.ModelRunner, "forward", "forward_host"))
    undo.append(clock.wrap(static_module.StaticForwards, "run", "device_forward"))
    return undo


def make_decoder(model, nodes: int, accelerator_order: bool, sources: tuple[str, ...] = DEFAULT_SOURCES) -> Decoder:
    """``sources`` (the CPU's defaults unless told) on a fixed tree of ``nodes``, in the accelerator's
    order if asked (on a GPU that is the decoder's own: static widths, captured graphs, work behind
    the forward)."""
    dec = Decoder(model, None, sources=make_sources(list(sources)), max_tree_nodes=nodes,
                  adaptive_budget=False, cpu_kernels="stock")
    if accelerator_order:
        dec.hide_host_work = True
        dec.row_choices = "batched"
        if model.device.type == "cpu":
            dec.runner.use_static(capture=False)  # the GPU's fixed widths and static buffers, run eagerly
            dec.engine.padding = Buckets()
    return dec


def one_run(model, clock: PhaseClock, prompt: list[int], nodes: int, new_tokens: int,
            accelerator_order: bool, sources: tuple[str, ...] = DEFAULT_SOURCES) -> dict[str, Any]:
    """One decode of ``new_tokens``: each phase's median ms per step, the steps, a hash of the output."""
    dec = make_decoder(model, nodes, accelerator_order, sources)
    stats = GenerationStats()
    clock.reset()
    tokens = list(dec.stream(prompt, max_new_tokens=new_tokens, stats=stats))
    steps = [s for s in clock.steps if "draft" in s][2:]
    per_phase = {p: statistics.median(s.get(p, 0.0) for s in steps) * 1e3 for p in PHASES}
    per_phase["critical"] = statistics.median(sum(s.get(p, 0.0) for p in CRITICAL) for s in steps) * 1e3
    per_phase["host_total"] = statistics.median(
        sum(s.get(p, 0.0) for p in PHASES if p != "device_forward") for s in steps) * 1e3
    return {"ms": per_phase, "steps": stats.steps, "output": hashlib.sha1(str(tokens).encode()).hexdigest()[:12]}


def merge_runs(before: list[Path], after: list[Path], out: Path) -> None:
    """Each cell's figures, median over the runs of each side (folders written by ``--out``)."""

    def side(folders: list[Path]) -> tuple[dict[tuple[int, int], dict[str, Any]], list[dict[str, Any]]]:
        cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
        configs = []
        for folder in folders:
            data = json.loads((folder / "results.json").read_text())
            configs.append(data["config"])
            for row in data["rows"]:
                cells.setdefault((row["context"], row["nodes"]), []).append(row)
        merged = {}
        for key, rows in cells.items():
            merged[key] = {"ms_per_step": {p: round(statistics.median(r["ms_per_step"][p] for r in rows), 4)
                                           for p in rows[0]["ms_per_step"]},
                           "runs": len(rows), "steps": sorted({s for r in rows for s in r["steps"]}),
                           "output_sha1": sorted({h for r in rows for h in r["output_sha1"]})}
        return merged, configs

    old, old_configs = side(before)
    new, new_configs = side(after)
    cells = [{"context": c, "nodes": n, "before": old[(c, n)], "after": new[(c, n)]} for c, n in sorted(set(old) & set(new))]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"critical_phases": list(CRITICAL), "other_phases": list(OTHER), "cells": cells,
         "before_runs": old_configs, "after_runs": new_configs}, indent=1) + "\n")
    for cell in cells:
        b, a = cell["before"]["ms_per_step"], cell["after"]["ms_per_step"]
        print(f"context {cell['context']:>5} nodes {cell['nodes']:>2}: critical {b['critical']:.3f} -> {a['critical']:.3f} ms"
              f"  host total {b['host_total']:.3f} -> {a['host_total']:.3f}  same output: "
              f"{cell['before']['output_sha1'] == cell['after']['output_sha1']}")


def run_real(args: argparse.Namespace) -> None:
    """``--model``: a real checkpoint's default decoder beside its plain decoding on ``--dataset``
    prompts (adaptive budget, the device's own order and defaults), each phase's mean ms per
    decode step, prompt by prompt: where a decoder that checks almost no draft (chat) spends
    the time plain decoding does not."""
    from specdraft.bench.datasets import load_prompts
    from specdraft.models import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, progress=False, device=args.device)
    prompts = [r.token_ids for r in load_prompts(args.dataset, args.prompts, tokenizer)]
    decoders = {"plain": Decoder(model, tokenizer, sources=[], max_tree_nodes=0), "default": Decoder(model, tokenizer)}
    for dec in decoders.values():
        dec.warm_up(1024)
    clock = PhaseClock()
    install(clock)
    rows = []
    for index, prompt in enumerate(prompts):
        for name, dec in decoders.items():  # in turns, prompt by prompt
            clock.reset()
            stats = GenerationStats()
            started = time.perf_counter()
            for _ in dec.stream(prompt, max_new_tokens=args.new_tokens, stats=stats):
                pass
            wall = time.perf_counter() - started
            steps = [s for s in clock.steps if "draft" in s][2:]  # (not the prefill and the prompt step)
            ms = {p: round(statistics.fmean(s.get(p, 0.0) for s in steps) * 1e3, 4) for p in PHASES}
            ms["critical"] = round(statistics.fmean(sum(s.get(p, 0.0) for p in CRITICAL) for s in steps) * 1e3, 4)
            row = {"prompt": index, "decoder": name, "ms_per_token": round(wall * 1e3 / max(1, stats.new_tokens), 3),
                   "steps": stats.steps, "skipped_drafts": stats.skipped_drafts,
                   "tokens_per_step": round(stats.mean_accepted, 3), "mean_ms_per_step": ms}
            rows.append(row)
            print(f"prompt {index} {name:>7}: {row['ms_per_token']:.2f} ms/token, {stats.steps} steps, "
                  f"{stats.skipped_drafts} skipped drafts; per step: critical {ms['critical']:.3f}  | "
                  + "  ".join(f"{p} {ms[p]:.3f}" for p in PHASES), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"config": machine() | {"model": args.model, "dtype": args.dtype, "dataset": args.dataset},
             "new_tokens": args.new_tokens, "rows": rows}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--nodes", default="8,32")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the near-free model runs (cuda: the host work a GPU waits for)")
    parser.add_argument("--cpu-order", action="store_true", help="the CPU's order (no static widths, walk, nothing behind)")
    parser.add_argument("--gpu-sources", action="store_true",
                        help="the GPU's default sources (Token Recycling among them) instead of the CPU's")
    parser.add_argument("--profile", default=None, help="CONTEXT,NODES: print a cProfile of that cell instead")
    parser.add_argument("--merge", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                        help="instead of measuring: join runs (comma-separated --out folders per side) into --out")
    parser.add_argument("--model", default=None,
                        help="instead of the near-free model: this checkpoint's default decoder against its plain "
                             "decoding on --dataset prompts, every phase's mean ms per step")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="with --model")
    parser.add_argument("--dataset", default="mtbench", help="with --model")
    parser.add_argument("--prompts", type=int, default=4, help="with --model")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.model:
        torch.set_num_threads(1)
        run_real(args)
        return
    if args.merge:
        merge_runs([Path(p) for p in args.merge[0].split(",")], [Path(p) for p in args.merge[1].split(",")],
                   args.out or Path("."))
        return
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    model = near_free_model(max(contexts) * 2 + 1024).to(args.device)
    accelerator = not args.cpu_order
    sources = GPU_DEFAULT_SOURCES if args.gpu_sources else DEFAULT_SOURCES
    if args.profile:
        context, nodes = (int(v) for v in args.profile.split(","))
        prompt = repetitive_context(context)
        dec = make_decoder(model, nodes, accelerator, sources)
        stream = dec.stream(prompt, max_new_tokens=args.new_tokens)
        for _ in range(3):
            next(stream)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in stream:
            pass
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats("specdraft", 60)
        return
    clock = PhaseClock()
    install(clock)
    rows = []
    for context in contexts:
        prompt = repetitive_context(context)
        for nodes in [int(n) for n in args.nodes.split(",")]:
            runs = [one_run(model, clock, prompt, nodes, args.new_tokens, accelerator, sources)
                    for _ in range(args.repeats)]
            ms = {p: round(statistics.median(r["ms"][p] for r in runs), 4) for p in runs[0]["ms"]}
            row = {"context": context, "nodes": nodes, "ms_per_step": ms, "steps": [r["steps"] for r in runs],
                   "output_sha1": sorted({r["output"] for r in runs})}
            rows.append(row)
            print(f"context {context:>5} nodes {nodes:>2}: critical {ms['critical']:.3f} ms  host total "
                  f"{ms['host_total']:.3f}  | " + "  ".join(f"{p} {ms[p]:.3f}" for p in PHASES), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"config": machine(), "accelerator_order": accelerator, "sources": list(sources),
             "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
