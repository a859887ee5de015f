"""What does MultiLevelNGram cost per decoding step, next to a forward pass of Qwen2.5-0.5B?

Real tokens, no model: the Qwen2.5-Coder tokenizer encodes Python source files of the installed
``transformers`` package. Each request takes a prompt of ``--prompt-tokens`` tokens from that text
and then "generates" the text's true continuation, step by step, exactly as the decoder drives a
source: ``propose(context, budget)``, a greedy verification *simulated* against the true next
tokens (the longest drafted path that matches, plus one bonus token), then ``observe``. So the
draft sizes and commit lengths are those of a model that would reproduce the file -- a realistic
load for the hot path (the acceptance numbers are an optimistic proxy, not a speedup claim).

Timed: ``begin`` (counting the prompt), and ``propose`` + ``observe`` per step. The per-step time is
reported in microseconds and as a fraction of one Qwen2.5-0.5B fp32 CPU step (``--forward-ms``,
145 ms by default, or measured with ``--measure-forward``). Memory per context is measured with
``tracemalloc`` on a model built from one prompt. ``PromptLookup`` (which rescans the context with
numpy every step) is timed on the same steps for reference.

    python benchmarks/ngram_overhead.py
    python benchmarks/ngram_overhead.py --prompt-tokens 2048 --new-tokens 512 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc

DEFAULT_MODEL = "qwen2.5-coder-0.5b"  # a specdraft.models alias: found in the cache or fetched once
SOURCE_FILES = ["generation/utils.py", "modeling_utils.py", "trainer.py", "models/llama/modeling_llama.py",
                "models/qwen2/modeling_qwen2.py", "tokenization_utils_base.py"]


def load_tokenizer(name: str):
    """The tokenizer of a model named as ``specdraft.models.load_model`` takes it (a checkpoint
    directory, a ``.gguf`` file, a hub id or a mirrored alias such as ``qwen2.5-coder-0.5b``)."""
    from specdraft.models import load_tokenizer as load

    return load(name)


def load_tokens(model: str, max_tokens: int) -> list[list[int]]:
    """Token ids of a few large Python files of the installed transformers package (one list each)."""
    import transformers

    tok = load_tokenizer(model)
    root = os.path.dirname(transformers.__file__)
    docs = []
    for rel in SOURCE_FILES:
        path = os.path.join(root, rel)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                docs.append(tok(fh.read())["input_ids"][:max_tokens])
    if not docs:
        sys.exit("no transformers source files found")
    return docs


def simulate_verify(branches: list[list[int]], truth: list[int]) -> int:
    """Accepted draft tokens under greedy verification if the model's output is ``truth``."""
    best = 0
    for br in branches:
        n = 0
        while n < len(br) and n < len(truth) and br[n] == truth[n]:
            n += 1
        best = max(best, n)
    return best


def run_requests(make_source, docs, prompt_tokens: int, new_tokens: int, budget: int, starts_per_doc: int):
    """Drive one source over several requests; return timings (ns) and acceptance."""
    from specdraft.sources import Context, Feedback

    source = make_source()
    init_ns, step_ns, propose_ns, observe_ns, accepted, drafted = [], [], [], [], [], []
    rid = 0
    for doc in docs:
        span = len(doc) - prompt_tokens - new_tokens
        if span <= 0:
            continue
        for j in range(starts_per_doc):
            rid += 1
            start = span * j // max(starts_per_doc, 1)
            tokens = list(doc[start : start + prompt_tokens])
            truth_all = doc[start + prompt_tokens : start + prompt_tokens + new_tokens]
            plen = len(tokens)
            ctx = Context(tuple(tokens), plen, rid)
            t0 = time.perf_counter_ns()
            source.begin(ctx)
            init_ns.append(time.perf_counter_ns() - t0)
            pos = 0
            while pos < len(truth_all):
                ctx = Context(tuple(tokens), plen, rid)
                t0 = time.perf_counter_ns()
                draft = source.propose(ctx, budget)
                t1 = time.perf_counter_ns()
                n = simulate_verify(draft.branches, truth_all[pos:])
                committed = list(truth_all[pos : pos + n + 1])
                tokens.extend(committed)
                pos += len(committed)
                after = Context(tuple(tokens), plen, rid)
                t2 = time.perf_counter_ns()
                source.observe(Feedback(committed=committed, context=after))
                t3 = time.perf_counter_ns()
                propose_ns.append(t1 - t0)
                observe_ns.append(t3 - t2)
                step_ns.append((t1 - t0) + (t3 - t2))
                accepted.append(len(committed))
                drafted.append(sum(len(b) for b in draft.branches))
            source.end(Context(tuple(tokens), plen, rid))
    return source, dict(init_ns=init_ns, step_ns=step_ns, propose_ns=propose_ns, observe_ns=observe_ns,
                        accepted=accepted, drafted=drafted)


def summarize(name: str, res: dict, forward_ms: float) -> dict:
    def us(xs, q=None):
        if not xs:
            return float("nan")
        if q is None:
            return statistics.median(xs) / 1e3
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] / 1e3

    step_med, step_p90, step_mean = us(res["step_ns"]), us(res["step_ns"], 0.9), statistics.mean(res["step_ns"]) / 1e3
    out = {
        "source": name,
        "requests": len(res["init_ns"]),
        "steps": len(res["step_ns"]),
        "init_us_median": us(res["init_ns"]),
        "propose_us_median": us(res["propose_ns"]),
        "observe_us_median": us(res["observe_ns"]),
        "step_us_median": step_med,
        "step_us_p90": step_p90,
        "step_us_mean": step_mean,
        "step_fraction_of_forward_mean": step_mean / (forward_ms * 1e3),
        "init_fraction_of_forward": us(res["init_ns"]) / (forward_ms * 1e3),
        "mean_committed_per_step": statistics.mean(res["accepted"]),
        "mean_drafted_per_step": statistics.mean(res["drafted"]),
    }
    return out


def bytes_per_context(prompt: list[int], **kwargs) -> tuple[int, int, float]:
    from specdraft.sources.ngram import NGramModel

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    model = NGramModel(**kwargs)
    model.add(prompt)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return model.num_contexts, model.num_counters, used / max(model.num_contexts, 1)


def measure_forward_ms(model_name: str, prompt: list[int], tree: int) -> float:
    import torch
    from transformers import DynamicCache

    from specdraft.model.compat import cache_keyword
    from specdraft.models import load_model

    torch.set_num_threads(1)
    model, _ = load_model(model_name, dtype="float32")
    keyword = cache_keyword(model)
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.tensor([prompt]), use_cache=True, **{keyword: cache})
        times = []
        for _ in range(5):
            ids = torch.tensor([prompt[-tree:]])
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, **{keyword: cache})
            times.append(time.perf_counter() - t0)
            cache.crop(-tree)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL,
                        help="model whose tokenizer encodes the text: checkpoint dir, .gguf, hub id or mirrored alias "
                             "(default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--starts-per-doc", type=int, default=3, help="requests per source file")
    parser.add_argument("--budget", type=int, default=32, help="node budget handed to propose (max_tree_nodes)")
    parser.add_argument("--forward-ms", type=float, default=145.0,
                        help="one Qwen2.5-0.5B fp32 decoding step on this CPU (default: %(default)s ms)")
    parser.add_argument("--measure-forward", action="store_true",
                        help="load the --tokenizer model and time a 1+budget-token forward instead")
    parser.add_argument("--json", action="store_true", help="one JSON line per configuration")
    args = parser.parse_args(argv)

    from specdraft.sources import MultiLevelNGram, PromptLookup

    docs = load_tokens(args.tokenizer, max_tokens=200_000)
    forward_ms = args.forward_ms
    if args.measure_forward:
        forward_ms = measure_forward_ms(args.tokenizer, docs[0][: args.prompt_tokens], args.budget + 1)
    configs = [
        ("ngram N=5 K=7 b=1 (paper)", lambda: MultiLevelNGram()),
        ("ngram N=5 K=7 b=2 depth=1", lambda: MultiLevelNGram(top_b=2)),
        ("ngram N=5 K=7 b=3 depth=2", lambda: MultiLevelNGram(top_b=3, branch_depth=2)),
        ("ngram shared (defaults)", lambda: MultiLevelNGram(shared=True)),
        ("ngram shared b=2", lambda: MultiLevelNGram(shared=True, top_b=2)),
        ("prompt lookup (reference)", lambda: PromptLookup()),
    ]
    gc.disable()  # a cyclic collection would land on a random step
    rows = []
    for name, make in configs:
        gc.collect()
        source, res = run_requests(make, docs, args.prompt_tokens, args.new_tokens, args.budget, args.starts_per_doc)
        row = summarize(name, res, forward_ms)
        if getattr(source, "shared_model", None) is not None:
            row["shared_contexts_after"] = source.shared_model.num_contexts
        rows.append(row)
    gc.enable()
    contexts, counters, per_ctx = bytes_per_context(docs[0][: args.prompt_tokens])
    if args.json:
        for row in rows:
            print(json.dumps(dict(row, forward_ms=forward_ms)))
        print(json.dumps({"memory": {"prompt_tokens": args.prompt_tokens, "contexts": contexts, "counters": counters,
                                     "bytes_per_context": per_ctx}}))
        return 0
    print(f"{sum(len(d) for d in docs)} tokens of transformers source, {len(docs)} files; prompt {args.prompt_tokens} "
          f"tokens, {args.new_tokens} new tokens per request, budget {args.budget}; one forward = {forward_ms:.0f} ms")
    print(f"{'source':34} {'req':>4} {'steps':>6} {'init us':>9} {'init %fw':>8} {'propose':>8} {'observe':>8} "
          f"{'step med':>9} {'p90':>7} {'mean':>7} {'%fw':>7} {'commit/st':>9}")
    for r in rows:
        print(f"{r['source']:34} {r['requests']:4d} {r['steps']:6d} {r['init_us_median']:9.0f} "
              f"{100 * r['init_fraction_of_forward']:7.2f}% {r['propose_us_median']:8.1f} "
              f"{r['observe_us_median']:8.1f} "
              f"{r['step_us_median']:9.1f} {r['step_us_p90']:7.1f} {r['step_us_mean']:7.1f} "
              f"{100 * r['step_fraction_of_forward_mean']:6.3f}% {r['mean_committed_per_step']:9.2f}")
    print(f"memory: a {args.prompt_tokens}-token prompt at N=5 -> {contexts} contexts, {counters} counters, "
          f"{per_ctx:.0f} bytes per context ({contexts * per_ctx / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
