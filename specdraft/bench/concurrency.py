"""``specdraft bench --concurrency N[,N...]``: throughput and latency with N requests at a time.

For each concurrency level N, on the same prompts in one process, one method after another
(their order rotates from level to level, so a slow minute of the machine does not always land
on the same method):

``generate``
    N sequential ``model.generate`` calls per group of N prompts (what a user without batching
    runs);
``hf-batched``
    transformers' batched ``model.generate`` on each group of N prompts, left-padded (the static
    batch a user would write); every request of a group finishes when its group does;
``plain-batched``
    our batched plain decoding (no drafts) on the same kernels as ours, continuous batching;
``default-batched``
    our batched decoder with the default sources under one budget across requests;
``default-alone`` (N = 1 only)
    the one-request :class:`~specdraft.decoder.Decoder`, to show the batched loop costs nothing
    at N = 1.

Reported per level and method: total new tokens per second, its ratio to ``generate``, the
per-request latency (from the moment the request could start to its last token; median and
p90), rows per forward and the tree size per decoding request, and how many requests' outputs
equal ``generate``'s token for token (greedy; in float32 they should all).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

__all__ = ["run_concurrency"]

METHODS = ("generate", "hf-batched", "plain-batched", "default-batched")


def trim_at_eos(tokens: Sequence[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first EOS (a batched ``generate`` pads rows after it)."""
    out = [int(t) for t in tokens]
    return out[: next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]


#: What each runner returns: the outputs, the per-request latencies, the seconds of the whole run and the
#: extra fields of its rows (our batched decoders' forward counts and tree sizes).
Timed = tuple[list[list[int]], list[float], float, dict[str, Any]]


def run_groups(prompts: Sequence[list[int]], n: int,
               run_group: Callable[[Sequence[list[int]]], Iterable[list[int]]]) -> Timed:
    """The requests in groups of ``n``, one group after another: a request's latency runs from its
    group's start, the moment it could have started, to the moment ``run_group`` gives its output."""
    outputs, latencies = [], []
    started = time.perf_counter()
    for group in (prompts[i : i + n] for i in range(0, len(prompts), n)):
        group_start = time.perf_counter()
        for output in run_group(group):
            outputs.append(output)
            latencies.append(time.perf_counter() - group_start)
    return outputs, latencies, time.perf_counter() - started, {}


def hf_batched(model: Any, group: Sequence[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """transformers' batched ``generate`` on one group, left padding; the rows run to the group's
    longest (the caller trims each at its EOS), and every one is ready when the group is."""
    import torch

    width = max(len(p) for p in group)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in group], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_id)
    return out[:, width:].tolist()


def run_ours_batched(decoder: Any, prompts: Sequence[list[int]], n: int, max_new_tokens: int) -> Timed:
    """Our continuous batching at concurrency ``n``: a request's latency runs from its admission."""
    started = time.perf_counter()
    result = decoder.generate_batch(list(prompts), max_new_tokens=max_new_tokens, concurrency=n)
    seconds = time.perf_counter() - started
    trees = [nodes for _, per in result.stats.tree_sizes for nodes in per]
    extra = {"forwards": result.stats.forwards, "rows_per_forward": result.stats.mean_rows,
             "tree_nodes_per_request": float(np.mean(trees)) if trees else 0.0,
             "tree_sizes": [[active, per] for active, per in result.stats.tree_sizes]}
    return [list(o.token_ids) for o in result], [o.stats.wall_time for o in result], seconds, extra


def run_concurrency(model: Any, tokenizer: Any, prompts: Sequence[list[int]], levels: Sequence[int],
                    max_new_tokens: int, max_tree_nodes: int,
                    say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Run every method at every level (see the module docstring) and return the summary (the
    caller writes it: ``concurrency.json``, and :func:`markdown`'s table)."""
    from specdraft.baseline import time_plain_generate
    from specdraft.decoder import Decoder
    from specdraft.stopping import eos_ids

    eos = set(eos_ids(model))
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else \
        (min(eos) if eos else 0)
    plain = Decoder(model, tokenizer, sources=[], max_tree_nodes=0)
    ours = Decoder(model, tokenizer, max_tree_nodes=max_tree_nodes)
    alone = Decoder(model, tokenizer, max_tree_nodes=max_tree_nodes)
    # warm-up: the first forwards of a process pay for allocations and kernel choices
    plain.generate_batch(list(prompts[:2]), max_new_tokens=4, concurrency=2)
    ours.generate_batch(list(prompts[:2]), max_new_tokens=4, concurrency=2)
    runners: dict[str, Callable[[int], Timed]] = {  # in the order of each level's rows
        "generate": lambda n: run_groups(prompts, n, lambda group: (
            time_plain_generate(model, list(ids), max_new_tokens, do_sample=False)[0] for ids in group)),
        "hf-batched": lambda n: run_groups(prompts, n, lambda group: hf_batched(model, group, max_new_tokens, pad_id)),
        "plain-batched": lambda n: run_ours_batched(plain, prompts, n, max_new_tokens),
        "default-batched": lambda n: run_ours_batched(ours, prompts, n, max_new_tokens),
        "default-alone": lambda n: run_groups(prompts, 1, lambda group: (
            list(alone.generate(list(ids), max_new_tokens=max_new_tokens).token_ids) for ids in group)),
    }
    rows: list[dict[str, Any]] = []
    for li, n in enumerate(levels):
        names = list(METHODS[li % len(METHODS):] + METHODS[: li % len(METHODS)]) + (["default-alone"] if n == 1 else [])
        results: dict[str, Timed] = {}
        for name in names:
            say(f"concurrency {n}: {name}")
            outputs, latencies, seconds, extra = runners[name](n)
            results[name] = [trim_at_eos(o, eos) for o in outputs], latencies, seconds, extra
        rows += [_row(n, name, results[name], results["generate"]) for name in runners if name in results]
    return {"levels": list(levels), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "max_tree_nodes": max_tree_nodes, "kernels": ours.kernels.describe(), "rows": rows}


def _row(n: int, method: str, timed: Timed, reference: Timed) -> dict[str, Any]:
    """The row of ``method`` at level ``n``; ``reference`` is sequential ``generate``'s run there."""
    outputs, latencies, seconds, extra = timed
    tokens = sum(len(o) for o in outputs)
    rate = tokens / seconds if seconds > 0 else 0.0
    base_rate = sum(len(o) for o in reference[0]) / reference[2]
    return {"concurrency": n, "method": method, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": rate, "vs_generate": rate / base_rate if base_rate else 0.0,
            "latency_median": statistics.median(latencies),
            "latency_p90": float(np.percentile(latencies, 90)),
            "identical": sum(a == b for a, b in zip(outputs, reference[0])), "requests": len(reference[0]), **extra}


def markdown(summary: dict[str, Any]) -> str:
    """The table of :func:`run_concurrency`'s summary."""
    lines = [f"{summary['prompts']} prompts, {summary['max_new_tokens']} new tokens, greedy; ratios to "
             "sequential `model.generate` in the same run", "",
             "| N | method | tokens/s | vs generate | latency median (s) | latency p90 (s) | rows/forward "
             "| tree nodes/request | identical |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        rows = f"{r['rows_per_forward']:.1f}" if "rows_per_forward" in r else ""
        tree = f"{r['tree_nodes_per_request']:.1f}" if "tree_nodes_per_request" in r else ""
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['vs_generate']:.2f}x "
                     f"| {r['latency_median']:.2f} | {r['latency_p90']:.2f} | {rows} | {tree} "
                     f"| {r['identical']}/{r['requests']} |")
    return "\n".join(lines) + "\n"


def tree_sizes_by_load(summary: dict[str, Any], method: str = "default-batched") -> dict[int, float]:
    """Mean tree nodes per decoding request, by how many requests the forward carried, over every
    level's run of ``method``: how the budget split the rows."""
    nodes: dict[int, list[int]] = {}
    for row in (r for r in summary["rows"] if r["method"] == method):
        for active, per in row.get("tree_sizes", []):
            if per:
                nodes.setdefault(int(active), []).extend(per)
    return {k: float(np.mean(v)) for k, v in sorted(nodes.items())}


def plot_tree_sizes(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """``tree-sizes.png``: mean tree nodes per request against the requests in the forward."""
    from .report import require_matplotlib, save_figure

    plt = require_matplotlib()
    points = tree_sizes_by_load(summary)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(list(points), list(points.values()), marker="o")
    ax.set_xlabel("requests in the forward")
    ax.set_ylabel("tree nodes per request (mean)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
