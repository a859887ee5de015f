"""Does Token Recycling draft better when its matrix first learns from the prompt's own rows?

Why this exists
    Token Recycling (:mod:`specdraft.sources.token_recycling`) fills its matrix from the rows the
    decode forwards compute, so on a fresh decoder its rows for common words are empty and many
    chat steps have no draft from it. The prefill computes a row for every prompt token too; a
    GPU could keep their top-k almost for free. Before building that into the step, this script
    measures what it would buy: before each request, every prompt token's matrix row gets the
    top-k the model predicts after it in the prompt (the last occurrence of a token wins, as in
    the source's own update), computed here by a separate forward over the prompt. One process
    runs one mode, ``cold`` (the source as it is) or ``warm``, over the prompts in order with one
    decoder, so the matrix carries from request to request in both.

What it prints
    Per prompt: its id, new tokens, steps (the prefill counts as one) and tokens per step; then
    the totals. The GPU default's sources on fixed trees (no adaptive budget), greedy.

    python benchmarks/recycling_prompt_warm.py --model qwen-bf16 --dataset mtbench --limit 10 \\
        --nodes 63 --mode warm
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SOURCES = ["prompt", "trie", "ngram", "suffix", "recycle[template=tr80]"]


def warm_from_prompt(recycling, model: torch.nn.Module, ids: list[int]) -> None:
    """Give every prompt token's row the top-k that follows it in the prompt, through the
    source's own update (the last row of a token wins); the rows belong to no request, so no
    request can take them back."""
    from specdraft.sources import Context, Feedback

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    top = torch.topk(logits, recycling.k, dim=-1).indices.numpy()
    recycling.observe(Feedback(committed=[], context=Context(ids, len(ids), request_id=-1),
                               top_ids=top, row_tokens=np.asarray(ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=63)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--mode", choices=["cold", "warm"], required=True)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft import Decoder
    from specdraft.bench.datasets import load_prompts
    from specdraft.sources.registry import make_sources
    from specdraft.sources.token_recycling import TokenRecycling

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(args.dataset, args.limit, tokenizer, "auto")
    decoder = Decoder(model, tokenizer, sources=make_sources(SOURCES), max_tree_nodes=args.nodes,
                      adaptive_budget=False)
    recycling = next(s for s in decoder.sources if isinstance(s, TokenRecycling))
    tokens = steps = 0
    per_prompt = []
    for prompt in prompts:
        if args.mode == "warm":
            warm_from_prompt(recycling, model, prompt.token_ids)
        stats = decoder.generate(prompt.token_ids, max_new_tokens=args.new_tokens).stats
        tokens, steps = tokens + stats.new_tokens, steps + stats.steps
        per_prompt.append(stats.new_tokens / stats.steps)
        print(args.mode, prompt.id, stats.new_tokens, stats.steps, round(stats.new_tokens / stats.steps, 3), flush=True)
    print(args.mode, "total", tokens, steps, round(tokens / steps, 3), "mean of prompts",
          round(statistics.mean(per_prompt), 3))


if __name__ == "__main__":
    main()
