"""Two versions of specdraft in one process, interleaved prompt by prompt: is a change faster or slower?

Why in one process: on a machine that other work shares, two runs an hour apart see different
loads, and a 3% difference drowns in that. Here the package of an earlier commit is copied under
another name (``specdraft_base``, its absolute imports renamed) and both versions decode the same
prompts over copies of the same model weights (the base version's own copy, so that neither can
leave the other, or ``generate``, on its attention backend), alternating which goes first, with
plain ``model.generate`` timed beside them; each version's speed is its ratio to ``generate`` on the same prompt, so a
load that slows everything alike cancels.

    python benchmarks/before_after.py --base 8ce14d2 --dataset humaneval --limit 10 --dtype bfloat16
    python benchmarks/before_after.py --base 8ce14d2 --dataset humaneval --limit 8 --concurrency 1,4,8

Single requests: per prompt, the seconds of ``generate``, the base decoder and the new one (the
default sources and kernels); the medians of the per-prompt ratios. Concurrency: for each level,
``generate_batch`` of all prompts with both versions, tokens per second, alternating order over
``--repeats`` rounds. The decoders keep what their sources learn from round to round, so from the
second round on the drafts replay answers of the same prompts seen before, and in bfloat16 a batch
that parts from them at a near-tie runs on without drafts: ``--fresh`` makes every round's decoders
new (what a server meets with prompts it has not seen), which measures the engine rather than the
memory. Outputs are compared too (greedy: both versions must give the same tokens in
float32; in bfloat16 they may part at near-ties).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BASE_NAME = "specdraft_base"


def import_base(rev: str) -> Any:
    """The package of commit ``rev`` imported as :data:`BASE_NAME` (absolute imports renamed)."""
    where = Path(tempfile.mkdtemp(prefix="specdraft-base-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "specdraft"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    package = where / BASE_NAME
    shutil.move(str(where / "specdraft"), package)
    pattern = re.compile(r"\bspecdraft(?=[.\s])")
    for path in package.rglob("*.py"):
        text = path.read_text()
        path.write_text(pattern.sub(BASE_NAME, text.replace("from specdraft import", f"from {BASE_NAME} import")))
    sys.path.insert(0, str(where))
    return importlib.import_module(BASE_NAME)


def commit_of(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                          text=True).stdout.strip()


def timed(fn) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def single(model, tokenizer, prompts, decoders: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """Per prompt: generate, then each decoder, the order of the decoders rotating."""
    rows = []
    names = list(decoders)
    for i, record in enumerate(prompts):
        ids = torch.tensor([record.token_ids])
        mask = torch.ones_like(ids)
        plain_s, plain = timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                                      do_sample=False)[0, ids.shape[1]:].tolist())
        row: dict[str, Any] = {"prompt": record.id, "generate_s": plain_s, "new_tokens": len(plain),
                               "generate_attention": model.config._attn_implementation}
        for name in names[i % len(names):] + names[: i % len(names)]:
            seconds, out = timed(lambda: decoders[name].generate(list(record.token_ids), max_new_tokens=new_tokens))
            row[f"{name}_s"] = seconds
            row[f"{name}_ratio"] = plain_s / seconds
            row[f"{name}_steps"] = out.stats.steps
            row[f"{name}_identical"] = list(out.token_ids) == plain
            row[f"{name}_output"] = list(out.token_ids)
        row["versions_agree"] = all(row[f"{n}_output"] == row[f"{names[0]}_output"] for n in names)
        if "new-plain" in names:  # what exact mode promises: our speculation = our plain decoding
            for n in names:
                row[f"{n}_identical_to_plain"] = row[f"{n}_output"] == row["new-plain_output"]
        rows.append(row)
        print(f"{record.id}: " + "  ".join(f"{n} {row[f'{n}_ratio']:.2f}x" for n in names), file=sys.stderr)
    summary = {name: {"median_ratio": statistics.median(r[f"{name}_ratio"] for r in rows),
                      "worst_ratio": min(r[f"{name}_ratio"] for r in rows),
                      "tokens_per_step": sum(r["new_tokens"] for r in rows) / sum(r[f"{name}_steps"] for r in rows),
                      "identical_to_generate": sum(r[f"{name}_identical"] for r in rows),
                      "identical_to_new_plain": sum(r.get(f"{name}_identical_to_plain", False) for r in rows)}
               for name in names}
    for name in names[1:]:
        paired = [r[f"{name}_ratio"] / r[f"{names[0]}_ratio"] for r in rows]
        summary[f"{name}_over_{names[0]}"] = {"median": statistics.median(paired), "per_prompt": paired}
    summary["outputs_agree"] = sum(r["versions_agree"] for r in rows)
    for r in rows:
        for name in names:
            r.pop(f"{name}_output")
    return {"rows": rows, "summary": summary}


def concurrency(prompts, decoders: dict[str, Any], new_tokens: int, levels: list[int], repeats: int,
                makers: dict[str, Any] | None = None) -> dict:
    """Tokens per second of ``generate_batch`` over all prompts at each level, both versions; with
    ``makers``, each round on decoders made for it (and closed after it)."""
    names = list(decoders)
    out: dict[str, Any] = {}
    for level in levels:
        runs: dict[str, list[float]] = {name: [] for name in names}
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                decoder = makers[name]() if makers else decoders[name]
                seconds, result = timed(lambda: decoder.generate_batch(
                    [list(p.token_ids) for p in prompts], max_new_tokens=new_tokens, concurrency=level))
                runs[name].append(sum(len(o.token_ids) for o in result) / seconds)
                if makers:
                    decoder.close()
        out[str(level)] = {name: {"tokens_per_s": statistics.median(v), "runs": v} for name, v in runs.items()}
        for name in names[1:]:
            ratio = out[str(level)][name]["tokens_per_s"] / out[str(level)][names[0]]["tokens_per_s"]
            out[str(level)][f"{name}_over_{names[0]}"] = ratio
            print(f"concurrency {level}: {name}/{names[0]} {ratio:.3f}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit (a git revision)")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=None, help="default: the library's default model")
    parser.add_argument("--concurrency", default=None, help="levels, e.g. 1,4,8 (instead of single requests)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per concurrency level")
    parser.add_argument("--fresh", action="store_true",
                        help="concurrency: new decoders for every round (nothing learned in one round drafts the next)")
    parser.add_argument("--variants", default="base,new",
                        help="decoders to compare, in order (the first is the reference): base, new, new with exact "
                             "mode forced off or on (new-inexact, new-exact), and new-plain (our plain decoding, "
                             "whose outputs exact mode must reproduce)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from specdraft import Decoder
    from specdraft.bench.datasets import load_prompts
    from specdraft.kernels.kernel_costs import cpu_name
    from specdraft.models import DEFAULT_MODEL, load_model

    base = import_base(args.base)
    model, tokenizer = load_model(args.model or DEFAULT_MODEL, dtype=args.dtype)
    prompts = load_prompts(args.dataset, args.limit, tokenizer)
    # the base version gets a model of its own: an older decoder may leave the model it was given on
    # its attention, and generate and the new version must run theirs
    base_model = copy.deepcopy(model) if "base" in args.variants.split(",") else None
    makers = {"base": lambda: base.Decoder(base_model, tokenizer), "new": lambda: Decoder(model, tokenizer),
              "new-inexact": lambda: Decoder(model, tokenizer, exact=False),
              "new-exact": lambda: Decoder(model, tokenizer, exact=True),
              "new-plain": lambda: Decoder(model, tokenizer, sources=[], max_tree_nodes=0)}
    decoders = {name: makers[name]() for name in args.variants.split(",")}
    for decoder in decoders.values():  # warm-up: kernels measured or loaded, buffers allocated
        decoder.generate(list(prompts[0].token_ids), max_new_tokens=8)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    report: dict[str, Any] = {"base": commit_of(args.base), "new": head, "variants": list(decoders), "dataset": args.dataset,
                              "limit": args.limit, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                              "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
                              "kernels": {n: d.kernels.describe() for n, d in decoders.items()}}
    if args.concurrency:
        levels = [int(x) for x in args.concurrency.split(",")]
        report["fresh"] = args.fresh
        if args.fresh:  # the warmed-up decoders only named the variants: free their packed weights
            for decoder in decoders.values():
                decoder.close()
        report["concurrency"] = concurrency(prompts, decoders, args.max_new_tokens, levels, args.repeats,
                                            makers if args.fresh else None)
    else:
        report["single"] = single(model, tokenizer, prompts, decoders, args.max_new_tokens)
        print(json.dumps(report["single"]["summary"], indent=1, default=str), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
