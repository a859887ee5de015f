"""Draw the figures of docs/results.md from the benchmark results committed under benchmarks/results/.

    python scripts/plot_results.py            # writes docs/images/*.png, prints the numbers it drew

Figures:

* ``speedup-per-prompt.png``: every prompt's speed ratio to ``model.generate``, sorted, for the
  default, our plain decoding, transformers' prompt lookup and the suffix tree alone (those a run
  has), one panel per run: the single-request CPU runs of the first screen
  (``render_tables.FIRST_SCREEN``) once they are measured, else :data:`LATEST_DEFAULT_RUNS`. Each
  panel names its dtype, kernels and commit. The ratio is computed from the Spec-Bench JSONL as
  ``specdraft bench`` computes it (baseline time / method time on the same prompt; tokens/s ratio
  if the lengths differ); the script checks its medians against the run's ``summary.json``.
* ``mean-accepted-per-source.png``: tokens committed per forward pass for each source alone and
  for ``prompt+trie+ngram`` (the default of those runs), from the "full" runs (every source alone
  on the same prompts).
* ``batch-tree-sizes.png``: the mean tree per request against the requests in the forward, from
  a ``specdraft bench --concurrency`` run (:data:`BATCH_TREE_RUN`); a bar per load that occurred,
  nothing where none did.

* ``cpu-cost-curve-float32.png``, ``cpu-cost-curve-bfloat16.png``: milliseconds per forward of
  ``k`` new tokens for each kernel path, from ``benchmarks/cost_curve.py``'s ``curve.json`` (the
  runs in ``COST_CURVES``), titled with the machine that measured them
  (``benchmarks/results/machines.json``).

Legible at page width: drawn at 200 dpi (2x for a page about 800 px wide) with no text under
11 pt, and no line through a point without data. The figures are regenerated from data only, so
re-running the script after a new run is all the page needs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: The latest runs of today's default sources, (run directory, dataset): drawn until the first
#: screen's CPU runs are measured.
LATEST_DEFAULT_RUNS = [("default-qwen0.5b-bf16-humaneval40-1d0208e", "humaneval"),
                       ("default-qwen0.5b-bf16-mtbench40-1d0208e", "mtbench")]

#: The concurrency run drawn in batch-tree-sizes.png: (run directory, dataset).
BATCH_TREE_RUN = ("concurrency-qwen0.5b-bf16-mtbench16-a6ccb47", "mtbench")

#: Runs with every source alone (and the default mix) on the same prompts: dtype -> directory.
FULL_RUNS = {"float32": "qwen0.5b-fp32-full", "bfloat16": "qwen0.5b-bf16-full"}

#: Methods drawn in the per-prompt figure, where a run has them: name in the run -> (legend label, colour).
SPEEDUP_METHODS = {
    "default": ("default", "#3949ab"),
    "specdraft:suffix": ("suffix tree alone", "#26a69a"),
    "plain": ("our plain decoding", "#757575"),
    "hf-prompt-lookup": ("transformers' prompt lookup", "#ef6c00"),
}

#: Cost curves drawn for docs/cpu-fast-path.md: output name -> run directory.
COST_CURVES = {"cpu-cost-curve-float32.png": "cost-curve-qwen0.5b-fp32",
               "cpu-cost-curve-bfloat16.png": "cost-curve-qwen0.5b-bf16"}

DPI = 200
FONT = {"font.size": 12, "axes.titlesize": 12, "axes.labelsize": 12, "xtick.labelsize": 11,
        "ytick.labelsize": 11, "legend.fontsize": 11, "figure.titlesize": 13}

SOURCES_ALONE = [("specdraft:prompt", "prompt"), ("specdraft:trie", "trie"), ("specdraft:ngram", "ngram"),
                 ("specdraft:jacobi", "jacobi"), ("default", "prompt+trie+ngram"),
                 ("hf-prompt-lookup", "transformers' prompt lookup")]


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


def _render_tables():
    import importlib.util
    import sys

    if "render_tables" not in sys.modules:
        spec = importlib.util.spec_from_file_location("render_tables", ROOT / "scripts" / "render_tables.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["render_tables"] = module
        spec.loader.exec_module(module)
    return sys.modules["render_tables"]


def speedup_panels() -> list[tuple[str, str]]:
    """(run, dataset) per panel: the first screen's measured single-request CPU rows, else the
    latest runs of today's default sources."""
    rt = _render_tables()
    measured = [(s.run, rt.WORKLOADS[s.workload]) for s in rt.FIRST_SCREEN
                if s.run and s.batch == 1 and s.device == "CPU"]
    return measured or LATEST_DEFAULT_RUNS


def _kernels(description: str) -> str:
    m = re.search(r"cpu_kernels='(\w+)'", description)
    return f"kernels: {m.group(1)}" + (" (the default)" if m.group(1) == "auto" else "") if m else "stock kernels"


def plot_speedups(out: Path) -> None:
    import matplotlib.pyplot as plt

    rt = _render_tables()
    panels = speedup_panels()
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 4.9 * rows), sharey=True, squeeze=False)
    for ax, (run, dataset) in zip(axes.flat, panels):
        summary = json.loads((RESULTS / run / "summary.json").read_text())
        methods = summary["datasets"][dataset]["methods"]
        for method, (name, colour) in SPEEDUP_METHODS.items():
            if method not in methods:
                continue
            ratios = per_prompt_speedups(run, dataset, method)
            xs = range(1, len(ratios) + 1)
            ax.plot(xs, ratios, marker="o", markersize=3, linewidth=1.2, color=colour,
                    label=f"{name}: {statistics.median(ratios):.2f}x")
            print(f"{run:45s} {method:18s} n={len(ratios)} median={statistics.median(ratios):.3f} "
                  f"min={ratios[0]:.3f} below 0.95x: {sum(r < 0.95 for r in ratios)}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.95, color="grey", linewidth=0.8, linestyle="--")
        name = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}.get(dataset, dataset)
        ax.set_title(f"{name} {len(ratios)}, {summary['config']['dtype']}, "
                     f"{_kernels(methods['default'].get('description', ''))}\n"
                     f"{run}", fontsize=11)
        ax.set_yscale("log")
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.legend(loc="upper left", title="median", title_fontsize=11)
        ax.set_xlabel("prompt (sorted by speed ratio)")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("speed ratio to model.generate")
    ticks = [0.5, 0.7, 1.0, 1.5, 2, 3, 4]
    axes[0, 0].set_yticks(ticks, [f"{t:g}x" for t in ticks])
    axes[0, 0].minorticks_off()
    cpus = sorted({rt.machine(run)["short"] for run, _ in panels})
    fig.suptitle(f"{rt.MODEL} on {' / '.join(cpus)}, 1 thread, greedy, 128 new tokens;\n"
                 f"default = {rt.default_sources()} (dashed: 0.95x)")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def plot_batch_tree_sizes(out: Path) -> None:
    """Mean tree nodes per request by the requests in the forward: a bar per load that occurred."""
    import matplotlib.pyplot as plt

    run, dataset = BATCH_TREE_RUN
    data = json.loads((RESULTS / run / dataset / "concurrency.json").read_text())
    load: dict[int, list[int]] = {}
    for row in data["rows"]:
        if row["method"] == "default-batched":
            for active, per in row.get("tree_sizes", []):
                load.setdefault(int(active), []).extend(per)
    ks = sorted(k for k, v in load.items() if v)
    means = [statistics.mean(load[k]) for k in ks]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.bar(ks, means, width=0.6, color="#3949ab")
    for k, m in zip(ks, means):
        ax.annotate(f"{m:.1f}", (k, m), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=11)
    ax.set_xticks(range(1, max(ks) + 1))
    ax.set_xlabel("requests in the forward")
    ax.set_ylabel("mean tree nodes per request")
    ax.set_ylim(0, max(means) * 1.18)
    ax.grid(True, axis="y", alpha=0.3)
    cfg = data.get("config", {})
    name = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}.get(dataset, dataset)
    ax.set_title(f"Tree size per request by load, {data['prompts']} {name} prompts, "
                 f"{cfg.get('dtype', '')}\n({run}; no bar: no forward had that many requests)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    print(f"{out.name}: {run} " + " ".join(f"{k}:{m:.1f}" for k, m in zip(ks, means)))


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
                 "(Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF mirror, 40 prompts, 1.0 = plain decoding)")
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
    ax.set_title(f"Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF mirror), {cfg['dtype']}, {cfg['cache_len']}-token cache\n"
                 f"1 thread, {cpu['cpu'].split(',')[0]}, {cpu['isa']} ({run})", fontsize=11)
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
    plot_batch_tree_sizes(args.out / "batch-tree-sizes.png")
    for name, run in COST_CURVES.items():
        plot_cost_curve(run, args.out / name)
    for png in sorted(args.out.glob("*.png")):
        print(f"{png.relative_to(ROOT)}: {png.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
