"""``specdraft bench``: the command behind the CLI subcommand (arguments are parsed in
:mod:`specdraft.cli`).

Every argument is checked before the model is loaded: method names, datasets (installed
package or readable file), matplotlib for the plot, the output directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..errors import UsageError
from .checkpoint import CheckpointMismatch
from .datasets import DatasetSpec, load_prompts, resolve_dataset
from .methods import build_methods, parse_methods
from .report import PlotUnavailableError, markdown_report, plot, require_matplotlib, summarize, write_specbench_jsonl
from .runner import run_benchmark

__all__ = ["run_bench"]

PROG = "specdraft bench"
#: Saved in ``<out>/<dataset>/`` after every prompt; ``--resume`` continues from it.
CHECKPOINT_NAME = "checkpoint.pkl"


@contextmanager
def _usage_errors(*errors: type[Exception], prefix: str = "") -> Iterator[None]:
    """Report ``errors`` raised inside the block as usage errors (exit 2, no traceback)."""
    try:
        yield
    except errors as exc:
        raise UsageError(prefix + str(exc)) from None


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def _dataset_specs(text: str) -> list[DatasetSpec]:
    whole = Path(text).expanduser()
    items = [text] if whole.is_file() else [t for t in (p.strip() for p in text.split(",")) if t]
    if not items:
        raise UsageError("--dataset needs humaneval, mtbench or a path to a .jsonl file")
    twice = next((item for item in items if items.count(item) > 1), None)
    if twice is not None:  # said before looking for the datasets' packages, which may be missing
        raise UsageError(f"dataset {twice!r} is listed twice in --dataset")
    specs: list[DatasetSpec] = []
    for item in items:
        spec = resolve_dataset(item)
        if any(s.key == spec.key for s in specs):
            raise UsageError(f"dataset {spec.key!r} is listed twice in --dataset")
        specs.append(spec)
    return specs


def _portable(text: str) -> str:
    """A path as a results file should record it: from ``site-packages/`` for a dataset shipped in
    a package, relative to the working directory or ``~`` where it lies below them, so results
    name no particular machine's folders. Anything that is not an absolute path is kept."""
    if not text.startswith(("/", "~")):
        return text
    path = Path(text).expanduser()
    parts = path.parts
    if "site-packages" in parts:
        return str(Path(*parts[parts.index("site-packages"):]))
    for base, shown in ((Path.cwd(), ""), (Path.home(), "~")):
        if path.is_relative_to(base):
            return str(Path(shown) / path.relative_to(base))
    return path.name


def _model_id(model: str) -> str:
    name = model.rstrip("/\\")
    return Path(name).name.removesuffix(".gguf") or name


def _versions() -> dict[str, str]:
    import torch
    import transformers

    import specdraft

    return {"specdraft": specdraft.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


#: The instruction-set extensions a CPU's speed depends on here, as /proc/cpuinfo names them.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "avx_ne_convert")


def _cpu() -> dict[str, Any]:
    """The CPU the run measured: model name, logical CPUs, the extensions in ``_CPU_FLAGS`` it has
    (Linux; elsewhere only what :mod:`platform` says)."""
    info: dict[str, Any] = {"model": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    pairs = (line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in pairs}
    info["model"] = fields.get("model name", info["model"])
    if "cpu family" in fields:
        info["family"] = fields["cpu family"]
    flags = set(fields.get("flags", "").split())
    info["flags"] = [f for f in _CPU_FLAGS if f in flags]
    return info


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed arguments; print the markdown table on stdout."""
    method_names = parse_methods(args.methods)
    specs = _dataset_specs(args.dataset)
    chat: Any = {"auto": "auto", "on": True, "off": False}[args.chat]
    out_dir = Path(args.out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {args.out!r} exists and is not a directory")
    if not args.no_plot:
        with _usage_errors(PlotUnavailableError):
            require_matplotlib()
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from specdraft.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, progress=not args.quiet, device=args.device)
    # Move everything alive now (modules, weights) out of the collector's sight: the runner
    # collects garbage before every timed run, and that is then milliseconds, not ~0.5 s.
    gc.collect()
    gc.freeze()
    try:
        return _run(args, model, tokenizer, method_names, specs, chat, out_dir)
    finally:
        gc.unfreeze()


def _run(args: argparse.Namespace, model: Any, tokenizer: Any, method_names: list[str], specs: list[DatasetSpec],
         chat: Any, out_dir: Path) -> int:
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr, flush=True))
    if args.max_tree_nodes is None:  # the device's default, named in the results
        from ..decoder import default_max_tree_nodes

        args.max_tree_nodes = default_max_tree_nodes(getattr(model, "device", None))
    config = {
        "model": _portable(args.model), "model_id": _model_id(args.model), "dtype": args.dtype, "threads": args.threads,
        "max_new_tokens": args.max_new_tokens, "max_tree_nodes": args.max_tree_nodes,
        "exact": args.exact,
        "limit": args.limit or None, "repeats": args.repeats, "chat": args.chat, "greedy": True,
        "datasets": {s.key: _portable(str(s.path)) for s in specs}, "methods": method_names,
        "versions": _versions(), "platform": platform.platform(), "cpu": _cpu(), "argv": [_portable(a) for a in sys.argv[1:]],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # what a checkpoint must share with this run to be resumed (the runner adds prompts and methods)
    setup = {key: config[key] for key in ("model", "dtype", "threads", "max_tree_nodes", "chat", "versions", "exact")}
    if args.concurrency:
        return _run_concurrency(args, model, tokenizer, specs, chat, out_dir, config, say)
    summaries: list[dict[str, Any]] = []
    for spec in specs:
        prompts = load_prompts(spec, args.limit or None, tokenizer, chat=chat)
        say(f"{spec.key}: {len(prompts)} prompts x {len(method_names)} methods x {args.repeats} repeat(s), "
            f"max {args.max_new_tokens} new tokens")
        # Fresh method objects per dataset: a learning source starts each dataset empty.
        methods = build_methods(method_names, model, tokenizer, args.max_tree_nodes, args.exact)
        with _usage_errors(CheckpointMismatch, prefix="--resume: "):
            run = run_benchmark(model, prompts, methods, args.max_new_tokens, repeats=args.repeats, dataset=spec.key,
                                progress=not args.quiet, checkpoint=out_dir / spec.key / CHECKPOINT_NAME,
                                resume=args.resume, setup=setup)
        if run.resumed:
            say(f"{spec.key}: resumed after {run.resumed} finished prompt(s) from the checkpoint")
        files = write_specbench_jsonl(run, out_dir / spec.key, config["model_id"] + f"-{args.dtype}", tokenizer)
        summary = summarize(run)
        for name, path in files.items():
            summary["methods"][name]["jsonl"] = str(path.relative_to(out_dir))
        summaries.append(summary)
        _write_outputs(out_dir, config, summaries, plot_it=False)  # keep finished datasets if a later one fails
    paths = _write_outputs(out_dir, config, summaries, plot_it=not args.no_plot)
    print(markdown_report(summaries, config), end="", flush=True)
    say("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _write_outputs(out_dir: Path, config: dict[str, Any], summaries: list[dict[str, Any]],
                   plot_it: bool) -> list[Path]:
    summary_path = out_dir / "summary.json"
    _write_json(summary_path, {"config": config, "datasets": {s["dataset"]: s for s in summaries}})
    table_path = out_dir / "results.md"
    table_path.write_text(markdown_report(summaries, config), encoding="utf-8")
    paths = [summary_path, table_path]
    if plot_it:
        title = f"{config['model_id']} {config['dtype']}, {config['max_new_tokens']} new tokens, greedy"
        paths.append(plot(summaries, out_dir / "speedup.png", title=title))
    return paths


def _run_concurrency(args: argparse.Namespace, model: Any, tokenizer: Any, specs: list[DatasetSpec], chat: Any,
                     out_dir: Path, config: dict[str, Any], say: Any) -> int:
    """``--concurrency``: see :mod:`specdraft.bench.concurrency`."""
    from .concurrency import markdown, plot_tree_sizes, run_concurrency

    config = {**config, "concurrency": list(args.concurrency)}
    datasets: dict[str, str] = {}
    for spec in specs:
        prompts = load_prompts(spec, args.limit or None, tokenizer, chat=chat)
        say(f"{spec.key}: {len(prompts)} prompts at concurrency {args.concurrency}")
        summary = run_concurrency(model, tokenizer, [p.token_ids for p in prompts], args.concurrency,
                                  args.max_new_tokens, args.max_tree_nodes, say=say)
        summary["config"] = config
        _write_json(out_dir / spec.key / "concurrency.json", summary)
        (out_dir / spec.key / "concurrency.md").write_text(markdown(summary), encoding="utf-8")
        if not args.no_plot:
            plot_tree_sizes(summary, out_dir / spec.key / "tree-sizes.png",
                            title=f"{config['model_id']} {args.dtype}: tree size per request by load")
        print(f"## {spec.key}\n\n" + markdown(summary), end="", flush=True)
        datasets[spec.key] = f"{spec.key}/concurrency.json"
        _write_json(out_dir / "summary.json", {"config": config, "concurrency": datasets})
    return 0
