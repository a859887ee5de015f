"""Render every table of benchmark results in the docs and the README from the results files.

    python scripts/render_tables.py            # rewrite the tables in place
    python scripts/render_tables.py --check    # exit 1 when a page's table is stale

A table lives between two marker comments in a page (invisible on the site and on GitHub)::

    <!-- table:NAME -->
    ...rendered here, never edited by hand...
    <!-- /table -->

``NAME`` is a key of :data:`TABLES`. Each table is drawn from ``summary.json`` (``specdraft
bench``) or ``curve.json`` (``benchmarks/cost_curve.py``) under ``benchmarks/results/`` and
names its run: the machine (from ``benchmarks/results/machines.json``, keyed by the platform
string the run recorded), the date the run started and the commit that added its results.

One statistic throughout: the **median of the per-prompt speed ratios**, with the **worst
prompt** beside it. The median is what a typical request sees and one outlier prompt cannot
move it; the worst prompt shows the downside that a mean hides. (The results files also hold
geomeans; the pages do not quote them.)

The first screen of the README and of the docs' home page is the ``first-screen`` table: one row
per setting a user would run, each drawn from the results folder :data:`FIRST_SCREEN` names for
it. Adding a run is one line there (see its comment); a setting with no run reads "not measured
at" :data:`FIRST_SCREEN_CODE`.

``tests/test_docs_numbers.py`` re-renders every table in memory and fails when a page differs,
and fails when a page states a speed-up (``1.23x``) that neither a table nor a results file of a
run the page names backs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
REPO_URL = "https://github.com/specdraft/specdraft"

#: The pages whose tables are rendered (relative to the repository root).
PAGES = ["README.md", "benchmarks/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]

MARKER = re.compile(r"<!-- table:([\w-]+) -->\n(.*?)<!-- /table -->", re.S)

DATASETS = {"humaneval": "HumanEval", "mtbench": "MT-Bench", "bfcl": "BFCL", "code-edit": "code-edit"}
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
PLD = "hf-prompt-lookup"

#: The model of every run, named once with its quantization (``specdraft/models/mirror.py``: the
#: GGUF file's type is Q4_K_M, dequantized to a plain checkpoint once; the hub weights are not used).
MODEL = "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF mirror)"


# -- reading runs --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def summary(run: str) -> dict:
    return json.loads((RESULTS / run / "summary.json").read_text())


@functools.lru_cache(maxsize=None)
def curve(run: str) -> dict:
    return json.loads((RESULTS / run / "curve.json").read_text())


@functools.lru_cache(maxsize=None)
def machines() -> dict:
    return json.loads((RESULTS / "machines.json").read_text())["machines"]


@functools.lru_cache(maxsize=None)
def added_in() -> dict[str, tuple[str, str]]:
    """Run directory -> (short hash, date) of the commit that first added a file of it."""
    try:
        out = subprocess.run(
            ["git", "log", "--diff-filter=A", "--name-only", "--format=@%h %cs", "--",
             "benchmarks/results"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    found: dict[str, tuple[str, str]] = {}
    commit = ("?", "?")
    for line in out.splitlines():  # newest first: the last hit for a run is its first commit
        if line.startswith("@"):
            h, date = line[1:].split()
            commit = (h, date)
        elif line.startswith("benchmarks/results/"):
            parts = line.split("/")
            if len(parts) > 3:
                found[parts[2]] = commit
    return found


def run_config(run: str) -> dict:
    if (RESULTS / run / "summary.json").exists():
        return summary(run)["config"]
    if (RESULTS / run / "host.json").exists():
        return host(run)["config"]
    return curve(run)["config"]


@functools.lru_cache(maxsize=None)
def host(run: str) -> dict:
    return json.loads((RESULTS / run / "host.json").read_text())


def machine(run: str) -> dict:
    """``short``, ``cpu`` and ``isa`` of a run's machine: from ``machines.json`` (by the platform
    string the run recorded) or else from the ``cpu`` field newer runs record."""
    cfg = run_config(run)
    known = machines().get(cfg["platform"])
    # (a platform string names the kernel, not the CPU: where the run recorded another CPU than
    # the one machines.json lists for it, the recorded one is the machine)
    if known is not None and ("cpu" not in cfg or cfg["cpu"]["model"].split()[0] in known["cpu"]):
        return known
    if "cpu" not in cfg:
        raise KeyError(f"{run}: no CPU recorded for platform {cfg['platform']!r}; "
                       "add it to benchmarks/results/machines.json")
    cpu = cfg["cpu"]
    flags = cpu.get("flags", [])
    isa = ("AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags
           else "no AVX2") + (" with AVX512-BF16" if "avx512_bf16" in flags else "") + (
        " and AMX-BF16" if "amx_bf16" in flags else "")
    return {"short": f"{cpu['model']}, {isa.split(',')[0]}", "isa": isa,
            "cpu": f"{cpu['model']}, {cpu.get('cpus', '?')} logical CPUs"}


def run_ref(run: str, page: str) -> str:
    """``[run](link)`` (started DATE, results committed in COMMIT)."""
    cfg = run_config(run)
    commit, added = added_in().get(run, ("?", "?"))
    started = cfg.get("started", "")[:10] or added
    return f"[`{run}`]({link(run, page)}) ({started}, results committed in `{commit}`)"


def runs_note(runs: list[str], page: str) -> str:
    """The runs of a table, grouped by machine: CPU, instruction set, threads."""
    groups: dict[tuple, list[str]] = {}
    for run in runs:
        m = machine(run)
        threads = run_config(run).get("threads", 1)
        key = (m["cpu"], m["isa"], f"{threads} thread{'s' if threads != 1 else ''}")
        groups.setdefault(key, []).append(run)
    lines = []
    for (cpu, isa, threads), rs in groups.items():
        lines.append(f"{'Run' if len(rs) == 1 else 'Runs'} on {cpu}, {isa}, {threads}: "
                     + ", ".join(run_ref(r, page) for r in rs) + ".")
    return "  \n".join(lines)


def link(run: str, page: str) -> str:
    if page.startswith("docs/"):
        return f"{REPO_URL}/tree/main/benchmarks/results/{run}"
    if page.startswith("benchmarks/"):
        return f"results/{run}"
    return f"benchmarks/results/{run}"


def ratios(run: str, dataset: str, method: str, against: str = "baseline") -> list[float]:
    """Per-prompt speed ratios of ``method`` to ``against`` (the bench's own per-prompt ratio
    to ``model.generate``, divided by ``against``'s)."""
    out = []
    for row in summary(run)["datasets"][dataset]["per_prompt"]:
        ms = row["methods"]
        if method in ms and against in ms:
            out.append(ms[method]["speedup"] / ms[against]["speedup"])
    return out


def x(value: float) -> str:
    return f"{value:.2f}x"


def med_worst(values: list[float]) -> str:
    return f"{x(statistics.median(values))} ({x(min(values))})"


# -- table layouts -------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    label: str
    run: str
    dataset: str
    method: str = "default"
    kernels: str = "stock"


def compare_table(rows: list[Row], page: str, *, workload: str = "workload",
                  show_pld: bool = True, show_below: bool = False) -> str:
    """One row per (run, method): speed-up against ``model.generate`` and transformers' prompt
    lookup, tokens per step, identical outputs; the runs named below."""
    runs: list[str] = []
    for r in rows:
        if r.run not in runs:
            runs.append(r.run)
    keys: dict[str, str] = {}
    for run in runs:
        cpu = machine(run)["short"]
        keys.setdefault(cpu, cpu)
    many = len({machine(run)["short"] for run in runs}) > 1
    head = [workload, "dtype, kernels, CPU" if many else "dtype, kernels", "vs `generate`"]
    if show_pld:
        head.append("vs HF prompt lookup")
    if show_below:
        head.append("prompts below 0.95x")
    head += ["tokens / step", "identical"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        data = summary(r.run)["datasets"][r.dataset]
        m = data["methods"][r.method]
        dtype = DTYPES[summary(r.run)["config"]["dtype"]]
        cells = [r.label, f"{dtype}, {r.kernels}" + (f", {machine(r.run)['short']}" if many else "")]
        vs_base = ratios(r.run, r.dataset, r.method)
        cells.append(med_worst(vs_base))
        if show_pld:
            cells.append("" if r.method == PLD else med_worst(ratios(r.run, r.dataset, r.method, PLD))
                         if PLD in data["methods"] else "not run")
        if show_below:
            cells.append(f"{sum(v < 0.95 for v in vs_base)} of {len(vs_base)}")
        cells.append(f"{m['mean_accepted']:.2f}")
        cells.append(f"{m['identical']}/{m['compared']}")
        lines.append("| " + " | ".join(cells) + " |")
    note = (f"{MODEL}, greedy, 128 new tokens. Speed-up against "
            + ("`model.generate` and against transformers' prompt lookup (HF)" if show_pld
               else "`model.generate`") + ": median of the "
            "per-prompt ratios, worst prompt in parentheses. Kernels: auto = the default, the cheapest "
            "measured path per forward width (`cpu_kernels=\"auto\"`); stock = PyTorch's own "
            "(`cpu_kernels=\"stock\"`); FBGEMM = `cpu_kernels=\"fbgemm\"`.  \n" + runs_note(runs, page))
    return "\n".join(lines) + "\n\n" + note + "\n"


def methods_table(run: str, datasets: list[str], methods: list[tuple[str, str]], page: str) -> str:
    """Methods down, datasets across: median (worst) against ``model.generate``, tokens per step,
    identical outputs."""
    dtype = DTYPES[summary(run)["config"]["dtype"]]
    head = ["method"] + [f"{DATASETS[d]}, {summary(run)['datasets'][d]['prompts']} prompts, {dtype}"
                         for d in datasets]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * len(datasets)]
    for method, label in methods:
        cells = [label]
        for d in datasets:
            data = summary(run)["datasets"][d]
            m = data["methods"][method]
            cells.append(f"{med_worst(ratios(run, d, method))}; {m['mean_accepted']:.2f} per step;"
                         f" {m['identical']}/{m['compared']} identical")
        lines.append("| " + " | ".join(cells) + " |")
    dtype = summary(run)["config"]["dtype"]
    note = (f"{MODEL}, {dtype}, greedy, 128 new tokens. Speed-up against `model.generate`: median of the "
            f"per-prompt ratios, worst prompt in parentheses.  \n{runs_note([run], page)}")
    return "\n".join(lines) + "\n\n" + note + "\n"


def mix_table(run: str, dataset: str, methods: list[tuple[str, str]], page: str) -> str:
    """Source mixes against their members on one prompt set: tokens per step, then the speed-up
    against ``model.generate`` (median, worst prompt), identical outputs."""
    data = summary(run)["datasets"][dataset]
    cfg = summary(run)["config"]
    lines = ["| sources | vs `generate` | tokens / step | identical |",
             "|---|---:|---:|---:|"]
    for method, label in methods:
        m = data["methods"][method]
        lines.append(f"| {label} | {med_worst(ratios(run, dataset, method))} | {m['mean_accepted']:.2f} "
                     f"| {m['identical']}/{m['compared']} |")
    note = (f"{data['prompts']} {DATASETS.get(dataset, dataset)} prompts, {MODEL}, "
            f"{DTYPES.get(cfg['dtype'], cfg['dtype'])}, greedy, 128 new tokens, default kernels, every method in one "
            f"process, interleaved per prompt. Speed-up against `model.generate`: median of the per-prompt ratios, "
            f"worst prompt in parentheses.  \n{runs_note([run], page)}")
    return "\n".join(lines) + "\n\n" + note + "\n"


def replay_table(run: str, configs: list[tuple[str, str]], page: str) -> str:
    """``benchmarks/budget_replay.py replay`` outputs of one folder (``<config>.json``): per
    configuration and prompt set, the simulated speed-up over plain decoding on the same kernels
    (median, worst prompt) and the tokens per step."""
    reports = {stem: json.loads((RESULTS / run / f"{stem}.json").read_text()) for stem, _ in configs}
    sets = list(next(iter(reports.values()))["datasets"])
    names = {"humaneval": "HumanEval 40", "mtbench": "MT-Bench 40", "code-edit": "code edits 12"}
    lines = ["| budget, sources | " + " | ".join(names.get(d, d) for d in sets) + " |",
             "|---|" + "---:|" * len(sets)]
    for stem, label in configs:
        cells = []
        for d in sets:
            sm = reports[stem]["datasets"][d]["summary"]
            cells.append(f"{x(sm['median'])} ({x(sm['min'])}), {sm['mean_accepted']:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    note = ("Replayed greedy outputs of the bfloat16 runs (`benchmarks/budget_replay.py`: the real decoder, "
            "sources and budget; a simulated clock priced by the forward costs of `cpu_kernels=\"auto\"` "
            "measured on the AMD EPYC Zen 5, in the file the row names). Each cell: median of the "
            "per-prompt speed-ups over plain decoding on the same kernels (worst prompt), then tokens per "
            f"step. Recordings, cost tables and outputs: [`{run}`]({link(run, page)}).")
    return "\n".join(lines) + "\n\n" + note + "\n"


def cost_table(run: str, paths: list[str], page: str, ks: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 32)) -> str:
    """Rows: tree width k; columns: ms per forward of each kernel path (and its ratio to its own
    one-token forward)."""
    data = curve(run)
    by = {(r["path"], r["k"]): r for r in data["rows"]}
    ks = tuple(k for k in ks if any((p, k) in by for p in paths))
    head = ["new tokens k"] + [f"{p}, ms (vs k=1)" for p in paths]
    lines = ["| " + " | ".join(head) + " |", "|---:|" + "---:|" * len(paths)]
    for k in ks:
        cells = [str(k)]
        for p in paths:
            r = by.get((p, k))
            cells.append("-" if r is None else f"{r['median_ms']:.0f} ({r['vs_own_k1']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    cfg = data["config"]
    note = (f"{cfg['dtype']}, {cfg['cache_len']}-token cache, median of {cfg['repeats']} "
            f"interleaved repeats.  \n{runs_note([run], page)}")
    return "\n".join(lines) + "\n\n" + note + "\n"


# -- the tables ----------------------------------------------------------------------------------

BF16_HE, BF16_MT = "qwen0.5b-bf16-356a2f7", "qwen0.5b-bf16-5f467ae"
FP32_HE, FP32_MT = "qwen0.5b-fp32-356a2f7", "qwen0.5b-fp32-14301f2"
FB_HE, FB_MT = "tr40-fbgemm-qwen0.5b-bf16-humaneval", "tr40-fbgemm-qwen0.5b-bf16-mtbench"
BFCL_BF16, BFCL_FP32 = "suffix-qwen0.5b-bf16-bfcl", "suffix-qwen0.5b-fp32-bfcl"

#: the defaults, no flags (``cpu_kernels="auto"``)
AUTO_BF16_HE = "auto-qwen0.5b-bf16-humaneval40-e46254a"
AUTO_FP32_HE = "auto-qwen0.5b-fp32-humaneval40-e46254a"
AUTO_BF16_MT = "auto-qwen0.5b-bf16-mtbench40-00df85b"
#: The default of 2026-11-26 (prompt+trie+ngram+suffix, acceptance averages 0.3), no flags.
NEW_BF16_HE = "default-qwen0.5b-bf16-humaneval40-1d0208e"
NEW_BF16_MT = "default-qwen0.5b-bf16-mtbench40-1d0208e"
FULL = {"fp32": "qwen0.5b-fp32-full", "bf16": "qwen0.5b-bf16-full"}
ALONE = [("specdraft:prompt", "`prompt` alone"), ("specdraft:trie", "`trie` alone"),
         ("specdraft:ngram", "`ngram` alone"), ("specdraft:jacobi", "`jacobi` alone"),
         ("default", "`prompt+trie+ngram` (then the default)"), (PLD, "transformers' prompt lookup")]
FBGEMM_METHODS = [("plain@fbgemm", "our plain decoding, FBGEMM"), ("default", "`prompt+trie+ngram`, stock kernels"),
                  ("default@fbgemm", "`prompt+trie+ngram`, FBGEMM"),
                  ("specdraft:recycle@fbgemm", "Token Recycling alone, FBGEMM"),
                  ("specdraft:prompt+trie+ngram+recycle@fbgemm", "`prompt+trie+ngram+recycle`, FBGEMM")]
BFCL_METHODS = [("specdraft:suffix", "`suffix`"), ("specdraft:arctic-suffix", "`arctic-suffix`"),
                ("specdraft:trie", "`trie`"), ("default", "`prompt+trie+ngram`"),
                ("specdraft:prompt+trie+ngram+suffix", "`prompt+trie+ngram+suffix` (today's default)")]
TR40_METHODS = [("default", "`prompt+trie+ngram`"), ("specdraft:recycle", "`recycle` alone"),
                ("specdraft:prompt+trie+ngram+recycle", "`prompt+trie+ngram+recycle`")]

JACOBI_METHODS = [("specdraft:jacobi", "`jacobi`, adaptive budget"),
                  ("specdraft:jacobi@fixed", "`jacobi`, fixed 32 nodes"),
                  ("specdraft:jacobi[window=2]@fixed", "`jacobi[window=2]`, fixed"),
                  ("specdraft:jacobi[window=3]@fixed", "`jacobi[window=3]`, fixed"),
                  ("specdraft:prompt+trie", "`prompt+trie`"),
                  ("specdraft:prompt+trie+jacobi", "`prompt+trie+jacobi`")]

def host_table(run: str, page: str) -> str:
    """Host work per step with a near-free forward (``benchmarks/host_overhead.py``), before and
    after, by context and tree size; then syncs and uploads per step by scenario."""
    data = host(run)
    lines = ["| context | tree nodes | host ms / step | first token: ms added | first draft (ms) |",
             "|---:|---:|---:|---:|---:|"]
    for cell in data["cells"]:
        b, a = cell["before"], cell["after"]
        lines.append(f"| {cell['context']:,} | {cell['nodes']} | {b['host_ms_per_step']:.2f} → "
                     f"**{a['host_ms_per_step']:.2f}** | {b['first_token_added_ms']:.0f} → "
                     f"**{a['first_token_added_ms']:.1f}** | {a['first_draft_ms']:.0f} |")
    syncs_b, syncs_a = data["syncs"]["before"], data["syncs"]["after"]
    if syncs_a:
        lines += ["", "| scenario (1k context, 32 nodes) | device reads / step | uploads / step |",
                  "|---|---:|---:|"]
        for name, after in syncs_a.items():
            before = syncs_b.get(name, {})
            was = ("fails" if "error" in before else f"{before['syncs_per_step']:.2f}") if before else "?"
            was_up = ("" if "error" in before else f"{before['uploads_per_step']:.2f} → ") if before else ""
            lines.append(f"| {name} | {was} → **{after['syncs_per_step']:.2f}** | "
                         f"{was_up}**{after['uploads_per_step']:.2f}** |")
    cfg = data["config"]
    return ("\n".join(lines) + "\n\n" + runs_note([run], page)
            + f" Before: commit `{cfg.get('commit_before', '?')}`; after: commit `{cfg.get('commit', '?')}`.\n")


def concurrency(run: str, dataset: str) -> dict:
    return json.loads((RESULTS / run / dataset / "concurrency.json").read_text())


def sequential_rate(rows: list[dict]) -> float:
    """Sequential ``model.generate``'s tokens/s over every level together: it does the same work at
    every level (one request after another), so one rate is the baseline of all of them."""
    seq = [r for r in rows if r["method"] == "generate"]
    return sum(r["tokens"] for r in seq) / sum(r["seconds"] for r in seq)


def tokens_per_step(row: dict) -> float | None:
    """New tokens per request per forward of a batched row (1.00 = plain decoding)."""
    steps = sum(int(active) for active, _ in row.get("tree_sizes", []))
    return row["tokens"] / steps if steps else None


CONCURRENCY_NAMES = {"generate": "sequential `generate`", "hf-batched": "batched `generate` (left padding)",
                     "plain-batched": "ours, batched plain", "default-batched": "**ours, batched default**",
                     "default-alone": "ours, one request at a time"}


def concurrency_table(run: str, dataset: str, page: str) -> str:
    """``specdraft bench --concurrency``: per level and method, tokens/s and its ratio to
    sequential ``model.generate`` (one rate over all levels), per-request latency, rows per forward,
    tree nodes per request, identical outputs; then the mean tree per request by the requests in
    the forward."""
    data = concurrency(run, dataset)
    base = sequential_rate(data["rows"])
    seq = [r["tokens_per_s"] for r in data["rows"] if r["method"] == "generate"]
    lines = ["| N | method | tokens/s | vs sequential | latency median / p90 (s) | rows / forward "
             "| tree nodes / request | identical |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        rows = f"{r['rows_per_forward']:.1f}" if "rows_per_forward" in r else ""
        tree = f"{r['tree_nodes_per_request']:.1f}" if "tree_nodes_per_request" in r else ""
        lines.append(f"| {r['concurrency']} | {CONCURRENCY_NAMES.get(r['method'], r['method'])} "
                     f"| {r['tokens_per_s']:.1f} | {x(r['tokens_per_s'] / base)} "
                     f"| {r['latency_median']:.1f} / {r['latency_p90']:.1f} | {rows} | {tree} "
                     f"| {r['identical']}/{r['requests']} |")
    load: dict[int, list[int]] = {}
    for r in data["rows"]:
        if r["method"] == "default-batched":
            for active, per in r.get("tree_sizes", []):
                load.setdefault(int(active), []).extend(per)
    split = " · ".join(f"{k}: {statistics.mean(v):.1f}" for k, v in sorted(load.items()) if v)
    cfg = run_config(run)
    note = (f"{data['prompts']} {DATASETS.get(dataset, dataset)} prompts, {MODEL}, {data['max_new_tokens']} new "
            f"tokens, greedy, {DTYPES.get(cfg['dtype'], cfg['dtype'])}, kernels: {data['kernels']}. "
            f"vs sequential: against sequential `generate` over all levels together, {base:.1f} tokens/s (it "
            f"ran {min(seq):.1f} to {max(seq):.1f} tokens/s at single levels: the machine's noise). Tree nodes "
            f"per request by requests in the forward (ours, batched default): {split}.  \n" + runs_note([run], page))
    return "\n".join(lines) + "\n\n" + note + "\n"


# -- the first screen ----------------------------------------------------------------------------

#: The commit whose code the first screen describes. A row whose run measured another commit says
#: so in its label; a setting with no run reads "not measured at" this commit. Set it to the
#: commit you measured when you add the runs below.
FIRST_SCREEN_CODE = "552a27e"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the first screen: a setting a user would run, on one prompt set."""

    device: str  #: "CPU" or "GPU"
    dtype: str  #: "float32" or "bfloat16": the run must have this dtype
    workload: str  #: "code" (HumanEval) or "chat" (MT-Bench)
    run: str | None  #: folder under benchmarks/results/ (or a subfolder); None: not measured yet
    batch: int = 1  #: requests at once; above 1 the run is a ``specdraft bench --concurrency`` output
    #: what sets the row apart from another of its device and dtype (a CPU without AVX-512: other
    #: kernels, so other speed-ups); empty for the usual machine
    variant: str = ""

    @property
    def name(self) -> str:
        """``CPU bfloat16``, ``CPU bfloat16 (AVX2)``, ``CPU bfloat16 ×8``: the row's setting in words."""
        return (f"{self.device} {self.dtype}" + (f" ({self.variant})" if self.variant else "")
                + (f" ×{self.batch}" if self.batch > 1 else ""))


#: The first screen, setting by setting: what a user gets on the default settings. To add a run,
#: put its folder in place of ``None`` (one line). The folder name ends in the commit measured
#: (``...-<commit>``; ``benchmarks/gpu_run.sh`` names its folders so: ``gpu-<gpu>-<date>-<commit>``).
#: Single rows need a ``specdraft bench`` output with the methods ``baseline`` and ``default``, and
#: ``plain`` and ``hf-prompt-lookup`` for the split line and the prompt-lookup column (the commands:
#: docs/results.md#measuring-the-first-screen); batched rows a ``--concurrency`` output with level 8.
FIRST_SCREEN = [
    Setting("CPU", "float32", "code", "first-screen-qwen0.5b-fp32-humaneval5-mtbench5-96def57"),
    Setting("CPU", "float32", "chat", "first-screen-qwen0.5b-fp32-humaneval5-mtbench5-96def57"),
    Setting("CPU", "float32", "code", "first-screen-avx2-qwen0.5b-fp32-humaneval5-mtbench5-2b105ca", variant="AVX2"),
    Setting("CPU", "float32", "chat", "first-screen-avx2-qwen0.5b-fp32-humaneval5-mtbench5-2b105ca", variant="AVX2"),
    Setting("CPU", "bfloat16", "code", "first-screen-qwen0.5b-bf16-humaneval5-mtbench5-552a27e"),
    Setting("CPU", "bfloat16", "chat", "first-screen-qwen0.5b-bf16-humaneval5-mtbench5-552a27e"),
    Setting("CPU", "bfloat16", "code", "first-screen-avx2-qwen0.5b-bf16-humaneval5-mtbench5-22ecf8e", variant="AVX2"),
    Setting("CPU", "bfloat16", "chat", "first-screen-avx2-qwen0.5b-bf16-humaneval5-mtbench5-22ecf8e", variant="AVX2"),
    Setting("CPU", "bfloat16", "code", "first-screen-xeon-amx-qwen0.5b-bf16-humaneval5-mtbench5-f4932f3", variant="AMX"),
    Setting("CPU", "bfloat16", "chat", "first-screen-xeon-amx-qwen0.5b-bf16-humaneval5-mtbench5-f4932f3", variant="AMX"),
    Setting("GPU", "bfloat16", "code", "gpu-h200-2026-11-28-27af751/main"),
    Setting("GPU", "bfloat16", "chat", "gpu-h200-2026-11-28-27af751/main"),
    Setting("CPU", "bfloat16", "code", "concurrency-qwen0.5b-bf16-humaneval8-552a27e", batch=8),
    Setting("GPU", "bfloat16", "code", "gpu-h200-2026-11-28-27af751/batch", batch=8),
]

WORKLOADS = {"code": "humaneval", "chat": "mtbench"}
NBSP = "\u00a0"
#: GPU names as ``benchmarks/gpu_run.sh`` writes them in its folder names.
GPUS = {"h100": "NVIDIA H100", "h200": "NVIDIA H200", "a100": "NVIDIA A100", "l4": "NVIDIA L4"}
_COMMIT_SUFFIX = re.compile(r"-([0-9a-f]{7,40})$")


def run_commit(run: str) -> str:
    """The commit a run measured: the end of its folder name (``...-<commit>``)."""
    m = _COMMIT_SUFFIX.search(run.split("/")[0])
    if not m:
        raise ValueError(f"{run}: a first-screen run's folder name must end in the commit it measured "
                         "(...-<commit>)")
    return m.group(1)[:7]


def run_on_gpu(run: str) -> bool:
    argv = run_config(run).get("argv", [])
    return any(a.startswith("cuda") for a in argv) or run.startswith("gpu-")


def device_name(run: str) -> str:
    """The GPU (from the folder name gpu_run.sh gives it) or the CPU (machines.json / the run's record)."""
    if run_on_gpu(run):
        m = re.match(r"gpu-([a-z0-9]+)-", run)
        return GPUS.get(m.group(1), m.group(1).upper()) if m else "a CUDA GPU"
    m = machine(run)
    return f"{m['cpu']}, {m['isa']}"


@functools.lru_cache(maxsize=None)
def default_sources(device: str = "CPU") -> str:
    """The default sources on ``device`` ("CPU" or "GPU"): ``DEFAULT_SOURCES`` or
    ``GPU_DEFAULT_SOURCES`` of ``specdraft/sources/registry.py``, read without importing the package."""
    import ast

    name = "GPU_DEFAULT_SOURCES" if device == "GPU" else "DEFAULT_SOURCES"
    tree = ast.parse((ROOT / "specdraft" / "sources" / "registry.py").read_text())
    for node in ast.walk(tree):
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == name:
            return "+".join(ast.literal_eval(node.value))
    raise LookupError(f"{name} not found in specdraft/sources/registry.py")


def _check_setting(s: Setting) -> None:
    cfg = run_config(s.run)
    if cfg["dtype"] != s.dtype:
        raise ValueError(f"{s.run}: ran {cfg['dtype']}, the first screen's row wants {s.dtype}")
    if run_on_gpu(s.run) != (s.device == "GPU"):
        raise ValueError(f"{s.run}: the row is a {s.device} row, the run is not")
    # a row measured at another commit says so in its label (other_commits), and ran that commit's default
    if s.batch == 1 and run_commit(s.run) == FIRST_SCREEN_CODE:
        methods = summary(s.run)["datasets"][WORKLOADS[s.workload]]["methods"]
        described = methods["default"].get("description", "")
        if f"sources {default_sources(s.device)}" not in described:
            raise ValueError(f"{s.run}: its 'default' is not today's default ({default_sources(s.device)}): {described}")


def setting_label(s: Setting) -> str:
    """``**CPU bfloat16** · code``; ``**CPU bfloat16 ×8** · code`` for eight requests at once;
    ``**CPU bfloat16 (AVX2)** · code`` for a variant."""
    return f"**{s.name}** · {s.workload}"


def other_commits(rows: list[Setting]) -> str:
    """``Measured at `abc1234`: GPU bfloat16 code, chat.`` for rows whose run measured another
    commit than :data:`FIRST_SCREEN_CODE` (empty when there are none)."""
    by: dict[str, list[str]] = {}
    for s in rows:
        if s.run and run_commit(s.run) != FIRST_SCREEN_CODE:
            by.setdefault(run_commit(s.run), []).append(
                f"{s.name} {s.workload}")
    return " ".join(f"Measured at `{c}`, not `{FIRST_SCREEN_CODE}`: {', '.join(r)}." for c, r in by.items())


def _batched_row(s: Setting) -> dict[str, dict]:
    rows = {r["method"]: r for r in concurrency(s.run, WORKLOADS[s.workload])["rows"]
            if r["concurrency"] == s.batch}
    missing = {"hf-batched", "default-batched"} - set(rows)
    if missing:
        raise ValueError(f"{s.run}: no {', '.join(sorted(missing))} at concurrency {s.batch}")
    return rows


def how_link(page: str) -> str:
    if page.startswith("docs/"):
        depth = page.count("/") - 1
        return "../" * depth + "results.md#measuring-the-first-screen"
    return "docs/results.md#measuring-the-first-screen"


def first_screen_cells(s: Setting, page: str) -> list[str]:
    """vs generate, vs prompt lookup, tokens per step, identical."""
    if s.run is None:
        return [f"not measured at `{FIRST_SCREEN_CODE}`", "", "", ""]
    _check_setting(s)
    if s.batch > 1:
        rows = _batched_row(s)
        ours, hf = rows["default-batched"], rows["hf-batched"]
        steps = tokens_per_step(ours)
        return [x(ours['tokens_per_s'] / hf['tokens_per_s']),
                "one request at a time only", f"{steps:.2f}" if steps else "",
                f"{ours['identical']}/{ours['requests']}"]
    dataset = WORKLOADS[s.workload]
    data = summary(s.run)["datasets"][dataset]
    m = data["methods"]["default"]
    pld = med_worst(ratios(s.run, dataset, "default", PLD)) if PLD in data["methods"] else "not run"
    identical = f"{m['identical']}/{m['compared']}"
    if s.dtype != "float32" and "identical_to_plain" in m:
        identical += f" ({m['identical_to_plain']}/{m['compared']} to our plain)"
    return [med_worst(ratios(s.run, dataset, "default")), pld, f"{m['mean_accepted']:.2f}", identical]


def split_line(rows: list[Setting]) -> str:
    """How much of each measured setting's gain is kernels and how much is drafts."""
    parts = []
    for name in dict.fromkeys(s.name for s in rows if s.batch == 1):
        cells = []
        for s in rows:
            if s.name != name or s.run is None:
                continue
            methods = summary(s.run)["datasets"][WORKLOADS[s.workload]]["methods"]
            if "plain" not in methods:
                continue
            dataset = WORKLOADS[s.workload]
            kernels = statistics.median(ratios(s.run, dataset, "plain"))
            drafts = statistics.median(ratios(s.run, dataset, "default", "plain"))
            cells.append(f"{s.workload} {x(kernels)} × {x(drafts)}")
        parts.append(f"{name}: " + ("; ".join(cells) if cells else "not measured"))
    if not any(s.run for s in rows if s.batch == 1):
        return f"**Kernels × drafts**: not measured at `{FIRST_SCREEN_CODE}`."
    return ("**Kernels × drafts** (median per prompt: our plain decoding against `generate`, times the "
            "default against our plain decoding on the same kernels): " + ". ".join(parts) + ".")


def first_screen_table(page: str) -> str:
    head = ["setting", "vs `generate`", "vs transformers' prompt lookup", "tokens / step", "identical"]
    lines = ["| " + " | ".join(h.replace(" ", NBSP) for h in head) + " |", "|---|---:|---:|---:|---:|"]
    for s in FIRST_SCREEN:
        # no-break spaces: a narrow screen scrolls the table sideways instead of breaking a cell
        # over four lines (the key columns come first)
        cells = [c.replace(" ", NBSP) for c in (setting_label(s), *first_screen_cells(s, page))]
        lines.append("| " + " | ".join(cells) + " |")
    measured = [s for s in FIRST_SCREEN if s.run]
    devices: dict[str, list[str]] = {}
    prompts: dict[str, set[int]] = {}
    for s in measured:
        where = device_name(s.run)
        if s.device == "CPU":
            threads = run_config(s.run).get("threads", 1)
            where += f", {threads} thread{'s' * (threads != 1)}"
        devices.setdefault(s.device, [])
        if where not in devices[s.device]:
            devices[s.device].append(where)
        if s.batch == 1:
            prompts.setdefault(s.device, set()).add(
                summary(s.run)["datasets"][WORKLOADS[s.workload]]["prompts"])
    counts = ", ".join(f"{'/'.join(map(str, sorted(n)))} prompts each on the {d}" for d, n in prompts.items())
    batch = max(s.batch for s in FIRST_SCREEN)
    tokens = {s: (concurrency(s.run, WORKLOADS[s.workload]) if s.batch > 1 else
                  summary(s.run)["datasets"][WORKLOADS[s.workload]])["max_new_tokens"] for s in measured}
    usual = statistics.mode(tokens.values()) if tokens else 128
    odd = ", ".join(f"{n} in {s.name} {s.workload}" for s, n in tokens.items() if n != usual)
    caption = (f"{MODEL}, default settings, greedy, {usual} new tokens" + (f" ({odd})" if odd else "")
               + "; code = HumanEval, chat = MT-Bench"
               + (f", {counts}" if counts else "")
               + f"; median per prompt (worst prompt); ×{batch} = {batch} requests at once, tokens/s "
               "against transformers' batched `generate`. "
               + ("; ".join(f"{d}: {' / '.join(w)}" for d, w in devices.items()) + "." if devices else
                  "The CPU and GPU are named here once measured.")
               + (" " + other_commits(FIRST_SCREEN) if other_commits(FIRST_SCREEN) else ""))
    provenance = (f"[Where each number comes from]({how_link(page).split('#')[0]}#the-first-screen)"
                  + (f" · [how to measure a missing row]({how_link(page)})" if len(measured) < len(FIRST_SCREEN)
                     else ""))
    return "\n".join(lines) + "\n\n" + caption + "\n\n" + split_line(FIRST_SCREEN) + "\n\n" + provenance + "\n"


def first_screen_runs_table(page: str) -> str:
    """Provenance of the first screen: per row, the run, its date, commit and machine."""
    lines = ["| setting | run | started | commit | machine |", "|---|---|---|---|---|"]
    for s in FIRST_SCREEN:
        if s.run is None:
            lines.append(f"| {setting_label(s)} | not measured at `{FIRST_SCREEN_CODE}` | | | |")
            continue
        cfg = run_config(s.run)
        threads = cfg.get("threads", 1)
        where = device_name(s.run) + ("" if run_on_gpu(s.run) else f", {threads} thread{'s' * (threads != 1)}")
        lines.append(f"| {setting_label(s)} | [`{s.run}`]({link(s.run, page)}) | {cfg.get('started', '')[:10]} "
                     f"| `{run_commit(s.run)}` | {where} |")
    return "\n".join(lines) + "\n"


#: The source mixes of the merge-by-value runs, each with its members.
MIX_METHODS = [("specdraft:suffix", "`suffix` alone"), ("specdraft:recycle", "`recycle` alone"),
               ("default", "`prompt+trie+ngram` (the default until 2026-11-26)"),
               ("specdraft:prompt+trie+ngram+recycle", "`prompt+trie+ngram+recycle`"),
               ("specdraft:prompt+trie+ngram+suffix", "`prompt+trie+ngram+suffix`"),
               ("specdraft:prompt+trie+ngram+suffix+recycle", "`prompt+trie+ngram+suffix+recycle`")]


#: The runs of the default of 2026-11-26 against its best member and the earlier sources.
NEW_DEFAULT_METHODS = [("default", "**`prompt+trie+ngram+suffix` (the default)**"),
                       ("specdraft:suffix", "`suffix` alone"), ("specdraft:prompt+trie+ngram", "`prompt+trie+ngram`")]

#: The budget replays behind the default of 2026-11-26: (output file stem, label).
REPLAY_CONFIGS = [
    ("old-default-bf16", "earlier default: `prompt+trie+ngram`, acceptance averages 0.5, bf16 costs"),
    ("new-default-bf16", "**default: `prompt+trie+ngram+suffix`, 0.3**, bf16 costs"),
    ("old-sources-new-smoothing-bf16", "`prompt+trie+ngram`, 0.3, bf16 costs"),
    ("new-sources-old-smoothing-bf16", "`prompt+trie+ngram+suffix`, 0.5, bf16 costs"),
    ("suffix-bf16", "`suffix` alone, 0.3, bf16 costs"),
    ("prompt-bf16", "`prompt` alone, 0.3, bf16 costs"),
    ("new-default-fixed4-bf16", "`prompt+trie+ngram+suffix`, fixed 4 nodes, bf16 costs"),
    ("suffix-fixed4-bf16", "`suffix` alone, fixed 4 nodes, bf16 costs"),
    ("old-default-fp32", "earlier default, 0.5, fp32 costs"),
    ("new-default-fp32", "**default, 0.3**, fp32 costs"),
    ("suffix-fp32", "`suffix` alone, 0.3, fp32 costs"),
]


TABLES: dict[str, Callable[[str], str]] = {
    "first-screen": first_screen_table,
    "first-screen-runs": first_screen_runs_table,
    "host-overhead": lambda page: host_table("host-overhead", page),
    "jacobi-grid": lambda page: methods_table(
        "qwen0.5b-bf16-jacobi-grid", ["humaneval"], JACOBI_METHODS, page),
    "mix-bfcl-bf16": lambda page: mix_table("mix-qwen0.5b-bf16-bfcl20-137f2df", "bfcl",
                                            [MIX_METHODS[0], MIX_METHODS[2], MIX_METHODS[4]], page),
    "mix-mt-bf16": lambda page: mix_table("mix-qwen0.5b-bf16-mtbench40-d8c1f6f", "mtbench", MIX_METHODS, page),
    "mix-he-bf16": lambda page: mix_table("mix-qwen0.5b-bf16-humaneval40-f3b9e82", "humaneval", MIX_METHODS, page),
    "mix-code-edit-bf16": lambda page: mix_table(
        "mix-qwen0.5b-bf16-code-edit12-f3b9e82", "code-edit",
        [("specdraft:prompt", "`prompt` alone"), MIX_METHODS[0], MIX_METHODS[2], MIX_METHODS[4], MIX_METHODS[5]],
        page),
    "default-he-bf16": lambda page: mix_table(NEW_BF16_HE, "humaneval", NEW_DEFAULT_METHODS, page),
    "default-mt-bf16": lambda page: mix_table(NEW_BF16_MT, "mtbench", NEW_DEFAULT_METHODS, page),
    "merge-replay": lambda page: replay_table("merge-replay-bf16-2026-11-26", REPLAY_CONFIGS, page),
    "concurrency-he-fp32": lambda page: concurrency_table("concurrency-qwen0.5b-fp32-humaneval8-a154cfe",
                                                          "humaneval", page),
    "concurrency-he-bf16": lambda page: concurrency_table("concurrency-qwen0.5b-bf16-humaneval16-fe7ce41",
                                                          "humaneval", page),
    "concurrency-mt-bf16": lambda page: concurrency_table("concurrency-qwen0.5b-bf16-mtbench16-a6ccb47", "mtbench",
                                                          page),
    "auto-defaults": lambda page: compare_table([
        Row("HumanEval: **default**", NEW_BF16_HE, "humaneval", kernels="auto"),
        Row("HumanEval: `suffix` alone", NEW_BF16_HE, "humaneval", "specdraft:suffix", kernels="auto"),
        Row("HumanEval: `prompt+trie+ngram`", AUTO_BF16_HE, "humaneval", kernels="auto"),
        Row("HumanEval: `prompt+trie+ngram`", AUTO_FP32_HE, "humaneval", kernels="auto"),
        Row("MT-Bench: **default**", NEW_BF16_MT, "mtbench", kernels="auto"),
        Row("MT-Bench: `suffix` alone", NEW_BF16_MT, "mtbench", "specdraft:suffix", kernels="auto"),
        Row("MT-Bench: `prompt+trie+ngram`", AUTO_BF16_MT, "mtbench", kernels="auto"),
        Row("MT-Bench: our plain decoding", AUTO_BF16_MT, "mtbench", "plain", kernels="auto")],
        page, workload="prompt set: method", show_pld=False, show_below=True),
    "results-stock": lambda page: compare_table([
        Row("HumanEval: `prompt+trie+ngram`", FP32_HE, "humaneval"),
        Row("HumanEval: `prompt+trie+ngram`", BF16_HE, "humaneval"),
        Row("MT-Bench: `prompt+trie+ngram`", FP32_MT, "mtbench"),
        Row("MT-Bench: `prompt+trie+ngram`", BF16_MT, "mtbench"),
        Row("HumanEval: transformers' prompt lookup", FP32_HE, "humaneval", PLD),
        Row("HumanEval: transformers' prompt lookup", BF16_HE, "humaneval", PLD),
        Row("MT-Bench: transformers' prompt lookup", FP32_MT, "mtbench", PLD),
        Row("MT-Bench: transformers' prompt lookup", BF16_MT, "mtbench", PLD)],
        page, workload="prompt set: method", show_below=True),
    "fbgemm": lambda page: methods_table(FB_MT, ["mtbench"], FBGEMM_METHODS, page) + "\n"
    + methods_table(FB_HE, ["humaneval"], FBGEMM_METHODS, page),
    "sources-alone-fp32": lambda page: methods_table(FULL["fp32"], ["humaneval", "mtbench"], ALONE, page),
    "sources-alone-bf16": lambda page: methods_table(FULL["bf16"], ["humaneval", "mtbench"], ALONE, page),
    "suffix-mt-he": lambda page: methods_table(
        "suffix-qwen0.5b-bf16-mt-he", ["humaneval", "mtbench"],
        [("specdraft:suffix", "`suffix`"), ("specdraft:trie", "`trie`")], page),
    "bfcl-bf16": lambda page: methods_table(BFCL_BF16, ["bfcl"], BFCL_METHODS, page),
    "bfcl-fp32": lambda page: methods_table(BFCL_FP32, ["bfcl"], BFCL_METHODS, page),
    "tr40-fp32-humaneval": lambda page: methods_table(
        "tr40-qwen0.5b-fp32-humaneval", ["humaneval"], TR40_METHODS, page),
    "cost-fp32-avx512": lambda page: cost_table("cost-curve-qwen0.5b-fp32", ["stock", "packed"], page),
    "cost-bf16-avx512": lambda page: cost_table("cost-curve-qwen0.5b-bf16", ["stock", "packed"], page),
    "cost-bf16-avx2": lambda page: cost_table(
        "cost-curve-qwen0.5b-bf16-fbgemm", ["stock", "fbgemm"], page),
    "cost-fp32-avx2": lambda page: cost_table(
        "cost-curve-qwen0.5b-fp32-fbgemm", ["stock", "packed", "fbgemm"], page),
}


# -- rendering pages -----------------------------------------------------------------------------


def render_page(page: str, text: str) -> str:
    """``text`` with every marked table re-rendered (an unknown table name raises)."""
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise KeyError(f"{page}: unknown table {name!r}; known: {', '.join(TABLES)}")
        return f"<!-- table:{name} -->\n{TABLES[name](page)}<!-- /table -->"
    return MARKER.sub(sub, text)


_COMMIT = re.compile(r"results committed in `[^`]*`")


def history_known() -> bool:
    """Whether git can tell which commit added each run (a full clone, not a shallow one)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return out == "false"


def stale_pages(ignore_commits: bool = False) -> list[str]:
    """Pages whose tables differ from a fresh rendering (``ignore_commits``: apart from the
    commits that added the runs, which a shallow clone cannot know)."""
    def norm(text: str) -> str:
        return _COMMIT.sub("results committed in `?`", text) if ignore_commits else text
    return [page for page in PAGES
            if norm(render_page(page, (ROOT / page).read_text())) != norm((ROOT / page).read_text())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale pages")
    args = parser.parse_args(argv)
    stale = stale_pages()
    if args.check:
        for page in stale:
            print(f"stale: {page} (run python scripts/render_tables.py)")
        return 1 if stale else 0
    for page in stale:
        path = ROOT / page
        path.write_text(render_page(page, path.read_text()))
        print(f"rendered {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
