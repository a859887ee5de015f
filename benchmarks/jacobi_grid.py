"""Pick JacobiLookahead defaults on this machine: a small (W, N, G) grid on a real model.

For every prompt, plain ``model.generate`` (greedy) is timed right before and right after the
grid's decoder runs on that prompt, in the same process; a config's speed ratio on a prompt is
``mean(plain before, plain after) / decoder time`` (> 1 = faster than plain decoding). We report
per config the mean accepted tokens per step (new tokens / forward passes, over all prompts) and
the median speed ratio over prompts, overall and per prompt set; outputs are checked against the
plain greedy output (in bf16 near-ties may legitimately differ; counted, not asserted).

    python benchmarks/jacobi_grid.py --dtype float32 --configs 3,3,2 5,4,2 --out grid.jsonl
    python benchmarks/jacobi_grid.py --dtype bfloat16 --budget 600

A config spec is ``W,N,G`` with optional suffixes ``,noprompt`` (no prompt-as-reference),
``,committed`` (advance="committed"), ``,adaptive`` (the decoder's adaptive tree budget, its
default; without it the budget is fixed at ``--max-tree-nodes`` so every step runs the window and
checks its n-grams: that is what the grid is about) and ``+prompt`` (mixed with PromptLookup). The run stops
starting new prompts once ``--budget`` seconds have passed (the machine here costs 150-600 ms
per Qwen-0.5B step), so partial grids still give every config the same prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch

CHAT_PROMPTS = [
    "Write a short persuasive email to my manager asking to let our team work remotely two days a week.",
    "Explain the difference between a stack and a queue, with an everyday analogy for each.",
    "Compose an engaging travel blog post about a weekend trip to Kyoto, highlighting cultural experiences.",
    "What are three strategies for improving sleep quality? Give practical tips for each one.",
    "Summarize the main causes of the French Revolution in a few bullet points.",
]

CODE_PROMPTS = [
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number, computed iteratively."""\n',
    "class Stack:\n    \"\"\"A simple LIFO stack backed by a Python list.\"\"\"\n\n    def __init__(self):\n"
    "        self._items = []\n\n    def push(self, item):\n",
    "import json\nimport os\n\n\ndef load_config(path):\n    \"\"\"Load a JSON config file, returning an empty dict "
    "if it does not exist.\"\"\"\n",
    "def binary_search(items, target):\n    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"\n"
    "    lo, hi = 0, len(items) - 1\n",
    "def parse_csv_line(line, sep=','):\n    \"\"\"Split one CSV line into fields, honouring double quotes.\"\"\"\n"
    "    fields = []\n    current = ''\n",
]

DEFAULT_CONFIGS = ["3,3,2", "3,4,2", "5,3,2", "5,4,2", "5,4,4", "8,4,4", "3,5,2"]


def parse_config(spec: str) -> dict:
    mixed = spec.endswith("+prompt")
    parts = spec.removesuffix("+prompt").split(",")
    w, n, g = (int(p) for p in parts[:3])
    flags = set(parts[3:])
    return dict(spec=spec, window=w, ngram=n, max_candidates=g, prompt_as_reference="noprompt" not in flags,
                advance="committed" if "committed" in flags else "one", adaptive="adaptive" in flags, mixed=mixed)


def make_prompts(tokenizer) -> list[tuple[str, str, list[int]]]:
    """Chat and code prompts alternating, so a run cut short by the budget still has both sets."""
    out = []
    for i, (text, code) in enumerate(zip(CHAT_PROMPTS, CODE_PROMPTS)):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(("chat", f"chat{i}", tokenizer(chat)["input_ids"]))
        out.append(("code", f"code{i}", tokenizer(code)["input_ids"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="anything specdraft.models.load_model takes: checkpoint dir, .gguf, hub id, mirrored alias "
                         "(default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-tree-nodes", type=int, default=32)
    ap.add_argument("--prompts", default="all", help="all, chat, code, or a comma list of names (chat0,code3)")
    ap.add_argument("--budget", type=float, default=1200.0, help="seconds; no new prompt starts after this")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append one JSON line per (prompt, config) here")
    args = ap.parse_args(argv)

    from specdraft import Decoder, PromptLookup
    from specdraft.baseline import time_plain_generate, warmup_forward
    from specdraft.models import load_model
    from specdraft.sources.jacobi import JacobiLookahead

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = load_model(args.model, dtype=args.dtype, attn_implementation="sdpa")
    prompts = make_prompts(tok)
    if args.prompts in ("chat", "code"):
        prompts = [p for p in prompts if p[0] == args.prompts]
    elif args.prompts != "all":
        names = set(args.prompts.split(","))
        prompts = [p for p in prompts if p[1] in names]
    configs = [parse_config(c) for c in args.configs]
    out = open(args.out, "a") if args.out else None

    def decoder_for(cfg):
        src = JacobiLookahead(window=cfg["window"], ngram=cfg["ngram"], max_candidates=cfg["max_candidates"],
                              prompt_as_reference=cfg["prompt_as_reference"], advance=cfg["advance"])
        sources = [src, PromptLookup()] if cfg["mixed"] else [src]
        return Decoder(model, tok, sources=sources, max_tree_nodes=args.max_tree_nodes,
                       adaptive_budget=cfg["adaptive"])

    # warm-up: lazy init, allocator growth
    warmup_forward(model, prompts[0][2])
    time_plain_generate(model, prompts[0][2], 4, do_sample=False)
    decoder_for(configs[0]).generate(prompts[0][2], max_new_tokens=4, do_sample=False)

    rows = {c["spec"]: [] for c in configs}
    for kind, name, ids in prompts:
        if time.perf_counter() - started > args.budget:
            print(f"# budget of {args.budget:.0f} s reached; stopping before {name}", file=sys.stderr)
            break
        ref, t_before = time_plain_generate(model, ids, args.max_new_tokens, do_sample=False)
        runs = []
        for cfg in configs:
            dec = decoder_for(cfg)
            t0 = time.perf_counter()
            res = dec.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            runs.append((cfg, res, time.perf_counter() - t0))
        _, t_after = time_plain_generate(model, ids, args.max_new_tokens, do_sample=False)
        t_plain = (t_before + t_after) / 2
        for cfg, res, t in runs:
            row = dict(model=args.model.rstrip("/").split("/")[-1], dtype=args.dtype, prompt=name, set=kind,
                       config=cfg["spec"], new_tokens=res.stats.new_tokens, steps=res.stats.steps,
                       mean_accepted=res.stats.mean_accepted, wall_time=t, plain_time=t_plain,
                       plain_before=t_before, plain_after=t_after, speed_ratio=t_plain / t,
                       identical=res.token_ids == ref[: len(res.token_ids)] and len(res.token_ids) == len(ref),
                       accept_lengths=res.stats.accept_lengths,
                       per_source={k: v.as_dict() for k, v in res.stats.per_source.items()})
            rows[cfg["spec"]].append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            print(f"{name:6s} {cfg['spec']:18s} S={row['mean_accepted']:.2f} ratio={row['speed_ratio']:.2f} "
                  f"({t:.1f}s vs plain {t_before:.1f}/{t_after:.1f}s) identical={row['identical']}", flush=True)

    print(f"\n# {args.dtype}, {args.max_new_tokens} new tokens, {args.threads} thread(s), "
          f"{time.perf_counter() - started:.0f} s total")
    print(f"{'config':18s} {'prompts':>7s} {'S all':>6s} {'S chat':>6s} {'S code':>6s} "
          f"{'ratio med':>9s} {'chat med':>8s} {'code med':>8s} {'identical':>9s}")
    for spec, rs in rows.items():
        if not rs:
            continue

        def s_of(sub):
            steps = sum(r["steps"] for r in sub)
            return sum(r["new_tokens"] for r in sub) / steps if steps else float("nan")

        def med(sub):
            return statistics.median(r["speed_ratio"] for r in sub) if sub else float("nan")

        chat = [r for r in rs if r["set"] == "chat"]
        code = [r for r in rs if r["set"] == "code"]
        print(f"{spec:18s} {len(rs):7d} {s_of(rs):6.2f} {s_of(chat):6.2f} {s_of(code):6.2f} "
              f"{med(rs):9.2f} {med(chat):8.2f} {med(code):8.2f} {sum(r['identical'] for r in rs):4d}/{len(rs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
