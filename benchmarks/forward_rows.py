"""Does a whole decode forward give a row the same bits at every width, and if not, where do they part?

Why: on an NVIDIA H200 (``results/gpu-h200-2026-11-28-27af751``) exact-mode speculation parted
from exact plain decoding on 2 of 10 HumanEval and 3 of 10 MT-Bench prompts. Yet exact mode's
probe (:mod:`specdraft.kernels.exact_rows`) found each of the model's linear and normalization
layers giving every row the same bits at every width from 1 to 64. The probe calls layers one at a
time, eagerly. A decoder runs whole forwards, replayed as CUDA graphs, through operations the
probe does not call. This script checks the whole forward the way the decoder runs it.

How: a decoder's own runner (exact mode and buckets as the decoder sets them up) commits a random
prefix, then runs, at each bucket width ``W``, one forward of ``W`` sibling rows. Row ``i`` holds
token ``t_i`` at the position after the prefix and sees the prefix and itself. So row ``i``'s
input is the same at every width, and its logits must be the widest width's row ``i``, bit for
bit. Three ways of running each width:

* ``captured``: the static forward replayed as a CUDA graph (the decoder's way on CUDA; skipped
  elsewhere);
* ``static``: the same static forward run eagerly;
* ``dynamic``: the runner's forward without static buffers.

The forwards run inside the engine's hold for a request, as decoding's do: only there does the model
run the decoder's attention (exact mode's, when on). Outside it the model keeps the implementation it
had (``sdpa``), which is not row-invariant, and the check would measure that instead. The result
names the implementation each way ran under.

In the two eager ways, forward hooks keep every module's output for the rows. For a row that
parts, the first module in call order whose output differs is named. Rows are also compared
across ways: captured against static at the same width says whether capture alone changes bits.

    python benchmarks/forward_rows.py --device cuda --shape qwen2.5-0.5b --out DIR   # random weights
    python benchmarks/forward_rows.py --device cuda --model CHECKPOINT --out DIR     # a folder or .gguf

Writes ``rows.json`` and ``rows.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_steps import SHAPES, build_model, machine  # noqa: E402

from specdraft import Decoder  # noqa: E402
from specdraft.model.kv_store import Region  # noqa: E402
from specdraft.model.runner import Segment  # noqa: E402
from specdraft.model.static import WIDTHS  # noqa: E402

WAYS = ("captured", "static", "dynamic")


class ModuleOutputs:
    """Forward hooks that keep each module's output for the forward's first ``rows`` rows, keyed
    by module name and call count (a module called twice in a forward is kept twice)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.rows = 0
        self.kept: dict[tuple[str, int], torch.Tensor] = {}
        self.order: list[tuple[str, int]] = []

    @contextmanager
    def recording(self, rows: int) -> Iterator[None]:
        self.rows, self.kept, self.order = rows, {}, []
        handles = [module.register_forward_hook(self._hook(name)) for name, module in self.model.named_modules()
                   if name]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str):
        def keep(module, args, output) -> None:
            tensor = next((t for t in (output if isinstance(output, (tuple, list)) else (output,))
                           if isinstance(t, torch.Tensor)), None)
            if tensor is None or tensor.dim() < 2 or tensor.shape[0] != 1 or tensor.shape[1] < self.rows:
                return  # not a per-row output of this forward (a cache, a mask, the store's views)
            calls = sum(1 for n, _ in self.order if n == name)
            self.order.append((name, calls))
            self.kept[(name, calls)] = tensor[0, : self.rows].detach().clone()
        return keep


def partings(a: ModuleOutputs, b: ModuleOutputs, row: int) -> list[str]:
    """The modules (in ``a``'s call order, as ``name`` or ``name#call``) whose output for ``row``
    differs between the two recordings: the first is where the row's computation parts."""
    parted = []
    for key in a.order:
        other = b.kept.get(key)
        if other is None:
            continue
        mine = a.kept[key]
        if mine.shape[1:] != other.shape[1:] or not torch.equal(mine[row], other[row]):
            name, call = key
            parted.append(name if call == 0 else f"{name}#{call}")
    return parted


def commit_prefix(dec: Decoder, prefix: Sequence[int]) -> Region:
    """A region of the decoder's store holding ``prefix`` committed, with room for the widest forward."""
    runner = dec.runner
    region = runner.store.allocate(len(prefix) + max(WIDTHS) + 64)
    runner.forward([Segment(region, list(prefix), np.arange(len(prefix)), None, [len(prefix) - 1])])
    runner.store.keep_all(region)
    return region


def sibling_rows(dec: Decoder, region: Region, width: int, tokens: Sequence[int]) -> torch.Tensor:
    """Logits (float32, on the CPU) of one forward of ``width`` sibling rows after ``region``'s
    committed tokens, each seeing those and itself; the rows are discarded after."""
    position = region.length
    segment = Segment(region, list(tokens[:width]), np.full(width, position), np.eye(width, dtype=bool),
                      list(range(width)))
    out = dec.runner.forward([segment])
    logits = out.logits[out.logit_spans[0]].to(torch.float32).cpu()
    dec.runner.store.keep(region, [])
    return logits


def check(model: torch.nn.Module, widths: Sequence[int] = WIDTHS, ways: Sequence[str] = WAYS,
          prefix_length: int = 48, seed: int = 0, exact: bool | None = None,
          cpu_kernels: str = "stock") -> dict[str, Any]:
    """Per way and width: how many rows equal the widest width's rows, the first module where the
    first parting row parts (eager ways), the width a decoder pads it to (``runs_at``: rows of a
    width padded away need not agree), and per width whether captured rows equal static ones; per
    way also the attention implementation the forwards ran under. ``cpu_kernels`` is the
    decoder's option (``"auto"``: the kernels a default decoder runs here; on a GPU, stock anyway)."""
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    generator = np.random.default_rng(seed)
    prefix = [int(t) for t in generator.integers(3, vocab, prefix_length)]
    tokens = [int(t) for t in generator.integers(3, vocab, max(widths))]
    widths = sorted(widths)
    widest = widths[-1]
    result: dict[str, Any] = {"widths": widths, "ways": {}}
    logits_by_way: dict[str, dict[int, torch.Tensor]] = {}
    for way in ways:
        if way == "captured" and not torch.cuda.is_available():
            continue
        dec = Decoder(model, None, sources=[], max_tree_nodes=0, exact=exact, cpu_kernels=cpu_kernels)
        # the width a decoder pads a forward of each width to (exact mode's rule; a GPU's buckets):
        # rows of a width it pads away are not expected to agree
        padding = dec.engine.padding
        runs_at = {w: padding.rows_for(w) if padding is not None else w for w in widths}
        if way == "dynamic":
            dec.runner.static = None
        else:
            if dec.runner.static is None or tuple(dec.runner.static.widths) != tuple(widths):
                dec.runner.use_static(widths, capture=None if way == "captured" else False)
            dec.runner.static.capture = None if way == "captured" else False
        logits: dict[int, torch.Tensor] = {}
        # as in decoding: the model on the decoder's attention (exact mode's) and CPU kernels
        with dec.engine.held(1), dec.engine.kernels():
            recorders = {w: ModuleOutputs(model) for w in widths}
            attention = getattr(model.config, "_attn_implementation", None)
            region = commit_prefix(dec, prefix)
            for width in [widest, *widths]:  # the widest first: it captures and sizes everything once
                if way == "captured":
                    logits[width] = sibling_rows(dec, region, width, tokens)
                else:
                    with recorders[width].recording(width):
                        logits[width] = sibling_rows(dec, region, width, tokens)
            repeat = sibling_rows(dec, region, widest, tokens)
        rows = {}
        for width in widths:
            parting = [i for i in range(width) if not torch.equal(logits[width][i], logits[widest][i])]
            modules = []
            if parting and way != "captured":
                modules = partings(recorders[width], recorders[widest], parting[0])
            rows[width] = {"agree": width - len(parting), "rows": width, "runs_at": runs_at[width],
                           "first_parting_row": parting[0] if parting else None,
                           "first_parting_module": modules[0] if modules else None,
                           "modules_parted": len(modules), "modules_kept": len(recorders[width].order)}
        result["ways"][way] = {"rows": rows, "repeatable": bool(torch.equal(repeat, logits[widest])),
                               "attention": attention}
        logits_by_way[way] = logits
    if "captured" in logits_by_way and "static" in logits_by_way:
        result["captured_equals_static"] = {w: bool(torch.equal(logits_by_way["captured"][w],
                                                                logits_by_way["static"][w])) for w in widths}
    return result


def markdown(result: dict[str, Any]) -> str:
    """:func:`check`'s result as a table (widths as the integers it keys them by)."""
    widths = result["widths"]
    lines = ["Rows whose logits equal the widest width's, bit for bit (in the eager ways, for the first row "
             "that parts: the first module whose output parts, and how many of the modules kept part). A width "
             "a decoder pads to another (exact mode's rule) never runs in decoding, and its rows may part:", "",
             "| way | attention | " + " | ".join(f"{w} rows" for w in widths) + " | widest twice alike |",
             "|---|---|" + "---:|" * len(widths) + "---|"]
    for way, data in result["ways"].items():
        cells = []
        for w in widths:
            r = data["rows"][w]
            cell = f"{r['agree']}/{r['rows']}"
            if r.get("runs_at", w) != w:
                cell += f" (padded to {r['runs_at']} in decoding)"
            if r["first_parting_module"]:
                cell += f" (`{r['first_parting_module']}`, {r['modules_parted']} of {r['modules_kept']} modules)"
            cells.append(cell)
        lines.append(f"| {way} | {data.get('attention')} | " + " | ".join(cells) + f" | {'yes' if data['repeatable'] else 'NO'} |")
    same = result.get("captured_equals_static")
    if same:
        lines += ["", "Captured rows equal the same static forward run eagerly: "
                  + ", ".join(f"{w} rows {'yes' if ok else 'NO'}" for w, ok in same.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES),
                        help="random weights of this shape (when --model is not given)")
    parser.add_argument("--model", help="a local checkpoint folder or .gguf file to load instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    parser.add_argument("--exact", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--cpu-kernels", default="stock", choices=["auto", "stock", "packed", "fbgemm"],
                        help="the decoder's cpu_kernels (a CPU's default is auto)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        widths = sorted({int(w) for w in args.widths.split(",")})
    except ValueError:
        parser.error(f"--widths takes comma-separated integers, got {args.widths!r}")
    if not widths or widths[0] < 1 or widths[-1] > max(WIDTHS):
        parser.error(f"--widths must lie in 1..{max(WIDTHS)}, got {args.widths!r}")
    dtype = getattr(torch, args.dtype)
    if args.model:
        from specdraft.models import load_model

        model = load_model(args.model, dtype=dtype, device=args.device)[0]
    else:
        model = build_model(args.shape, args.device, dtype)
    result = check(model, widths, exact={"auto": None, "on": True, "off": False}[args.exact],
                   cpu_kernels=args.cpu_kernels)
    result["config"] = machine(args.device) | {"model": args.model or f"random {args.shape}", "dtype": args.dtype,
                                               "exact": args.exact, "cpu_kernels": args.cpu_kernels}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "rows.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
