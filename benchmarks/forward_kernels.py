"""Where a decode forward's device time goes, by kind of operation, at each width.

Why: on an H100 (``results/gpu-h100-2026-11-27-7a7546a``) a tree step's forward, replayed as a
CUDA graph, spanned 5.4-5.7 ms against 3.6 for a plain step's one row. A graph replay pays no
launches, so the difference is kernel time that grows with the rows: the linear layers (cuBLAS
picks other kernels for 8 rows than for one), the attention (a masked ``sdpa`` over the whole
store, after transformers repeats the key/value heads), the mask, the cache moves. This script
says which, so that a fix is aimed rather than guessed.

It decodes with the library's own static forwards run eagerly (no capture, so that the profiler
sees every kernel), a plain decoder (every forward one row) and fixed trees (the buckets 8 to 64),
under ``torch.profiler``. Each decode forward is marked with its width; every operation inside
it is charged its own device time (its kernels' time, without its children's) on CUDA, or its
own CPU time elsewhere (a smoke run), and grouped by kind. Figures are microseconds per forward
of that width, averaged over the forwards of the run. Kernels launched outside an aten operation
(the exact attention's Triton kernels, which on an H200 the profiler tied to no CPU operation at
all) are charged to ``kernels outside aten ops``, by the forward whose launch last began before
them.

    python benchmarks/forward_kernels.py --device cuda --out DIR            # random weights, Qwen2.5-0.5B's shape
    python benchmarks/forward_kernels.py --device cuda --attention eager --out DIR

Writes ``kernels.json`` and ``kernels.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_steps import SHAPES, build_model, machine  # noqa: E402
from host_overhead import repetitive_context  # noqa: E402

from specdraft import Decoder  # noqa: E402
from specdraft.model import static as static_module  # noqa: E402
from specdraft.model.static import Buckets  # noqa: E402
from specdraft.sources.registry import DEFAULT_SOURCES, make_sources  # noqa: E402

#: the record that marks one decode forward (its width follows the dot)
MARK = "specdraft.decode_forward."
#: kinds of operation, by words in the aten operation's name (first match wins)
KINDS = (
    ("attention", ("attention", "attn", "flash", "sdpa", "fmha", "softmax")),
    ("matmul", ("mm", "matmul", "linear", "gemm", "gemv")),
    ("copies (cache writes and moves, repeated heads, concatenations)",
     ("copy", "index_put", "index_copy", "cat", "clone", "contiguous", "repeat", "expand", "gather", "scatter")),
    ("norms and reductions", ("mean", "pow", "rsqrt", "sum", "max", "min", "argmax", "topk", "sort")),
    ("elementwise", ("mul", "add", "sub", "div", "silu", "neg", "cos", "sin", "exp", "where", "masked_fill",
                     "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "fill", "zero", "arange", "to",
                     "embedding", "index", "select", "slice")),
)
OUTSIDE = "kernels outside aten ops"


def kind_of(name: str) -> str:
    """The kind of an operation by its name (see :data:`KINDS`)."""
    if name.startswith(MARK):
        return OUTSIDE
    short = name.split("::")[-1].lower()
    for kind, words in KINDS:
        if any(word in short for word in words):
            return kind
    return "other"


def marked_width(event: Any) -> int | None:
    """The width of the decode forward an event ran inside (``None``: outside any)."""
    while event is not None:
        if event.name.startswith(MARK):
            return int(event.name[len(MARK):])
        event = event.cpu_parent
    return None


def mark_forwards(counts: dict[int, int]) -> Any:
    """Wrap :meth:`StaticForwards.run` so each decode forward is a profiler record named by its
    width (counted in ``counts``); returns what undoes it."""
    original = static_module.StaticForwards.run

    def run(self, width, forward, store):
        counts[width] += 1
        with torch.profiler.record_function(f"{MARK}{width}"):
            return original(self, width, forward, store)

    static_module.StaticForwards.run = run
    return lambda: setattr(static_module.StaticForwards, "run", original)


def profile_decoder(dec: Decoder, prompt: list[int], new_tokens: int) -> dict[int, dict[str, Any]]:
    """Per width: the decode forwards' count and microseconds per forward by kind and by operation."""
    cuda = dec.runner.device.type == "cuda"
    if dec.runner.static is not None:
        dec.runner.static.capture = False  # eager static forwards: the profiler sees every kernel
    dec.generate(prompt[:256], max_new_tokens=8)  # warm-up: kernel choice, step costs, allocator
    counts: dict[int, int] = defaultdict(int)
    undo = mark_forwards(counts)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    try:
        with torch.profiler.profile(activities=activities) as prof:
            dec.generate(prompt, max_new_tokens=new_tokens)
            if cuda:
                torch.cuda.synchronize()
    finally:
        undo()
    by_kind: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_op: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        width = marked_width(event)
        if width is None:
            continue
        spent = event.self_device_time_total if cuda else event.self_cpu_time_total
        if spent <= 0:
            continue
        by_kind[width][kind_of(event.name)] += spent
        by_op[width][event.name] += spent
    if cuda:
        _charge_loose_kernels(prof.events(), by_kind, by_op)
    result = {}
    for width, n in sorted(counts.items()):
        kinds = {k: round(v / n, 2) for k, v in sorted(by_kind[width].items(), key=lambda kv: -kv[1])}
        ops = sorted(by_op[width].items(), key=lambda kv: -kv[1])[:12]
        result[width] = {"forwards": n, "us_per_forward": round(sum(kinds.values()), 2), "kinds": kinds,
                         "top_ops": {name: round(v / n, 2) for name, v in ops}}
    return result


def _charge_loose_kernels(events: Any, by_kind: dict[int, dict[str, float]],
                          by_op: dict[int, dict[str, float]]) -> None:
    """Charge the GPU kernels that no CPU operation launched as the profiler sees it (Triton's
    own launcher: the exact attention's and the flash merge's kernels) to the decode forward whose
    launch last began before them, as :data:`OUTSIDE`. Their launches happen inside that forward,
    and the step waits for its forward before the next one is launched."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = list(events)
    cpu_ids = {event.id for event in events if event.device_type == cpu}
    marks = sorted((event.time_range.start, int(event.name[len(MARK):])) for event in events
                   if event.device_type == cpu and event.name.startswith(MARK))
    starts = [start for start, _ in marks]
    for event in events:
        if (event.device_type != cuda or getattr(event, "is_user_annotation", False) or event.name.startswith(MARK)
                or getattr(event, "linked_correlation_id", 0) in cpu_ids):
            continue
        index = bisect.bisect_right(starts, event.time_range.start) - 1
        if index < 0:
            continue
        width, spent = marks[index][1], event.time_range.elapsed_us()
        by_kind[width][OUTSIDE] += spent
        by_op[width][event.name] += spent


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    widths = sorted({int(w) for run in result["runs"].values() for w in run})
    kinds = sorted({k for run in result["runs"].values() for row in run.values() for k in row["kinds"]})
    unit = "device time (CUDA kernels)" if cfg["device"] == "cuda" else "CPU time (a smoke run: not a GPU's figures)"
    lines = [f"# A decode forward's time by kind ({cfg['started'][:10]}, commit {cfg['commit']})", "",
             f"{cfg.get('gpu', cfg['device'])}; {cfg['shape']} with random weights, {cfg['dtype']}, attention "
             f"`{cfg['attention']}`, exact mode {cfg['exact']}, a {cfg['context']}-token context, {cfg['new_tokens']} new tokens per run. "
             f"Microseconds per decode forward of each width, {unit}, static forwards run eagerly.", "",
             "| kind | " + " | ".join(f"{w} rows" for w in widths) + " |",
             "|---|" + "---:|" * len(widths)]
    merged: dict[int, dict[str, Any]] = {}
    for run in result["runs"].values():
        for w, row in run.items():
            if int(w) not in merged or row["forwards"] > merged[int(w)]["forwards"]:
                merged[int(w)] = row
    for kind in kinds + ["all"]:
        cells = []
        for w in widths:
            row = merged.get(w)
            value = row["us_per_forward"] if kind == "all" and row else (row or {}).get("kinds", {}).get(kind)
            cells.append("-" if value is None else f"{value:.0f}")
        label = f"**{kind}**" if kind == "all" else kind
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "The largest operations per width (microseconds per forward):", ""]
    for w in widths:
        row = merged[w]
        top = ", ".join(f"`{name}` {us:.0f}" for name, us in list(row["top_ops"].items())[:8])
        lines.append(f"- {w} rows ({row['forwards']} forwards): {top}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--attention", default="auto", choices=["auto", "sdpa", "eager", "flash"])
    parser.add_argument("--exact", default="auto", choices=["auto", "on", "off"],
                        help="exact mode: the decoder's default for the device and dtype, or forced")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--nodes", default="0,8,32", help="fixed tree sizes to decode with (0: plain decoding)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        nodes = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes takes comma-separated integers, got {args.nodes!r}")
    if any(n < 0 for n in nodes) or args.context < 300 or args.new_tokens < 1:
        parser.error("--nodes must be >= 0, --context at least 300 and --new-tokens at least 1")
    model = build_model(args.shape, args.device, getattr(torch, args.dtype))
    prompt = repetitive_context(args.context)
    config = machine(args.device) | {"shape": args.shape, "dtype": args.dtype, "attention": args.attention,
                                     "exact": args.exact,
                                     "context": args.context, "new_tokens": args.new_tokens}
    runs = {}
    for n in nodes:
        sources = make_sources(list(DEFAULT_SOURCES)) if n else []
        dec = Decoder(model, None, sources=sources, max_tree_nodes=n, adaptive_budget=False,
                      attention=args.attention, exact={"auto": None, "on": True, "off": False}[args.exact])
        if dec.runner.static is None:  # off a GPU: its fixed widths and static buffers, run eagerly
            dec.runner.use_static(capture=False)
            dec.engine.padding = Buckets()
        started = time.perf_counter()
        runs[f"nodes {n}"] = profile_decoder(dec, prompt, args.new_tokens)
        print(f"nodes {n}: {time.perf_counter() - started:.1f} s, widths "
              f"{ {w: r['forwards'] for w, r in runs[f'nodes {n}'].items()} }", file=sys.stderr, flush=True)
    result = {"config": config, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "kernels.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
