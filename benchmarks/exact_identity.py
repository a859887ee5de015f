"""Exact mode end to end: does speculation give the very tokens of plain decoding in bfloat16?

The experiment behind exact mode: a random 2-layer, 896-wide Llama in bfloat16 (vocabulary 512),
repetitive prompts, 64 new tokens, stock kernels. A ``Decoder`` with its default sources is
compared with the same decoder doing plain decoding (``max_tree_nodes=0``), prompt by prompt, in
two modes:

``inexact``
    ``exact=False``: ``sdpa``, forwards as wide as the tree;
``exact``
    ``exact=True``: every forward padded by the probed :class:`~specdraft.kernels.exact_rows.RowRule`
    and the model on :mod:`specdraft.model.exact_attention`; plain decoding the same way.

The batched half runs ``generate_batch`` over all prompts at once against single plain decoding.

    python benchmarks/exact_identity.py --prompts 10 --new-tokens 64

With ``--model`` it runs a real checkpoint on a benchmark's prompts instead (``--dataset``,
``--prompts`` of them) with the decoder's default kernels, and also reports each mode's speed-up
of speculation over plain decoding in CPU time (``time.process_time``, one thread: the wall
clock of a machine shared with other work is too uneven to compare two modes by).

    python benchmarks/exact_identity.py --model qwen2.5-coder-0.5b --dataset humaneval \
        --prompts 10 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--batch", action="store_true", help="also run generate_batch over all prompts")
    parser.add_argument("--sample", action="store_true",
                        help="also sample (temperature 0.8, top-k 50, a seed per prompt), against plain sampling")
    parser.add_argument("--seed", type=int, default=43)
    parser.add_argument("--model", help="a checkpoint (alias, directory, .gguf, hub id) instead of the random model")
    parser.add_argument("--dataset", default="humaneval", help="with --model: the prompts (humaneval, mtbench, ...)")
    parser.add_argument("--cpu-kernels", default=None, help="stock for the random model, auto for --model")
    parser.add_argument("--modes", default="inexact,exact", help="with --model: which modes to run")
    parser.add_argument("--json", help="write the counts here")
    return parser.parse_args(argv)


def build_model(dtype, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval().requires_grad_(False)


def prompts(count: int, seed: int) -> list[list[int]]:
    """Repetitive prompts: a random phrase of 5-12 tokens repeated with small edits, 60-120 tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        phrase = rng.integers(3, 512, int(rng.integers(5, 13))).tolist()
        tokens: list[int] = []
        while len(tokens) < int(rng.integers(60, 121)):
            piece = list(phrase)
            piece[int(rng.integers(len(piece)))] = int(rng.integers(3, 512))
            tokens += piece
        out.append(tokens)
    return out



def compare_on_checkpoint(model, batch: list[list[int]], kernels: str, new_tokens: int,
                          modes: Sequence[str] = ("inexact", "exact")) -> dict:
    """Per prompt, back to back: transformers' greedy ``generate`` (stock kernels, sdpa), then
    speculation and plain decoding with exact mode off and on. Interleaving per prompt keeps a
    machine's slow minutes from landing on one mode only; CPU time (one thread) is what is timed."""
    import torch

    from specdraft import Decoder

    decoders = {mode: (Decoder(model, cpu_kernels=kernels, exact=mode == "exact"),
                       Decoder(model, cpu_kernels=kernels, max_tree_nodes=0, exact=mode == "exact"))
                for mode in modes}
    if "exact" in decoders:
        print(f"exact ({decoders['exact'][0].kernels.describe()}): {decoders['exact'][0].engine.padding}",
              file=sys.stderr)
    rows = []
    for index, prompt in enumerate(batch):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            started = time.process_time()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            row = {"prompt": index, "generate_cpu_s": round(time.process_time() - started, 3),
                   "generate_attention": model.config._attn_implementation}
        reference = out[0, len(prompt):].tolist()
        for mode, (spec, plain) in decoders.items():
            started = time.process_time()
            a = spec.generate(prompt, max_new_tokens=new_tokens)
            spec_cpu = time.process_time() - started
            started = time.process_time()
            b = plain.generate(prompt, max_new_tokens=new_tokens)
            plain_cpu = time.process_time() - started
            row[mode] = {"speculation_cpu_s": round(spec_cpu, 3), "plain_cpu_s": round(plain_cpu, 3),
                         "same_as_plain": a.token_ids == b.token_ids,
                         "same_as_generate": a.token_ids == reference[:len(a.token_ids)] and len(a.token_ids) > 0,
                         "plain_same_as_generate": b.token_ids == reference[:len(b.token_ids)] and len(b.token_ids) > 0,
                         "tokens": len(a.token_ids), "steps": a.stats.steps}
        rows.append(row)
        print(f"prompt {index}: generate {row['generate_cpu_s']:.1f}s; " + "; ".join(
            f"{mode} {row[mode]['speculation_cpu_s']:.1f}s/{row[mode]['plain_cpu_s']:.1f}s "
            f"plain={row[mode]['same_as_plain']} generate={row[mode]['same_as_generate']}" for mode in decoders),
            file=sys.stderr, flush=True)
    for spec, plain in decoders.values():
        spec.close()
        plain.close()
    return {"prompts": rows, "summary": summarize_checkpoint(rows, modes)}


def summarize_checkpoint(rows: list[dict], modes: Sequence[str] = ("inexact", "exact")) -> dict:
    """Counts and speed-ups: totals of CPU time, and the median of per-prompt ratios."""
    import statistics

    summary = {"prompts": len(rows), "generate_cpu_s": round(sum(r["generate_cpu_s"] for r in rows), 2)}
    for mode in modes:
        cells = [r[mode] for r in rows]
        spec = sum(c["speculation_cpu_s"] for c in cells)
        plain = sum(c["plain_cpu_s"] for c in cells)
        summary[mode] = {
            "same_as_plain": sum(c["same_as_plain"] for c in cells),
            "same_as_generate": sum(c["same_as_generate"] for c in cells),
            "plain_same_as_generate": sum(c["plain_same_as_generate"] for c in cells),
            "tokens_per_step": round(sum(c["tokens"] for c in cells) / sum(c["steps"] for c in cells), 3),
            "speculation_cpu_s": round(spec, 2), "plain_cpu_s": round(plain, 2),
            "speedup_over_generate_cpu": round(summary["generate_cpu_s"] / spec, 3),
            "speedup_over_plain_cpu": round(plain / spec, 3),
            "median_speedup_over_generate": round(statistics.median(
                r["generate_cpu_s"] / r[mode]["speculation_cpu_s"] for r in rows), 3),
        }
    if set(modes) < {"inexact", "exact"}:
        return summary
    summary["exact_vs_inexact_speed"] = round(
        summary["exact"]["speedup_over_generate_cpu"] / summary["inexact"]["speedup_over_generate_cpu"], 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from specdraft import Decoder

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    if args.model:
        from specdraft.bench.datasets import load_prompts
        from specdraft.models import load_model

        model, tokenizer = load_model(args.model, dtype=args.dtype, progress=False)
        batch = [r.token_ids for r in load_prompts(args.dataset, args.prompts, tokenizer)]
        kernels = args.cpu_kernels or "auto"
    else:
        model = build_model(dtype, args.seed)
        batch = prompts(args.prompts, args.seed)
        kernels = args.cpu_kernels or "stock"
    results = {}
    if args.model:
        results = compare_on_checkpoint(model, batch, kernels, args.new_tokens, args.modes.split(","))
        print(json.dumps(results, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        return 0
    for mode in ("inexact", "exact"):
        spec = Decoder(model, cpu_kernels=kernels, exact=mode == "exact")
        plain = Decoder(model, cpu_kernels=kernels, max_tree_nodes=0, exact=mode == "exact")
        if mode == "exact":
            print(f"exact ({spec.kernels.describe()}): {spec.engine.padding}", file=sys.stderr)
        same, steps, tokens = 0, 0, 0
        spec_cpu, plain_cpu = 0.0, 0.0
        plain_out = []
        for prompt in batch:
            started = time.process_time()
            a = spec.generate(prompt, max_new_tokens=args.new_tokens)
            spec_cpu += time.process_time() - started
            started = time.process_time()
            b = plain.generate(prompt, max_new_tokens=args.new_tokens)
            plain_cpu += time.process_time() - started
            plain_out.append(b.token_ids)
            same += a.token_ids == b.token_ids
            steps += a.stats.steps
            tokens += len(a.token_ids)
        results[mode] = {"same_as_plain": same, "prompts": len(batch), "tokens_per_step": round(tokens / steps, 2),
                         "speculation_cpu_s": round(spec_cpu, 2), "plain_cpu_s": round(plain_cpu, 2),
                         "speedup_over_plain_cpu": round(plain_cpu / spec_cpu, 3)}
        if "generate_cpu_s" in results:
            results[mode]["speedup_over_generate_cpu"] = round(results["generate_cpu_s"] / spec_cpu, 3)
        print(f"{mode}: {results[mode]}", file=sys.stderr)
        if args.batch:
            outs = spec.generate_batch(batch, max_new_tokens=args.new_tokens, concurrency=len(batch))
            results[mode]["batched_same_as_plain"] = sum(o.token_ids == p for o, p in zip(outs, plain_out))
            print(f"{mode}, batched: {results[mode]['batched_same_as_plain']}/{len(batch)}", file=sys.stderr)
        if args.sample:
            sampling = dict(max_new_tokens=args.new_tokens, do_sample=True, temperature=0.8, top_k=50)
            same = sum(spec.generate(p, seed=i, **sampling).token_ids == plain.generate(p, seed=i, **sampling).token_ids
                       for i, p in enumerate(batch))
            results[mode]["sampled_same_as_plain"] = same
            print(f"{mode}, sampled: {same}/{len(batch)}", file=sys.stderr)
            if args.batch:  # batched draws are keyed by seed and position: compared with batched plain sampling
                a = spec.generate_batch(batch, concurrency=len(batch), seed=7, **sampling)
                b = plain.generate_batch(batch, concurrency=len(batch), seed=7, **sampling)
                same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
                results[mode]["batched_sampled_same_as_plain"] = same
                print(f"{mode}, batched sampled: {same}/{len(batch)}", file=sys.stderr)
        spec.close()
        plain.close()
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
