"""Draw the figures of docs/results.md from the benchmark results committed under benchmarks/results/.

    python scripts/plot_results.py            # writes docs/images/*.png, prints the numbers it drew

Figures:

* ``speedup-per-prompt.png``: for each published run (the ones README.md's "Measured here" quotes),
  every prompt's speed ratio to plain decoding, sorted, for the default combination and for
  transformers' prompt lookup. The ratio is computed from the Spec-Bench JSONL as ``specdraft
  bench`` computes it (baseline time / method time on the same prompt; tokens/s ratio if the
  lengths differ); the script checks its medians against the run's ``summary.json``.
* ``mean-accepted-per-source.png``: tokens committed per forward pass for each source alone and
  for the default combination, from the "full" runs (every source alone on the same prompts).

* ``cpu-cost-curve-float32.png``, ``cpu-cost-curve-bfloat16.png``: milliseconds per forward of
  ``k`` new tokens for each kernel path, from ``benchmarks/cost_curve.py``'s ``curve.json`` (the
  runs in ``COST_CURVES``), titled with the machine that measured them
  (``benchmarks/results/machines.json``).

Legible at page width: drawn at 200 dpi (2x for a page about 800 px wide) with no text under
11 pt. The figures are regenerated from data only, so re-running the script after a new run is
all the page needs (add the run to ``PUBLISHED``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: (label, run directory, dataset): the runs README.md's "Measured here" table quotes.
PUBLISHED = [
    ("HumanEval, float32", "qwen0.5b-fp32-356a2f7", "humaneval"),
    ("HumanEval, bfloat16", "qwen0.5b-bf16-356a2f7", "humaneval"),
    ("MT-Bench, float32", "qwen0.5b-fp32-14301f2", "mtbench"),
    ("MT-Bench, bfloat16", "qwen0.5b-bf16-5f467ae", "mtbench"),
]

#: Runs with every source alone (and the default mix) on the same prompts: dtype -> directory.
FULL_RUNS = {"float32": "qwen0.5b-fp32-full", "bfloat16": "qwen0.5b-bf16-full"}

#: Methods drawn in the per-prompt figure: name in the run -> (legend label, colour).
SPEEDUP_METHODS = {
    "default": ("specdraft default", "#3949ab"),
    "hf-prompt-lookup": ("transformers PL", "#ef6c00"),
}

#: Cost curves drawn for docs/cpu-fast-path.md: output name -> run directory.
COST_CURVES = {"cpu-cost-curve-float32.png": "cost-curve-qwen0.5b-fp32",
               "cpu-cost-curve-bfloat16.png": "cost-curve-qwen0.5b-bf16"}

DPI = 200
FONT = {"font.size": 12, "axes.titlesize": 12, "axes.labelsize": 12, "xtick.labelsize": 11,
        "ytick.labelsize": 11, "legend.fontsize": 11, "figure.titlesize": 13}

SOURCES_ALONE = [("specdraft:prompt", "prompt"), ("specdraft:trie", "trie"), ("specdraft:ngram", "ngram"),
                 ("specdraft:jacobi", "jacobi"), ("default", "default mix"), ("hf-prompt-lookup", "transformers PL")]


def _records(path: Path) -> dict[str, dict]:
    """Spec-Bench JSONL records by question id."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["question_id"]] = rec
    return out


def _time_and_tokens(rec: dict) -> tuple[float, int]:
    choice = rec["choices"][0]
    return sum(choice["wall_time"]), sum(choice["new_tokens"])


def per_prompt_speedups(run: str, dataset: str, method: str) -> list[float]:
    """Each prompt's speed ratio of ``method`` to plain decoding (``baseline``), sorted."""
    summary = json.loads((RESULTS / run / "summary.json").read_text())
    methods = summary["datasets"][dataset]["methods"]
    base = _records(RESULTS / run / methods["baseline"]["jsonl"])
    ours = _records(RESULTS / run / methods[method]["jsonl"])
    ratios = []
    for qid, rec in ours.items():
        b_time, b_tokens = _time_and_tokens(base[qid])
        o_time, o_tokens = _time_and_tokens(rec)
        if b_time <= 0 or o_time <= 0 or (b_tokens != o_tokens and b_tokens == 0):
            continue
        ratios.append(b_time / o_time if b_tokens == o_tokens else (o_tokens / o_time) / (b_tokens / b_time))
    expected = methods[method]["speedup_median"]
    if abs(statistics.median(ratios) - expected) > 1e-6:
        raise SystemExit(f"{run}/{dataset}/{method}: median {statistics.median(ratios):.4f} from the JSONL, "
                         f"{expected:.4f} in summary.json; the JSONL and the summary disagree")
    return sorted(ratios)


def plot_speedups(out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 8.4), sharey=True)
    for ax, (label, run, dataset) in zip(axes.flat, PUBLISHED):
        for method, (name, colour) in SPEEDUP_METHODS.items():
            ratios = per_prompt_speedups(run, dataset, method)
            xs = range(1, len(ratios) + 1)
            ax.plot(xs, ratios, marker="o", markersize=3, linewidth=1.2, color=colour,
                    label=f"{name}: {statistics.median(ratios):.2f}x")
            print(f"{label:22s} {method:18s} n={len(ratios)} median={statistics.median(ratios):.3f} "
                  f"min={ratios[0]:.3f} below 0.95x: {sum(r < 0.95 for r in ratios)}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.95, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.legend(loc="upper left", fontsize=11, title="median", title_fontsize=11)
    for ax in axes[1]:
        ax.set_xlabel("prompt (sorted by speed ratio)")
    for ax in axes[:, 0]:
        ax.set_ylabel("speed ratio to model.generate")
    ticks = [0.5, 0.7, 1.0, 1.5, 2, 3, 4]
    axes[0, 0].set_yticks(ticks, [f"{t:g}x" for t in ticks])
    axes[0, 0].minorticks_off()
    machines = json.loads((RESULTS / "machines.json").read_text())["machines"]
    cpus = {machines[json.loads((RESULTS / run / "summary.json").read_text())["config"]["platform"]]["short"]
            for _, run, _ in PUBLISHED}
    fig.suptitle(f"Qwen2.5-Coder-0.5B-Instruct on {' / '.join(sorted(cpus))}, 1 thread, greedy, "
                 "128 new tokens,\n"
                 "40 prompts each; specdraft default = prompt + trie + ngram,\n"
                 "transformers PL = transformers' prompt lookup (dashed: 0.95x)")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def plot_sources(out: Path) -> None:
    import matplotlib.pyplot as plt

    groups = []  # (label, {method label: mean accepted})
    for dtype, run in FULL_RUNS.items():
        summary = json.loads((RESULTS / run / "summary.json").read_text())
        for dataset, data in summary["datasets"].items():
            methods = data["methods"]
            groups.append((f"{'HumanEval' if dataset == 'humaneval' else 'MT-Bench'}, {dtype}",
                           {name: methods[m]["mean_accepted"] for m, name in SOURCES_ALONE if m in methods}))
    names = [name for _, name in SOURCES_ALONE]
    colours = ["#5c6bc0", "#26a69a", "#9ccc65", "#bdbdbd", "#283593", "#ef6c00"]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(10, 5.6))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
        ys = [g.get(name, 0.0) for _, g in groups]
        ax.bar(xs, ys, width, label=name, color=colours[j])
    for label, g in groups:
        print(f"{label:22s} " + "  ".join(f"{k}={v:.2f}" for k, v in g.items()))
    ax.set_xticks(range(len(groups)), [label for label, _ in groups])
    ax.set_ylabel("tokens per forward pass")
    ax.set_ylim(1.0, max(max(g.values()) for _, g in groups) * 1.08)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    ax.set_title("Mean accepted tokens per step, each source alone\n"
                 "(Qwen2.5-Coder-0.5B, 40 prompts, 1.0 = plain decoding)")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def plot_cost_curve(run: str, out: Path) -> None:
    import matplotlib.pyplot as plt

    data = json.loads((RESULTS / run / "curve.json").read_text())
    machines = json.loads((RESULTS / "machines.json").read_text())["machines"]
    cfg = data["config"]
    cpu = machines[cfg["platform"]]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    rows = data["rows"]
    for path in dict.fromkeys(r["path"] for r in rows):
        pts = sorted((r["k"], r["median_ms"]) for r in rows if r["path"] == path)
        ax.plot([k for k, _ in pts], [m for _, m in pts], marker="o", linewidth=2, label=path)
    ks = sorted({r["k"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("new tokens per forward (k)")
    ax.set_ylabel("ms per forward (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Qwen2.5-Coder-0.5B, {cfg['dtype']}, {cfg['cache_len']}-token cache, 1 thread\n"
                 f"{cpu['cpu'].split(',')[0]}, {cpu['isa']} ({run})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    print(f"{out.name}: {run}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="output folder (%(default)s)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "specdraft"  # deterministic output
    matplotlib.rcParams.update(FONT)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_speedups(args.out / "speedup-per-prompt.png")
    plot_sources(args.out / "mean-accepted-per-source.png")
    for name, run in COST_CURVES.items():
        plot_cost_curve(run, args.out / name)
    for png in sorted(args.out.glob("*.png")):
        print(f"{png.relative_to(ROOT)}: {png.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
