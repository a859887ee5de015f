"""Long soak: many short requests through one set of shared draft sources, memory recorded.

A server keeps its sources for as long as it runs, so what matters is whether memory levels off.
This script runs ``--requests`` short requests (random prompts over a small slice of the
vocabulary, 1-``--max-new-tokens`` new tokens, greedy and sampled mixed) through two decoders
(adaptive budget and fixed budget) that share every source: prompt lookup, the frequency trie at
its defaults, the per-request n-gram, a shared n-gram at its defaults and Jacobi lookahead. Every
``--every`` requests it records the process RSS (``VmRSS`` / ``VmHWM`` from ``/proc/self/status``,
``resource.getrusage`` elsewhere) and each source's size (trie nodes and trees, shared n-gram
contexts and counters, live per-request states) to ``soak.csv`` and plots them to ``soak.png``
in ``--out``. It also compares every ``--check-every``-th greedy output with
``model.generate(do_sample=False)`` and reports mismatches (there must be none).

The model is a tiny random Qwen2 (hidden 32, 2 layers) with ``--vocab-size`` tokens, by default
151936, the vocabulary of the default model (Qwen2.5), so token ids, trie keys and n-gram
contexts span the real range. A random model's greedy continuations are noise over the whole
vocabulary, so almost every output window is new to the trie: the worst case for its growth.

    python benchmarks/soak.py --requests 10000 --out benchmarks/results/soak-<date>-<commit>
    python benchmarks/soak.py --requests 500 --vocab-size 1000 --out soak-out   # a quick look
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

FIELDS = ["requests", "seconds", "rss_mib", "peak_rss_mib", "new_tokens", "trie_nodes", "trie_trees",
          "trie_prunes", "trie_pruned_nodes", "trie_live", "ngram_shared_contexts", "ngram_shared_counters",
          "ngram_live", "ngram_shared_live", "jacobi_live", "greedy_checked", "greedy_mismatches"]


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    try:
        values = {}
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, amount, _unit = line.split()
                    values[key[:-1]] = int(amount) / 1024  # kB -> MiB
        return values["VmRSS"], values["VmHWM"]
    except (OSError, KeyError):  # not Linux: only the peak is available
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mib = peak / 2**20 if sys.platform == "darwin" else peak / 1024
        return peak_mib, peak_mib


def tiny_model(vocab_size: int, seed: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen2ForCausalLM(config).eval()
    return model


def live(source: Any) -> int:
    value = source.active_requests
    return value if isinstance(value, int) else len(value)


def check_plotting(parser: argparse.ArgumentParser, no_plot: bool) -> None:
    """Stop at once, with the install command, where the plot cannot be drawn: not after a run of
    half an hour (``--no-plot`` skips the plot and the check)."""
    if no_plot:
        return
    from specdraft.bench.report import PlotUnavailableError, require_matplotlib

    try:
        require_matplotlib()
    except PlotUnavailableError as exc:
        parser.error(str(exc))


def plot(rows: list[dict[str, float]], path: Path, title: str, caps: dict[str, int]) -> None:
    from specdraft.bench.report import require_matplotlib

    plt = require_matplotlib()
    x = [r["requests"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(x, [r["rss_mib"] for r in rows], label="RSS")
    axes[0].plot(x, [r["peak_rss_mib"] for r in rows], label="peak RSS", linestyle="--")
    axes[0].set_ylabel("MiB")
    axes[0].legend()
    axes[1].plot(x, [r["trie_nodes"] for r in rows], label="trie nodes")
    axes[1].axhline(caps["trie_max_nodes"], color="grey", linestyle=":", label="max_nodes")
    axes[1].set_ylabel("nodes")
    axes[1].legend()
    axes[2].plot(x, [r["ngram_shared_contexts"] for r in rows], label="shared n-gram contexts")
    axes[2].axhline(caps["ngram_max_contexts"], color="grey", linestyle=":", label="max_contexts")
    axes[2].set_ylabel("contexts")
    axes[2].set_xlabel("requests")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--vocab-size", type=int, default=151_936,
                        help="vocabulary of the tiny random model (default: the default model's, %(default)s)")
    parser.add_argument("--prompt-vocab", type=int, default=2000,
                        help="prompts draw from this many token ids, so they repeat (default: %(default)s)")
    parser.add_argument("--max-prompt", type=int, default=48, help="longest prompt (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="most new tokens (default: %(default)s)")
    parser.add_argument("--sample-share", type=float, default=0.3, help="share of sampled requests")
    parser.add_argument("--every", type=int, default=250, help="record a row every N requests")
    parser.add_argument("--check-every", type=int, default=25, help="compare every N-th greedy output")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="directory for soak.csv and soak.png")
    parser.add_argument("--no-plot", action="store_true", help="write no soak.png (needs no matplotlib)")
    args = parser.parse_args(argv)
    check_plotting(parser, args.no_plot)
    for name in ("requests", "vocab_size", "prompt_vocab", "max_prompt", "max_new_tokens", "every", "check_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompt_vocab > args.vocab_size - 3:
        parser.error(f"--prompt-vocab must be <= --vocab-size - 3 ({args.vocab_size - 3}), got {args.prompt_vocab}")
    args.out.mkdir(parents=True, exist_ok=True)

    from specdraft import Decoder
    from specdraft.sources import FrequencyTrie, JacobiLookahead, MultiLevelNGram, PromptLookup

    torch.set_num_threads(1)
    model = tiny_model(args.vocab_size, args.seed)
    eos = int(model.generation_config.eos_token_id)
    trie = FrequencyTrie()
    ngram = MultiLevelNGram()
    shared = MultiLevelNGram(shared=True, name="ngram-shared")
    jacobi = JacobiLookahead()
    sources = [PromptLookup(), trie, ngram, shared, jacobi]
    decoders = [Decoder(model, sources=sources, max_tree_nodes=32),
                Decoder(model, sources=sources, max_tree_nodes=16, adaptive_budget=False)]
    caps = {"trie_max_nodes": trie.max_nodes, "trie_capacity": trie.capacity,
            "ngram_max_contexts": shared.max_contexts, "ngram_max_followers": shared.max_followers,
            "jacobi_pool_size": jacobi.pool_size}
    rng = np.random.default_rng(args.seed)
    vocab_slice = rng.choice(np.arange(3, args.vocab_size), size=args.prompt_vocab, replace=False)
    rows: list[dict[str, float]] = []
    new_tokens = greedy = checked = mismatches = 0
    gc.collect()
    started = time.perf_counter()

    def record(done: int) -> None:
        rss, peak = rss_mib()
        row = dict(requests=done, seconds=round(time.perf_counter() - started, 2), rss_mib=round(rss, 1),
                   peak_rss_mib=round(peak, 1), new_tokens=new_tokens, trie_nodes=len(trie),
                   trie_trees=len(trie.tree_sizes()), trie_prunes=trie.prunes, trie_pruned_nodes=trie.pruned_nodes,
                   trie_live=live(trie), ngram_shared_contexts=shared.shared_model.num_contexts,
                   ngram_shared_counters=shared.shared_model.num_counters, ngram_live=live(ngram),
                   ngram_shared_live=live(shared), jacobi_live=live(jacobi), greedy_checked=checked,
                   greedy_mismatches=mismatches)
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    record(0)
    for i in range(args.requests):
        prompt = [int(t) for t in rng.choice(vocab_slice, size=int(rng.integers(1, args.max_prompt + 1)))]
        n = int(rng.integers(1, args.max_new_tokens + 1))
        dec = decoders[i % 2]
        if rng.random() < args.sample_share:
            out = dec.generate(prompt, max_new_tokens=n, do_sample=True, seed=i)
        else:
            out = dec.generate(prompt, max_new_tokens=n)
            if greedy % args.check_every == 0:
                ids = torch.tensor([prompt])
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                         do_sample=False)[0, len(prompt):].tolist()
                checked += 1
                if ref != out.token_ids:
                    mismatches += 1
                    print(f"MISMATCH at request {i}: {out.token_ids} != {ref}", file=sys.stderr, flush=True)
            greedy += 1
        new_tokens += len(out.token_ids)
        assert len(out.token_ids) == n or out.token_ids[-1] == eos
        if (i + 1) % args.every == 0 or i + 1 == args.requests:
            record(i + 1)

    csv_path = args.out / "soak.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    first, last = rows[0], rows[-1]
    print(f"wrote {csv_path}; {args.requests} requests, {new_tokens} new tokens in {last['seconds']:.0f} s; "
          f"RSS {first['rss_mib']:.0f} -> {last['rss_mib']:.0f} MiB (peak {last['peak_rss_mib']:.0f}); "
          f"trie {last['trie_nodes']} nodes (max_nodes {caps['trie_max_nodes']}, {last['trie_prunes']} prunes); "
          f"shared n-gram {last['ngram_shared_contexts']} contexts (max {caps['ngram_max_contexts']}); "
          f"live states trie/ngram/shared/jacobi {last['trie_live']}/{last['ngram_live']}/"
          f"{last['ngram_shared_live']}/{last['jacobi_live']}; greedy checked {checked}, mismatches {mismatches}")
    if not args.no_plot:
        title = (f"soak: {args.requests} requests, tiny random model, vocab {args.vocab_size}, "
                 f"{os.cpu_count()} CPU(s), 1 thread")
        plot(rows, args.out / "soak.png", title, caps)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
