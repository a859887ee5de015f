"""How much does a forward of ``k`` new tokens cost, per CPU kernel path?

Speculation pays when checking ``k`` draft tokens costs about what checking one does. This script
measures that curve on your machine: milliseconds per forward of ``k`` new tokens (a causal chain,
as a tree's deepest branch) over a KV cache of ``--cache-len`` tokens, for each kernel path of
``Decoder(cpu_kernels=...)``, ``k`` in 1, 2, 3, 4, 8, 16, 32. Paths and widths are interleaved
inside every repeat (so a machine that slows down mid-run slows every path alike) and medians are
reported. Every forward goes through specdraft's own ``ModelRunner`` with the packed layers
swapped in around it, exactly as the decoder runs it; the cache is cut back to ``--cache-len``
after each.

    python benchmarks/cost_curve.py                        # qwen2.5-coder-0.5b, float32
    python benchmarks/cost_curve.py --dtype bfloat16 --repeats 7 --out cost-bf16
    python benchmarks/cost_curve.py --dtype bfloat16 --paths stock,fbgemm --out cost-bf16-fbgemm

Writes ``curve.json``, ``curve.csv`` and ``curve.png`` (with matplotlib) under ``--out``.
Use one thread (``--threads 1``, the default) for numbers comparable with single-stream decoding
on a shared machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

DEFAULT_MODEL = "qwen2.5-coder-0.5b"  # a specdraft.models alias: found in the cache or fetched once
WIDTHS = (1, 2, 3, 4, 8, 16, 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="alias, checkpoint dir, .gguf file or hub id")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cache-len", type=int, default=300, help="tokens already in the KV cache")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per (path, k)")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma list of k")
    parser.add_argument("--paths", default="stock,packed", help="comma list of cpu_kernels values")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="cost-curve", help="output directory")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",") if w.strip()]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    from specdraft.kernels.cpu_kernels import CPU_KERNELS

    bad = [p for p in args.paths if p not in CPU_KERNELS]
    if bad:
        parser.error(f"--paths: unknown {bad}; valid: {list(CPU_KERNELS)}")
    if args.cache_len < 1 or args.repeats < 1 or not args.widths or min(args.widths) < 1:
        parser.error("--cache-len, --repeats and every width must be >= 1")
    return args


def measure(model, paths: list[str], widths: list[int], cache_len: int, repeats: int,
            say=lambda msg: None) -> dict[str, dict[int, list[float]]]:
    """Seconds of each timed forward, ``{path: {k: [seconds, ...]}}``."""
    import numpy as np
    import torch

    from specdraft.kernels.cpu_kernels import check_cpu_kernels, packed_model
    from specdraft.model.runner import ModelRunner, Segment

    for path in paths:
        check_cpu_kernels(model, path)
    contexts = {path: (nullcontext if path == "stock" else packed_model(model, path).swapped) for path in paths}
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, min(vocab, 30000), cache_len).tolist()
    runner = ModelRunner(model)
    region = runner.store.allocate(cache_len + max(widths) + 1)
    runner.forward([Segment(region, prompt, np.arange(cache_len), None, [cache_len - 1])])
    runner.store.keep_all(region)
    times: dict[str, dict[int, list[float]]] = {p: {k: [] for k in widths} for p in paths}

    def one(path: str, k: int) -> float:
        tokens = rng.integers(100, min(vocab, 30000), k).tolist()
        segment = Segment(region, tokens, cache_len + np.arange(k), np.tril(np.ones((k, k), dtype=bool)), range(k))
        start = time.perf_counter()
        with contexts[path]():
            runner.forward([segment])
        seconds = time.perf_counter() - start
        runner.store.keep(region, [])  # back to cache_len
        return seconds

    with torch.inference_mode():
        for path in paths:  # warm-up: first calls allocate and pick kernels
            for k in widths:
                one(path, k)
        for r in range(repeats):
            for k in widths:
                for path in (paths if (r + k) % 2 == 0 else paths[::-1]):
                    times[path][k].append(one(path, k))
            say(f"repeat {r + 1}/{repeats} done")
    return times


def summarize(times: dict[str, dict[int, list[float]]]) -> list[dict]:
    rows = []
    for path, per_k in times.items():
        base = statistics.median(per_k[min(per_k)])
        for k, seconds in per_k.items():
            med = statistics.median(seconds)
            rows.append({"path": path, "k": k, "median_ms": round(med * 1e3, 2),
                         "min_ms": round(min(seconds) * 1e3, 2), "max_ms": round(max(seconds) * 1e3, 2),
                         "vs_own_k1": round(med / base, 3), "repeats": len(seconds)})
    stock = {r["k"]: r["median_ms"] for r in rows if r["path"] == "stock"}
    for r in rows:
        if r["k"] in stock:
            r["vs_stock_same_k"] = round(r["median_ms"] / stock[r["k"]], 3)
    return rows


def table(rows: list[dict]) -> str:
    paths = list(dict.fromkeys(r["path"] for r in rows))
    ks = sorted({r["k"] for r in rows})
    at = {(r["path"], r["k"]): r["median_ms"] for r in rows}
    lines = ["| path | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---:|" * len(ks)]
    for p in paths:
        lines.append(f"| {p} | " + " | ".join(f"{at[p, k]:.0f}" for k in ks) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for p in dict.fromkeys(r["path"] for r in rows):
        pts = sorted((r["k"], r["median_ms"]) for r in rows if r["path"] == p)
        ax.plot([k for k, _ in pts], [m for _, m in pts], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ks = sorted({r["k"] for r in rows})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("new tokens per forward (k)")
    ax.set_ylabel("ms per forward (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from specdraft.models import load_model

    torch.set_num_threads(args.threads)
    say = lambda msg: print(f"cost_curve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    model, _ = load_model(args.model, dtype=args.dtype, progress=False)
    times = measure(model, args.paths, args.widths, args.cache_len, args.repeats, say)
    rows = summarize(times)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"model": args.model, "dtype": args.dtype, "cache_len": args.cache_len, "repeats": args.repeats,
              "threads": args.threads, "torch": torch.__version__, "platform": platform.platform(),
              "processor": platform.processor() or platform.machine(), "argv": sys.argv[1:]}
    (out / "curve.json").write_text(json.dumps({"config": config, "rows": rows,
                                                "seconds": {p: {str(k): v for k, v in per.items()}
                                                            for p, per in times.items()}}, indent=2) + "\n")
    with open(out / "curve.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if not args.no_plot:
        plot(rows, out / "curve.png",
             f"{Path(args.model).name} {args.dtype}, cache {args.cache_len}, {args.threads} thread(s)")
    print(table(rows))
    say(f"wrote {out}/curve.json, curve.csv" + ("" if args.no_plot else ", curve.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
