"""Code-edit requests through one reused decoder: does the default keep taking up the copies?

Why: answers to "add type hints to this function" or "add a docstring" copy most of the function
from the prompt, so prompt lookup should accept long runs on every request. A decoder reused
across such requests once stopped speculating after the first few (a shadow-tree bias and stale
step prices, see ``docs/concepts/adaptive-budget.md``). This replays that job on functions of
Python's own standard library (20-60 lines each, so the set needs no download), with the
methods interleaved per request in one process:

* ``hf-prompt-lookup``: ``model.generate(prompt_lookup_num_tokens=10)``, stock kernels;
* ``default@stock`` and ``default``: one ``Decoder`` each (default sources, adaptive budget),
  reused for every request, on ``cpu_kernels="stock"`` and on the default ``"auto"``;
* ``plain`` (``model.generate``) with ``--plain``.

It prints per request the tokens committed per step, the share of one-token steps, and the speed
against prompt lookup (and plain), with the geometric means; greedy outputs are checked equal.

    python benchmarks/code_edit.py --limit 6 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import statistics
import sys
import textwrap
import time
from typing import Sequence

import torch

#: (module, function) of the standard library: plain functions without type hints, 20-60 lines.
FUNCTIONS = [("textwrap", "dedent"), ("statistics", "median_grouped"), ("fnmatch", "translate"),
             ("difflib", "get_close_matches"), ("heapq", "nsmallest"), ("colorsys", "rgb_to_hls"),
             ("urllib.parse", "urljoin"), ("ast", "literal_eval"), ("getopt", "getopt"),
             ("statistics", "quantiles"), ("random", "Random.sample"), ("getopt", "do_longs")]
TASKS = ["Add type hints to this function. Output only the complete function.",
         "Add a docstring to this function (keep the code as it is). Output only the complete function."]


def prompts(limit: int) -> list[tuple[str, str]]:
    """(name, prompt text) of the code-edit requests, tasks alternating."""
    out = []
    for i, (module, name) in enumerate(FUNCTIONS[:limit]):
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        try:
            source = textwrap.dedent(inspect.getsource(obj))
        except (OSError, TypeError):  # a C implementation on this Python: take the next one
            continue
        lines = source.splitlines()[:60]
        out.append((f"{module}.{name}", f"```python\n" + "\n".join(lines) + f"\n```\n\n{TASKS[i % 2]}"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--limit", type=int, default=len(FUNCTIONS))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--plain", action="store_true", help="also time plain model.generate")
    parser.add_argument("--methods", default="hf-prompt-lookup,default@stock,default",
                        help="comma list of hf-prompt-lookup (always run: the reference), default@stock, default, "
                             "specdraft:<source>[+<source>...] (a Decoder with those sources, default kernels)")
    parser.add_argument("--out", default=None, help="also write the per-request rows to OUT/results.json")
    parser.add_argument("--jsonl", default=None, metavar="FILE",
                        help="only write the requests as a JSON-lines prompt file for `specdraft bench --dataset FILE` "
                             "(which wraps them in the chat template, as this script does), then exit")
    args = parser.parse_args(argv)
    if args.jsonl:
        import json

        with open(args.jsonl, "w") as fh:
            for name, text in prompts(args.limit):
                fh.write(json.dumps({"id": name, "prompt": text}) + "\n")
        print(f"wrote {args.jsonl}")
        return 0

    from specdraft.baseline import time_plain_generate, warmup_forward
    from specdraft.cli import _encode_prompt
    from specdraft.decoder import Decoder
    from specdraft.models import DEFAULT_MODEL, load_model
    from specdraft.sources.registry import SOURCES, make_sources

    torch.set_num_threads(args.threads)
    model_name = args.model or DEFAULT_MODEL
    model, tokenizer = load_model(model_name, dtype=args.dtype, progress=False)
    wanted = [m.strip() for m in args.methods.split(",") if m.strip() != "hf-prompt-lookup"]
    mixes = {m: m.removeprefix("specdraft:").split("+") for m in wanted if m.startswith("specdraft:")}
    unknown = sorted({m for m in wanted if m not in mixes and m not in ("default@stock", "default")}
                     | {m for m, names in mixes.items() if not set(names) <= set(SOURCES)})
    if unknown:
        parser.error(f"unknown methods {unknown}; allowed: hf-prompt-lookup, default@stock, default, "
                     f"specdraft:<sources joined by +> with sources from {sorted(SOURCES)}")
    builders = {"default@stock": lambda: Decoder(model, tokenizer, cpu_kernels="stock"),
                "default": lambda: Decoder(model, tokenizer)}
    builders |= {m: (lambda names=names: Decoder(model, tokenizer, sources=make_sources(names)))
                 for m, names in mixes.items()}
    decoders = {m: builders[m]() for m in wanted}
    for m, d in decoders.items():
        print(f"{m}: {d.kernels.describe() if hasattr(d, 'kernels') else 'stock'}", file=sys.stderr)
    requests = [(name, _encode_prompt(tokenizer, text, chat=True)) for name, text in prompts(args.limit)]
    warmup_forward(model, requests[0][1])
    methods = (["plain"] if args.plain else []) + ["hf-prompt-lookup"] + wanted
    rows = []
    for name, ids in requests:
        row: dict[str, dict[str, float]] = {}
        outputs = {}
        for method in methods:
            if method in decoders:
                started = time.perf_counter()
                out = decoders[method].generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                seconds = time.perf_counter() - started
                tokens, steps = list(out.token_ids), out.stats.steps
                plain_steps = sum(1 for size in out.stats.tree_sizes[1:] if size == 1)
            else:
                extra = {"prompt_lookup_num_tokens": 10} if method == "hf-prompt-lookup" else {}
                tokens, seconds = time_plain_generate(model, ids, args.max_new_tokens, do_sample=False, **extra)
                steps, plain_steps = len(tokens), len(tokens)
            outputs[method] = tokens
            row[method] = {"seconds": seconds, "tokens": len(tokens), "steps": steps, "plain_steps": plain_steps}
        same = all(outputs[m] == outputs["hf-prompt-lookup"] for m in methods)
        rows.append((name, row, same))
        ref = row["hf-prompt-lookup"]["seconds"]
        print(f"{name:28s} {row['hf-prompt-lookup']['tokens']:4d} tok  " + "  ".join(
            f"{m}: {r['tokens'] / max(1, r['steps']):.2f} tok/step, {100 * r['plain_steps'] / max(1, r['steps']):3.0f}% "
            f"plain, {ref / r['seconds']:.2f}x hf" for m, r in row.items() if m in decoders)
            + f"  identical: {'yes' if same else 'NO'}", flush=True)
    print(f"\n{model_name}, {args.dtype}, {args.threads} thread(s), {len(rows)} requests, {args.max_new_tokens} tokens max")
    vs_plain = "plain" in methods
    print("| method | geomean vs hf-prompt-lookup | worst request | tokens/step | one-token steps |"
          + (" geomean vs plain | worst vs plain |" if vs_plain else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if vs_plain else ""))
    for method in methods:
        ratios = [row["hf-prompt-lookup"]["seconds"] / row[method]["seconds"] for _, row, _ in rows]
        tokens = sum(row[method]["tokens"] for _, row, _ in rows)
        steps = sum(row[method]["steps"] for _, row, _ in rows)
        plain = sum(row[method]["plain_steps"] for _, row, _ in rows)
        geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
        per_step = "n/a" if method not in decoders else f"{tokens / steps:.2f}"
        share = "n/a" if method not in decoders else f"{100 * plain / steps:.0f}%"
        extra = ""
        if vs_plain:
            against = [row["plain"]["seconds"] / row[method]["seconds"] for _, row, _ in rows]
            extra = f" {math.exp(statistics.fmean(math.log(r) for r in against)):.2f}x | {min(against):.2f}x |"
        print(f"| {method} | {geo:.2f}x | {min(ratios):.2f}x | {per_step} | {share} |" + extra)
    print(f"identical outputs on {sum(s for _, _, s in rows)} of {len(rows)} requests")
    if args.out:
        import json
        import os

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump({"model": model_name, "dtype": args.dtype, "threads": args.threads,
                       "max_new_tokens": args.max_new_tokens, "methods": methods,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "rows": [{"request": name, "identical": same, "methods": row} for name, row, same in rows]},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
