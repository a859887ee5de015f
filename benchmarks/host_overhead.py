"""Host work per decoding step: what is left of a step when the forward costs almost nothing.

On a GPU a batch-1 forward of a 0.5-7B model takes about 5-25 ms eager and 2-5 ms compiled, and it
runs asynchronously: everything the decoder does on the host (drafting, merging the tree, laying
out the step's input, verifying, compacting the cache, feeding the sources back) is time the GPU
may sit idle, and every host sync makes it wait. This script measures that part on the CPU with a
model whose forward is nearly free (one layer, hidden size 64, a 32k vocabulary), so what remains
is the decoder's own work:

* **host ms / step**: the time between one forward's end and the next one's start (verify,
  compact, commit, feed the sources back, draft, lay out the next input), median over the steps,
  with a fixed tree of 8, 32 or 64 nodes (``adaptive_budget=False``), greedy, default sources;
* **first draft**: the first of those gaps, which also waits for whatever of the sources' prompt
  indexing (``begin``, which on a CPU runs at the first draft);
* **added before the first token**: time from the call to the first committed token, minus the
  prefill forward;
* **syncs / uploads per step**: the same decode on :class:`~specdraft.simulated_device.SimulatedDevice`
  (the model reports a CUDA device; host reads and host-to-device copies outside the forward are
  counted), for several scenarios (greedy, sampling, each source).

Contexts are 1k, 4k and 16k tokens of repeated, lightly mutated segments, so the sources find
matches and fill the tree as they would on a RAG or code-edit prompt. The model's output is random;
what is measured does not depend on it. Times are the best of ``--repeats`` runs on one thread.

    python benchmarks/host_overhead.py                      # the full table (a few minutes)
    python benchmarks/host_overhead.py --contexts 1024 --nodes 32 --repeats 1   # quick look
    python benchmarks/host_overhead.py --out DIR              # write results.json + results.md
    python benchmarks/host_overhead.py --merge OLD1,OLD2 NEW1,NEW2 --out DIR   # before/after table

The before/after table of the docs comes from runs of two commits made alternately, context by
context, on one machine (each commit's checkout running its own copy of this script), joined with
``--merge`` into ``host.json``; ``scripts/render_tables.py`` renders it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from specdraft import Decoder
from specdraft.simulated_device import SimulatedDevice
from specdraft.sources.registry import SOURCES, make_sources

VOCAB = 32000
#: Tokens the context and the model's output are drawn from: with 512 of them, every root has
#: earlier occurrences, so the sources fill the tree every step as on a long repetitive prompt.
ACTIVE = 512


def near_free_model(max_positions: int = 32768) -> torch.nn.Module:
    """A 1-layer Llama with hidden size 64 and a 32k vocabulary: its forward costs about a
    millisecond at a 32-node tree, so a step's time is mostly the decoder's own."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config.eos_token_id = None  # decode the full length every time
    with torch.no_grad():  # only the first ACTIVE ids can win the argmax (the other rows score 0)
        model.lm_head.weight[ACTIVE:] = 0.0
    return model.eval()


def repetitive_context(length: int, seed: int = 0) -> list[int]:
    """``length`` tokens made of 64-token segments drawn from a pool of 48, each copy with a few
    tokens changed: text that repeats the way retrieved documents and code under edit do."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(3, ACTIVE, size=(48, 64))
    out: list[int] = []
    while len(out) < length:
        segment = pool[rng.integers(len(pool))].copy()
        flips = rng.integers(0, 64, size=3)
        segment[flips] = rng.integers(3, ACTIVE, size=3)
        out.extend(int(t) for t in segment)
    return out[:length]


class ForwardTimer:
    """When each ``model.forward`` started and ended (forward pre/post hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        model.register_forward_pre_hook(lambda *_: self.starts.append(time.perf_counter()))
        model.register_forward_hook(lambda *_: self.ends.append(time.perf_counter()))

    def reset(self) -> None:
        self.starts, self.ends = [], []

    def gaps(self) -> list[float]:
        """Host time between forwards: from the end of forward ``k`` to the start of ``k + 1``
        (verify, compact, commit, feed back, draft, lay out the next input)."""
        return [b - a for a, b in zip(self.ends, self.starts[1:])]


@dataclass
class HostRow:
    nodes: int
    context: int
    host_ms_per_step: float  # median gap between forwards, from the second tree step on
    first_draft_ms: float  # the first gap: what is left of the sources' prompt indexing, plus a step
    first_token_added_ms: float
    forward_ms_per_step: float
    steps: int
    mean_tree_nodes: float


def time_decode(model, timer: ForwardTimer, prompt: list[int], nodes: int, new_tokens: int,
                sources: list[str]) -> HostRow:
    """One decode, timed (see :class:`HostRow`)."""
    from specdraft.stats import GenerationStats

    dec = Decoder(model, None, sources=make_sources(sources), max_tree_nodes=nodes, adaptive_budget=False,
                  cpu_kernels="stock")
    stats = GenerationStats()
    timer.reset()
    started = time.perf_counter()
    stream = dec.stream(prompt, max_new_tokens=new_tokens, stats=stats)
    next(stream)
    first_at = time.perf_counter() - started
    for _ in stream:
        pass
    prefill = timer.ends[0] - timer.starts[0]
    gaps = timer.gaps()
    forwards = [b - a for a, b in zip(timer.starts[1:], timer.ends[1:])]
    drafted = statistics.mean(stats.tree_sizes[1:]) - 1 if len(stats.tree_sizes) > 1 else 0.0
    return HostRow(nodes, len(prompt), statistics.median(gaps[1:]) * 1e3, gaps[0] * 1e3, (first_at - prefill) * 1e3,
                   statistics.median(forwards) * 1e3, stats.steps, drafted)


def host_table(model, contexts: list[int], nodes_list: list[int], new_tokens: int, repeats: int,
               sources: list[str]) -> list[HostRow]:
    """Each cell's best run (the least disturbed by other work on the machine)."""
    timer = ForwardTimer(model)
    rows = []
    for context in contexts:
        prompt = repetitive_context(context)
        for nodes in nodes_list:
            runs = [time_decode(model, timer, prompt, nodes, new_tokens, sources) for _ in range(repeats)]
            best = min(runs, key=lambda r: r.host_ms_per_step)
            best.first_token_added_ms = min(r.first_token_added_ms for r in runs)
            best.first_draft_ms = min(r.first_draft_ms for r in runs)
            rows.append(best)
            print(f"  context {context:>6}  nodes {nodes:>3}  host {best.host_ms_per_step:6.2f} ms/step  "
                  f"first draft {best.first_draft_ms:7.1f} ms  before first token +{best.first_token_added_ms:6.1f} ms  "
                  f"forward {best.forward_ms_per_step:6.2f} ms  tree {best.mean_tree_nodes:.1f} nodes", flush=True)
    return rows


#: Sync-count scenarios: name -> (sources, generate options).
SCENARIOS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "greedy, default sources": (["prompt", "trie", "ngram"], {}),
    "greedy, repetition penalty": (["prompt", "trie", "ngram"], {"repetition_penalty": 1.1}),
    "sampling (seed, T, top-k, top-p, min-p, penalty)": (
        ["prompt", "trie", "ngram"],
        {"do_sample": True, "seed": 0, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.02,
         "repetition_penalty": 1.1}),
    **{f"greedy, {name} alone": ([name], {}) for name in SOURCES},
}


def sync_counts(base_model, context: int, nodes: int, new_tokens: int) -> dict[str, dict[str, float]]:
    """Syncs and uploads per tree step outside the forward, per scenario, on the simulated device."""
    prompt = repetitive_context(context)
    out = {}
    for name, (sources, options) in SCENARIOS.items():
        model = copy.deepcopy(base_model)
        sim = SimulatedDevice()
        sim.adopt(model)
        try:
            with sim, sim.patched_generator():
                dec = Decoder(model, None, sources=make_sources(sources), max_tree_nodes=nodes,
                              adaptive_budget=False, cpu_kernels="stock")
                dec.generate(prompt, max_new_tokens=4, **options)  # warm: sources begin, caches fill
                sim.reset_counts()
                result = dec.generate(prompt, max_new_tokens=new_tokens, **options)
        except Exception as exc:  # noqa: BLE001 - a device bug is a result of this benchmark too
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"  {name:<52} FAILS: {out[name]['error']}", flush=True)
            continue
        steps = result.stats.steps
        out[name] = {"syncs_per_step": sim.counts.syncs / steps, "uploads_per_step": sim.counts.uploads / steps,
                     "steps": steps}
        print(f"  {name:<52} syncs/step {out[name]['syncs_per_step']:.2f}  "
              f"uploads/step {out[name]['uploads_per_step']:.2f}", flush=True)
    return out


def machine() -> dict[str, Any]:
    """The run's configuration as ``specdraft bench`` records it (platform, CPU, threads, date,
    commit), so ``scripts/render_tables.py`` names the machine the same way."""
    cpu, flags = platform.processor() or "unknown CPU", []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = [f for f in line.split(":", 1)[1].split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")]
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"platform": platform.platform(), "cpu": {"model": cpu, "cpus": os.cpu_count(), "flags": flags},
            "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": commit,
            "threads": torch.get_num_threads()}


def merge_runs(before: list[str], after: list[str], out: str) -> None:
    """Join runs of two commits (each folder a ``--out`` of this script, run alternately on the
    same machine) into one ``host.json``: every (context, tree size) cell before and after, and
    the sync counts of both. Where two folders hold the same cell, the later one wins: list a
    sync-count run (one repeat) before the timing runs."""

    def load(folders: list[str]) -> tuple[dict, dict, dict]:
        rows, syncs, config = {}, {}, {}
        for folder in folders:
            data = json.load(open(os.path.join(folder, "results.json")))
            config = data.get("config", data.get("machine", {}))
            syncs = data.get("syncs") or syncs
            for row in data["rows"]:
                rows[(row["context"], row["nodes"])] = row
        return rows, syncs, config

    rows_b, syncs_b, config_b = load(before)
    rows_a, syncs_a, config_a = load(after)
    cells = [{"context": c, "nodes": n, "before": rows_b[(c, n)], "after": rows_a[(c, n)]}
             for (c, n) in sorted(set(rows_b) & set(rows_a))]
    config = dict(config_a)
    config["commit_before"] = config_b.get("commit", "")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "host.json"), "w") as fh:
        json.dump({"config": config, "cells": cells, "syncs": {"before": syncs_b, "after": syncs_a}}, fh, indent=2)
    print(f"wrote {out}/host.json ({len(cells)} cells)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096,16384", help="context lengths, comma-separated")
    parser.add_argument("--nodes", default="8,32,64", help="fixed tree sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is reported")
    parser.add_argument("--sync-context", type=int, default=1024, help="context of the sync-count scenarios")
    parser.add_argument("--no-syncs", action="store_true", help="skip the simulated-device sync counts")
    parser.add_argument("--out", default=None, help="folder for results.json and results.md")
    parser.add_argument("--merge", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                        help="instead of measuring: join runs of two commits (comma-separated --out folders "
                             "each) into --out/host.json")
    args = parser.parse_args(argv)
    if args.merge:
        merge_runs(args.merge[0].split(","), args.merge[1].split(","), args.out or ".")
        return
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    nodes_list = [int(n) for n in args.nodes.split(",")]
    model = near_free_model(max(contexts) * 2 + 1024)
    info = machine()
    print(f"host work per step, near-free forward ({info['cpu']['model']}, 1 thread, torch {info['torch']}, "
          f"commit {info['commit']})")
    rows = host_table(model, contexts, nodes_list, args.new_tokens, args.repeats, ["prompt", "trie", "ngram"])
    syncs = {}
    if not args.no_syncs:
        print(f"syncs and uploads per step outside the forward (simulated CUDA device, context "
              f"{args.sync_context}, 32 nodes)")
        syncs = sync_counts(model, args.sync_context, 32, 24)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump({"config": info, "rows": [asdict(r) for r in rows], "syncs": syncs}, fh, indent=2)
        with open(os.path.join(args.out, "results.md"), "w") as fh:
            fh.write(render_markdown(info, rows, syncs))
        print(f"wrote {args.out}/results.json and results.md")


def render_markdown(info: dict[str, Any], rows: list[HostRow], syncs: dict[str, dict[str, float]]) -> str:
    lines = [f"Host work per step with a near-free forward: {info['cpu']['model']}, {info['threads']} thread, "
             f"torch {info['torch']}, {info['started'][:10]}, commit {info['commit']}.", "",
             "| tree nodes (mean used) | context | host ms / step | first draft (ms) | added before first token (ms) |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.nodes} ({r.mean_tree_nodes:.1f}) | {r.context} | {r.host_ms_per_step:.2f} | "
                     f"{r.first_draft_ms:.1f} | {r.first_token_added_ms:.1f} |")
    if syncs:
        lines += ["", "| scenario | syncs / step | uploads / step |", "|---|---:|---:|"]
        for name, c in syncs.items():
            if "error" in c:
                lines.append(f"| {name} | fails: {c['error'][:60]} | |")
                continue
            lines.append(f"| {name} | {c['syncs_per_step']:.2f} | {c['uploads_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
