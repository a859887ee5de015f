"""Which CPU kernels compute a row the same whatever else shares the forward?

Exact mode (issue 43) needs every logit row of a decode forward to be bit for bit what a plain
one-token step gives for the same prefix. This script measures, on this machine, where that
holds and where it breaks, with the shapes of Qwen2.5-0.5B (hidden 896, 14 query heads and 2
key/value heads of 64, MLP 4864; the vocabulary head cut to 512 outputs, as in the random test
model):

Linear layers
    For each kernel path (``stock`` torch linear, ``packed`` oneDNN, ``fbgemm`` float16 weights),
    dtype (float32, bfloat16, float16 where the path runs it), layer shape and thread count: the
    forward widths 1..64 (and a few wider ones), partitioned into classes inside which every
    input row gets the same bits whatever its index and its neighbours
    (:func:`specdraft.kernels.exact_rows.width_classes`), the smallest width from which all widths agree
    (the padding rule), and whether two paths agree with each other at the same width.

Attention
    transformers' ``sdpa`` and ``eager`` attention functions and specdraft's ``exact`` one, on the
    real head layout over a cache of ``L`` keys, per dtype and thread count:

    (a) query rows: ``M`` rows that all see the same ``L`` keys, against the one-row forward;
    (b) interleaved masked keys: a tree node whose ancestors sit among masked siblings after
        the cache, against a plain step where the same keys are contiguous at the cache's end;
    (c) offset: the same contiguous keys preceded by masked columns (a request's region in a
        packed batch), against the same keys from column 0;
    (d) a whole tree of ``M`` nodes against plain steps walking each node's path.

    Each cell counts the rows (or cases) whose output differs from the reference in any bit.

    python benchmarks/row_invariance.py --out benchmarks/results/row-invariance-<date>-<commit>

Writes ``invariance.json`` and ``invariance.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from specdraft.kernels.cpu_kernels import PackedLinear, packed_dtype_problem  # noqa: E402
from specdraft.model.exact_attention import exact_attention  # noqa: E402
from specdraft.kernels.exact_rows import RowRule, agreeing_widths, invariant_from, width_classes  # noqa: E402
from specdraft.kernels.fp16_linear import Fp16Linear, fbgemm_problem  # noqa: E402
from specdraft.kernels.kernel_costs import cpu_name  # noqa: E402

#: (in, out) of every linear layer of Qwen2.5-0.5B (q, k/v, o, gate/up, down, a cut vocabulary head)
SHAPES = ((896, 896), (896, 128), (896, 4864), (4864, 896), (896, 512))
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WIDE = (80, 96, 128, 192, 256)
TABLE_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    parser.add_argument("--cache-lens", default="40,300,1000", help="comma list of cache lengths L for attention")
    parser.add_argument("--max-width", type=int, default=64, help="widest forward measured one by one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    args.cache_lens = [int(t) for t in args.cache_lens.split(",") if t.strip()]
    if not args.threads or min(args.threads) < 1 or not args.cache_lens or min(args.cache_lens) < 1:
        parser.error("--threads and --cache-lens need positive integers")
    return args


# -- linear layers ---------------------------------------------------------------------------------


def linear_paths(dtype: torch.dtype, linear: nn.Linear) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """The kernel paths that run this layer here, and why each other one does not."""
    paths: dict[str, nn.Module] = {"stock": linear}
    skipped: dict[str, str] = {}
    problem = packed_dtype_problem(dtype)
    if problem is None:
        paths["packed"] = PackedLinear(linear)
    else:
        skipped["packed"] = problem
    problem = fbgemm_problem()
    layer = Fp16Linear.build(linear) if problem is None else None
    if layer is not None:
        paths["fbgemm"] = layer
    else:
        skipped["fbgemm"] = problem or "float16 cannot hold the weights"
    return paths, skipped


def measure_linear(threads: int, widths: tuple[int, ...], seed: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    rows: list[dict[str, Any]] = []
    for dtype_name, dtype in DTYPES.items():
        for shape in SHAPES:
            torch.manual_seed(seed)
            linear = nn.Linear(*shape, bias=False)
            with torch.no_grad():  # a bfloat16 checkpoint's values, so every path can hold them
                linear.weight.copy_(linear.weight.to(torch.bfloat16).to(torch.float32))
            linear = linear.to(dtype).eval().requires_grad_(False)
            paths, skipped = linear_paths(dtype, linear)
            outputs = {}
            probe = torch.randn(64, shape[0]).to(dtype)
            for path, layer in paths.items():
                started = time.perf_counter()
                classes = width_classes(layer, shape[0], dtype, widths, seed=seed)
                with torch.inference_mode():
                    outputs[path] = layer(probe[None])[0]
                rows.append({"dtype": dtype_name, "path": path, "shape": list(shape), "threads": threads,
                             "classes": classes, "invariant_from": invariant_from(classes),
                             "seconds": round(time.perf_counter() - started, 2)})
            for path in paths:  # do two paths give the same bits at a 64-row width?
                rows_same = {other: bool(torch.equal(outputs[path], outputs[other])) for other in paths if other != path}
                next(r for r in rows if r["dtype"] == dtype_name and r["path"] == path and r["shape"] == list(shape)
                     and r["threads"] == threads)["same_as_at_64"] = rows_same
            for path, why in skipped.items():
                rows.append({"dtype": dtype_name, "path": path, "shape": list(shape), "threads": threads,
                             "skipped": why})
    return rows


# -- attention --------------------------------------------------------------------------------------


class _Attention(nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self) -> None:
        super().__init__()
        self.num_key_value_groups = HEADS // KV_HEADS
        self.is_causal = True
        self.training = False


def attention_functions() -> dict[str, Callable]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward, "exact": exact_attention}


def _run(fn: Callable, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         allowed: torch.Tensor | None) -> torch.Tensor:
    """``fn`` on ``[1, H, q, D]`` queries; ``allowed`` ``[q, kv]`` bool or ``None``; ``[q, H, D]`` out."""
    mask = None
    if allowed is not None:
        mask = allowed[None, None]
        if fn.__name__.startswith("eager"):  # eager takes an additive mask
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    with torch.inference_mode():
        out, _ = fn(module, q, k, v, mask, scaling=HEAD_DIM ** -0.5, dropout=0.0)
    return out[0]


def _tree(n: int, generator: torch.Generator) -> list[list[int]]:
    """Ancestors (and self) of each node of a random tree of ``n`` nodes in topological order, each
    node's parent among the last few nodes (bushy near the root, deep paths)."""
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (), generator=generator)) for i in range(1, n)]
    ancestors = []
    for i in range(n):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            j = parents[j]
        ancestors.append(sorted(chain))
    return ancestors


def measure_attention(threads: int, cache_lens: list[int], widths: tuple[int, ...], seed: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    module = _Attention()
    functions = attention_functions()
    rows: list[dict[str, Any]] = []
    for dtype_name, dtype in DTYPES.items():
        for cache_len in cache_lens:
            generator = torch.Generator().manual_seed(seed)
            n = max(widths)
            keys = torch.randn(1, KV_HEADS, cache_len + n + 8, HEAD_DIM, generator=generator).to(dtype)
            values = torch.randn(1, KV_HEADS, cache_len + n + 8, HEAD_DIM, generator=generator).to(dtype)
            queries = torch.randn(1, n, HEADS, HEAD_DIM, generator=generator).to(dtype).transpose(1, 2)
            ancestors = _tree(n, generator)
            for name, fn in functions.items():
                record: dict[str, Any] = {"dtype": dtype_name, "function": name, "cache_len": cache_len,
                                          "threads": threads}
                plain = [_run(fn, module, queries[:, :, r : r + 1], keys[:, :, :cache_len], values[:, :, :cache_len],
                              None)[0] for r in range(n)]
                # (a) M rows over the same L keys
                record["a_query_rows"] = {}
                for m in widths:
                    allowed = torch.ones(m, cache_len, dtype=torch.bool)
                    out = _run(fn, module, queries[:, :, :m], keys[:, :, :cache_len], values[:, :, :cache_len],
                               allowed if m > 1 else None)
                    record["a_query_rows"][m] = sum(not torch.equal(out[r], plain[r]) for r in range(m))
                # plain steps along each node's path: the keys contiguous at the cache's end
                cols = [list(range(cache_len)) + [cache_len + a for a in ancestors[r]] for r in range(n)]
                walk = [_run(fn, module, queries[:, :, r : r + 1], keys[:, :, cols[r]], values[:, :, cols[r]], None)[0]
                        for r in range(n)]
                # (b) one node, its ancestors among masked siblings (the columns of a 64-node tree)
                kv = cache_len + n
                diff_b = 0
                for r in range(n):
                    allowed = torch.zeros(1, kv, dtype=torch.bool)
                    allowed[0, cols[r]] = True
                    out = _run(fn, module, queries[:, :, r : r + 1], keys[:, :, :kv], values[:, :, :kv], allowed)
                    diff_b += not torch.equal(out[0], walk[r])
                record["b_interleaved"] = f"{diff_b}/{n}"
                # (c) the same contiguous keys after masked columns
                diff_c = 0
                for shift in (1, 5, 8, 31, 64):
                    ks = torch.cat([keys[:, :, -8:].repeat(1, 1, 8, 1)[:, :, :shift], keys[:, :, : cache_len + 1]], 2)
                    vs = torch.cat([values[:, :, -8:].repeat(1, 1, 8, 1)[:, :, :shift], values[:, :, : cache_len + 1]], 2)
                    allowed = torch.ones(1, shift + cache_len + 1, dtype=torch.bool)
                    allowed[0, :shift] = False
                    out = _run(fn, module, queries[:, :, :1], ks, vs, allowed)
                    ref = _run(fn, module, queries[:, :, :1], keys[:, :, : cache_len + 1], values[:, :, : cache_len + 1],
                               None)
                    diff_c += not torch.equal(out, ref)
                record["c_offset"] = f"{diff_c}/5"
                # (d) trees of M nodes against the walks
                record["d_tree"] = {}
                for m in widths:
                    allowed = torch.zeros(m, cache_len + m, dtype=torch.bool)
                    allowed[:, :cache_len] = True
                    for r in range(m):
                        allowed[r, [cache_len + a for a in ancestors[r]]] = True
                    out = _run(fn, module, queries[:, :, :m], keys[:, :, : cache_len + m], values[:, :, : cache_len + m],
                               allowed if m > 1 else None)
                    record["d_tree"][m] = sum(not torch.equal(out[r], walk[r]) for r in range(m))
                rows.append(record)
    return rows


# -- report -----------------------------------------------------------------------------------------


def _label(classes: list[list[int]], width: int) -> str:
    for i, members in enumerate(classes):
        if width in members:
            return "ABCDEFGHIJ"[i] if i < 10 else str(i)
    return "-"


def markdown(result: dict[str, Any]) -> str:
    for r in result["attention"]:  # JSON keys are strings
        for part in ("a_query_rows", "d_tree"):
            r[part] = {int(m): n for m, n in r[part].items()}
    lines = [f"# Row-count invariance, {result['machine']['cpu']}", "",
             f"torch {result['machine']['torch']}, transformers {result['machine']['transformers']}, "
             f"commit {result['machine']['commit']}, {result['machine']['date']}. "
             f"ISA: {result['machine']['isa']}.", "",
             "## Linear layers: width classes", "",
             "Each cell names the class of that forward width (rows); widths with the same letter compute every "
             "row bit for bit alike, whatever its index and the other rows. `pad to` is the smallest width from "
             "which every width up to 256 is in one class: padding every decode forward to it makes each row "
             "independent of the row count. Shapes are (in, out).", ""]
    header = "| dtype | path | threads | shape | " + " | ".join(str(w) for w in TABLE_WIDTHS) + " | pad to |"
    lines += [header, "|" + "---|" * (5 + len(TABLE_WIDTHS))]
    for row in result["linear"]:
        if "skipped" in row:
            continue
        cells = [_label(row["classes"], w) for w in TABLE_WIDTHS]
        pad = row["invariant_from"]
        lines.append(f"| {row['dtype']} | {row['path']} | {row['threads']} | {row['shape'][0]}x{row['shape'][1]} | "
                     + " | ".join(cells) + f" | {pad if pad is not None else 'none'} |")
    skipped = sorted({(r["dtype"], r["path"], r["skipped"]) for r in result["linear"] if "skipped" in r})
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{p} {d} ({why})" for d, p, why in skipped) + "."]
    lines += ["", "### The rule per path and dtype (worst layer shape)", "",
              "| dtype | path | threads | pad to at least (all widths up to 256 agree) | rule (widths agreeing with 64 rows) | same bits as other paths at 64 rows |",
              "|---|---|---|---|---|---|"]
    seen: dict[tuple, list[dict[str, Any]]] = {}
    for row in result["linear"]:
        if "skipped" not in row:
            seen.setdefault((row["dtype"], row["path"], row["threads"]), []).append(row)
    for (dtype, path, threads), group in seen.items():
        pads = [r["invariant_from"] for r in group]
        pad = "none" if None in pads else max(pads)
        agree = sorted({o for r in group for o, same in r.get("same_as_at_64", {}).items() if same})
        agree_all = [o for o in agree if all(r.get("same_as_at_64", {}).get(o) for r in group)]
        narrow = max(w for r in group for members in r["classes"] for w in members if w <= 64)
        common = set.intersection(*(set(agreeing_widths(r["classes"], anchor=narrow)) for r in group))
        wide = {w for r in group for members in r["classes"] for w in members if w > narrow}
        rule = RowRule(tuple(sorted(w for w in common if w <= narrow)), wider=bool(wide) and wide <= common)
        buckets = rule.describe().removeprefix("pad to ")
        lines.append(f"| {dtype} | {path} | {threads} | {pad} | {buckets} | {', '.join(agree_all) or 'none'} |")
    lines += ["", "## Attention", "",
              "Rows (or cases) whose output differs in any bit from the reference: (a) of `M` query rows over the "
              "same keys, against one-row forwards; (b) a tree node whose ancestors sit among masked siblings, "
              "against the plain step with the same keys contiguous; (c) the same keys after masked columns; "
              "(d) of a tree of `M` nodes, against plain steps along each node's path.", ""]
    widths = sorted({int(m) for r in result["attention"] for m in r["a_query_rows"]})
    lines += ["| dtype | function | L | threads | " + " | ".join(f"(a) M={m}" for m in widths) +
              " | (b) | (c) | " + " | ".join(f"(d) M={m}" for m in widths) + " |",
              "|" + "---|" * (6 + 2 * len(widths))]
    for r in result["attention"]:
        lines.append(f"| {r['dtype']} | {r['function']} | {r['cache_len']} | {r['threads']} | "
                     + " | ".join(str(r["a_query_rows"][m]) for m in widths) + f" | {r['b_interleaved']} | "
                     f"{r['c_offset']} | " + " | ".join(str(r["d_tree"][m]) for m in widths) + " |")
    return "\n".join(lines) + "\n"


def machine() -> dict[str, Any]:
    import transformers

    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16") if f" {f}" in flags]
    family = model = ""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        family = next(line.split(":")[1].strip() for line in info if line.startswith("cpu family"))
        model = next(line.split(":")[1].strip() for line in info if line.startswith("model\t"))
    except (OSError, StopIteration, IndexError):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {"cpu": f"{cpu_name()} (family {family}, model {model})", "isa": ", ".join(isa) or "unknown",
            "platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(), "commit": commit,
            "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    widths = tuple(range(1, args.max_width + 1)) + tuple(w for w in WIDE if w > args.max_width)
    result: dict[str, Any] = {"machine": machine(), "linear": [], "attention": []}
    for threads in args.threads:
        print(f"linear layers, {threads} thread(s) ...", file=sys.stderr)
        result["linear"] += measure_linear(threads, widths, args.seed)
    attention_widths = tuple(w for w in (1, 2, 3, 4, 8, 16, 64) if w <= args.max_width)
    for threads in args.threads:
        print(f"attention, {threads} thread(s) ...", file=sys.stderr)
        result["attention"] += measure_attention(threads, args.cache_lens, attention_widths, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "invariance.json").write_text(json.dumps(result, indent=1))
    (out / "invariance.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
