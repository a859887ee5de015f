"""How a mix of draft sources compares with its members, and what the tree merge costs.

Two measurements of the merge (:meth:`specdraft.tree.TokenTree.from_drafts`):

* **the minimal mix**: a tiny random float64 Llama (hidden 32, 2 layers, vocabulary 80), greedy,
  a fixed tree of 6 nodes (``adaptive_budget=False``), two sources: ``oracle`` proposes the true
  continuation (the model's own greedy output) with the whole budget, ``noise`` one branch of
  random tokens with the whole budget. Reported: accepted tokens per step (new tokens / steps) of
  each source alone and of both mixes (noise listed first, and last). A merge that lets the
  sources take turns hands the noise the first nodes whatever it achieves; one by value learns
  that the oracle's nodes are the ones accepted.
* **merge time**: microseconds per ``from_drafts`` call for a 32-node tree from 3-4 sources'
  branch lists (shaped like prompt lookup, the trie, the n-gram model and Token Recycling:
  several overlapping branches each, about 160 proposed tokens in all), with the decoder's
  calibrated rates, median of many calls on one thread.

    python benchmarks/merge_by_value.py                # both, printed
    python benchmarks/merge_by_value.py --out DIR      # also DIR/results.json

Run it on two checkouts (each with its own copy of this script) for a before/after comparison;
a checkout without :mod:`specdraft.budget.acceptance` is timed with the merge's defaults.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdraft import Decoder
from specdraft.sources.base import Context, Draft, SourceBase
from specdraft.tree import TokenTree

VOCAB = 80
PROMPT = [5, 17, 33, 8, 41, 12]


class Oracle(SourceBase):
    """Proposes the true continuation of ``sequence`` with the whole budget."""

    name = "oracle"

    def __init__(self, sequence: list[int]) -> None:
        super().__init__()
        self.sequence = sequence

    def propose(self, context: Context, budget: int) -> Draft:
        n = len(context.tokens)
        true = self.sequence[n:n + budget]
        return Draft(branches=[true] if true and list(context.tokens) == self.sequence[:n] else [])


class Noise(SourceBase):
    """Proposes one branch of random tokens with the whole budget (seeded by the context length)."""

    name = "noise"

    def propose(self, context: Context, budget: int) -> Draft:
        rng = np.random.default_rng([0, len(context.tokens)])
        return Draft(branches=[rng.integers(0, VOCAB, size=budget).tolist()] if budget else [])


def tiny_model() -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    return model.eval()


def minimal_mix(new_tokens: int, nodes: int) -> dict[str, float]:
    """Accepted tokens per step of each source alone and of both mixes."""
    model = tiny_model()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens + 10,
                             do_sample=False)
    sequence = out[0].tolist()
    results = {}
    for label, make in [("oracle", lambda: [Oracle(sequence)]), ("noise", lambda: [Noise()]),
                        ("noise+oracle", lambda: [Noise(), Oracle(sequence)]),
                        ("oracle+noise", lambda: [Oracle(sequence), Noise()])]:
        dec = Decoder(model, sources=make(), max_tree_nodes=nodes, adaptive_budget=False)
        gen = dec.generate(PROMPT, max_new_tokens=new_tokens)
        if gen.token_ids != sequence[len(PROMPT):len(PROMPT) + new_tokens]:
            raise AssertionError(f"{label}: output differs from greedy decoding")
        results[label] = gen.stats.new_tokens / gen.stats.steps
    return results


def sample_drafts(rng: np.random.Generator, sources: int) -> list[list[list[int]]]:
    """Branch lists shaped like the real sources' (overlapping, several per source)."""
    truth = rng.integers(0, 1000, size=24).tolist()
    drafts = []
    for s in range(sources):
        branches = []
        for b in range(6):
            keep = int(rng.integers(0, 6))
            branch = truth[:keep] + rng.integers(0, 1000, size=int(rng.integers(2, 8))).tolist()
            branches.append(branch)
        drafts.append(branches)
    return drafts


def merge_time(sources: int, nodes: int, calls: int) -> dict[str, float]:
    """Median microseconds per merge, with the decoder's rate function when there is one."""
    try:
        from specdraft.budget.acceptance import AcceptanceTracker
    except ImportError:  # a checkout from before the acceptance tracker
        rate = None
    else:
        rate = AcceptanceTracker(nodes, sources).start().source_rates
    rng = np.random.default_rng(0)
    cases = [sample_drafts(rng, sources) for _ in range(64)]
    times = []
    for k in range(calls):
        drafts = cases[k % len(cases)]
        start = time.perf_counter()
        if rate is None:
            TokenTree.from_drafts(7, drafts, nodes)
        else:
            TokenTree.from_drafts(7, drafts, nodes, rate)
        times.append(time.perf_counter() - start)
    proposed = statistics.mean(sum(len(b) for d in c for b in d) for c in cases)
    return {"median_us": 1e6 * statistics.median(times), "p90_us": 1e6 * sorted(times)[int(0.9 * len(times))],
            "proposed_tokens": proposed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=80, help="tokens generated in the minimal mix")
    parser.add_argument("--nodes", type=int, default=6, help="fixed tree size of the minimal mix")
    parser.add_argument("--calls", type=int, default=5000, help="merges timed per source count")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mix = minimal_mix(args.new_tokens, args.nodes)
    print(f"minimal mix, {args.nodes}-node fixed tree, {args.new_tokens} new tokens: accepted tokens per step")
    for label, value in mix.items():
        print(f"  {label:14s} {value:.2f}")
    timing = {}
    for sources in (3, 4):
        timing[sources] = merge_time(sources, 32, args.calls)
        t = timing[sources]
        print(f"merge of {sources} sources ({t['proposed_tokens']:.0f} proposed tokens) into 32 nodes: "
              f"median {t['median_us']:.1f} us, p90 {t['p90_us']:.1f} us")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        (args.out / "results.json").write_text(json.dumps({
            "commit": commit, "machine": platform.processor() or platform.machine(), "threads": 1,
            "minimal_mix": {"nodes": args.nodes, "new_tokens": args.new_tokens, "tokens_per_step": mix},
            "merge_time": {str(k): v for k, v in timing.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
