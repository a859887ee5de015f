"""``model.generate(..., custom_generate=specdraft.hf.loop())`` against ``Decoder`` on the same prompts.

Why: ``specdraft.hf`` lets code that calls ``model.generate`` keep calling it. The layer around the
decoder (transformers preparing the call, the loop reading the processors and criteria back,
releasing committed tokens one position at a time) must cost next to nothing; this measures it.

Two parts, in one process, methods interleaved prompt by prompt (and their order alternated), one
torch thread:

* **one prompt at a time**: ``Decoder.generate`` (one decoder, default sources) against
  ``model.generate(**inputs, custom_generate=loop)`` (its own loop, default sources, so neither
  sees the other's outputs), with plain ``model.generate`` as the reference for the speed-up;
  the ratio per prompt, its median and worst;
* **a batch**: the first ``--batch`` prompts left-padded through
  ``model.generate(**inputs, custom_generate=loop)`` against ``Decoder.generate_batch`` on the
  same prompts, with transformers' batched ``generate`` as the reference; throughput (new tokens,
  padding and what follows EOS excluded, per second), ``--repeats`` times.

Greedy outputs are compared between the methods (in bfloat16 they may part at near-ties, see
``docs/concepts/exactness.md``). Results go to ``benchmarks/results/<name>-<commit>/``:
``summary.json``, ``summary.txt`` (the table with its ratios) and the command line.

    python benchmarks/hf_generate.py --model qwen2.5-coder-0.5b --dtype bfloat16 --limit 10 \\
        --max-new-tokens 128 --batch 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, installed or not

from specdraft.bench.concurrency import trim_at_eos  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> dict[str, Any]:
    info: dict[str, Any] = {"model": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()[:40]
    except OSError:
        return info
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
    info["model"] = fields.get("model name", info["model"])
    flags = set(fields.get("flags", "").split())
    info["flags"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return info


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: on a shared machine, how much else was running."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall time and the CPU time this process spent on it. With one torch thread the
    CPU time barely moves when other work shares the machine; the wall time does."""
    started, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - started, time.process_time() - cpu


class EngineClock:
    """Time spent inside the loop's decoder (making its stream and every step of it), so that
    the rest of a ``model.generate(custom_generate=loop)`` call, transformers' preparation and
    the loop's own work, can be told apart: the layer's cost, whatever else the machine runs.
    Installed on the loop's decoder instance; the decoder itself is not changed."""

    def __init__(self, decoder: Any) -> None:
        self.wall = self.cpu = 0.0
        for name in ("stream", "stream_batch"):
            setattr(decoder, name, self._timed_stream(getattr(decoder, name)))

    def reset(self) -> None:
        self.wall = self.cpu = 0.0

    def _add(self, wall: float, cpu: float) -> None:
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu

    def _timed_stream(self, make: Callable[..., Any]) -> Callable[..., Any]:
        clock = self

        class Timed:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __iter__(self):
                iterator = iter(self.inner)
                while True:
                    wall, cpu = time.perf_counter(), time.process_time()
                    try:
                        item = next(iterator)
                    except StopIteration:
                        clock._add(wall, cpu)
                        return
                    clock._add(wall, cpu)
                    yield item

            def close(self) -> None:
                wall, cpu = time.perf_counter(), time.process_time()
                self.inner.close()
                clock._add(wall, cpu)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            inner = make(*args, **kwargs)
            clock._add(wall, cpu)
            return Timed(inner)

        return timed


def _left_padded(prompts: Sequence[list[int]], pad: int, device: torch.device) -> dict[str, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return {"input_ids": ids, "attention_mask": mask}


def one_at_a_time(model: Any, decoder: Any, loop: Any, prompts: Sequence[list[int]], new: int, eos: set[int],
                  baseline: bool, clock: EngineClock) -> dict[str, Any]:
    rows = []
    for index, ids in enumerate(prompts):
        inputs = _left_padded([ids], 0, model.device)
        runs: dict[str, tuple[list[int], float, float]] = {}
        steps: dict[str, list[int]] = {}  # tokens committed per step: equal lists mean equal work
        layer: dict[str, float] = {}  # the call's time outside the decoder

        def run_decoder() -> None:
            out, seconds, cpu = _timed(lambda: decoder.generate(list(ids), max_new_tokens=new))
            runs["decoder"] = (list(out.token_ids), seconds, cpu)
            steps["decoder"] = list(out.stats.accept_lengths)

        def run_loop() -> None:
            clock.reset()
            out, seconds, cpu = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False,
                                                              custom_generate=loop))
            runs["custom_generate"] = (trim_at_eos(out[0, len(ids):].tolist(), eos), seconds, cpu)
            steps["custom_generate"] = list(loop.last_stats[0].accept_lengths)
            layer["wall"], layer["cpu"] = seconds - clock.wall, cpu - clock.cpu

        order = [run_decoder, run_loop] if index % 2 == 0 else [run_loop, run_decoder]
        for run in order:
            run()
        if baseline:
            out, seconds, cpu = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False))
            runs["generate"] = (trim_at_eos(out[0, len(ids):].tolist(), eos), seconds, cpu)
        row = {"prompt": index, **{f"{k}_s": v[1] for k, v in runs.items()},
               **{f"{k}_cpu_s": v[2] for k, v in runs.items()},
               **{f"{k}_tokens": len(v[0]) for k, v in runs.items()},
               "same_as_decoder": runs["custom_generate"][0] == runs["decoder"][0],
               **{f"{k}_steps": len(v) for k, v in steps.items()},
               "same_steps_as_decoder": steps["custom_generate"] == steps["decoder"],
               "layer_s": layer["wall"], "layer_cpu_s": layer["cpu"],
               "layer_share": layer["wall"] / runs["custom_generate"][1]}
        pairs = [("loop_vs_decoder", "decoder", "custom_generate")]
        if baseline:
            row["same_as_generate"] = runs["custom_generate"][0] == runs["generate"][0]
            pairs += [("loop_vs_generate", "generate", "custom_generate"), ("decoder_vs_generate", "generate", "decoder")]
        for key, slow, fast in pairs:  # speed of ``fast`` relative to ``slow``: > 1 is faster
            row[key] = runs[slow][1] / runs[fast][1]
            row[f"{key}_cpu"] = runs[slow][2] / runs[fast][2]
        rows.append(row)
        print(f"  prompt {index}: " + ", ".join(f"{k} {v[1]:.2f}s (cpu {v[2]:.2f}s)/{len(v[0])}t" for k, v in runs.items())
              + f"; loop/decoder speed {row['loop_vs_decoder']:.3f} (cpu {row['loop_vs_decoder_cpu']:.3f})", flush=True)
    return {"rows": rows, **_ratios(rows, "loop_vs_decoder"), "cpu": _ratios(rows, "loop_vs_decoder_cpu"),
            "layer": _spread(rows, "layer_s"), "layer_share": _spread(rows, "layer_share"),
            **({"vs_generate": _ratios(rows, "loop_vs_generate"), "vs_generate_cpu": _ratios(rows, "loop_vs_generate_cpu"),
                "decoder_vs_generate": _ratios(rows, "decoder_vs_generate"),
                "decoder_vs_generate_cpu": _ratios(rows, "decoder_vs_generate_cpu")} if baseline else {})}


def _spread(rows: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
    values = [r[key] for r in rows]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ratios(rows: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
    values = [r[key] for r in rows]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "geomean": math.exp(sum(math.log(v) for v in values) / len(values))}


def batched(model: Any, decoder: Any, loop: Any, prompts: Sequence[list[int]], new: int, eos: set[int], pad: int,
            repeats: int, baseline: bool, clock: EngineClock) -> dict[str, Any]:
    inputs = _left_padded(prompts, pad, model.device)
    width = inputs["input_ids"].shape[1]
    rows = []
    for repeat in range(repeats):
        runs: dict[str, tuple[list[list[int]], float, float]] = {}
        steps: dict[str, list[list[int]]] = {}
        layer: dict[str, float] = {}

        def run_batch() -> None:
            out, seconds, cpu = _timed(lambda: decoder.generate_batch([list(p) for p in prompts], max_new_tokens=new,
                                                                      concurrency=len(prompts)))
            runs["generate_batch"] = ([list(o.token_ids) for o in out], seconds, cpu)
            steps["generate_batch"] = [list(o.stats.accept_lengths) for o in out]

        def run_loop() -> None:
            clock.reset()
            out, seconds, cpu = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False,
                                                              pad_token_id=pad, custom_generate=loop))
            layer["wall"], layer["cpu"] = seconds - clock.wall, cpu - clock.cpu
            runs["custom_generate"] = ([trim_at_eos(r, eos) for r in out[:, width:].tolist()], seconds, cpu)
            steps["custom_generate"] = [list(s.accept_lengths) if s is not None else [] for s in loop.last_stats]

        order = [run_batch, run_loop] if repeat % 2 == 0 else [run_loop, run_batch]
        for run in order:
            run()
        if baseline:
            out, seconds, cpu = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False,
                                                              pad_token_id=pad))
            runs["generate"] = ([trim_at_eos(r, eos) for r in out[:, width:].tolist()], seconds, cpu)
        tokens = {k: sum(len(t) for t in v[0]) for k, v in runs.items()}
        row = {"repeat": repeat, **{f"{k}_s": v[1] for k, v in runs.items()},
               **{f"{k}_cpu_s": v[2] for k, v in runs.items()},
               **{f"{k}_tokens": tokens[k] for k in runs},
               **{f"{k}_tokens_per_s": tokens[k] / runs[k][1] for k in runs},
               **{f"{k}_tokens_per_cpu_s": tokens[k] / runs[k][2] for k in runs},
               "same_as_generate_batch": sum(a == b for a, b in zip(runs["custom_generate"][0],
                                                                     runs["generate_batch"][0])),
               "same_steps_as_generate_batch": sum(a == b for a, b in zip(steps["custom_generate"],
                                                                           steps["generate_batch"])),
               "layer_s": layer["wall"], "layer_cpu_s": layer["cpu"],
               "layer_share": layer["wall"] / runs["custom_generate"][1]}
        pairs = [("loop_vs_generate_batch", "custom_generate", "generate_batch")]
        if baseline:
            row["same_as_generate"] = sum(a == b for a, b in zip(runs["custom_generate"][0], runs["generate"][0]))
            pairs += [("loop_vs_generate", "custom_generate", "generate"),
                      ("generate_batch_vs_generate", "generate_batch", "generate")]
        for key, a, b in pairs:  # throughput of ``a`` relative to ``b``: > 1 is faster
            row[key] = row[f"{a}_tokens_per_s"] / row[f"{b}_tokens_per_s"]
            row[f"{key}_cpu"] = row[f"{a}_tokens_per_cpu_s"] / row[f"{b}_tokens_per_cpu_s"]
        rows.append(row)
        print(f"  repeat {repeat}: " + ", ".join(f"{k} {v[1]:.1f}s (cpu {v[2]:.1f}s)/{tokens[k]}t" for k, v in runs.items())
              + f"; loop/generate_batch throughput {row['loop_vs_generate_batch']:.3f} "
                f"(cpu {row['loop_vs_generate_batch_cpu']:.3f})", flush=True)
    return {"rows": rows, **_ratios(rows, "loop_vs_generate_batch"), "cpu": _ratios(rows, "loop_vs_generate_batch_cpu"),
            "layer": _spread(rows, "layer_s"), "layer_share": _spread(rows, "layer_share"),
            **({"vs_generate": _ratios(rows, "loop_vs_generate"), "vs_generate_cpu": _ratios(rows, "loop_vs_generate_cpu"),
                "generate_batch_vs_generate": _ratios(rows, "generate_batch_vs_generate"),
                "generate_batch_vs_generate_cpu": _ratios(rows, "generate_batch_vs_generate_cpu")} if baseline else {})}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--limit", type=int, default=10, help="prompts of the one-at-a-time part")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="prompts of the batch part (0: skip it)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the batch part")
    parser.add_argument("--no-baseline", action="store_true", help="skip plain model.generate")
    parser.add_argument("--fixed-budget", action="store_true",
                        help="adaptive_budget=False on both sides: the same trees, so the same work, step for step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<name>-<commit>)")
    args = parser.parse_args(argv)

    import transformers

    import specdraft
    import specdraft.hf
    from specdraft import Decoder
    from specdraft.bench.datasets import load_prompts
    from specdraft.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    records = load_prompts(args.dataset, max(args.limit, args.batch) + 1, tokenizer)
    warm, prompts = records[-1].token_ids, [r.token_ids for r in records[:-1]]
    eos = set(specdraft.hf._eos_ids(model.generation_config.eos_token_id))
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    adaptive = not args.fixed_budget
    decoder = Decoder(model, tokenizer, adaptive_budget=adaptive)
    loop = specdraft.hf.loop(adaptive_budget=adaptive)
    clock = EngineClock(loop.decoder(model))
    with torch.inference_mode():  # first use: kernel choice, caches; both learn from the same warm prompt
        decoder.generate(list(warm), max_new_tokens=16)
        model.generate(**_left_padded([warm], pad, model.device), max_new_tokens=16, do_sample=False,
                       custom_generate=loop)

    commit = _commit()
    name = (f"hf-generate-{Path(args.model).name}-{args.dtype}-{args.dataset}{args.limit}-b{args.batch}"
            f"{'-fixed' if args.fixed_budget else ''}-{commit}")
    out_dir = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / name
    config = {"model": Path(args.model).name, "dtype": args.dtype, "dataset": args.dataset, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "batch": args.batch, "repeats": args.repeats,
              "threads": args.threads, "adaptive_budget": adaptive, "commit": commit, "cpu": _cpu(),
              "versions": {"specdraft": specdraft.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "python": platform.python_version()},
              "argv": ["benchmarks/hf_generate.py", *(argv if argv is not None else sys.argv[1:])],
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average_at_start": _load()}
    summary: dict[str, Any] = {"config": config}
    with torch.inference_mode():
        if args.limit:
            print(f"one prompt at a time: {args.limit} prompts, {args.max_new_tokens} new tokens", flush=True)
            summary["one_at_a_time"] = one_at_a_time(model, decoder, loop, prompts[: args.limit],
                                                     args.max_new_tokens, eos, not args.no_baseline, clock)
        if args.batch:
            print(f"batch of {args.batch}, {args.repeats} repeats", flush=True)
            summary["batch"] = batched(model, decoder, loop, prompts[: args.batch], args.max_new_tokens, eos, pad,
                                       args.repeats, not args.no_baseline, clock)
    config["load_average_at_end"] = _load()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.txt").write_text(report(summary))
    print(report(summary))
    print(f"wrote {out_dir}")
    return 0


def report(summary: dict[str, Any]) -> str:
    """The results as a short text table (ratios written ``1.00x``; "cpu": the same ratio of the
    CPU time the process spent, which other work on the machine barely moves)."""
    c = summary["config"]
    lines = [f"{c['model']} {c['dtype']}, {c['dataset']}, {c['max_new_tokens']} new tokens, greedy, "
             f"{c['threads']} thread(s), {'adaptive' if c.get('adaptive_budget', True) else 'fixed'} budget, "
             f"commit {c['commit']}, {c['cpu']['model']} ({c['cpu']['cpus']} CPUs), "
             f"load average {c.get('load_average_at_start')} at start, {c.get('load_average_at_end')} at end", ""]

    def ratio(r: dict[str, float], cpu: dict[str, float] | None = None) -> str:
        text = f"median {r['median']:.2f}x (from {r['min']:.2f}x to {r['max']:.2f}x), geometric mean {r['geomean']:.3f}"
        if cpu is not None:
            text += f"; cpu time: median {cpu['median']:.2f}x ({cpu['min']:.2f}x to {cpu['max']:.2f}x)"
        return text

    one = summary.get("one_at_a_time")
    if one:
        n = len(one["rows"])
        lines += [f"One prompt at a time ({n} prompts), speed of model.generate(custom_generate=loop), per prompt:",
                  f"  vs Decoder.generate: {ratio(one, one['cpu'])}; same output "
                  f"{sum(r['same_as_decoder'] for r in one['rows'])}/{n}, same steps "
                  f"{sum(r['same_steps_as_decoder'] for r in one['rows'])}/{n}",
                  f"  time outside the decoder (transformers' preparation and the loop): median "
                  f"{one['layer']['median'] * 1000:.1f} ms per call, {one['layer_share']['median'] * 100:.2f}% of it "
                  f"(at most {one['layer_share']['max'] * 100:.2f}%)"]
        if "vs_generate" in one:
            lines += [f"  vs plain model.generate: {ratio(one['vs_generate'], one['vs_generate_cpu'])}; same output "
                      f"{sum(r['same_as_generate'] for r in one['rows'])}/{n}",
                      f"  (Decoder.generate vs plain model.generate: "
                      f"{ratio(one['decoder_vs_generate'], one['decoder_vs_generate_cpu'])})"]
        lines.append("")
    batch = summary.get("batch")
    if batch:
        n, rows = c["batch"], batch["rows"]
        tps = {k: statistics.median(r[f"{k}_tokens_per_s"] for r in rows)
               for k in ("custom_generate", "generate_batch", "generate") if f"{k}_tokens_per_s" in rows[0]}
        lines += [f"Batch of {n}, left-padded ({len(rows)} repeats), throughput of model.generate(custom_generate=loop):",
                  f"  vs Decoder.generate_batch: {ratio(batch, batch['cpu'])}; same output "
                  f"{rows[-1]['same_as_generate_batch']}/{n} rows, same steps "
                  f"{rows[-1]['same_steps_as_generate_batch']}/{n} rows",
                  f"  time outside the decoder: median {batch['layer']['median'] * 1000:.1f} ms per call, "
                  f"{batch['layer_share']['median'] * 100:.2f}% of it (at most {batch['layer_share']['max'] * 100:.2f}%)",
                  "  new tokens/s (median): " + ", ".join(f"{k} {v:.1f}" for k, v in tps.items())]
        if "vs_generate" in batch:
            lines += [f"  vs transformers' batched generate: {ratio(batch['vs_generate'], batch['vs_generate_cpu'])}; "
                      f"same output {rows[-1]['same_as_generate']}/{n} rows",
                      f"  (generate_batch vs batched generate: "
                      f"{ratio(batch['generate_batch_vs_generate'], batch['generate_batch_vs_generate_cpu'])})"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
