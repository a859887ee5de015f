"""Token Recycling's acceptance with a warm matrix, replayed from recorded top-k.

Why this exists
    The plain acceptance replay (``acceptance_replay.py``) cannot replay Token Recycling: its
    matrix is filled from the model's top-k at every row a step forwards, so what it drafts depends
    on logits. Real runs measure it, but on a CPU where a wide step costs several plain ones the
    adaptive budget runs plain steps and never shows what the source *could* accept, and fixed-size
    runs are slow. This script records the logits instead: one teacher-forced forward over
    ``prompt + reference output`` gives the top-k at every position of the greedy output, which is
    the top-k a real run computes at each step's root and accepted nodes (up to summation-order
    noise). The matrix then evolves as in a real run, prompt after prompt (the paper's hot start),
    except that it never sees the rows of rejected tree nodes, which a real run also recycles. The
    figures are therefore an estimate of a real fixed-budget run, not a bound in either direction.

What it prints
    For each template: mean accepted tokens per step at a fixed budget (the template's size), on
    its own, merged with the default sources (prompt lookup, trie, shared n-gram; the branches
    are merged round-robin by the decoder's own ``TokenTree.from_drafts`` and cut at the
    template's size), and the default sources alone at the same size; and, with ``--cost-curve
    curve.json`` from ``cost_curve.py``, the speed a fixed budget of that size would reach on the
    machine that measured the curve: ``mean accepted x cost(1) / cost(1 + nodes)``.

    python benchmarks/recycling_replay.py --model qwen2.5-coder-0.5b --dtype bfloat16 --limit 40 \\
        --references bench-out/mtbench/checkpoint.pkl --out bench-out/recycling-replay

``--references`` takes a ``specdraft bench`` checkpoint (its prompts, as the bench encoded them, and
its ``baseline`` outputs are the greedy references; ``--dataset`` is then not read) or a
``references-<dataset>.json`` of ``acceptance_replay.py`` (generated with ``model.generate`` and
cached there when it does not exist; by default in ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance_replay import greedy_step, reference_outputs  # noqa: E402
from budget_replay import load_recordings  # noqa: E402

from specdraft.sources import Context, Feedback  # noqa: E402


@torch.inference_mode()
def recorded_top_k(model: Any, prompt: Sequence[int], reference: Sequence[int], k: int,
                   prompt_rows: bool = False) -> np.ndarray:
    """``[len(reference), k]``: row ``j`` holds the top-k next tokens after ``prompt + reference[:j]``
    (row 0 is the prefill's last position), from one forward over the whole sequence. With
    ``prompt_rows`` the prompt's other positions come first (``len(prompt) - 1`` more rows)."""
    ids = torch.tensor([list(prompt) + list(reference[:-1])])
    logits = model(ids).logits[0, 0 if prompt_rows else len(prompt) - 1:]
    return logits.topk(k, dim=-1).indices.to(torch.int64).numpy()


def recorded_top_k_cached(model: Any, prompts: list[dict[str, Any]], refs: dict[str, list[int]], k: int,
                          cache: Path, prompt_rows: bool = False) -> dict[str, np.ndarray]:
    """:func:`recorded_top_k` of every prompt, kept in ``cache`` (an ``.npz`` keyed by prompt id and
    the sequence's length) so that another grid over the same references skips the forwards."""
    saved: dict[str, np.ndarray] = dict(np.load(cache)) if cache.exists() else {}
    tops: dict[str, np.ndarray] = {}
    started = time.perf_counter()
    for i, p in enumerate(prompts):
        key = f"{p['id']}:{len(p['ids'])}+{len(refs[p['id']])}" + ("+prompt-rows" if prompt_rows else "")
        if key not in saved:
            saved[key] = recorded_top_k(model, p["ids"], refs[p["id"]], k, prompt_rows)
            np.savez(cache, **saved)
        tops[p["id"]] = saved[key]
        print(f"\rtop-k recorded {i + 1}/{len(prompts)} ({time.perf_counter() - started:.0f} s)", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return tops


def replay(prompt: Sequence[int], reference: Sequence[int], top: np.ndarray, sources: Sequence[Any],
           max_tree_nodes: int, request_id: int, prompt_rows: bool = False) -> list[int]:
    """Tokens committed per step when decoding ``reference`` after ``prompt`` with ``sources``, the
    way the decoder steps: the prefill commits the first token (step 0, observed by nobody), then
    every tree step commits its accepted path plus one. Sources that asked for top-k
    (``top_k > 0``) get, every tree step, the recorded top-k of the rows on the accepted path (the
    root and the accepted nodes), the first one preceded by the prefill's last row, or, with
    ``prompt_rows`` (``top`` from :func:`recorded_top_k` with ``prompt_rows``), by every prompt row:
    what a decoder that computed the prompt's logits at the prefill would hand on."""
    committed = list(prompt)
    start, end = len(prompt), len(prompt) + len(reference)
    full = list(prompt) + list(reference)
    for s in sources:
        s.begin(Context(tuple(committed), start, request_id))
    lengths: list[int] = []
    first = 0 if prompt_rows else start - 1  # the position of ``top``'s first row
    pending = list(range(first, start))  # rows computed but not yet delivered: the prefill's rows
    try:
        if reference:
            committed.append(full[start])  # step 0: the prefill's token
            lengths.append(1)
        while len(committed) < end:
            context = Context(tuple(committed), start, request_id)
            step = greedy_step(sources, context, full, max_tree_nodes)
            rows = pending + list(range(len(committed) - 1, len(committed) - 1 + len(step)))  # positions in ``full``
            pending = []
            row_tokens = np.array([full[j] for j in rows], dtype=np.int64)
            row_top = top[np.array(rows) - first]
            committed.extend(step)
            lengths.append(len(step))
            after = Context(tuple(committed), start, request_id)
            for s in sources:
                if getattr(s, "top_k", 0):
                    s.observe(Feedback(committed=list(step), context=after, top_ids=row_top, row_tokens=row_tokens))
                else:
                    s.observe(Feedback(committed=list(step), context=after))
    finally:
        final = Context(tuple(committed), start, request_id)
        for s in sources:
            s.end(final)
    return lengths


def load_cost_curve(path: Path, kernels: str) -> dict[int, float]:
    """Median milliseconds per forward width from ``cost_curve.py``'s ``curve.json``."""
    rows = json.loads(path.read_text())["rows"]
    curve = {int(r["k"]): float(r["median_ms"]) for r in rows if r["path"] == kernels}
    if 1 not in curve:
        raise SystemExit(f"{path} has no width-1 row for kernels {kernels!r}")
    return curve


def cost_ratio(curve: dict[int, float], nodes: int) -> float | None:
    """cost(1 + nodes) / cost(1) on a cost curve, interpolated linearly between the measured widths;
    None past the widest one (measure it with ``cost_curve.py --widths``)."""
    width = 1 + nodes
    if width > max(curve):
        return None
    widths = sorted(curve)
    return float(np.interp(width, widths, [curve[x] for x in widths])) / curve[1]


def main(argv: Sequence[str] | None = None) -> int:
    from specdraft.bench.datasets import load_prompts
    from specdraft.models import load_model
    from specdraft.sources import FrequencyTrie, MultiLevelNGram, PromptLookup, TokenRecycling

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory or mirrored alias")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="Token Recycling's candidates per token")
    ap.add_argument("--templates", default="tr8,tr16,tr32,tr80")
    ap.add_argument("--references", type=Path, help="a bench checkpoint (.pkl, .pkl.gz) or a references-<dataset>.json")
    ap.add_argument("--cost-curve", type=Path, help="curve.json of cost_curve.py, for the speed estimate")
    ap.add_argument("--prompt-rows", action="store_true",
                    help="also hand Token Recycling the top-k of every prompt row at the first step (an idea "
                         "of the roadmap: what warming the matrix from the prompt would gain)")
    ap.add_argument("--kernels", default="stock", choices=["stock", "packed"], help="which row of the cost curve")
    ap.add_argument("--out", default="bench-out/recycling-replay")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    if args.references is not None and args.references.suffix in (".pkl", ".gz"):
        dataset, recordings, _ = load_recordings(args.references)
        recordings = recordings[: args.limit] if args.limit else recordings
        prompts = [{"id": str(r.prompt_id), "ids": r.prompt_ids} for r in recordings]
        refs = {str(r.prompt_id): r.reference for r in recordings}
    else:
        dataset = args.dataset
        records = load_prompts(args.dataset, args.limit, tokenizer)
        prompts = [{"id": str(r.id), "ids": list(r.token_ids)} for r in records]
        cache = args.references or out / f"references-{dataset}.json"
        refs = reference_outputs(model, prompts, args.max_new_tokens, cache)
    print(f"{len(prompts)} prompts, {sum(len(refs[p['id']]) for p in prompts)} reference tokens", file=sys.stderr)

    tops = recorded_top_k_cached(model, prompts, refs, args.k, out / f"top-k-{dataset}-{args.dtype}-k{args.k}.npz",
                                 args.prompt_rows)

    curve = load_cost_curve(args.cost_curve, args.kernels) if args.cost_curve is not None else None

    def run(name: str, make: Callable[[], list[Any]], nodes: int) -> dict[str, Any]:
        sources = make()
        lengths: list[int] = []
        per_prompt = []
        for i, p in enumerate(prompts):
            got = replay(p["ids"], refs[p["id"]], tops[p["id"]], sources, nodes, request_id=10_000 + i,
                         prompt_rows=args.prompt_rows)
            lengths += got
            per_prompt.append(sum(got) / len(got))
        mean = sum(lengths) / len(lengths)
        ratio = None if curve is None else cost_ratio(curve, nodes)
        result = {"config": name, "nodes": nodes, "mean_accepted": mean,
                  "median_prompt_mean_accepted": statistics.median(per_prompt), "steps": len(lengths),
                  "per_prompt_mean_accepted": per_prompt,
                  "cost_ratio": ratio, "estimated_speedup": None if ratio is None else mean / ratio}
        speed = "" if ratio is None else f"  step cost {ratio:.2f}x plain -> {mean / ratio:.2f}x"
        print(f"{name:<36} {nodes:>3} nodes  mean accepted {mean:.3f} (per-prompt median "
              f"{result['median_prompt_mean_accepted']:.3f}){speed}", flush=True)
        return result

    results = []
    for template in args.templates.split(","):
        size = len(TokenRecycling(k=args.k, template=template, vocab_size=len(tokenizer)).template)
        results.append(run(f"recycle[{template}]", lambda t=template: [TokenRecycling(k=args.k, template=t)], size))
        results.append(run(f"prompt+trie+ngram+recycle[{template}]",
                           lambda t=template: [PromptLookup(), FrequencyTrie(), MultiLevelNGram(),
                                               TokenRecycling(k=args.k, template=t)], size))
        results.append(run("prompt+trie+ngram", lambda: [PromptLookup(), FrequencyTrie(), MultiLevelNGram()], size))
    suffix = "-prompt-rows" if args.prompt_rows else ""
    (out / f"recycling-replay-{dataset}-{args.dtype}{suffix}.json").write_text(json.dumps(
        {"model": args.model, "dtype": args.dtype, "dataset": dataset, "limit": args.limit, "k": args.k, "prompt_rows": args.prompt_rows,
         "references": str(args.references) if args.references else None, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
