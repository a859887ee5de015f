"""Drafting pauses where a forward is cheap: a GPU's step, emulated on the CPU.

On a GPU a plain step replays a captured graph in about 4 ms, and drafting (the sources' search,
the merge) is host work of about a millisecond on top of it. On chat the budget checks almost no
draft, so the default ran below our plain decoding there (0.85x on an H100, MT-Bench).
:mod:`specdraft.engine.pause` skips drafting for a few steps after drafts that did not pay for
their host time. This script measures what that changes where no GPU is at hand: the real model
runs on the CPU, but the decoder's clock (by which the budget prices steps and the pause weighs
drafts) counts each forward as ``--forward-ms`` per 64 rows (3.4 ms: transformers' compiled
static-cache ``generate`` per token on an H100 at 549453d) instead of its CPU time; the host work
(drafting, merging, verifying, learning) counts as it runs here, on one thread. Every width up to
64 rows costs the same, as eager forwards did on GPUs, unless ``--width-cost`` makes wide ones
dearer (which also counts the step's read as device work). What a GPU does not pay at all is
not charged: the release of a step's tensors at its end (a caching allocator keeps them) and
the budget's own price for attention (the emulated forward's price holds it).
The CPU kernels stay stock: swapping packed ones in around each forward is CPU-only host work.

Per prompt and method (interleaved per prompt), in emulated milliseconds per new token: our plain
decoding, the default with pauses switched off (the budget's ``drafting_share = 0``), and the default; with tokens
per step, skipped drafts and whether the output equals our plain decoding's. Medians of the
per-prompt ratios are reported. Host times are CPU times of this process (``time.process_time``),
so other work on the machine does not count.

    python benchmarks/draft_pause.py --datasets mtbench,humaneval --prompts 10 \\
        --out benchmarks/results/draft-pause-<date>-<commit>

``--forward-ms 0`` runs the CPU as it is instead (its own forward times, the decoder's default
CPU kernels), to check that drafting pauses leave CPU decoding alone. ``--extra NAME=SOURCES``
adds a method with other sources (for example ``--extra tr=prompt,trie,ngram,suffix,recycle``:
what the default would do with Token Recycling where a tree of 64 rows costs what one row does).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdraft.budget.whole_tree import WholeTreeTrial  # noqa: E402  (after the path: runs from a checkout)

METHODS = ("plain", "no-pause", "default")


class EmulatedClock:
    """CPU time of this process, with every forward's own CPU time replaced by ``forward_s`` per
    ``rows_per_forward`` rows (a forward hook measures what to take out), a forward of ``k <=
    rows_per_forward`` rows costing ``1 + width_cost * (k - 1) / (rows_per_forward - 1)`` times one
    of a single row."""

    def __init__(self, model: Any, forward_s: float, rows_per_forward: int = 64, width_cost: float = 0.0) -> None:
        self.forward_s = forward_s
        self.rows = rows_per_forward
        self.width_cost = width_cost
        self.correction = 0.0
        self.last_forward_s = 0.0
        self._started: float | None = None
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post)

    def __call__(self) -> float:
        return time.process_time() + self.correction

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        width = ids.shape[-1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        full, rest = divmod(width, self.rows)
        growth = self.width_cost / max(1, self.rows - 1)
        self.last_forward_s = self.forward_s * (full * (1 + growth * (self.rows - 1))
                                                + (1 + growth * (rest - 1) if rest else 0))
        self.correction += self.last_forward_s
        self._started = time.process_time()

    def hide_behind_forwards(self) -> None:
        """Count the work run behind each forward (``Step.behind_forward``) as free up to that
        forward's time, as on a GPU, where the device computes meanwhile."""
        from specdraft.engine import step as step_module

        original = step_module.Step.behind_forward

        def behind(step: Any, members: Any) -> None:
            started = time.process_time()
            original(step, members)
            self.correction -= min(time.process_time() - started, self.last_forward_s)

        step_module.Step.behind_forward = behind

    def read_on_device(self) -> None:
        """Count the step's read (every row's argmax and the top-k, over the vocabulary) as free:
        on a GPU those are kernels launched behind the forward, while on a CPU they are host work
        that grows with the rows and would price wide trees as a GPU does not."""
        from specdraft.engine import step as step_module

        original = step_module.Step.read_back

        def read_back(step: Any, *args: Any) -> Any:
            started = time.process_time()
            try:
                return original(step, *args)
            finally:
                self.correction -= time.process_time() - started

        step_module.Step.read_back = read_back

    def release_on_device(self) -> None:
        """Count the release of a step's tensors (its logits above all: 64 rows of a 150k-token
        vocabulary are 39 MB in float32, which the CPU's allocator hands back to the system at the
        end of every step, some 3 ms here) as free: on a GPU they stay in the caching allocator.
        The release runs as :meth:`Step.run` returns, after its last phase (``account``)."""
        from specdraft.engine import step as step_module

        original_run, original_account = step_module.Step.run, step_module.Step.account
        accounted: list[float] = []

        def account(step: Any, *args: Any) -> Any:
            try:
                return original_account(step, *args)
            finally:
                accounted.append(time.process_time())

        def run(step: Any) -> Any:
            accounted.clear()
            report = original_run(step)
            if accounted:
                self.correction -= time.process_time() - accounted[-1]
            return report

        step_module.Step.account = account
        step_module.Step.run = run

    def _post(self, module: Any, args: tuple, output: Any) -> None:
        self.correction -= time.process_time() - self._started


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="alias, checkpoint dir, .gguf file or hub id")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--datasets", default="mtbench,humaneval")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--forward-ms", type=float, default=3.4)
    parser.add_argument("--width-cost", type=float, default=0.0,
                        help="how much dearer a forward of 64 rows is than one of 1 (0.15: 15%%), linear between; "
                             "the step's read counts as device work (free) when this is given")
    parser.add_argument("--max-tree-nodes", type=int, default=32, help="the decoders' max_tree_nodes")
    parser.add_argument("--buckets", default=None, metavar="W,W,...",
                        help="run every decoder's forwards at these fixed widths over static buffers, as on a GPU "
                             "(16,32,64: exact mode's buckets there; eagerly here, without exact mode)")
    parser.add_argument("--builtin", default=",".join(METHODS),
                        help=f"which of {', '.join(METHODS)} to run beside the --extra ones (plain always runs)")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=SOURCES",
                        help="another method: the default decoder with these sources (repeatable); a NAME "
                             "with @fixed runs it with a fixed budget, with @nofill without the budget's padding "
                             "fill, with @nopause without drafting pauses, with @notrial without the budget's whole-tree "
                             "trial (a GPU's, on with --buckets), with @pauselearnsexplored with a trial whose "
                             "explored steps teach the drafting pause too, with @<N>n at max_tree_nodes=N")
    parser.add_argument("--hide", action="store_true",
                        help="the accelerator's order: host work the read does not need runs behind the forward "
                             "and counts as free up to the forward's time; adds the method default-nolag (drafting "
                             "pauses that skip drafting instead of drafting behind the forward)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.hide and not args.forward_ms:
        parser.error("--hide needs an emulated forward (--forward-ms > 0)")
    if args.prompts < 1 or args.new_tokens < 2 or not args.forward_ms >= 0:
        parser.error("--prompts >= 1, --new-tokens >= 2 and --forward-ms >= 0 are required")
    from specdraft.sources.registry import parse_source_names

    extras = {}
    for item in args.extra:
        name, _, sources = item.partition("=")
        if not name or not sources or name in METHODS or name in extras:
            parser.error(f"--extra takes NAME=SOURCES with a new name, got {item!r}")
        extras[name] = parse_source_names(sources)
    args.extras = extras
    if args.buckets is not None:
        try:
            args.buckets = tuple(sorted({int(w) for w in args.buckets.split(",")}))
        except ValueError:
            parser.error(f"--buckets takes widths like 16,32,64, got {args.buckets!r}")
        if not args.buckets or args.buckets[0] < 1:
            parser.error(f"--buckets takes positive widths, got {args.buckets!r}")
    builtin = [m.strip() for m in args.builtin.split(",") if m.strip()]
    if any(m not in METHODS for m in builtin):
        parser.error(f"--builtin takes some of {', '.join(METHODS)}, got {args.builtin!r}")
    args.builtin = ["plain", *[m for m in METHODS if m in builtin and m != "plain"]]
    return args


class ExploredStepsTeachPauses(WholeTreeTrial):
    """For comparison: a trial whose steps of the arm that is not leading count for the drafting
    pause like any other (the library's pause skips them, :mod:`specdraft.engine.pause`)."""

    @property
    def exploring(self) -> bool:
        return False


def _suffix_nodes(name: str, default: int) -> int:
    """``max_tree_nodes`` of an ``--extra`` method: a ``@<N>n`` suffix of its name, else ``default``."""
    sizes = [int(part[:-1]) for part in name.split("@")[1:] if part.endswith("n") and part[:-1].isdigit()]
    return sizes[-1] if sizes else default


def run_method(decoders: dict[str, Any], method: str, prompt: list[int], new_tokens: int,
               clock: Callable[[], float]) -> dict[str, Any]:
    started = clock()
    trial = decoders[method].budget.whole_tree
    before = list(trial.steps) if trial is not None else None
    out = decoders[method].generate(prompt, max_new_tokens=new_tokens)
    seconds = clock() - started
    stats = out.stats
    row = {"ms_per_token": 1e3 * seconds / max(1, stats.new_tokens), "tokens": out.token_ids,
           "steps": stats.steps, "tokens_per_step": stats.mean_accepted, "skipped_drafts": stats.skipped_drafts}
    if trial is not None:  # the steps of each arm of the budget's whole-tree trial in this request
        row["choice_steps"], row["whole_steps"] = (now - then for now, then in zip(trial.steps, before))
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from specdraft import Decoder
    from specdraft.bench.datasets import load_prompts
    from specdraft.model.static import Buckets
    from specdraft.models import load_model
    from specdraft.sources.registry import make_sources

    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model, dtype=args.dtype, progress=False)
    clock: Callable[[], float] = (EmulatedClock(model, args.forward_ms / 1e3, width_cost=args.width_cost)
                                  if args.forward_ms else time.process_time)
    if args.hide:
        clock.hide_behind_forwards()
    if args.width_cost:
        clock.read_on_device()
    if args.forward_ms:
        clock.release_on_device()
    kernels = "stock" if args.forward_ms else "auto"
    exact = False if args.buckets else None  # (the CPU's exact rule does not hold at every bucket)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"setup": setup(args), "datasets": {}}
    for dataset in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        prompts = [r.token_ids for r in load_prompts(dataset, args.prompts, tokenizer)]
        nodes = args.max_tree_nodes
        decoders = {"plain": Decoder(model, tokenizer, max_tree_nodes=0, cpu_kernels=kernels, exact=exact),
                    "no-pause": Decoder(model, tokenizer, max_tree_nodes=nodes, cpu_kernels=kernels, exact=exact),
                    "default": Decoder(model, tokenizer, max_tree_nodes=nodes, cpu_kernels=kernels, exact=exact)}
        decoders.update({name: Decoder(model, tokenizer, sources=make_sources(names),
                                       max_tree_nodes=_suffix_nodes(name, nodes),
                                       adaptive_budget="@fixed" not in name, cpu_kernels=kernels, exact=exact)
                         for name, names in args.extras.items()})
        if args.hide and "default" in args.builtin:
            lagless = decoders["default-nolag"] = Decoder(model, tokenizer, cpu_kernels=kernels)
            drafter = lagless.engine.drafter
            drafter.propose_lagged = lambda request, d=drafter: d.propose(request, False)  # a budget of 0
            drafter.draft_behind = lambda request: None
        for name in args.extras:
            if "@nofill" in name:  # the budget without its padding fill (Budget._fill_padding), for comparison
                decoders[name].budget._fill_padding = lambda asks, offered, grants, limit: grants
            if "@nopause" in name:
                decoders[name].budget.drafting_share = 0.0
        methods = [*args.builtin, *(["default-nolag"] if args.hide and "default" in args.builtin else []),
                   *args.extras]
        decoders = {m: decoders[m] for m in methods}
        if "no-pause" in decoders:
            decoders["no-pause"].budget.drafting_share = 0.0
        for name, dec in decoders.items():
            dec.clock = clock
            dec.engine.hide_host_work = True if args.hide else None
            if args.forward_ms:  # the emulated forward's price holds its attention, as a GPU's does
                dec.budget.costs.attention_seconds = 0.0  # (the decoder measured this CPU's sdpa)
            if args.width_cost:
                dec.row_choices = "batched"  # a GPU's: every row's choice made at once, in the read
            if args.buckets:
                dec.runner.use_static(args.buckets, capture=False)
                dec.engine.padding = Buckets(args.buckets)
                # as on a GPU, the budget weighs its choice against the whole tree (not with @notrial)
                trial = ExploredStepsTeachPauses if "@pauselearnsexplored" in name else WholeTreeTrial
                dec.budget.whole_tree = None if "@notrial" in name else trial()
            dec.generate(prompts[0][:64], max_new_tokens=8)  # warm: kernels chosen, budget priced
        rows = []
        for index, prompt in enumerate(prompts):
            row = {m: run_method(decoders, m, prompt, args.new_tokens, clock) for m in methods}
            plain_tokens = row["plain"]["tokens"]
            for m in methods:
                row[m]["same_as_plain"] = row[m].pop("tokens") == plain_tokens
            rows.append(row)
            print(f"{dataset} {index}: " + "  ".join(
                f"{m} {row[m]['ms_per_token']:.2f} ms/tok {row[m]['tokens_per_step']:.2f} tok/step "
                f"skip {row[m]['skipped_drafts']}" for m in methods), file=sys.stderr, flush=True)
        results["datasets"][dataset] = {"prompts": rows, "summary": summarize(rows)}
        for dec in decoders.values():
            dec.close()
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "results.md").write_text(render(results))
    (out_dir / "summary.json").write_text(json.dumps(bench_summary(results), indent=1) + "\n")
    print(render(results))
    return 0


def summarize(rows: list[dict]) -> dict[str, Any]:
    def ratios(m: str) -> list[float]:
        return [r["plain"]["ms_per_token"] / r[m]["ms_per_token"] for r in rows]

    summary: dict[str, Any] = {}
    for m in rows[0]:
        summary[m] = {
            "median_ms_per_token": round(statistics.median(r[m]["ms_per_token"] for r in rows), 3),
            "median_vs_plain": round(statistics.median(ratios(m)), 3),
            "worst_vs_plain": round(min(ratios(m)), 3),
            "tokens_per_step": round(statistics.mean(r[m]["tokens_per_step"] for r in rows), 3),
            "skipped_drafts": sum(r[m]["skipped_drafts"] for r in rows),
            "same_as_plain": sum(r[m]["same_as_plain"] for r in rows),
        }
    return summary


def bench_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The ratios in the shape of ``specdraft bench``'s ``summary.json`` (what the docs' checks read)."""
    return {"datasets": {dataset: {"methods": {
        m: {"speedup_vs_plain_median": row["median_vs_plain"], "speedup_min": row["worst_vs_plain"]}
        for m, row in data["summary"].items()}} for dataset, data in results["datasets"].items()}}


def render(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [f"# Drafting pauses ({s['date']}, commit {s['commit']})", "",
             f"{s['model']} ({s['dtype']}) on {s['cpu']}, one thread; "
             + (_emulated(s) if s["forward_ms"] else "the CPU's own forward times (default CPU kernels), CPU time")
             + ("; the accelerator's order, work behind each forward free up to its time" if s.get("hide") else "")
             + f"; greedy, {s['new_tokens']} new tokens; {s['prompts']} prompts per set.", "",
             "| set | method | ms/token (median) | vs our plain (median, worst) | tokens/step | skipped drafts "
             "| = our plain |", "|---|---|---:|---:|---:|---:|---:|"]
    for dataset, data in results["datasets"].items():
        for m, row in data["summary"].items():
            lines.append(f"| {dataset} | {m} | {row['median_ms_per_token']:.2f} | {row['median_vs_plain']:.3f}x "
                         f"({row['worst_vs_plain']:.3f}x) | {row['tokens_per_step']:.2f} | {row['skipped_drafts']} "
                         f"| {row['same_as_plain']}/{len(data['prompts'])} |")
    return "\n".join(lines) + "\n"


def _emulated(s: dict[str, Any]) -> str:
    """How the run priced a forward, for the table's heading."""
    text = f"each forward counted as {s['forward_ms']} ms per 64 rows (stock CPU kernels)"
    if s.get("width_cost"):
        text += f", 64 rows {s['width_cost']:.0%} dearer than 1, the read on the device"
    if s.get("buckets"):
        text += f", forwards padded to {'/'.join(map(str, s['buckets']))} rows (without exact mode)"
    return text


def setup(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit, "model": args.model, "dtype": args.dtype,
            "cpu": cpu, "torch": torch.__version__, "forward_ms": args.forward_ms, "new_tokens": args.new_tokens,
            "prompts": args.prompts, "extra": args.extra, "builtin": args.builtin, "hide": args.hide,
            "width_cost": args.width_cost, "buckets": args.buckets,
            "max_tree_nodes": args.max_tree_nodes}


if __name__ == "__main__":
    sys.exit(main())
