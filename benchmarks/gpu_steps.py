"""Decoding steps on a CUDA GPU, with a real model's shape: what a forward costs per width, how
much of a step the GPU sits idle, how many times a step waits for the device, and the speed of
plain and speculative decoding through the same model.

Why: on a GPU the forward runs asynchronously and a batch-1 forward of an eager Hugging Face model
costs about the same for 1 or 64 rows, so what decides the speed-up is (a) how flat that cost is
and (b) how much host work and how many device syncs the decoder adds to each step. Both are
properties of the GPU, the model's shape and our code, not of the weights, so this script builds
the model from a config (random weights, ``bfloat16``, no download: GPU machines are often
offline). The weights' output is random, so the speeds of the speculative runs below are not a
prediction for real text; the forward costs, idle time and sync counts are.

Measured, per model shape:

* **forward ms at k rows**: one cached forward of k new tokens over a 1k-token cache, synchronized,
  median of 10;
* **plain decoding ms/token**: ``model.generate(do_sample=False)`` and our loop with
  ``max_tree_nodes=0``, over a 1k and a 16k context;
* **speculative steps**: the default sources on a fixed tree of 8, 32 and 64 nodes
  (``adaptive_budget=False``) over a repetitive context (the sources fill the tree): ms per step,
  the GPU's busy time per step (CUDA events around each forward, the prompt's prefill included,
  spread over the steps), the idle rest, the median span of a decode forward alone (the figure
  to compare between plain and tree steps: with few steps, the prefill's share of the per-step
  figure is large), the prefill's span, and the synchronizing calls per step outside and inside
  the forward (``torch.cuda.set_sync_debug_mode``);
* the adaptive default, sampling, and ``generate_batch`` (8 requests) for completeness.
* with ``--compile``, plain decoding and the 32-node tree through ``torch.compile``; with
  ``--attentions eager``, the same two through transformers' eager attention (a tree forward's
  masked ``sdpa`` over the whole store may cost more than plain products: the attention price of
  ``exact_attention_price.py`` says which part).

    python benchmarks/gpu_steps.py --shapes qwen2.5-0.5b,qwen2.5-7b --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import ACTIVE, repetitive_context  # noqa: E402

from specdraft import Decoder  # noqa: E402
from specdraft.sources.registry import DEFAULT_SOURCES, make_sources  # noqa: E402

#: Qwen2.5 shapes (their published configs), the family of the project's default model.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32000),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
}


def build_model(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Qwen2 model of ``shape`` with random weights, built on ``device``; only the first
    ``ACTIVE`` token ids can win the argmax, so its output repeats tokens of the context and the
    sources find matches (as in ``host_overhead.py``)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.generation_config.eos_token_id = None  # decode the full length every time
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        model.lm_head.weight[ACTIVE:] = 0.0
        model.lm_head.weight[:ACTIVE] *= 50.0  # clear winners: bfloat16 ties would blur identity checks
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def forward_curve(model: torch.nn.Module, context: int, widths: list[int], repeats: int = 10) -> dict[int, float]:
    """Median ms of one cached forward of k rows over a ``context``-token cache."""
    from transformers import DynamicCache

    from specdraft.model.compat import cache_keyword

    keyword = cache_keyword(model)  # ``past_key_values`` before transformers 5.x renamed it ``cache``
    device = model.device
    ids = torch.tensor([repetitive_context(context)], device=device)
    cache = DynamicCache()
    model(input_ids=ids, use_cache=True, **{keyword: cache})
    out = {}
    for k in widths:
        new = torch.randint(3, ACTIVE, (1, k), device=device)
        times = []
        for i in range(repeats + 3):
            sync()
            t = time.perf_counter()
            model(input_ids=new, use_cache=True, **{keyword: cache})
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t)
            cache.crop(-k)  # drop the k new rows (a negative count works on every release)
        out[k] = statistics.median(times) * 1e3
    return out


class StepProbe:
    """GPU time of each forward (CUDA events from pre/post hooks) and the synchronizing calls made
    inside and outside forwards (``torch.cuda.set_sync_debug_mode("warn")`` warnings)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.cuda = model.device.type == "cuda"
        self.events: list[tuple[Any, Any]] = []
        self.in_forward = False
        self.syncs_inside = 0
        self.syncs_outside = 0
        self.where: dict[str, int] = {}
        model.register_forward_pre_hook(lambda *_: self._pre())
        model.register_forward_hook(lambda *_: self._post())

    def _pre(self) -> None:
        self.in_forward = True
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append((start, None))

    def _post(self) -> None:
        self.in_forward = False
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events[-1] = (self.events[-1][0], end)

    def watch_static(self, static: Any) -> None:
        """Time the static forwards too: a replayed CUDA graph runs no module hooks."""
        if static is None or getattr(static, "_watched", False):
            return
        run = static.run

        def timed(*args: Any, **kwargs: Any):
            self._pre()
            try:
                return run(*args, **kwargs)
            finally:
                self._post()

        static.run = timed
        static._watched = True

    def gpu_ms(self) -> float:
        return sum(self.spans())

    def spans(self) -> list[float]:
        """Each forward's span in ms, in order (the first of a ``generate`` call is its prompt's
        prefill, an eager forward as wide as the prompt)."""
        sync()
        return [a.elapsed_time(b) for a, b in self.events if b is not None]

    def run(self, fn):
        """Run ``fn()`` counting syncs; returns (result, wall seconds)."""
        self.events, self.syncs_inside, self.syncs_outside, self.where = [], 0, 0, {}
        shown = warnings.showwarning

        def count(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message).lower():
                return None  # other warnings (deprecations repeated per forward) would only cost time here
            if self.in_forward:
                self.syncs_inside += 1
            else:
                self.syncs_outside += 1
                import traceback
                frames = [f for f in traceback.extract_stack() if "specdraft" in f.filename]
                if frames:
                    key = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}"
                    self.where[key] = self.where.get(key, 0) + 1

        sync()
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        warnings.showwarning = count
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = count
                started = time.perf_counter()
                result = fn()
                sync()
                wall = time.perf_counter() - started
        finally:
            warnings.showwarning = shown
            if self.cuda:
                torch.cuda.set_sync_debug_mode(0)
        return result, wall


def timed_generate(model, prompt: list[int], new: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
        sync()
        return out[0, len(prompt):].tolist(), time.perf_counter() - t


def eager(dec: Decoder) -> Decoder:
    """``dec`` without static forwards or CUDA graphs: every forward as wide as it comes, eagerly."""
    dec.runner.static = None
    dec.engine.padding = None
    return dec


def decoder_row(probe: StepProbe, dec: Decoder, prompt: list[int], new: int, **options) -> dict[str, Any]:
    probe.watch_static(dec.runner.static)
    dec.generate(prompt[:256], max_new_tokens=16, **options)  # warm-up: kernel choice, step costs, allocator
    out, wall = probe.run(lambda: dec.generate(prompt, max_new_tokens=new, **options))
    steps = out.stats.steps
    spans = probe.spans() if probe.cuda else []
    gpu = sum(spans) if probe.cuda else float("nan")
    decode = spans[1:]  # after the prompt's prefill: one forward per decoding step
    return {"tokens": len(out.token_ids), "steps": steps, "tokens_per_step": len(out.token_ids) / steps,
            "ms_per_token": wall * 1e3 / len(out.token_ids), "ms_per_step": wall * 1e3 / steps,
            "gpu_ms_per_step": gpu / steps, "idle_ms_per_step": (wall * 1e3 - gpu) / steps,
            "prefill_forward_ms": spans[0] if spans else float("nan"),
            "decode_forward_ms_median": statistics.median(decode) if decode else float("nan"),
            "decode_forward_ms_mean": statistics.mean(decode) if decode else float("nan"),
            "syncs_outside_per_step": probe.syncs_outside / steps, "syncs_inside_per_step": probe.syncs_inside / steps,
            "mean_tree_nodes": statistics.mean(out.stats.tree_sizes[1:]) if len(out.stats.tree_sizes) > 1 else 0.0,
            "sync_sites": dict(sorted(probe.where.items(), key=lambda kv: -kv[1])[:6]), "token_ids": out.token_ids}


def gpu_clocks() -> str:
    """The SM clock now (a launch-bound run may leave a GPU at low clocks; printed for the record)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def run_shape(shape: str, device: str, dtype: torch.dtype, new: int, contexts: list[int],
              nodes_list: list[int], repeats: int, compile: bool = False,
              attentions: Sequence[str] = ()) -> dict[str, Any]:
    """Per context: the methods timed in turns, ``repeats`` rounds, without any probe (medians);
    then one probed run of each of our methods for the GPU/idle split and the sync counts."""
    started = time.perf_counter()
    model = build_model(shape, device, dtype)
    probe = StepProbe(model)
    params = sum(p.numel() for p in model.parameters())
    print(f"\n## {shape} ({params / 1e6:.0f}M parameters, {dtype}, {device}), built in "
          f"{time.perf_counter() - started:.1f} s; clocks {gpu_clocks()}", flush=True)
    widths = [1, 2, 4, 8, 16, 32, 64]
    curve = forward_curve(model, contexts[0], widths)
    print(f"forward ms at k rows over a {contexts[0]}-token cache: "
          + ", ".join(f"k={k}: {ms:.2f}" for k, ms in curve.items()), flush=True)
    result: dict[str, Any] = {"parameters": params, "forward_ms": curve, "contexts": {}}
    for context in contexts:
        prompt = repetitive_context(context)
        decoders: dict[str, Any] = {"ours, plain": lambda: Decoder(model, None, sources=[], max_tree_nodes=0),
                                    "ours, plain, eager": lambda: eager(Decoder(model, None, sources=[],
                                                                                max_tree_nodes=0))}
        for nodes in nodes_list if context == contexts[0] else nodes_list[1:2]:
            decoders[f"default, fixed {nodes}"] = (lambda n=nodes: Decoder(
                model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=n, adaptive_budget=False))
        decoders["default, fixed 32, eager"] = lambda: eager(Decoder(
            model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=32, adaptive_budget=False))
        decoders["default, adaptive"] = lambda: Decoder(model, None)
        if compile:  # the decode forwards through torch.compile (without exact mode), beside the above
            decoders["ours, plain, compiled"] = lambda: Decoder(model, None, sources=[], max_tree_nodes=0, compile=True)
            decoders["default, fixed 32, compiled"] = lambda: Decoder(
                model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=32, adaptive_budget=False,
                compile=True)
        for attention in attentions:  # the same steps through another attention implementation
            decoders[f"ours, plain, {attention} attention"] = (lambda a=attention: Decoder(
                model, None, sources=[], max_tree_nodes=0, attention=a))
            decoders[f"default, fixed 32, {attention} attention"] = (lambda a=attention: Decoder(
                model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=32, adaptive_budget=False,
                attention=a))
        sampling = dict(do_sample=True, seed=0, temperature=0.8, top_p=0.9, repetition_penalty=1.1)
        timed_generate(model, prompt[:64], 8)  # warm-up
        built = {name: make() for name, make in decoders.items()}
        for dec in built.values():
            dec.generate(prompt[:256], max_new_tokens=16)  # warm-up: kernel choice, step costs, allocator
            if dec.runner.static is not None:
                print(f"  static forwards: captured widths {dec.runner.static.captured} {dec.runner.static.note}",
                      flush=True)
        seconds: dict[str, list[float]] = {"model.generate": []} | {name: [] for name in built}
        outputs: dict[str, Any] = {}
        for _ in range(repeats):  # in turns, so drift of clocks or load hits every method alike
            reference, sec = timed_generate(model, prompt, new)
            seconds["model.generate"].append(sec)
            for name, dec in built.items():
                sync()
                t = time.perf_counter()
                out = dec.generate(prompt, max_new_tokens=new)
                sync()
                seconds[name].append(time.perf_counter() - t)
                outputs[name] = out
        hf = statistics.median(seconds["model.generate"]) * 1e3 / new
        rows: dict[str, Any] = {"model.generate": {"ms_per_token": hf}}
        print(f"context {context}: model.generate {hf:.2f} ms/token (median of {repeats}); clocks {gpu_clocks()}",
              flush=True)
        for name, dec in list(built.items()) + [("default, sampling", built["default, adaptive"])]:
            options = sampling if "sampling" in name else {}
            probed = decoder_row(probe, dec, prompt, new, **options)
            tokens = probed.pop("token_ids")
            row = dict(probed)
            if name in seconds:
                out = outputs[name]
                ms = statistics.median(seconds[name]) * 1e3
                row.update(ms_per_token=ms / len(out.token_ids), ms_per_step=ms / out.stats.steps,
                           tokens_per_step=out.stats.mean_accepted, speedup_vs_generate=hf * len(out.token_ids) / ms)
                same = next((i for i, (a, b) in enumerate(zip(out.token_ids, reference)) if a != b), None)
                row["first_difference_from_generate"] = same
            else:
                row["speedup_vs_generate"] = hf / row["ms_per_token"]
                row["repeat_gives_same_tokens"] = tokens == decoder_row(probe, dec, prompt, new, **options)["token_ids"]
            rows[name] = row
            print(f"  {name:<20} {row['ms_per_token']:6.2f} ms/token ({row['speedup_vs_generate']:.2f}x)  "
                  f"{row['tokens_per_step']:.2f} tok/step  tree {row['mean_tree_nodes']:.1f}  probed step "
                  f"{row['gpu_ms_per_step'] + row['idle_ms_per_step']:.2f} ms = forward span {row['gpu_ms_per_step']:.2f}"
                  f" + rest {row['idle_ms_per_step']:.2f}  (decode forward median "
                  f"{row['decode_forward_ms_median']:.2f} ms, prefill {row['prefill_forward_ms']:.1f} ms)  "
                  f"syncs/step {row['syncs_outside_per_step']:.2f} outside, "
                  f"{row['syncs_inside_per_step']:.2f} inside"
                  + (f"  differs from generate at {row['first_difference_from_generate']}"
                     if row.get("first_difference_from_generate") is not None else "")
                  + (f"  same seed, same tokens: {row['repeat_gives_same_tokens']}" if "repeat_gives_same_tokens" in row
                     else ""), flush=True)
        result["contexts"][context] = rows
    prompts = [repetitive_context(512, seed=s) for s in range(8)]
    batch_rows = {}
    for name, dec in [("batch plain", Decoder(model, None, sources=[], max_tree_nodes=0)),
                      ("batch default", Decoder(model, None))]:
        dec.generate_batch(prompts[:2], max_new_tokens=8, concurrency=2)  # warm-up
        widths = count_decode_forwards(dec)
        sync()
        t = time.perf_counter()
        res = dec.generate_batch(prompts, max_new_tokens=new, concurrency=8)
        sync()
        elapsed = time.perf_counter() - t
        static = dec.runner.static
        batch_rows[name] = {"tokens_per_s": sum(len(o.token_ids) for o in res) / elapsed,
                            "errors": [str(o.error) for o in res if o.error],
                            "forwards": len(widths), "rows_per_forward": statistics.mean(widths) if widths else 0.0,
                            "wider_than_widest_bucket": sum(w > max(static.widths) for w in widths) if static else None,
                            "captured": static.captured if static else None}
        print(f"  {name:<20} 8 requests x {new} tokens: {batch_rows[name]['tokens_per_s']:.0f} tokens/s, "
              f"{len(widths)} decode forwards of {batch_rows[name]['rows_per_forward']:.1f} rows on average, "
              f"{batch_rows[name]['wider_than_widest_bucket']} wider than the widest bucket (eager), captured "
              f"{batch_rows[name]['captured']} {batch_rows[name]['errors'] or ''}", flush=True)
    result["batch8"] = batch_rows
    result["forward_ms_after"] = forward_curve(model, contexts[0], [1, 32])
    print(f"forward ms again at the end: {result['forward_ms_after']}; clocks {gpu_clocks()}", flush=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def count_decode_forwards(dec: Decoder) -> list[int]:
    """From now on, the rows of every forward of ``dec`` whose rows are all trees (decode steps)."""
    widths: list[int] = []
    forward = dec.runner.forward

    def counting(segments, *args, **kwargs):
        if all(s.block is not None for s in segments):
            widths.append(sum(len(s.tokens) for s in segments))
        return forward(segments, *args, **kwargs)

    dec.runner.forward = counting
    return widths


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "torch": torch.__version__,
                            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": device}
    try:
        import transformers
        info["transformers"] = transformers.__version__
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=False).stdout.strip()
    except OSError:
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b", help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--contexts", default="1024,16384")
    parser.add_argument("--nodes", default="8,32,64")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of the methods, in turns")
    parser.add_argument("--out", default=None, help="folder for results.json")
    parser.add_argument("--compile", action="store_true",
                        help="also time plain decoding and a fixed 32-node tree with compile=True (CUDA only)")
    parser.add_argument("--attentions", default="",
                        help="comma list of attention implementations (eager, flash, sdpa) to time plain decoding "
                             "and a fixed 32-node tree with as well")
    args = parser.parse_args(argv)
    attentions = [a for a in args.attentions.split(",") if a]
    if any(a not in ("eager", "flash", "sdpa") for a in attentions):
        parser.error(f"--attentions takes some of eager, flash, sdpa; got {args.attentions!r}")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; allowed: {list(SHAPES)}")
    dtype = getattr(torch, args.dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    nodes = [int(n) for n in args.nodes.split(",")]
    results = {"config": machine(args.device) | {"dtype": args.dtype, "new_tokens": args.new_tokens}, "shapes": {}}
    print(json.dumps(results["config"]), flush=True)
    for shape in args.shapes.split(","):
        results["shapes"][shape] = run_shape(shape, args.device, dtype, args.new_tokens, contexts, nodes,
                                               args.repeats, args.compile, attentions)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as fh:
                json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
