"""What does exact mode cost? Milliseconds per forward of ``k`` new tokens, today against exact mode.

Exact mode (issue 43) pads every decode forward to the width from which the linear layers compute
each row alike (:mod:`specdraft.kernels.exact_rows`, probed here per kernel path) and runs the attention
on :mod:`specdraft.model.exact_attention`. This script times, for each CPU kernel path (``stock``,
``packed``, ``fbgemm``) and each forward width ``k`` (a tree of ``k`` nodes over a KV cache of
``--cache-len`` tokens, through specdraft's own ``ModelRunner``):

``today``
    the forward as the decoder runs it now (``sdpa``, no padding, no mask for one row);
``padded``
    padded to the path's width, still on ``sdpa`` (the price of the padding alone);
``exact``
    padded and on the exact attention (exact mode).

Modes, paths and widths are interleaved inside every repeat. Times are the process's CPU time
(``time.process_time``: with one torch thread the forward runs on the calling thread), not the
wall clock: on a machine shared with other work the wall clock adds the time the process waited
for a core, unevenly, and a 2-core machine busy with other jobs made wall-clock medians of the
same forward differ by 2x between repeats. Medians of the repeats are reported. A second table times the attention alone (one layer's worth, the
model's head layout, ``sdpa`` against exact, fastest of many calls), which is what exact mode
changes besides the padding. One thread by default. The attention switch is a registered function that routes to ``sdpa`` or to the exact
attention by a flag of this script, so both modes run on one model and one cache.

    python benchmarks/exact_price.py --model qwen2.5-coder-0.5b --dtype bfloat16 \\
        --out benchmarks/results/exact-price-<date>-<commit>

Writes ``price.json`` and ``price.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WIDTHS = (1, 2, 3, 4, 8, 16, 32, 64)
ATTENTION_CACHES = (300, 1000)
ATTENTION_CALLS = 30
MODES = ("today", "padded", "exact")
ROUTE_NAME = "specdraft_price_route"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="alias, checkpoint dir, .gguf file or hub id")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--cache-len", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    parser.add_argument("--paths", default="stock,packed,fbgemm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",") if w.strip()]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if args.cache_len < 1 or args.repeats < 1 or not args.widths or min(args.widths) < 1:
        parser.error("--cache-len, --repeats and every width must be >= 1")
    return args


class _Route:
    """Which attention the registered route runs: ``sdpa`` (today) or the exact one."""

    exact = False


def _route(module, query, key, value, attention_mask, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdraft.model.exact_attention import exact_attention

    fn = exact_attention if _Route.exact else sdpa_attention_forward
    return fn(module, query, key, value, attention_mask, *args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    import specdraft.model.runner as runner_module
    from row_invariance import machine
    from specdraft.kernels.cpu_kernels import CpuKernelError, check_cpu_kernels, packed_model
    from specdraft.kernels.exact_rows import ExactRowsError, pad_block, probe_rule, row_layers
    from specdraft.models import load_model

    torch.set_num_threads(args.threads)
    say = lambda msg: print(f"exact_price: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    model, _ = load_model(args.model, dtype=args.dtype, progress=False)
    dtype = next(model.parameters()).dtype
    AttentionInterface.register(ROUTE_NAME, _route)
    AttentionMaskInterface.register(ROUTE_NAME, sdpa_mask)
    runner_module._MASK_KIND[ROUTE_NAME] = "bool"  # this script's route takes sdpa's bool masks
    model.set_attn_implementation(ROUTE_NAME)

    paths, skipped, packs, rules, probe_seconds = [], {}, {}, {}, {}
    for path in args.paths:
        try:
            check_cpu_kernels(model, path)
            packs[path] = None if path == "stock" else packed_model(model, path)
            started = time.perf_counter()
            rules[path] = probe_rule(row_layers(model, packs[path]), dtype)
            probe_seconds[path] = round(time.perf_counter() - started, 1)
            paths.append(path)
            say(f"{path}: {rules[path].describe()}, probed in "
                f"{probe_seconds[path]} s")
        except (CpuKernelError, ExactRowsError) as exc:
            skipped[path] = str(exc)
            say(f"{path} skipped: {exc}")
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(0)
    runner = runner_module.ModelRunner(model)
    with torch.inference_mode():
        runner.prefill(rng.integers(100, min(vocab, 30000), args.cache_len).tolist())
        runner.compact([0])

    def parents(k: int) -> list[int]:
        return [-1] + [max(0, i - 1 - (i % 3)) for i in range(1, k)]  # branches every third node

    def block_of(k: int) -> tuple[np.ndarray, np.ndarray]:
        par = parents(k)
        block = np.zeros((k, k), dtype=bool)
        depth = np.zeros(k, dtype=np.int64)
        for i in range(k):
            depth[i] = 0 if par[i] < 0 else depth[par[i]] + 1
            j = i
            while j >= 0:
                block[i, j] = True
                j = par[j]
        return depth, block

    def one(path: str, mode: str, k: int) -> float:
        tokens = rng.integers(100, min(vocab, 30000), k).tolist()
        offsets, block = block_of(k)
        if mode != "today":
            tokens, offsets, block = pad_block(tokens, offsets, block, rules[path].rows_for(k))
        _Route.exact = mode == "exact"
        context = nullcontext() if packs[path] is None else packs[path].swapped()
        start = time.process_time()
        with context:
            runner.forward(tokens, offsets, block)
        seconds = time.process_time() - start
        runner.compact([])
        return seconds

    times: dict[str, dict[str, dict[int, list[float]]]] = {p: {m: {k: [] for k in args.widths} for m in MODES}
                                                           for p in paths}
    with torch.inference_mode():
        for path in paths:
            for mode in MODES:
                for k in args.widths:
                    one(path, mode, k)  # warm-up
        for r in range(args.repeats):
            for k in args.widths:
                order = [(p, m) for p in paths for m in MODES]
                for path, mode in (order if (r + k) % 2 == 0 else order[::-1]):
                    times[path][mode][k].append(one(path, mode, k))
            say(f"repeat {r + 1}/{args.repeats} done")

    rows = []
    for path in paths:
        for k in args.widths:
            best = {m: min(times[path][m][k]) * 1e3 for m in MODES}
            med = {m: statistics.median(times[path][m][k]) * 1e3 for m in MODES}
            rows.append({"path": path, "k": k, "width": rules[path].rows_for(k),
                         **{f"{m}_ms": round(med[m], 2) for m in MODES},
                         **{f"{m}_fastest_ms": round(best[m], 2) for m in MODES},
                         "padded_vs_today": round(med["padded"] / med["today"], 3),
                         "exact_vs_today": round(med["exact"] / med["today"], 3)})
    say("attention alone ...")
    attention = attention_alone(model, args.widths, rules)
    result = {"machine": machine(), "config": {"model": args.model, "dtype": args.dtype, "cache_len": args.cache_len,
                                               "repeats": args.repeats, "threads": args.threads,
                                               "argv": sys.argv[1:]},
              "rules": {p: {"rule": rules[p].describe(), "widths": list(rules[p].widths),
                            "per_shape": [[list(s), list(w)] for s, w in rules[p].per_shape],
                            "probe_seconds": probe_seconds[p]} for p in paths},
              "skipped": skipped, "rows": rows, "attention": attention,
              "seconds": {p: {m: {str(k): v for k, v in per.items()} for m, per in modes.items()}
                          for p, modes in times.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "price.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (out / "price.md").write_text(text)
    print(text)
    return 0


def attention_alone(model, widths: list[int], rules: dict) -> list[dict[str, Any]]:
    """Microseconds per attention call of one layer, ``sdpa`` (today: no padding, no mask for one
    row) against exact (padded like the narrowest rule pads), over a tree of ``k`` nodes."""
    import numpy as np
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdraft.model.exact_attention import exact_attention

    layer = next(m for m in model.modules() if hasattr(m, "num_key_value_groups"))
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    pad_to = max((r.min_rows for r in rules.values()), default=1)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for cache_len in ATTENTION_CACHES:
        for k in widths:
            width = max(k, pad_to)
            keys = torch.randn(1, kv_heads, cache_len + width, dim, generator=gen).to(dtype)
            values = torch.randn(1, kv_heads, cache_len + width, dim, generator=gen).to(dtype)
            query = torch.randn(1, width, heads, dim, generator=gen).to(dtype).transpose(1, 2)
            parents = [-1] + [max(0, i - 1 - (i % 3)) for i in range(1, k)]
            allowed = np.zeros((width, cache_len + width), dtype=bool)
            allowed[:, :cache_len] = True
            for i in range(width):
                j = i if i < k else -1
                allowed[i, cache_len + i] = True
                while j >= 0:
                    allowed[i, cache_len + j] = True
                    j = parents[j]
            mask = torch.from_numpy(allowed)[None, None]
            calls = {"sdpa": lambda: sdpa_attention_forward(layer, query[:, :, :k], keys[:, :, : cache_len + k],
                                                            values[:, :, : cache_len + k],
                                                            None if k == 1 else mask[:, :, :k, : cache_len + k],
                                                            scaling=dim ** -0.5),
                     "exact": lambda: exact_attention(layer, query, keys, values, mask, scaling=dim ** -0.5)}
            best = {name: float("inf") for name in calls}
            with torch.inference_mode():
                for _ in range(ATTENTION_CALLS):
                    for name, call in calls.items():
                        start = time.process_time()
                        call()
                        best[name] = min(best[name], time.process_time() - start)
            rows.append({"cache_len": cache_len, "k": k, "width": width, "sdpa_us": round(best["sdpa"] * 1e6, 1),
                         "exact_us": round(best["exact"] * 1e6, 1),
                         "exact_vs_sdpa": round(best["exact"] / best["sdpa"], 3)})
    return rows


def markdown(result: dict[str, Any]) -> str:
    cfg, mach = result["config"], result["machine"]
    lines = [f"# Exact mode's price, {Path(cfg['model']).name} {cfg['dtype']}", "",
             f"{mach['cpu']}, {mach['isa']}; torch {mach['torch']}, {cfg['threads']} thread(s), cache of "
             f"{cfg['cache_len']} tokens, median CPU time of {cfg['repeats']} interleaved repeats, commit {mach['commit']}, "
             f"{mach['date']}.", "",
             "Padding rule per path (probed on the model's layers): " +
             "; ".join(f"{p}: {r['rule']} (probe {r['probe_seconds']} s)"
                       for p, r in result["rules"].items()) + ".", "",
             "CPU ms per forward of a tree of `k` nodes (median; fastest in parentheses): today (sdpa, no padding) / "
             "padded (sdpa) / exact (padded, exact attention), and exact against today.", "",
             "| path | k | width | today ms | padded ms | exact ms | padded vs today | exact vs today |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['path']} | {r['k']} | {r['width']} | {r['today_ms']:.1f} ({r['today_fastest_ms']:.0f}) | "
                     f"{r['padded_ms']:.1f} ({r['padded_fastest_ms']:.0f}) | {r['exact_ms']:.1f} "
                     f"({r['exact_fastest_ms']:.0f}) | {r['padded_vs_today']:.2f}x | {r['exact_vs_today']:.2f}x |")
    lines += ["", "The attention alone, one layer, CPU microseconds per call (fastest of "
              f"{ATTENTION_CALLS}): sdpa over the `k` rows as today, exact over them padded.", "",
              "| cache | k | width | sdpa us | exact us | exact vs sdpa |", "|---:|---:|---:|---:|---:|---:|"]
    for r in result["attention"]:
        lines.append(f"| {r['cache_len']} | {r['k']} | {r['width']} | {r['sdpa_us']:.0f} | {r['exact_us']:.0f} | "
                     f"{r['exact_vs_sdpa']:.2f}x |")
    if result["skipped"]:
        lines += ["", "Not run: " + "; ".join(f"{p} ({why})" for p, why in result["skipped"].items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
