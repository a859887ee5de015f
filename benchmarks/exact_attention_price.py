"""What does the exact attention cost on a device? Milliseconds per forward's worth of attention.

Exact mode replaces the model's attention with :mod:`specdraft.model.exact_attention`. On a GPU
its rows are laid out at fixed shapes on the device and run either as Triton kernels
(:mod:`specdraft.model.exact_triton`) or as torch operations; a decode forward runs as a captured
CUDA graph. This script times, with random tensors of a model's head layout (no checkpoint
needed), one forward's attention -- ``--layers`` calls over one mask, as the layers of a forward
share it -- for every width (rows: a plain step or a tree) and store capacity (columns):

``sdpa``
    ``torch.nn.functional.scaled_dot_product_attention`` with the bool mask and ``enable_gqa``
    (the reference every mode is checked against);
``hf-sdpa``
    transformers' own ``sdpa`` attention function, as a decode forward outside exact mode calls it
    through the model: with a mask, its 5.17 release repeats the key/value heads over every column
    (5.24 packs a one-row query's heads instead), and PyTorch picks the kernel;
``hf-eager``
    transformers' ``eager`` attention (the model's own products and softmax, an additive mask):
    whether plain products beat ``sdpa``'s masked kernels at tree widths over long stores;
``triton``
    the exact attention in its Triton kernels;
``torch``
    the exact attention's fixed layout in torch operations;
``flash``
    the flash split (:mod:`specdraft.model.attention`) with the layout a decode forward hands it:
    the committed columns through FlashAttention 4's variable-length kernel where
    ``flash_attn.cute`` is installed (the dense product otherwise: ``setup.flash_prefix`` says
    which), the tree rows among themselves densely, merged.

On CUDA each is captured once as a CUDA graph and replayed, timed by CUDA events (median of
``--repeats``); elsewhere the calls run eagerly, timed by the wall clock (a smoke run: the CPU's
exact attention lays out on the host instead, which this does not time). Each row is also checked
against ``sdpa`` (largest absolute difference, float32 values of bfloat16 outputs).

    python benchmarks/exact_attention_price.py --device cuda --out benchmarks/results/exact-attention-price-<gpu>-<date>

Writes ``price.json`` and ``price.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("sdpa", "hf-sdpa", "hf-eager", "triton", "torch", "flash")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=14, help="query heads (Qwen2.5-0.5B: 14)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24, help="attention calls per forward, over one mask")
    parser.add_argument("--widths", default="1,8,16,32,64")
    parser.add_argument("--capacities", default="512,2048,8192", help="store columns the forward attends over")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        args.widths = [int(w) for w in args.widths.split(",")]
        args.capacities = [int(c) for c in args.capacities.split(",")]
    except ValueError:
        parser.error("--widths and --capacities take comma-separated integers")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        parser.error(f"--modes takes some of {list(MODES)}, got {args.modes}")
    if any(w < 1 or w > 512 for w in args.widths) or any(c < 2 * max(args.widths) for c in args.capacities):
        parser.error("--widths must be in [1, 512] and every capacity at least twice the widest width")
    if args.heads % args.kv_heads or args.repeats < 1 or args.layers < 1:
        parser.error("--heads must be a multiple of --kv-heads; --repeats and --layers at least 1")
    return args


def inputs(args: argparse.Namespace, width: int, capacity: int, device: Any, dtype: Any) -> dict[str, Any]:
    """A tree of ``width`` rows after half the capacity of committed tokens; the rest hidden."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(width * 7919 + capacity)
    committed = capacity // 2
    parents = [-1] + [int(np.random.default_rng(i).integers(max(0, i - 4), i)) for i in range(1, width)]
    allowed = torch.zeros(width, capacity, dtype=torch.bool)
    allowed[:, :committed] = True
    for row in range(width):
        node = row
        while node >= 0:
            allowed[row, committed + node] = True
            node = parents[node]

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return {"q": rand(1, args.heads, width, args.dim), "k": rand(1, args.kv_heads, capacity, args.dim),
            "v": rand(1, args.kv_heads, capacity, args.dim), "allowed": allowed.to(device),
            "committed": committed}


def flash_layout_of(data: dict[str, Any]) -> Any:
    """The flash split's layout of ``data``: one request, its ``committed`` columns from 0, its
    tree rows written right after them (no host spans: what a captured forward has)."""
    import torch

    from specdraft.model.flash_kernels import FlashLayout

    width, committed = data["q"].shape[2], data["committed"]
    device = data["q"].device
    columns = torch.arange(committed, committed + width, device=device)
    return FlashLayout(torch.zeros(width, dtype=torch.long, device=device),
                       torch.full((width,), committed, dtype=torch.long, device=device),
                       torch.zeros(width, dtype=torch.long, device=device), columns,
                       data["allowed"][:, committed : committed + width].contiguous())


def forward_of(mode: str, data: dict[str, Any], layers: int, groups: int) -> Callable[[], Any]:
    """One forward's attention: ``layers`` calls over one mask object (made inside, as a forward does)."""
    import torch

    import specdraft.model.exact_attention as exact
    from specdraft.model.attention import tree_flash_attention
    from specdraft.model.flash_kernels import FLASH_LAYOUT_KEYWORD
    from specdraft.model.masks import model_mask

    class Module(torch.nn.Module):
        num_key_value_groups = groups
        is_causal = True

    module = Module().eval()
    flash = {FLASH_LAYOUT_KEYWORD: flash_layout_of(data)} if mode == "flash" else {}
    transformers_attention = _transformers_attention(mode)

    def run() -> Any:
        mask = data["allowed"][None, None]
        # what the model hands its attention: bool, or additive for eager (the decoder's own mask maker)
        layer_mask = model_mask(data["allowed"], "additive" if mode == "hf-eager" else "bool", data["q"].dtype)
        exact.TRITON = mode == "triton"
        out = None
        for _ in range(layers):
            if mode == "sdpa":
                out = torch.nn.functional.scaled_dot_product_attention(data["q"], data["k"], data["v"], attn_mask=mask,
                                                                       enable_gqa=True).transpose(1, 2)
            elif mode == "flash":
                out = tree_flash_attention(module, data["q"], data["k"], data["v"], None, **flash)[0]
            elif transformers_attention is not None:
                out = transformers_attention(module, data["q"], data["k"], data["v"], layer_mask, dropout=0.0,
                                             scaling=data["q"].shape[-1] ** -0.5)[0]
            else:
                out = exact.exact_attention(module, data["q"], data["k"], data["v"], mask)[0]
        return out

    return run


def _transformers_attention(mode: str) -> Callable[..., Any] | None:
    """transformers' attention function a ``hf-`` mode times (``None`` for the other modes)."""
    if mode == "hf-sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    if mode == "hf-eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return None


def time_forward(run: Callable[[], Any], device: Any, repeats: int) -> tuple[float, Any]:
    """Median milliseconds per call of ``run`` (a CUDA graph replay on CUDA) and its output."""
    import torch

    if device.type == "cuda":
        from specdraft.model.static import CudaGraph

        graph = CudaGraph(run)  # as the decoder captures a forward: two warm-up runs, then the capture
        output = graph.output
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), output
    output = run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        output = run()
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times), output


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    import specdraft.model.exact_attention as exact

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    exact.FIXED_SHAPES = True
    groups = args.heads // args.kv_heads
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for capacity in args.capacities:
            for width in args.widths:
                data = inputs(args, width, capacity, device, dtype)
                row: dict[str, Any] = {"width": width, "capacity": capacity}
                reference = None
                for mode in args.modes:
                    try:
                        ms, out = time_forward(forward_of(mode, data, args.layers, groups), device, args.repeats)
                    except Exception as exc:  # noqa: BLE001 - a mode that cannot run here is reported, not fatal
                        row[mode] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        continue
                    out = out.float()
                    if mode == "sdpa":
                        reference = out
                    row[mode] = {"ms_per_forward": round(ms, 4), "ms_per_layer": round(ms / args.layers, 5)}
                    if reference is not None and mode != "sdpa":
                        row[mode]["max_abs_vs_sdpa"] = float((out - reference).abs().max())
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"setup": setup(args, device), "rows": rows, "triton_note": dict(exact.TRITON_NOTE)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "price.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "price.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    modes = [m for m in MODES if m in s["modes"]]
    lines = [f"# Exact attention's price ({s['date']}, commit {s['commit']})", "",
             f"{s['device_name']}; {s['dtype']}, {s['heads']} query heads on {s['kv_heads']} key/value heads of "
             f"{s['dim']}, {s['layers']} calls per forward over one mask; "
             + ("each forward a replayed CUDA graph, CUDA events" if s["graphs"] else "eager calls, wall clock")
             + f", median of {s['repeats']}. Milliseconds per forward's attention (ratio to `sdpa`)."
             + (f" The flash split's prefix ran {s['flash_prefix']}." if "flash_prefix" in s else ""), "",
             "| columns | rows | " + " | ".join(f"`{m}`" for m in modes) + " | largest difference to `sdpa` |",
             "|---:|---:|" + "---:|" * len(modes) + "---|"]
    for row in result["rows"]:
        base = row.get("sdpa", {}).get("ms_per_forward")
        cells, diffs = [], []
        for m in modes:
            cell = row.get(m, {})
            if "error" in cell:
                cells.append("failed")
            elif "ms_per_forward" in cell:
                ratio = f" ({cell['ms_per_forward'] / base:.2f}x)" if base and m != "sdpa" else ""
                cells.append(f"{cell['ms_per_forward']:.3f}{ratio}")
            else:
                cells.append("-")
            if "max_abs_vs_sdpa" in cell:
                diffs.append(f"{m} {cell['max_abs_vs_sdpa']:.1e}")
        lines.append(f"| {row['capacity']} | {row['width']} | " + " | ".join(cells) + f" | {', '.join(diffs)} |")
    if result["triton_note"]:
        lines += ["", f"Triton did not run: {result['triton_note']}"]
    errors = {m: row[m]["error"] for row in result["rows"] for m in modes if "error" in row.get(m, {})}
    lines += [f"- `{m}` failed: {e}" for m, e in errors.items()]
    return "\n".join(lines) + "\n"


def setup(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import subprocess

    import torch

    from specdraft.model.flash_kernels import fa4_runs

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit, "device_name": name, "torch": torch.__version__,
            "dtype": args.dtype, "heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim,
            "layers": args.layers, "repeats": args.repeats, "modes": args.modes, "graphs": device.type == "cuda",
            "flash_prefix": "FlashAttention 4" if fa4_runs(torch.zeros(1, device=device, dtype=getattr(torch, args.dtype)))
            else "dense"}


if __name__ == "__main__":
    raise SystemExit(main())
