"""Benchmark outputs: Spec-Bench JSONL per method, ``summary.json``, a markdown table, a PNG plot.

Definitions (also in ``benchmarks/README.md``):

* **speed ratio** of a method on a prompt = baseline wall time / method wall time on that prompt.
  When the two outputs have different lengths (a mismatch, or sampling) the ratio of tokens/s
  is used instead, so a method is not rewarded for stopping early.
* **speedup median / geomean / min**: over the prompts' speed ratios.
* **tokens/s**: all new tokens of the method / all its wall time (timed around the whole
  ``generate`` call, prefill included, the same for every method).
* **mean accepted**: new tokens / forward passes (Spec-Bench's "#Mean accepted tokens" and the
  papers' compression ratio; 1.00 is plain decoding).
* **identical n/N**: prompts whose greedy output equals the baseline's token for token.
* **= plain n/N** (when ``plain`` ran): prompts whose output equals our own plain decoding's on the
  same kernels, what exact mode guarantees in every dtype.
* **vs plain** (only when the run has a ``plain`` method): geomean over prompts of our ``plain``
  decoding's time on the *same kernels* (``plain`` or ``plain@packed``) / the method's time, so
  the gain of speculation is never mixed up with the gain of a kernel path.
* **per-source accepted share**: of all new tokens, the fraction a source had drafted (and the
  model accepted). A token drafted by two sources counts for both, so shares can overlap; the
  rest of the tokens are the model's own "bonus" tokens.

The Spec-Bench layout is that of its ``evaluation/eval.py``: one line per question with
``question_id``, ``category``, ``answer_id``, ``model_id``, ``choices`` (one choice with ``index``,
``turns``, ``decoding_steps``, ``new_tokens``, ``wall_time``, ``accept_lengths``) and ``tstamp``, so
Spec-Bench's ``speed.py`` reads the files (``--task overall``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from .methods import BASELINE, plain_reference
from .runner import DatasetRun, PromptRun

__all__ = ["PlotUnavailableError", "markdown_report", "markdown_table", "method_file_name", "plot",
           "require_matplotlib", "save_figure", "speed_ratio", "summarize", "write_specbench_jsonl"]


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


# --------------------------------------------------------------------------------------------
# numbers
# --------------------------------------------------------------------------------------------


def speed_ratio(baseline: PromptRun, ours: PromptRun) -> float | None:
    """Baseline time / method time on one prompt (tokens/s ratio if the lengths differ)."""
    b_tokens, o_tokens = len(baseline.result.token_ids), len(ours.result.token_ids)
    b_time, o_time = baseline.wall_time, ours.wall_time
    if b_time <= 0 or o_time <= 0:
        return None
    if b_tokens == o_tokens:
        return b_time / o_time
    if b_tokens == 0:
        return None
    return (o_tokens / o_time) / (b_tokens / b_time)


def _ratios(references: Sequence[PromptRun], runs: Sequence[PromptRun]) -> list[float]:
    """The speed ratios of ``runs`` against ``references``, prompt by prompt, where defined."""
    return [r for r in (speed_ratio(b, p) for b, p in zip(references, runs)) if r is not None]


def _geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summarize(run: DatasetRun) -> dict[str, Any]:
    """Per-method metrics and per-prompt details of one dataset (JSON-ready)."""
    baseline = run.runs[BASELINE]
    methods: dict[str, Any] = {}
    for method in run.methods:
        prompt_runs = run.runs[method.name]
        new_tokens = sum(len(p.result.token_ids) for p in prompt_runs)
        wall = sum(p.wall_time for p in prompt_runs)
        steps = _total(p.result.steps for p in prompt_runs)
        ratios = _ratios(baseline, prompt_runs)
        methods[method.name] = {
            "description": getattr(method, "description", method.name),
            "prompts": len(prompt_runs),
            "new_tokens": new_tokens,
            "wall_time": wall,
            "tokens_per_s": new_tokens / wall if wall > 0 else None,
            "speedup_median": statistics.median(ratios) if ratios else None,
            "speedup_geomean": _geomean(ratios),
            "speedup_min": min(ratios) if ratios else None,
            "speedup_max": max(ratios) if ratios else None,
            "steps": steps,
            "mean_accepted": new_tokens / steps if steps else None,
            "identical": sum(p.result.token_ids == b.result.token_ids for b, p in zip(baseline, prompt_runs)),
            "compared": len(run.prompts),
            "reference": method.name == BASELINE,
            "per_source": _per_source(prompt_runs, new_tokens),
            "skipped_drafts": _total(p.result.skipped_drafts for p in prompt_runs),
            "repeats_disagree": [prompt.id for prompt, p in zip(run.prompts, prompt_runs) if not p.consistent],
        }
        plain = plain_reference(method.name)
        if method.name != BASELINE and plain in run.runs:
            methods[method.name].update(_against_plain(plain, run.runs[plain], prompt_runs))
    per_prompt = []
    for i, prompt in enumerate(run.prompts):
        ref = baseline[i]
        row: dict[str, Any] = {"prompt_id": prompt.id, "category": prompt.category,
                               "prompt_tokens": len(prompt.token_ids), "methods": {}}
        for method in run.methods:
            p = run.runs[method.name][i]
            row["methods"][method.name] = {
                "new_tokens": len(p.result.token_ids), "wall_time": p.wall_time, "wall_times": p.wall_times,
                "steps": p.result.steps, "skipped_drafts": p.result.skipped_drafts, "speedup": speed_ratio(ref, p),
                "identical": p.result.token_ids == ref.result.token_ids,
            }
        per_prompt.append(row)
    return {
        "dataset": run.dataset,
        "prompts": len(run.prompts),
        "max_new_tokens": run.max_new_tokens,
        "repeats": run.repeats,
        "methods": methods,
        "mismatches": [asdict(m) for m in run.mismatches],
        "skipped": run.skipped,
        "per_prompt": per_prompt,
    }


def _total(counts: Any) -> int | None:
    """The sum of ``counts``, or ``None`` if any is unknown."""
    values = list(counts)
    return None if any(v is None for v in values) else sum(values)


def _per_source(prompt_runs: Sequence[Any], new_tokens: int) -> dict[str, dict[str, Any]]:
    """Each source's proposed and accepted tokens over the prompts, its share of the new tokens
    and its acceptance rate."""
    per_source: dict[str, dict[str, Any]] = {}
    for p in prompt_runs:
        for source, counts in p.result.per_source.items():
            acc = per_source.setdefault(source, {"proposed": 0, "accepted": 0})
            acc["proposed"] += counts.get("proposed", 0)
            acc["accepted"] += counts.get("accepted", 0)
    for acc in per_source.values():
        acc["share"] = acc["accepted"] / new_tokens if new_tokens else 0.0
        acc["acceptance_rate"] = acc["accepted"] / acc["proposed"] if acc["proposed"] else 0.0
    return per_source


def _against_plain(plain: str, plain_runs: Sequence[Any], prompt_runs: Sequence[Any]) -> dict[str, Any]:
    """A method against our plain decoding on the same kernels: speed, and equal outputs (the
    reference exact mode promises equality with, in every dtype)."""
    vs_plain = _ratios(plain_runs, prompt_runs)
    return {"plain_reference": plain,
            "speedup_vs_plain_geomean": _geomean(vs_plain),
            "speedup_vs_plain_median": statistics.median(vs_plain) if vs_plain else None,
            "identical_to_plain": sum(a.result.token_ids == b.result.token_ids for a, b in zip(plain_runs, prompt_runs))}


# --------------------------------------------------------------------------------------------
# Spec-Bench JSONL
# --------------------------------------------------------------------------------------------


def method_file_name(method: str) -> str:
    """A file-system-safe file name for a method's JSONL (``specdraft:prompt+trie`` ->
    ``specdraft-prompt+trie.jsonl``)."""
    return re.sub(r"[^A-Za-z0-9+._-]", "-", method) + ".jsonl"


def write_specbench_jsonl(run: DatasetRun, out_dir: Path, model_id: str, tokenizer: Any = None) -> dict[str, Path]:
    """One Spec-Bench answer file per method in ``out_dir``; returns method -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for method in run.methods:
        path = out_dir / method_file_name(method.name)
        with open(path, "w", encoding="utf-8") as fh:
            for prompt, p in zip(run.prompts, run.runs[method.name]):
                r = p.result
                text = tokenizer.decode(r.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
                accept = r.accept_lengths if r.accept_lengths is not None else []
                choice = {"index": 0, "turns": [text], "decoding_steps": [r.steps if r.steps is not None else 0],
                          "new_tokens": [len(r.token_ids)], "wall_time": [p.wall_time], "accept_lengths": accept}
                record = {"question_id": prompt.id, "category": prompt.category, "answer_id": uuid.uuid4().hex,
                          "model_id": f"{model_id}-{method.name}", "choices": [choice], "tstamp": time.time()}
                fh.write(json.dumps(record) + "\n")
        paths[method.name] = path
    return paths


# --------------------------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------------------------

#: The table's columns; the two on our plain decoding (:data:`PLAIN_COLUMNS`) only in a run that has it.
COLUMNS = ["method", "tokens/s", "speedup median", "speedup geomean", "min speedup", "vs plain (same kernels)",
           "mean accepted", "identical n/N", "= plain n/N", "per-source accepted share"]
PLAIN_COLUMNS = ("vs plain (same kernels)", "= plain n/N")


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _shares(per_source: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{name} {s['share'] * 100:.0f}%" for name, s in per_source.items()) or "-"


def markdown_table(summary: dict[str, Any]) -> str:
    """The per-method table of one dataset summary (see :func:`summarize`)."""
    with_plain = any("plain_reference" in m for m in summary["methods"].values())
    shown = [i for i, column in enumerate(COLUMNS) if with_plain or column not in PLAIN_COLUMNS]
    lines = ["| " + " | ".join(COLUMNS[i] for i in shown) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(shown) - 2) + ["---"]) + "|"]
    for name, m in summary["methods"].items():
        cells = [f"`{name}`", _num(m["tokens_per_s"], 1), _x(m["speedup_median"]), _x(m["speedup_geomean"]),
                 _x(m["speedup_min"]), _x(m["speedup_vs_plain_geomean"]) if "plain_reference" in m else "-",
                 _num(m["mean_accepted"]), f"{m['identical']}/{m['compared']}" + (" (ref)" if m["reference"] else ""),
                 f"{m['identical_to_plain']}/{m['compared']}" if "identical_to_plain" in m else "-",
                 _shares(m["per_source"])]
        lines.append("| " + " | ".join(cells[i] for i in shown) + " |")
    return "\n".join(lines)


def markdown_report(summaries: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    """Tables for every dataset, then the mismatches and skipped prompts."""
    head = (f"model `{config.get('model')}`, {config.get('dtype')}, {config.get('threads')} thread(s), "
            f"max {config.get('max_new_tokens')} new tokens, greedy, median of {config.get('repeats')} run(s) "
            f"per prompt and method")
    parts = [f"# specdraft bench\n\n{head}\n"]
    for s in summaries:
        parts.append(f"## {s['dataset']} ({s['prompts']} prompts)\n\n{markdown_table(s)}\n")
        if "default" in s["methods"]:
            parts.append(f"`default` = {s['methods']['default']['description']}\n")
        if s["mismatches"]:
            parts.append("Greedy mismatches (first differing position; margin = top1 - top2 of the baseline "
                         "model's logits there):\n")
            for m in s["mismatches"]:
                margin = "n/a" if m["margin"] is None else f"{m['margin']:.4g}"
                parts.append(f"- `{m['method']}` on prompt {m['prompt_id']!r}: position {m['position']}, baseline "
                             f"token {m['baseline_token']}, method token {m['method_token']}, margin {margin}")
            parts.append("")
        for skip in s["skipped"]:
            parts.append(f"- skipped prompt {skip['prompt_id']!r}: {skip['reason']}")
        parts += [f"- `{name}`: repeats gave different outputs on prompts {m['repeats_disagree']}"
                  for name, m in s["methods"].items() if m["repeats_disagree"]]
    return "\n".join(parts).rstrip() + "\n"


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a clear error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError("the plot needs matplotlib: pip install 'specdraft[bench]' "
                                   "(or pip install matplotlib), or pass --no-plot") from None
    return plt


def plot(summaries: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Grouped bars per method (one bar per dataset): geomean speedup (with the median as a dot
    and the minimum as a tick) and mean accepted tokens per step."""
    plt = require_matplotlib()
    methods = list(dict.fromkeys(m for s in summaries for m in s["methods"]))  # in order of first appearance
    width = 0.8 / max(len(summaries), 1)
    fig, (ax_speed, ax_acc) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(methods) + 4), 4.5))
    for k, s in enumerate(summaries):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(methods))]
        get = lambda key: [(s["methods"].get(m) or {}).get(key) for m in methods]  # noqa: E731
        geo = [v or 0.0 for v in get("speedup_geomean")]
        bars = ax_speed.bar(xs, geo, width, label=s["dataset"])
        color = bars.patches[0].get_facecolor() if bars.patches else None
        for x, med, low in zip(xs, get("speedup_median"), get("speedup_min")):
            if med is not None:
                ax_speed.plot([x], [med], "o", color="black", markersize=3)
            if low is not None:
                ax_speed.plot([x - width / 3, x + width / 3], [low, low], "-", color="black", linewidth=1)
        ax_acc.bar(xs, [v or 0.0 for v in get("mean_accepted")], width, label=s["dataset"], color=color)
    for ax, label in ((ax_speed, "speedup vs baseline (bar: geomean, dot: median, tick: min)"),
                      (ax_acc, "mean accepted tokens per forward")):
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (120 dpi) and close a figure of :func:`require_matplotlib`'s pyplot."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    require_matplotlib().close(fig)
    return path
