"""README command 1's job (``specdraft demo``) on stock kernels and on ``cpu_kernels="auto"``, in one process.

Why: the demo reports one kernel choice against plain decoding; to see what the default kernel
choice buys, the same prompt is run, interleaved round by round so machine drift hits every
method alike, through plain ``model.generate`` (stock kernels), transformers' prompt lookup, and
the demo's decoder (``PromptLookup``, adaptive budget) on ``cpu_kernels="stock"`` and on
``"auto"``. Speeds are medians over rounds, quoted as ratios to plain ``model.generate`` measured
in the same process; greedy identity with it is checked for every method.

    python benchmarks/demo_kernels.py --dtype float32 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Sequence

import torch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the demo's model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    from specdraft.baseline import time_plain_generate, warmup_forward
    from specdraft.cli import DEMO_PROMPT, _encode_prompt
    from specdraft.decoder import Decoder
    from specdraft.models import DEFAULT_MODEL, load_model
    from specdraft.sources import PromptLookup

    torch.set_num_threads(args.threads)
    model_name = args.model or DEFAULT_MODEL
    model, tokenizer = load_model(model_name, dtype=args.dtype, progress=False)
    prompt_ids = _encode_prompt(tokenizer, DEMO_PROMPT, chat=bool(getattr(tokenizer, "chat_template", None)))
    decoders = {}
    for kernels in ("stock", "auto"):
        started = time.perf_counter()
        decoders[kernels] = Decoder(model, tokenizer, sources=[PromptLookup()], cpu_kernels=kernels)
        print(f"Decoder(cpu_kernels={kernels!r}) built in {time.perf_counter() - started:.1f} s: "
              f"{decoders[kernels].kernels.describe()}", file=sys.stderr)
    warmup_forward(model, prompt_ids)
    times: dict[str, list[float]] = {"plain": [], "hf-prompt-lookup": [], "specdraft@stock": [], "specdraft@auto": []}
    outputs: dict[str, list[int]] = {}
    steps: dict[str, int] = {}
    for round_index in range(args.repeats):
        print(f"round {round_index + 1}/{args.repeats}", file=sys.stderr, flush=True)
        outputs["plain"], seconds = time_plain_generate(model, prompt_ids, args.max_new_tokens, do_sample=False)
        times["plain"].append(seconds)
        outputs["hf-prompt-lookup"], seconds = time_plain_generate(
            model, prompt_ids, args.max_new_tokens, do_sample=False, prompt_lookup_num_tokens=10)
        times["hf-prompt-lookup"].append(seconds)
        for kernels, decoder in decoders.items():
            started = time.perf_counter()
            out = decoder.generate(prompt_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            times[f"specdraft@{kernels}"].append(time.perf_counter() - started)
            outputs[f"specdraft@{kernels}"] = list(out.token_ids)
            steps[f"specdraft@{kernels}"] = out.stats.steps
    plain = statistics.median(times["plain"])
    n = len(outputs["plain"])
    print(f"{model_name}, {args.dtype}, {args.threads} thread(s), {n} new tokens, median of {args.repeats} "
          f"interleaved rounds")
    print("| method | tokens/s | vs plain | vs hf-prompt-lookup | steps | identical to plain |")
    print("|---|---:|---:|---:|---:|---|")
    hf = statistics.median(times["hf-prompt-lookup"])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"| {name} | {len(outputs[name]) / median:.1f} | {plain / median:.2f}x | {hf / median:.2f}x | "
              f"{steps.get(name, len(outputs[name]))} | {'yes' if outputs[name] == outputs['plain'] else 'NO'} |")
    print(decoders["auto"].kernels.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
